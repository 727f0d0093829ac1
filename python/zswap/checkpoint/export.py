"""``zswap export``: a checkpoint folder → consolidated Hugging Face weights, offline.

torch.distributed is not started: each param is read from the files of every rank that saved a slice of
it, `CHUNK_BYTES` at a time, cast, and appended to its shard — memory stays at one chunk whatever the model
size. Where the class ``config.json`` names has weight conversions to reverse (`_hf_revert`), it is built
on the meta device for them and each group's params are read whole. The output is byte for byte what
`zswap.save_weights` writes for the same weights. Every block read is checksum-verified first.
"""

from __future__ import annotations

import logging
import os
from pathlib import Path

import torch

from .._progress import progress
from . import _hf_revert
from ._atomic import write_file
from ._hf_layout import (
    CONFIG_FILES,
    METADATA,
    Staged,
    parse_size,
    plan_shards,
    shard_names,
    with_fields,
    write_index,
)
from ._reader import Reader
from ._safetensors import Entry, StreamWriter
from ._state import NO_NEEDS, check_state, unpickle
from .errors import CheckpointArgumentError, CheckpointMismatchError
from .manifest import dtype_of, file_name, read_manifest, resolve
from .peft_save import ADAPTER_WAY
from .weights import cast_dtype

CHUNK_BYTES = 64 << 20


def export(
    ckpt_dir: str | os.PathLike[str],
    out_dir: str | os.PathLike[str],
    *,
    tag: str | None = None,
    dtype: torch.dtype | None = None,
    max_shard_size: int | str = "5GB",
) -> Path:
    """Write the weights of checkpoint ``ckpt_dir/tag`` (default: ``latest``) to ``out_dir``, as
    `zswap.save_weights` would have. Returns ``out_dir``."""
    limit = parse_size(max_shard_size)
    folder, _ = resolve(ckpt_dir, tag)
    m = read_manifest(folder)
    if m.get("adapters"):
        raise CheckpointMismatchError(
            f"zswap export: {folder} is a checkpoint of {m['adapters']}: its weights are PEFT's state dict "
            "(base_model.model.*, base_layer, the adapters'), which no from_pretrained loads as a model. "
            f"Load it into that model and save from there: {ADAPTER_WAY}"
        )
    reader = Reader(folder, m)
    staged: Staged | None = None
    try:
        params = {p["name"]: p for p in m["params"]}
        buffers = {b["name"]: b for b in m["buffers"]}
        rank0 = file_name(0, reader.world, "params")
        tensors = []
        for key, kind, source in m["weights"]:
            spec = params[source] if kind == "param" else buffers[source]
            dt = dtype_of(spec["dtype"])
            tensors.append((key, dt, tuple(spec["shape"])))
            if kind == "param":
                numel = _numel(spec["shape"])
                reader.need(reader.pieces(spec, "params", 0, numel), dt)
            else:
                reader.need_entry(rank0, source, spec["shape"])
        configs = [n for n in CONFIG_FILES if n in reader.infos]
        verify_whole(reader, folder)
        # transformers' conversions reversed as save_weights reverses them (where it did at the save; older
        # checkpoints: where the class config.json names has conversions)
        reverts = "config.json" in configs and m.get("reverts", True)
        model = _hf_revert.meta_model(reader.whole["config.json"]) if reverts else None
        reversal = _hf_revert.plan(model, tensors) if model is not None else None
        written = [(o.name, o.dtype, o.shape) for o in reversal.outputs] if reversal is not None else tensors
        entries = [Entry(key, cast_dtype(dt, dtype), shape) for key, dt, shape in written]
        out = Path(out_dir)
        for inner in (folder, Path(ckpt_dir)):  # the tag folder, and the save_dir holding every tag
            if _inside(out, inner):
                raise CheckpointArgumentError(
                    f"zswap export: the output folder {out} is inside the checkpoint folder {inner}; "
                    "writing there would change the checkpoint"
                )
        try:
            out.mkdir(parents=True, exist_ok=True)
        except OSError as err:  # a file in the way, a path no folder can be made under (/proc)
            why = "a file is in the way" if out.exists() and not out.is_dir() else os.strerror(err.errno or 0)
            raise type(err)(err.errno, f"cannot make the export's output folder ({why})", str(out)) from err
        staged = Staged(out)
        shards = plan_shards(entries, limit)
        names = shard_names(len(shards))
        key_of = {key: (kind, source) for key, kind, source in m["weights"]}

        def read(key: str) -> torch.Tensor:
            """The whole tensor saved under ``key`` (a reversal's input)."""
            kind, source = key_of[key]
            spec = params[source] if kind == "param" else buffers[source]
            t = torch.empty(_numel(spec["shape"]), dtype=dtype_of(spec["dtype"]))
            if kind == "param":
                reader.read(reader.pieces(spec, "params", 0, t.numel()), t)
            else:
                reader.file(rank0).read_elements(source, 0, t)
            return t.view(spec["shape"])

        values = _hf_revert.Values(reversal, read)
        for shard, name in zip(shards, names, strict=True):
            w = StreamWriter(staged.path(name), shard, METADATA)
            try:
                # shards need not follow key order (a tensor over the limit goes alone)
                for e in progress(shard, f"exporting {name}", unit="tensor"):
                    if reversal is None and key_of[e.name][0] == "param":  # streamed, a chunk at a time
                        _copy_param(reader, params[key_of[e.name][1]], w, dtype)
                    else:
                        t = values(e.name)
                        w.write(t.to(cast_dtype(t.dtype, dtype)).contiguous())
                w.close()
            finally:
                w.abort()
        write_index(staged, shards, names, int(m["total_parameters"]))
        for n in configs:  # the bytes `verify` checked, not the file again
            data = reader.whole[n]
            if n == "config.json" and dtype is not None:
                data = with_fields(data, {"dtype": str(dtype).removeprefix("torch.")}, folder / n)
            write_file(staged.path(n), data)
        staged.commit()
        logging.getLogger(__name__).info("exported %s to %s (%d file(s))", folder, out, len(names))
        return out
    finally:
        if staged is not None:
            staged.abort()
        reader.close()


def verify_whole(reader: Reader, folder: Path) -> None:
    """Every file of the checkpoint checked as whole as a load reads it (checksums, and each ``state.pt``
    unpickled as a load does): what a load refuses, an offline read refuses too."""
    reader.need_all()
    reader.verify()
    for name in sorted(reader.whole):
        if name.endswith(".state.pt"):
            check_state(unpickle(reader.whole[name], folder / name), folder / name, NO_NEEDS)


def _copy_param(reader: Reader, spec: dict, w: StreamWriter, dtype: torch.dtype | None) -> None:
    dt = dtype_of(spec["dtype"])
    numel = _numel(spec["shape"])
    chunk = max(1, CHUNK_BYTES // dt.itemsize)
    buf = torch.empty(min(chunk, numel), dtype=dt)
    pos = 0
    while pos < numel:
        n = min(chunk, numel - pos)
        piece = buf[:n]
        reader.read(reader.pieces(spec, "params", pos, n), piece)
        w.write(piece.to(cast_dtype(dt, dtype)))
        pos += n


def _inside(out: Path, folder: Path) -> bool:
    """Whether ``out`` is ``folder`` or lies under it (symlinks resolved; ``out`` need not exist)."""
    a, b = out.resolve(), folder.resolve()
    return a == b or b in a.parents


def _numel(shape: list[int]) -> int:
    n = 1
    for d in shape:
        n *= d
    return n
