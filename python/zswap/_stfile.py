"""Safetensors checkpoints read by byte range: a header parser, ranged reads, and checkpoint resolution.

A safetensors file is ``u64 little-endian N`` + ``N`` bytes of JSON (``name -> {dtype, shape,
data_offsets}``, offsets relative to the end of the header) + the tensor bytes, each tensor row-major and
contiguous. So element ``i`` of a tensor's flattened form lies at a known byte offset, and a rank reads
exactly the bytes of its partition with ``pread`` into the destination buffer: nothing else of the file is
read, and no page of the file is mapped into the process (page-cache pages read by ``pread`` are not counted
in its RSS, pages of a mapping are).

`parse_header` is zswap's one safetensors header parser (`zswap.checkpoint` reads its files with it too).
`resolve` turns a path — one ``.safetensors`` file, a sharded index (``*.safetensors.index.json``, the
``weight_map`` layout `save_pretrained` writes), or a folder holding either — into ``name -> TensorEntry``.
"""

from __future__ import annotations

import json
import os
import struct
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path

import torch

from .errors import ZswapError

# Header size cap: safetensors itself refuses headers over 100 MB.
MAX_HEADER_BYTES = 100_000_000

DTYPES: dict[str, torch.dtype] = {
    "BOOL": torch.bool,
    "U8": torch.uint8,
    "I8": torch.int8,
    "I16": torch.int16,
    "U16": torch.uint16,
    "I32": torch.int32,
    "U32": torch.uint32,
    "I64": torch.int64,
    "U64": torch.uint64,
    "F16": torch.float16,
    "BF16": torch.bfloat16,
    "F32": torch.float32,
    "F64": torch.float64,
    "F8_E4M3": torch.float8_e4m3fn,
    "F8_E5M2": torch.float8_e5m2,
}


class CheckpointError(ZswapError, ValueError):
    """A checkpoint file or index is malformed, or a path holds no checkpoint."""


@dataclass(frozen=True)
class TensorEntry:
    """One tensor of a safetensors file: where its bytes are."""

    name: str
    path: str
    dtype: torch.dtype
    shape: torch.Size
    offset: int
    """Absolute byte offset of element 0 in the file."""

    @property
    def numel(self) -> int:
        return self.shape.numel()


def read_header(path: str) -> dict[str, TensorEntry]:
    """The tensors of one safetensors file, checked against the file's size (no tensor data is read)."""
    fd = os.open(path, os.O_RDONLY | getattr(os, "O_CLOEXEC", 0))
    try:
        return parse_header(fd, os.fstat(fd).st_size, path, CheckpointError)[0]
    finally:
        os.close(fd)


def parse_header(
    fd: int, size: int, path: str, error: type[Exception]
) -> tuple[dict[str, TensorEntry], dict[str, str], int]:
    """(tensors, ``__metadata__``, byte offset of the data) of the safetensors file open as ``fd`` (``size``
    bytes), every entry checked: a known dtype, ``data_offsets`` spanning exactly its shape's bytes, inside
    the file. The one header parser of zswap (weights loading and `zswap.checkpoint` both use it); problems
    raise ``error`` naming ``path`` (and the tensor)."""
    head = os.pread(fd, 8, 0)
    if len(head) < 8:
        raise error(f"{path}: truncated or not a safetensors file ({size} bytes, no header)")
    (n,) = struct.unpack("<Q", head)
    if n > MAX_HEADER_BYTES or 8 + n > size:
        raise error(f"{path}: truncated or not safetensors: header length {n} does not fit {size} bytes")
    raw = os.pread(fd, n, 8)
    try:
        header = json.loads(raw)
    except (UnicodeDecodeError, json.JSONDecodeError) as e:
        raise error(f"{path}: header is not valid JSON ({e})") from None
    if not isinstance(header, dict):
        raise error(f"{path}: header is not a JSON object")
    meta = header.pop("__metadata__", None) or {}
    if not isinstance(meta, dict):
        raise error(f"{path}: __metadata__ is not a JSON object")
    base = 8 + n
    out: dict[str, TensorEntry] = {}
    for name, info in header.items():
        try:
            dtype = DTYPES[info["dtype"]]
            shape = torch.Size(int(d) for d in info["shape"])
            begin, end = (int(x) for x in info["data_offsets"])
        except (KeyError, TypeError, ValueError) as e:
            raise error(f"{path}: tensor {name!r} has a malformed entry {info!r} ({e!r})") from None
        what = f"tensor {name!r} ({info['dtype']} {list(shape)}) has data_offsets [{begin}, {end}]"
        if end - begin != shape.numel() * dtype.itemsize or begin < 0:
            raise error(f"{path}: {what} that do not match its size")
        if base + end > size:
            raise error(f"{path}: truncated: {what} that lie past the end of the file ({size} bytes)")
        out[name] = TensorEntry(name, path, dtype, shape, base + begin)
    return out, meta, base


