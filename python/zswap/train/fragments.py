"""One param's float32 value, optimizer state and gradient, read and written outside the step: the
substance of DeepSpeed's tensor-fragment API (``deepspeed.utils.safe_get_full_fp32_param`` and its
kin, `zswap.deepspeed.utils`).

*Full* values have the param's shape and are gathered from every rank (a collective: every rank calls
for the same params in the same order); *local* ones are this rank's flat partition (``partition_numel``
elements, the padding of the last rank's included). Everything read is a new float32 tensor on the
param's device. What each kind is:

- ``fp32``: the float32 master a float16 / bfloat16 param's optimizer records hold from its first step
  on (before it, the param's value as float32 — what that step starts from); a float32 param is its own
  master, so its value. Writing the master of a low-precision param changes the param at its next step
  (DeepSpeed's behaviour too); writing a float32 param changes it at once.
- ``exp_avg`` / ``exp_avg_sq``: zswap's AdamW moments (zeros before the param's first step).
- the gradient, between backward and `Engine.step`, as backward left it (``None`` without one): times
  the fp16 loss scale and before clipping, which the step applies (DeepSpeed's too).

A param that does not require grad has none of them (reads give ``None``, writes raise). Writes between
backward and the step leave the step to the ordinary path (the early step's update used the old values).
"""

from __future__ import annotations

from typing import Any

import torch
import torch.distributed as dist

from ..errors import ZswapError
from ..gradients.gradstore import store_of
from ..parts.gather import GatheredParameters, no_torch_function
from ..parts.params import ParamState, param_state
from ..parts.runners import runners_of
from ..step import early_commit
from . import resize

STATE_KEYS = ("exp_avg", "exp_avg_sq")
"""The optimizer state kinds zswap's AdamW keeps per element."""
_VIEW = {"exp_avg": 0, "exp_avg_sq": 1, "fp32": 2}
"""Where each kind sits in `OffloadedAdamW.stream_state`'s views."""


def read(p: torch.Tensor, kind: str, *, full: bool, api: str) -> torch.Tensor | None:
    """``kind`` ("fp32", "exp_avg", "exp_avg_sq") of ``p``, full or this rank's partition (see above)."""
    engine, st = _of(p, api)
    if not p.requires_grad:
        return None
    opt, i = _optimizer_index(engine, p, kind, api)
    stepped = i is not None and (opt.records.steps[i] > 0 or (kind == "fp32" and opt.seeded(i)))
    if i is not None and stepped and (kind != "fp32" or p.dtype != torch.float32):
        local = _read_records(opt, i, kind)
    elif kind == "fp32":
        local = _stored_partition(st)
    else:
        local = torch.zeros(st.partition_numel, dtype=torch.float32)  # Adam's moments before a first step
    return _gathered(st, local) if full else local.to(st.device)


def write(p: torch.Tensor, value: torch.Tensor, kind: str, *, full: bool, api: str) -> None:
    """Write ``value`` as ``kind`` of ``p`` (the whole param's, or this rank's partition)."""
    engine, st = _of(p, api)
    _outside_backward(api)
    if not p.requires_grad:
        raise ZswapError(
            f"{api}: the param (shape {tuple(st.shape)}) does not require grad, so it has no optimizer "
            "state; write its value with zswap.GatheredParameters(params, modifier_rank=0)"
        )
    local = _partition_of(st, value, full, api)
    opt, i = _optimizer_index(engine, p, kind, api)
    if kind == "fp32" and p.dtype == torch.float32:
        whole = _gathered(st, local)  # a float32 param is its own master: its value changes now
        _leave_early_step(engine, api)
        with GatheredParameters([p], modifier_rank=0), no_torch_function():
            p.data.copy_(whole)
        return
    if i is None or opt.records.steps[i] == 0:
        what = "float32 master" if kind == "fp32" else kind
        raise ZswapError(
            f"{api}: the param (shape {tuple(st.shape)}, {p.dtype}) has taken no optimizer step yet, so "
            f"zswap keeps no {what} for it (its first engine.step() makes them, from the param and zeros): "
            "set it after that step"
        )
    _leave_early_step(engine, api)
    at = _VIEW[kind]

    def fill(_: int, start: int, views: tuple[torch.Tensor, torch.Tensor, torch.Tensor | None]) -> None:
        view = views[at]
        assert view is not None  # (a low-precision param's records hold its master)
        view.copy_(local[start : start + view.numel()])

    opt.stream_state(fill, write=True, params=[i])


def read_grad(p: torch.Tensor, *, full: bool, api: str) -> torch.Tensor | None:
    """``p``'s gradient of this step as float32 (full or this rank's partition), ``None`` without one."""
    _, st = _of(p, api)
    if not p.requires_grad:
        return None
    store = store_of(st)
    store.wanted = True  # keep_applied_grads "auto": gradients read are kept from the next backward on
    if not store.has(st):
        return None
    part, handle = store.load(st)
    if handle is not None:
        handle.wait()
    local = part.to(torch.float32, copy=True)  # (the stored tensor itself, or a pooled load buffer)
    return _gathered(st, local) if full else local.to(st.device)


