"""The float32 masters a checkpoint load leaves where it does not restore the optimizer's state and the
optimizer already holds masters (bf16 / fp16 params that have stepped) — DeepSpeed's rules:

- ``load_module_only``: each master becomes its loaded 16-bit param, widened (DeepSpeed's
  ``refresh_fp32_params``);
- ``load_optimizer_states=False``: each master becomes the checkpoint's (DeepSpeed's ZeRO-3 copies its
  fp32 partitions whatever that flag says), or the loaded param widened where the checkpoint holds none.

Moments and step counts stay as they were. Left alone, the old masters would be stepped and rounded into
the params at the next step: the loaded weights silently lost. An optimizer that has not stepped holds no
master: its first step takes each from the loaded param."""

from __future__ import annotations

from typing import Any

import torch

from ..step.optim import OffloadedAdamW
from ..step.optim._layout import needs_master
from ._reader import Piece, Reader, window
from .manifest import ParamRecord

Plan = dict[int, tuple[list[Piece], torch.dtype]]
"""Optimizer param index → the pieces its master is read from and the dtype they are read as."""


def plan(
    opt: Any,
    params: list[tuple[ParamRecord, list[Piece]]],
    reader: Reader,
    saved: dict[str, Any],
    saved_state: set[str] | None,
) -> Plan:
    """Where each master ``opt`` holds comes from: the checkpoint's for the names in ``saved_state`` (those
    it saved optimizer state for; ``None``: the load takes the module only), else the loaded param's
    pieces (``params``, planned already). Every read is declared to ``reader`` before anything is written."""
    if not isinstance(opt, OffloadedAdamW):
        return {}
    flat = [p for g in opt.param_groups for p in g["params"]]
    loaded = {id(rec.p): (rec, pcs) for rec, pcs in params}
    out: Plan = {}
    for i, _, _ in opt.state_layout():
        if not needs_master(flat[i]) or id(flat[i]) not in loaded:
            continue
        rec, pcs = loaded[id(flat[i])]
        if saved_state is not None and rec.name in saved_state:
            master = reader.pieces(saved[rec.name], "master", rec.start, rec.partition_numel)
            reader.need(master, torch.float32)
            out[i] = (master, torch.float32)
        else:
            out[i] = (pcs, rec.dtype)
    return out


def apply(opt: Any, masters: Plan, reader: Reader) -> None:
    """Write each planned master into the optimizer's records (their moments read and written back as
    they were)."""
    if not masters:
        return

    def fill(i: int, start: int, views: tuple[torch.Tensor, torch.Tensor, torch.Tensor | None]) -> None:
        w = views[2]
        if w is None:
            return
        pieces, dtype = masters[i]
        part = w if dtype == torch.float32 else torch.empty(w.numel(), dtype=dtype)
        reader.read(window(pieces, start, w.numel()), part)
        if part is not w:
            w.copy_(part)

    opt.stream_state(fill, write=True, params=masters)
