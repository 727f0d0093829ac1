"""Reading slices of saved tensors across the files of every saving rank, checksums verified first.

A load first *plans* every read (which bytes of which file), then `Reader.verify` checks the CRC-32C of
every 8 MiB block those reads touch — and the size of every file against the manifest — before the caller
changes anything; only then are the reads done. A rank thus reads (and checks) only its own slices.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from ._crc import crc32c
from ._safetensors import TensorFile, crc_range
from ._validate import read_bytes
from .errors import CheckpointCorruptError, CheckpointNotFoundError
from .manifest import dtype_of, file_name


@dataclass(frozen=True)
class Piece:
    file: str
    entry: str
    elem_start: int
    out_start: int
    count: int
    entry_shape: tuple[int, ...] | None = None
    """The shape the whole entry must have (a partition: ``(partition_numel,)``); ``None``: not checked."""


class Reader:
    """Ranged reads out of one tag folder described by ``manifest``."""

    def __init__(self, folder: Path, manifest: dict[str, Any]) -> None:
        self.folder = folder
        self.manifest = manifest
        self.world = int(manifest["world_size"])
        self.infos = {f["name"]: f for f in manifest["files"]}
        self._files: dict[str, TensorFile] = {}
        self._needed: dict[str, set[int]] = {}
        self._whole: set[str] = set()
        self.whole: dict[str, bytes] = {}
        """The bytes of each file `need_whole` named, once `verify` checked them."""

    def file(self, name: str) -> TensorFile:
        f = self._files.get(name)
        if f is None:
            info = self.infos.get(name)
            path = self.folder / name
            if info is None:
                raise CheckpointCorruptError(f"{self.folder / 'manifest.json'}: lists no file {name!r}")
            f = TensorFile(path)
            if f.size != info["bytes"]:
                f.close()
                what = "truncated" if f.size < info["bytes"] else "longer than written"
                raise CheckpointCorruptError(
                    f"{path}: {what}: {f.size} bytes, the manifest says {info['bytes']}"
                )
            self._files[name] = f
        return f

    def pieces(self, saved: dict[str, Any], kind: str, start: int, count: int) -> list[Piece]:
        """Where elements ``[start, start+count)`` of the flat, padded ``kind`` of param ``saved`` (its
        manifest entry) are; a part beyond what was saved is left out (the caller zero-fills it)."""
        part = saved["partition"]
        n, holders = int(part["partition_numel"]), int(part["ranks"])
        out: list[Piece] = []
        if n == 0:
            return out
        end = min(start + count, n * holders)
        pos = start
        while pos < end:
            s = pos // n
            take = min(end, (s + 1) * n) - pos
            name = file_name(s, self.world, kind)
            out.append(Piece(name, saved["name"], pos - s * n, pos - start, take, (n,)))
            pos += take
        return out

    def need(self, pieces: list[Piece], dtype: torch.dtype) -> None:
        """Register ``pieces`` for `verify` (opens their files and checks the entries exist)."""
        for pc in pieces:
            f = self.file(pc.file)
            e = f.entry(pc.entry)
            shaped = pc.entry_shape is None or tuple(e.shape) == pc.entry_shape
            inside = pc.elem_start + pc.count <= (e.end - e.begin) // dtype.itemsize
            if e.dtype != dtype or not shaped or not inside:
                want = "" if pc.entry_shape is None else f" of shape {list(pc.entry_shape)}"
                raise CheckpointCorruptError(
                    f"{f.path}: entry {pc.entry!r} is not the {dtype} tensor{want} it should be (it is "
                    f"{e.dtype} {list(e.shape)})"
                )
            bb = int(self.infos[pc.file]["block_bytes"])
            first = e.begin + pc.elem_start * dtype.itemsize
            last = first + pc.count * dtype.itemsize
            blocks = self._needed.setdefault(pc.file, {0})  # block 0 holds the header
            blocks.update(range(first // bb, -(-last // bb)))

    def need_entry(self, file: str, entry: str, shape: Any = None) -> None:
        """Register the whole of ``entry``; ``shape`` (a manifest's, for a buffer): what it must be."""
        f = self.file(file)
        e = f.entry(entry)
        want = None if shape is None else tuple(int(d) for d in shape)
        self.need([Piece(file, entry, 0, 0, (e.end - e.begin) // e.dtype.itemsize, want)], e.dtype)

    def need_whole(self, name: str) -> None:
        """A file read whole (not safetensors): its size and whole-file CRC are checked."""
        info = self.infos.get(name)
        if info is None:
            raise CheckpointCorruptError(f"{self.folder / 'manifest.json'}: lists no file {name!r}")
        self._whole.add(name)

    def need_all(self) -> None:
        """Every file of the manifest checked whole by `verify` (what an export does: it must refuse
        whatever a load would)."""
        for name in self.infos:
            if name.endswith(".safetensors"):
                f = self.file(name)
                bb = int(self.infos[name]["block_bytes"])
                self._needed.setdefault(name, set()).update(range(-(-f.size // bb)))
            else:
                self.need_whole(name)

    def verify(self) -> None:
        for name, blocks in sorted(self._needed.items()):
            f, info = self.file(name), self.infos[name]
            bb, crcs = int(info["block_bytes"]), info["block_crc32c"]
            for b in sorted(blocks):
                if b >= len(crcs):
                    raise CheckpointCorruptError(f"{f.path}: the manifest has no checksum for block {b}")
                end = min((b + 1) * bb, f.size)
                crc = crc_range(f, b * bb, end - b * bb)
                if crc != crcs[b]:
                    raise CheckpointCorruptError(
                        f"{f.path}: checksum mismatch in bytes {b * bb}..{end} (crc32c {crc:#010x}, "
                        f"manifest {crcs[b]:#010x}): the file was changed or damaged after it was saved"
                    )
        for name in sorted(self._whole):
            path, info = self.folder / name, self.infos[name]
            try:
                data = read_bytes(str(path), info["bytes"])
            except CheckpointNotFoundError:
                raise CheckpointCorruptError(f"{path}: listed in the manifest but missing") from None
            self.whole[name] = data
            if len(data) != info["bytes"]:
                raise CheckpointCorruptError(f"{path}: {len(data)} bytes, the manifest says {info['bytes']}")
            if crc32c(data) != info["crc32c"]:
                raise CheckpointCorruptError(
                    f"{path}: checksum mismatch (the file was changed after it was saved)"
                )

    def read(self, pieces: list[Piece], out: torch.Tensor) -> None:
        """Fill ``out`` (1-D) from ``pieces`` (planned for it); elements no piece covers are zeroed."""
        covered = 0
        for pc in pieces:
            self.file(pc.file).read_elements(
                pc.entry, pc.elem_start, out[pc.out_start : pc.out_start + pc.count]
            )
            covered += pc.count
        if covered < out.numel():
            if not pieces:
                out.zero_()
            else:
                last = pieces[-1]
                out[last.out_start + last.count :].zero_()
                out[: pieces[0].out_start].zero_()

    def close(self) -> None:
        for f in self._files.values():
            f.close()
        self._files.clear()


def window(pieces: list[Piece], start: int, count: int) -> list[Piece]:
    """The part of ``pieces`` (planned for a whole partition) covering its elements ``[start, start+count)``,
    re-based to 0."""
    out = []
    for pc in pieces:
        lo, hi = max(pc.out_start, start), min(pc.out_start + pc.count, start + count)
        if lo < hi:
            out.append(Piece(pc.file, pc.entry, pc.elem_start + lo - pc.out_start, lo - start, hi - lo))
    return out


def saved_dtype(saved: dict[str, Any]) -> torch.dtype:
    return dtype_of(saved["dtype"])
