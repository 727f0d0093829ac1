"""Gradients of managed params: taken from autograd as each one is complete, reduce-scattered across ranks,
and accumulated as this rank's partition on the offload tier (`ParamState.grad`).

Autograd's own graph and `AccumulateGrad` are left exactly as they are: a param used in several places (tied
embeddings, activation checkpointing) still has its contributions summed by autograd in the same order as in
a plain model, and ``p.grad`` is read and cleared by a post-accumulate hook, so one backward's gradient is
folded into the partition with one in-place add — the op autograd itself uses to accumulate into ``p.grad``.
With one rank nothing else touches the values, so they are bitwise those of the plain model.

Partitions are kept in CPU memory (on the param's device for tier "none"), also when params live on NVMe;
the optimizer reads them from there.
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any

import torch
import torch.distributed as dist

from .gather import Item, no_torch_function
from .params import ParamState, Status, param_state


class GradSink:
    """Installs, on each managed param that requires grad, the hooks that move its gradient to its
    partition. ``remove()`` takes them off again."""

    def __init__(self, items: Iterable[Item]) -> None:
        self._handles: list[Any] = []
        self.placeholders = 0
        """Times a param was not gathered when autograd accumulated its gradient (see `_pre`)."""
        for p, st in items:
            if p.requires_grad:
                self._handles.append(p.register_hook(self._make_pre(p, st)))
                self._handles.append(p.register_post_accumulate_grad_hook(self._make_post(st)))

    def remove(self) -> None:
        for h in self._handles:
            h.remove()
        self._handles.clear()

    def _make_pre(self, p: torch.Tensor, st: ParamState) -> Any:
        def pre(grad: torch.Tensor) -> None:
            # AccumulateGrad lays a new gradient out like the param and copies it into that layout, which
            # fails on an empty ``.data``. The module hooks keep a param gathered until its gradient is in,
            # so this is a safety net (a param whose last use needs no data, outside every hooked module):
            # a stride-0 placeholder of the full shape and one element makes autograd keep the gradient as
            # it is; `post` puts the empty tensor back.
            if st.status is not Status.AVAILABLE:
                with no_torch_function():
                    p.data = torch.empty((), dtype=st.dtype, device=st.device).expand(st.shape)
                self.placeholders += 1

        return pre

    def _make_post(self, st: ParamState) -> Any:
        def post(p: torch.Tensor) -> None:
            with no_torch_function():
                grad = p.grad
                p.grad = None  # never left holding a full-size gradient
                if st.status is not Status.AVAILABLE:
                    p.data = torch.empty(0, dtype=st.dtype, device=st.device)
                if grad is not None:
                    accumulate(st, grad)

        return post


def accumulate(st: ParamState, grad: torch.Tensor) -> None:
    """Add one backward's full gradient of a param to its local partition, ``st.grad``."""
    part = local_part(st, grad)
    if st.tier != "none" and part.device.type != "cpu":
        part = part.to("cpu")
    if st.grad is None:
        # Autograd hands the gradient over (``p.grad`` was cleared), so the first one is kept as is.
        st.grad = part if part.is_contiguous() else part.contiguous()
    else:
        st.grad.add_(part)


def local_part(st: ParamState, grad: torch.Tensor) -> torch.Tensor:
    """This rank's slice of ``grad`` averaged over the ranks: reduce-scatter (sum) then divide by the world
    size, as DDP and DeepSpeed do. One rank: the flattened gradient itself."""
    flat = grad.reshape(-1)
    if st.world_size == 1:
        return flat
    padded_numel = st.partition_numel * st.world_size
    if flat.numel() != padded_numel:
        padded = flat.new_zeros(padded_numel)
        padded[: flat.numel()] = flat
        flat = padded
    out = flat.new_empty(st.partition_numel)
    _reduce_scatter(out, flat.contiguous(), st)
    return out.div_(st.world_size)


def _reduce_scatter(out: torch.Tensor, flat: torch.Tensor, st: ParamState) -> None:
    try:
        dist.reduce_scatter_tensor(out, flat, op=dist.ReduceOp.SUM, group=st.group)
    except (RuntimeError, NotImplementedError) as exc:
        if "support" not in str(exc).lower() and "implement" not in str(exc).lower():
            raise
        # A backend without a flat reduce-scatter (gloo before torch 2.5): all-reduce, keep this rank's
        # slice. Every rank takes the same branch, so the collectives still line up.
        total = flat.clone()
        dist.all_reduce(total, op=dist.ReduceOp.SUM, group=st.group)
        start = st.rank * st.partition_numel
        out.copy_(total[start : start + st.partition_numel])


def full_grad(p: torch.Tensor) -> torch.Tensor | None:
    """The full-shape gradient of ``p`` after backward and before `Engine.step` (``p.grad`` for a param zswap
    does not manage), or ``None`` if it has none.

    For a partitioned param the partitions are gathered across ranks, so every rank must call it for the
    same params in the same order. The result is a new tensor on the param's device.
    """
    st = param_state(p)
    if st is None:
        return p.grad
    part = st.grad
    if part is None:
        return None
    with no_torch_function():
        if st.world_size == 1:
            full = part.to(st.device, copy=True)
        else:
            local = part.to(st.device)
            full = torch.empty(st.partition_numel * st.world_size, dtype=part.dtype, device=st.device)
            dist.all_gather_into_tensor(full, local.contiguous(), group=st.group)
        return full[: st.numel].view(st.shape)


def clear(items: Iterable[Item]) -> None:
    """Drop the gradients of ``items`` (partitions of managed params, ``p.grad`` of the rest)."""
    for p, st in items:
        st.grad = None
        p.grad = None