def write_grad(p: torch.Tensor, value: torch.Tensor, *, full: bool, api: str) -> None:
    """Replace ``p``'s gradient of this step (taken as given: no averaging over ranks)."""
    engine, st = _of(p, api)
    _outside_backward(api)
    if not p.requires_grad:
        raise ZswapError(f"{api}: the param (shape {tuple(st.shape)}) does not require grad")
    local = _partition_of(st, value, full, api)
    _leave_early_step(engine, api)
    store = store_of(st)
    store.wanted = True
    kept = store.dtype(st) or p.dtype
    dtype = kept if local.dtype == kept else torch.float32  # what is given, no rounding below float32
    store.clear([st])
    store.add(st, local.to("cpu" if st.tier != "none" else st.device, dtype, copy=True))
    store.wait_all()


# -- internals ----------------------------------------------------------------------------------------


def _of(p: torch.Tensor, api: str) -> tuple[Any, ParamState]:
    st = param_state(p)
    engines = runners_of([p]) if st is not None else []
    if st is None or not engines:
        raise ZswapError(
            f"{api}: the param (shape {tuple(p.shape)}) is not trained by an open zswap engine "
            "(zswap.initialize / zswap.deepspeed.initialize over a model built under zswap.Init)"
        )
    return engines[0], st


def _outside_backward(api: str) -> None:
    if torch._C._current_graph_task_id() != -1:
        raise ZswapError(f"{api} inside backward: call it between backward() and step(), or after step()")


def _leave_early_step(engine: Any, api: str) -> None:
    """An update made in the last backward used what is being written: the step runs the ordinary way
    from the stored gradients (`GradientsNotKeptError` now if the early step had let go of some)."""
    es = engine._early
    if es is not None and es.state == "running" and es.ended:
        early_commit.drop(es, f"{api} wrote between backward and step")


def _optimizer_index(engine: Any, p: torch.Tensor, kind: str, api: str) -> tuple[Any, int | None]:
    """The engine's `OffloadedAdamW` and ``p``'s index in it (``None``: it steps no such param)."""
    records = resize.records_of(engine.optimizer)
    if records is None:
        if kind != "fp32":
            raise ZswapError(
                f"{api}: {type(engine.optimizer).__name__} keeps its own state; zswap reads and writes "
                f"{kind} of its AdamW (the config's optimizer section, or a torch Adam / AdamW passed to "
                "initialize)"
            )
        return None, None
    if kind != "fp32" and kind not in STATE_KEYS:
        raise ZswapError(f"{api}: zswap's AdamW keeps {' and '.join(STATE_KEYS)}, not {kind!r}")
    index = next((i for i, q in enumerate(records.params) if q is p), None)
    if index is None and kind != "fp32":
        raise ZswapError(f"{api}: the engine's optimizer steps no such param (it is in none of its groups)")
    return engine.optimizer, index


def _read_records(opt: Any, i: int, kind: str) -> torch.Tensor:
    out = torch.empty(opt.state_numel(i), dtype=torch.float32)
    at = _VIEW[kind]

    def take(_: int, start: int, views: tuple[torch.Tensor, torch.Tensor, torch.Tensor | None]) -> None:
        view = views[at]
        assert view is not None
        out[start : start + view.numel()] = view

    opt.stream_state(take, write=False, params=[i])
    return out


def _stored_partition(st: ParamState) -> torch.Tensor:
    part, handle = st.store.load(st.key, st.partition_numel, st.dtype)
    if handle is not None:
        handle.wait()
    return part.to("cpu", torch.float32, copy=True)  # (the stored tensor itself, or a pooled load buffer)


def _gathered(st: ParamState, local: torch.Tensor) -> torch.Tensor:
    """The whole param's tensor from every rank's ``local`` partition (collective), on its device."""
    with no_torch_function():
        local = local.to(st.device)
        if st.world_size == 1:
            return local[: st.numel].view(st.shape)
        full = torch.empty(st.partition_numel * st.world_size, dtype=local.dtype, device=st.device)
        dist.all_gather_into_tensor(full, local.contiguous(), group=st.group)
        return full[: st.numel].view(st.shape)


def _partition_of(st: ParamState, value: torch.Tensor, full: bool, api: str) -> torch.Tensor:
    """This rank's flat partition of ``value`` (the whole param's, or already a partition), on the CPU."""
    if not isinstance(value, torch.Tensor) or not value.is_floating_point():
        raise TypeError(f"{api}: the value must be a floating-point tensor, got {_kind(value)}")
    want = st.numel if full else st.partition_numel
    if value.numel() != want:
        what = f"the param's {tuple(st.shape)}" if full else "this rank's partition of the param"
        raise ValueError(f"{api}: the value has {value.numel()} elements, {what} has {want}")
    flat = value.detach().reshape(-1).to("cpu")
    if not full:
        return flat
    lo = min(st.rank * st.partition_numel, st.numel)
    part = flat[lo : lo + st.partition_numel]
    if part.numel() < st.partition_numel:  # the last rank's padding
        part = torch.cat([part, part.new_zeros(st.partition_numel - part.numel())])
    return part


def _kind(value: object) -> str:
    return f"a {value.dtype} tensor" if isinstance(value, torch.Tensor) else type(value).__name__
