"""A checkpoint's weights as whole float32 tensors, offline: what DeepSpeed's ``zero_to_fp32`` gives of its
own checkpoints (`zswap.deepspeed.utils.zero_to_fp32` has its call shapes).

No model is built and torch.distributed is not started. A low-precision param whose float32 master the
checkpoint holds (`OffloadedAdamW`'s records: every bf16 / fp16 param it steps) is that master — the value
training goes on from, as DeepSpeed's masters are —, any other param its saved value widened. Every name a
tied param has is a key (one tensor under each), and the persistent buffers are keys at their own dtype.
Every block read is checksum-verified first, as a load verifies it. The whole model is in memory at once:
for a model larger than that, `zswap.checkpoint.export` streams its params to files.
"""

from __future__ import annotations

import math
import os
from pathlib import Path
from typing import Any

import torch

from ._atomic import naming_write_errors
from ._hf_layout import METADATA, WEIGHTS, Staged, parse_size, plan_shards, shard_names, write_index
from ._reader import Reader
from ._safetensors import Entry, StreamWriter
from .errors import CheckpointArgumentError
from .export import verify_whole
from .manifest import dtype_of, file_name, read_manifest, resolve

BIN = "pytorch_model.bin"
"""What Hugging Face names ``torch.save``-d weights (`shard_names` numbers their shards)."""


def fp32_state_dict(
    ckpt_dir: str | os.PathLike[str], tag: str | None = None, *, exclude_frozen: bool = False
) -> dict[str, torch.Tensor]:
    """``name → tensor`` of checkpoint ``ckpt_dir/tag`` (default: the one ``latest`` names), params and
    floating-point buffers in float32 (as DeepSpeed's ``zero_to_fp32`` gives them; integer and boolean
    buffers keep their dtype). ``exclude_frozen``: without the params that did not require grad when the
    checkpoint was saved, as DeepSpeed's (a checkpoint that does not record it: the params its optimizer
    held, its param groups)."""
    folder, _ = resolve(ckpt_dir, tag)
    m = read_manifest(folder)
    optim = m.get("optimizer") if isinstance(m.get("optimizer"), dict) else None
    trained: set[str] | None = None
    if all("requires_grad" in spec for spec in m["params"]):
        trained = {spec["name"] for spec in m["params"] if spec["requires_grad"]}
    elif optim is not None:
        trained = {name for group in optim["groups"] for name in group}
    if exclude_frozen and trained is None:
        raise CheckpointArgumentError(
            f"{folder} was saved without an optimizer, so which params were frozen is not known: read it "
            "with exclude_frozen_parameters=False"
        )
    # The float32 masters `OffloadedAdamW` held (every low-precision param it holds a record for).
    mastered = set()
    if optim is not None and optim.get("kind") == "zswap":
        mastered = {entry[0] for rank in optim["layout"] for entry in rank}
    reader = Reader(folder, m)
    try:
        plan: list[tuple[dict[str, Any], torch.dtype, list[Any]]] = []
        for spec in m["params"]:
            if exclude_frozen and trained is not None and spec["name"] not in trained:
                continue
            dtype = dtype_of(spec["dtype"])
            kind = "master" if spec["name"] in mastered and dtype != torch.float32 else "params"
            dtype = torch.float32 if kind == "master" else dtype
            pieces = reader.pieces(spec, kind, 0, math.prod(spec["shape"]))
            reader.need(pieces, dtype)
            plan.append((spec, dtype, pieces))
        rank0 = file_name(0, reader.world, "params")
        for b in m["buffers"]:
            reader.need_entry(rank0, b["name"], b["shape"])
        verify_whole(reader, folder)
        out: dict[str, torch.Tensor] = {}
        for spec, dtype, pieces in plan:
            flat = torch.empty(math.prod(spec["shape"]), dtype=dtype)
            reader.read(pieces, flat)
            value = flat.view(spec["shape"]).float()
            for name in (spec["name"], *spec["aliases"]):
                out[name] = value
        for b in m["buffers"]:
            flat = torch.empty(math.prod(b["shape"]), dtype=dtype_of(b["dtype"]))
            reader.file(rank0).read_elements(b["name"], 0, flat)
            value = flat.view(b["shape"])
            out[b["name"]] = value.float() if value.is_floating_point() else value
        return out
    finally:
        reader.close()


def write_state_dict(
    state: dict[str, torch.Tensor],
    out_dir: str | os.PathLike[str],
    *,
    max_shard_size: int | str = "5GB",
    safetensors: bool = True,
) -> Path:
    """``state`` written to ``out_dir`` as Hugging Face names its weights: ``model.safetensors``, or
    ``pytorch_model.bin`` (``torch.save``) where not ``safetensors``; past ``max_shard_size`` in numbered
    shards with their index. A name that shares its tensor with another (a tied param) is written under
    each. The files are complete before any takes its name; those of an earlier save of the same kind that
    this one does not overwrite are removed, as ``save_pretrained`` does."""
    limit = parse_size(max_shard_size)
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    shards = plan_shards([Entry(k, t.dtype, tuple(t.shape)) for k, t in state.items()], limit)
    weights = WEIGHTS if safetensors else BIN
    names, staged = shard_names(len(shards), weights), Staged(out, weights)
    try:
        for shard, name in zip(shards, names, strict=True):
            if not safetensors:
                _torch_save({e.name: state[e.name] for e in shard}, staged.path(name), out / name)
                continue
            w = StreamWriter(staged.path(name), shard, METADATA)
            try:
                for e in shard:
                    w.write(state[e.name].contiguous().view(-1))
                w.close()
            finally:
                w.abort()
        total = sum(t.numel() for t in {id(t): t for t in state.values()}.values())
        write_index(staged, shards, names, total, weights)
        staged.commit()
    finally:
        staged.abort()
    return out


def _torch_save(obj: object, path: Path, final: Path) -> None:
    """``torch.save(obj, path)``; a failed write (a full disk) is a `SwapIOError` naming ``final``, not
    torch's "unexpected pos"."""
    with naming_write_errors(final), open(path, "wb") as f:
        torch.save(obj, f)


SCRIPT = "zero_to_fp32.py"
"""The script DeepSpeed's ``save_checkpoint`` leaves in ``save_dir`` (users run ``python zero_to_fp32.py .
OUTPUT_DIR`` there, as Hugging Face's docs say); zswap's runs `zswap.deepspeed.utils.zero_to_fp32`."""

_SCRIPT_TEXT = """#!/usr/bin/env python
# Left here by zswap's save_checkpoint where DeepSpeed leaves its own script of this name: this folder's
# float32 weights written out, DeepSpeed's arguments (python zero_to_fp32.py . OUTPUT_DIR [-t TAG]
# [--safe_serialization] [--max_shard_size 5GB] [--exclude_frozen_parameters]). Needs zswap installed.
from zswap.deepspeed.utils.zero_to_fp32 import main

if __name__ == "__main__":
    raise SystemExit(main())
"""


def write_script(save_dir: str | os.PathLike[str]) -> None:
    """`SCRIPT` in ``save_dir``, executable, complete before it takes its name (one rank calls it)."""
    path = Path(save_dir) / SCRIPT
    staged = path.with_name(f".{SCRIPT}.tmp")
    staged.write_text(_SCRIPT_TEXT)
    staged.chmod(0o755)
    os.replace(staged, path)
