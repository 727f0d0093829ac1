"""`zswap.save_weights`: consolidated weights in the Hugging Face layout, one param gathered at a time."""

from __future__ import annotations

import logging
import os
from collections.abc import Callable
from pathlib import Path
from typing import TYPE_CHECKING

import torch
from torch import nn

from .._dist import resolve_group
from .._progress import progress
from ..parts.gather import no_torch_function
from ..parts.params import param_state
from . import _hf_revert
from ._gather import full_copy
from ._hf_layout import (
    METADATA,
    Key,
    Staged,
    parse_size,
    plan_shards,
    save_config,
    shard_names,
    weight_keys,
    write_index,
)
from ._safetensors import Entry, StreamWriter
from .manifest import ParamRecord, describe, persistent_buffers
from .peft_save import ADAPTER_WAY, adapters

if TYPE_CHECKING:
    from torch.distributed import ProcessGroup


def save_weights(
    model: nn.Module,
    save_dir: str | os.PathLike[str],
    *,
    dtype: torch.dtype | None = None,
    max_shard_size: int | str = "5GB",
) -> None:
    """Write ``model``'s weights to ``save_dir`` as Hugging Face does (``model.safetensors``, or shards plus
    ``model.safetensors.index.json``; tied weights once; ``config.json`` for a `PreTrainedModel`), so plain
    ``safetensors`` and ``from_pretrained`` read them without zswap. Params are gathered one at a time (every
    rank must call this; rank 0 writes), so memory holds one param, never the model. ``dtype`` casts
    floating tensors; ``max_shard_size``: bytes or a string such as ``"5GB"`` (default)."""
    if dtype is not None and not (isinstance(dtype, torch.dtype) and dtype.is_floating_point):
        raise TypeError(f"dtype must be a floating torch.dtype or None, got {dtype!r}")
    kind = adapters(model)
    if kind is not None:
        raise TypeError(
            f"zswap.save_weights: the model is {kind}; its state dict (PEFT's keys: base_model.model.*, "
            f"base_layer, the adapters') is no model from_pretrained loads. {ADAPTER_WAY}"
        )
    limit = parse_size(max_shard_size)
    records = describe(model)
    group: ProcessGroup | None = next((r.st.group for r in records if r.st is not None), None)
    _, rank, _ = resolve_group(group) if any(r.st is not None for r in records) else resolve_group(None)
    buffers = persistent_buffers(model)
    keys = weight_keys(model, {id(r.p): r.name for r in records}, {id(b): n for n, b in buffers})
    rec_of = {r.name: r for r in records}
    buf_of = dict(buffers)
    tensors = key_tensors(keys, rec_of, buf_of)
    reversal = _hf_revert.plan(model, tensors)
    written = [(o.name, o.dtype, o.shape) for o in reversal.outputs] if reversal is not None else tensors
    entries = [Entry(name, cast_dtype(dt, dtype), shape) for name, dt, shape in written]
    shards = plan_shards(entries, limit)
    names = shard_names(len(shards))
    out = Path(save_dir)
    staged = None
    if rank == 0:
        out.mkdir(parents=True, exist_ok=True)
        staged = Staged(out)
    try:
        values = _hf_revert.Values(reversal, _reader(keys, rec_of, buf_of))
        _write_shards(shards, names, values, dtype, staged)
        if staged is not None:
            write_index(staged, shards, names, sum(r.numel for r in records))
            staged.commit()
    finally:
        if staged is not None:
            staged.abort()
    if rank == 0:
        save_config(model, out, [r.dtype for r in records], dtype)
        logging.getLogger(__name__).info("weights saved: %s (%d file(s))", out, len(names))


def key_tensors(
    keys: list[Key], rec_of: dict[str, ParamRecord], buf_of: dict[str, torch.Tensor]
) -> list[tuple[str, torch.dtype, tuple[int, ...]]]:
    """``(key, dtype, shape)`` of each tensor saved under ``keys`` (what `_hf_revert.plan` takes)."""
    out = []
    for k in keys:
        if k.kind == "param":
            r = rec_of[k.source]
            out.append((k.key, r.dtype, tuple(r.shape)))
        else:
            b = buf_of[k.source]
            out.append((k.key, b.dtype, tuple(b.shape)))
    return out


def _reader(
    keys: list[Key], rec_of: dict[str, ParamRecord], buf_of: dict[str, torch.Tensor]
) -> Callable[[str], torch.Tensor]:
    """``read(key)``: the full value saved under ``key`` (a param gathered: every rank calls it in turn)."""
    key_of = {k.key: k for k in keys}

    def read(key: str) -> torch.Tensor:
        k = key_of[key]
        if k.kind != "param":
            return buf_of[k.source].detach().to("cpu")
        r = rec_of[k.source]
        st = param_state(r.p)
        with no_torch_function():
            return full_copy(r.p, st) if st is not None else r.p.detach().to("cpu")

    return read


def _write_shards(
    shards: list[list[Entry]],
    names: list[str],
    values: _hf_revert.Values,
    dtype: torch.dtype | None,
    staged: Staged | None,
) -> None:
    for shard, name in zip(shards, names, strict=True):
        w = StreamWriter(staged.path(name), shard, METADATA) if staged is not None else None
        try:
            # a tensor over the limit gets its own shard out of key order, as in HF
            for e in progress(shard, f"saving {name}", unit="tensor"):
                value = values(e.name)
                if w is not None:
                    w.write(_cast(value, dtype))
            if w is not None:
                w.close()
        finally:
            if w is not None:
                w.abort()


def cast_dtype(dt: torch.dtype, dtype: torch.dtype | None) -> torch.dtype:
    return dtype if dtype is not None and dt.is_floating_point else dt


def _cast(t: torch.Tensor, dtype: torch.dtype | None) -> torch.Tensor:
    return t.to(cast_dtype(t.dtype, dtype)).contiguous()
