"""The float32 masters a checkpoint load leaves where it does not restore the optimizer's state, for
bf16 / fp16 params (whose optimizer keeps a master) — DeepSpeed's rules:

- ``load_optimizer_states=False``: each master becomes the checkpoint's (DeepSpeed's ZeRO-3 copies its
  fp32 partitions whatever that flag says), or the loaded param widened where the checkpoint holds none.
  A param that has not stepped here gets it as a seed: its first step starts its moments afresh from that
  master (`OffloadedAdamW.seed_masters`), not from the 16-bit param;
- ``load_module_only``: each master becomes its loaded 16-bit param, widened (DeepSpeed's
  ``refresh_fp32_params``); a param that has not stepped takes it from the param at its first step anyway.

Moments and step counts stay as they were. Left alone, the old masters would be stepped and rounded into
the params at the next step: the loaded weights silently lost."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch

from ..parts.params import param_state
from ..step import early_memory
from ..step.optim import OffloadedAdamW
from ..step.optim._layout import needs_master
from ._reader import Piece, Reader, window
from .manifest import ParamRecord

Plan = dict[int, tuple[list[Piece], torch.dtype, bool]]
"""Optimizer param index → the pieces its master is read from, the dtype they are read as, and whether it
is a seed (the param has not stepped: `OffloadedAdamW.seed_masters`) rather than a master to overwrite."""


def plan(
    opt: Any,
    params: list[tuple[ParamRecord, list[Piece]]],
    reader: Reader,
    saved: dict[str, Any],
    saved_state: set[str] | None,
) -> Plan:
    """Where each master of ``opt`` comes from: the checkpoint's for the names in ``saved_state`` (those
    it saved optimizer state for; ``None``: the load takes the module only), else the loaded param's
    pieces (``params``, planned already). Every read is declared to ``reader`` before anything is written."""
    if not isinstance(opt, OffloadedAdamW):
        return {}
    flat = opt.records.params  # in the order of its param groups: the index is the optimizer's
    loaded = {id(rec.p): (rec, pcs) for rec, pcs in params}
    stepped = {i for i, _, _ in opt.state_layout()}
    out: Plan = {}
    for i, p in enumerate(flat):
        if not needs_master(p) or id(p) not in loaded:
            continue
        rec, pcs = loaded[id(p)]
        if saved_state is not None and rec.name in saved_state:
            master = reader.pieces(saved[rec.name], "master", rec.start, rec.partition_numel)
            reader.need(master, torch.float32)
            out[i] = (master, torch.float32, i not in stepped)
        elif i in stepped:
            out[i] = (pcs, rec.dtype, False)
    return out


def apply(opt: Any, masters: Plan, reader: Reader) -> None:
    """Write each planned master into the optimizer's records (their moments read and written back as
    they were), each seed into its param's record."""
    if not masters:
        return

    def fill(i: int, start: int, views: tuple[torch.Tensor, torch.Tensor, torch.Tensor | None]) -> None:
        w = views[2]
        if w is None:
            return
        pieces, dtype, _ = masters[i]
        part = w if dtype == torch.float32 else torch.empty(w.numel(), dtype=dtype)
        reader.read(window(pieces, start, w.numel()), part)
        if part is not w:
            w.copy_(part)

    seeds = {i: _unchanged(opt.records.params[i]) for i, (_, _, seed) in masters.items() if seed}
    opt.stream_state(fill, write=True, params=[i for i in masters if i not in seeds])
    opt.seed_masters(fill, seeds)


def _unchanged(p: torch.Tensor) -> Callable[[], bool]:
    """Whether ``p``'s stored partition is still the one loaded now (nothing wrote it since)."""
    st = param_state(p)
    if st is None:
        return lambda: False
    seen = early_memory.version(st)
    return lambda: early_memory.unchanged(st, seen)
