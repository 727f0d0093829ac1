"""`state_dict` / `load_state_dict` for `OffloadedAdamW`: per-param tensors gathered from, and scattered
into, the sub-group records, one record in memory at a time (plus the ring the NVMe store reads through).

For a param zswap partitioned, the state is this rank's partition (1-D, `OffloadedAdamW.state_numel`
elements), as for a torch optimizer stepped by `zswap.Engine`: a state dict round-trips on the same ranks.
`zswap.checkpoint` (``engine.save_checkpoint``) is the way to keep it across processes and world sizes.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

import torch

from ...parts.params import param_state
from ._layout import SubGroup, needs_master

if TYPE_CHECKING:
    from .adamw import OffloadedAdamW

_MOMENTS = ("exp_avg", "exp_avg_sq")


def gather_state(opt: OffloadedAdamW) -> dict[int, dict[str, torch.Tensor]]:
    """``{param index: {"step", "exp_avg", "exp_avg_sq"[, "master"]}}`` for every param with state."""
    state: dict[int, dict[str, torch.Tensor]] = {}
    for i, step in enumerate(opt.records.steps):
        if step == 0:
            continue
        p = opt.records.params[i]
        st = {"step": torch.tensor(float(step), dtype=torch.float32)}
        shape = p.shape if param_state(p) is None else torch.Size([opt.state_numel(i)])
        for name in (*_MOMENTS, "master") if needs_master(p) else _MOMENTS:
            st[name] = torch.empty(shape, dtype=torch.float32)
        state[i] = st

    def take(sg: SubGroup, record: torch.Tensor) -> None:
        for seg, (exp_avg, exp_avg_sq, master) in sg.slices(record):
            st = state.get(seg.param)
            if st is None:
                continue
            for name, src in (("exp_avg", exp_avg), ("exp_avg_sq", exp_avg_sq), ("master", master)):
                if src is not None:
                    st[name].view(-1)[seg.start : seg.stop].copy_(src)

    opt.records.store.stream(_touching(opt, state.keys()), take, write=False)
    return state


def scatter_state(opt: OffloadedAdamW, state_dict: dict[str, Any]) -> None:
    """Replaces the optimizer's state and group settings with `state_dict`'s. Checks everything before
    changing anything."""
    saved_groups = state_dict["param_groups"]
    if len(saved_groups) != len(opt.param_groups):
        raise ValueError(
            f"loaded state dict has {len(saved_groups)} parameter groups, "
            f"the optimizer {len(opt.param_groups)}"
        )
    ids: dict[Any, int] = {}
    index = 0
    for k, (ours, theirs) in enumerate(zip(opt.param_groups, saved_groups, strict=True)):
        if len(ours["params"]) != len(theirs["params"]):
            raise ValueError(
                f"loaded state dict's parameter group {k} has {len(theirs['params'])} params, "
                f"the optimizer's {len(ours['params'])}"
            )
        for saved_id in theirs["params"]:
            ids[saved_id] = index
            index += 1
    loaded: dict[int, tuple[int, dict[str, torch.Tensor]]] = {}
    for saved_id, st in state_dict["state"].items():
        if saved_id not in ids:
            raise ValueError(f"loaded state dict has state for param id {saved_id!r}, which no group lists")
        i = ids[saved_id]
        loaded[i] = _check_entry(i, opt.records.params[i], opt.state_numel(i), st)

    opt.records.place(sorted(loaded))

    def put(sg: SubGroup, record: torch.Tensor) -> None:
        for seg, (exp_avg, exp_avg_sq, master) in sg.slices(record):
            entry = loaded.get(seg.param)
            if entry is None:
                continue
            st = entry[1]
            exp_avg.copy_(st["exp_avg"][seg.start : seg.stop])
            exp_avg_sq.copy_(st["exp_avg_sq"][seg.start : seg.stop])
            if master is not None:
                master.copy_(st["master"][seg.start : seg.stop])

    opt.records.store.stream(_touching(opt, loaded.keys()), put)  # all records or none (one transaction)
    for ours, theirs in zip(opt.param_groups, saved_groups, strict=True):
        ours.update({k: v for k, v in theirs.items() if k != "params"})
    opt.records.reset_steps([loaded[i][0] if i in loaded else 0 for i in range(len(opt.records.params))])


def _check_entry(
    i: int, p: torch.Tensor, numel: int, st: dict[str, Any]
) -> tuple[int, dict[str, torch.Tensor]]:
    """(step, flat float32 tensors) of one saved param state; errors name the param and the entry."""
    missing = [k for k in ("step", *_MOMENTS) if k not in st]
    if missing:
        raise ValueError(f"loaded state of param {i} lacks {', '.join(missing)}")
    step = float(st["step"])
    if step < 1 or step != int(step):
        raise ValueError(f"loaded state of param {i} has step {step}; expected a whole number >= 1")
    out: dict[str, torch.Tensor] = {}
    names = (*_MOMENTS, "master") if needs_master(p) else _MOMENTS
    partitioned = param_state(p) is not None
    for name in names:
        t = st.get(name, p.data if name == "master" and not partitioned else None)
        if not isinstance(t, torch.Tensor):
            raise TypeError(f"loaded state of param {i}: {name} must be a tensor, got {type(t).__name__}")
        if t.numel() != numel:
            what = "its partition on this rank" if partitioned else f"the param (shape {tuple(p.shape)})"
            raise ValueError(
                f"loaded state of param {i}: {name} has {t.numel()} elements, {what} {numel}; to move "
                "optimizer state between processes or world sizes use engine.save_checkpoint / "
                "load_checkpoint"
            )
        out[name] = t.detach().to(device="cpu", dtype=torch.float32).reshape(-1)
    return int(step), out


def _touching(opt: OffloadedAdamW, params: Any) -> list[SubGroup]:
    """The sub-groups holding any of `params`, in walk order."""
    wanted = set(params)
    return [sg for sg in opt.records.sub_groups if any(s.param in wanted for s in sg.segments)]