def resolve(path: str | os.PathLike[str]) -> dict[str, TensorEntry]:
    """``name -> TensorEntry`` of the checkpoint at ``path`` (a file, an index, or a folder of them)."""
    p = Path(path)
    if not p.exists():
        raise FileNotFoundError(2, "no checkpoint at this path", str(p))
    if p.is_dir():
        indexes = sorted(p.glob("*.safetensors.index.json"))
        files = sorted(p.glob("*.safetensors"))
        if len(indexes) > 1:
            raise CheckpointError(
                f"{p}: several index files ({', '.join(i.name for i in indexes)}); pass one"
            )
        if indexes:
            return _from_index(indexes[0])
        if not files:
            raise CheckpointError(
                f"{p}: no *.safetensors file and no *.safetensors.index.json in this folder"
            )
        return merge([str(f) for f in files])
    if p.name.endswith(".json"):
        return _from_index(p)
    return merge([str(p)])


def _from_index(index: Path) -> dict[str, TensorEntry]:
    try:
        weight_map = json.loads(index.read_text())["weight_map"]
        if not isinstance(weight_map, Mapping):
            raise TypeError("weight_map is not an object")
    except (json.JSONDecodeError, KeyError, TypeError, UnicodeDecodeError) as e:
        raise CheckpointError(
            f"{index}: not a safetensors index (a JSON object with 'weight_map'): {e}"
        ) from None
    shards = sorted({str(index.parent / f) for f in weight_map.values()})
    for shard in shards:
        if not os.path.exists(shard):
            raise FileNotFoundError(2, f"shard named by {index.name} is missing", shard)
    entries = merge(shards)
    for name, file in weight_map.items():
        found = entries.get(name)
        if found is None or found.path != str(index.parent / file):
            raise CheckpointError(f"{index}: {name!r} is mapped to {file!r}, which does not hold it")
    return entries


def merge(paths: list[str]) -> dict[str, TensorEntry]:
    """The tensors of several files, each name in one file only."""
    out: dict[str, TensorEntry] = {}
    for path in paths:
        for name, entry in read_header(path).items():
            if name in out:
                raise CheckpointError(f"tensor {name!r} is in both {out[name].path} and {path}")
            out[name] = entry
    return out


def read_range(entry: TensorEntry, start: int, out: torch.Tensor) -> None:
    """Fill ``out`` (1-D, contiguous, CPU, ``entry.dtype``) with elements ``[start, start + out.numel())``
    of the flattened tensor, reading exactly those bytes."""
    count = out.numel()
    if count == 0:
        return
    if out.dtype != entry.dtype or not out.is_contiguous() or out.device.type != "cpu":
        raise ValueError(f"read_range into {out.dtype} {out.device} for {entry.name!r} ({entry.dtype})")
    if start < 0 or start + count > entry.numel:
        raise ValueError(f"{entry.name!r}: elements [{start}, {start + count}) outside its {entry.numel}")
    view = memoryview(out.view(torch.uint8).numpy()).cast("B")  # type: ignore[arg-type]
    offset = entry.offset + start * entry.dtype.itemsize
    fd = os.open(entry.path, os.O_RDONLY | getattr(os, "O_CLOEXEC", 0))
    try:
        done = 0
        while done < len(view):
            n = os.preadv(fd, [view[done:]], offset + done)
            if n <= 0:
                raise CheckpointError(
                    f"{entry.path}: unexpected end of file reading {entry.name!r} at byte {offset + done}"
                )
            done += n
    finally:
        os.close(fd)
