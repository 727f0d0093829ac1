"""Backward's large matmul outputs in host memory reused across the backward, instead of fresh pages.

glibc maps every allocation of `zswap.memory.MMAP_THRESHOLD` bytes or more by itself (zswap fixes the
threshold so that freed tensors go back to the kernel: `zswap.memory`), so on the CPU each weight gradient
of a backward is a new mapping: its pages fault in, the kernel zeroes them, and the free unmaps them again.
At 2 GiB of params that is 2 GiB of first touches a step (about 460 k faults and 1 CPU-second of kernel
time; benches/README.md, "Step time, stop 23"). Plain PyTorch does not pay it: without a fixed threshold
glibc's heap keeps the freed chunks, at a memory cost that grows with the model's depth (the reason for
the threshold).

Here the outputs of ``mm`` and ``bmm`` (weight gradients, and the input gradients of the matmuls) that a
managed module's backward nodes compute go to an `OutputPool` instead: buffers of exactly the requested
size, reused once nothing views them any more. The op runs as its ``out=`` overload into the buffer — the
same kernel, so the values are bitwise those of the plain op. The node's pre-hook enters a
`TorchDispatchMode` that does this and its post-hook leaves it, so it is on only while such a node runs
(every other op in it passes through unchanged, a Python ``Function.backward`` among them included); the
autograd engine also restores its thread-local state after every node, so a node that raises leaves no
mode behind. The hooks go on the nodes between a module's outputs and its inputs
(`BackwardOutputs.instrument`, from the module's forward post-hook), only for modules that own managed
params, only on the CPU (a CUDA device's caching allocator already reuses memory).

The pool maps at most the most bytes its buffers had in use at once and is emptied when the outermost
backward ends: between backwards it holds nothing.

Off by default (`DEFAULT`, `zswap.Engine.reuse_backward_outputs`): it removes the faults but, on the 6 GiB
checkpointed demo, peak RSS came out 30–40 MiB higher, and that bound has no such margin (benches/README.md,
"Step time, stop 24", splits it at the peak).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any, cast

import torch
from torch.utils._python_dispatch import (
    TorchDispatchMode,
    _get_current_dispatch_mode,
    _get_current_dispatch_mode_stack,
    _pop_mode,
    _push_mode,
)

from .. import memory
from ..pool import BufferPool

MIN_BYTES = memory.MMAP_THRESHOLD
"""Outputs from this size on come from the pool; glibc's heap serves smaller ones without faulting."""

DEFAULT = False
"""`zswap.Engine.reuse_backward_outputs` of a new engine (off: see its docstring; the suite turns it on)."""

MAX_NODES = 256
"""Most autograd nodes `BackwardOutputs.instrument` walks from one module call's outputs: a module whose
output depends on a tensor that is not among its inputs would otherwise walk the graph before it."""

_aten = torch.ops.aten
_MARK = "zswap_outputs"  # key in a node's ``metadata``: its hooks are on


class OutputPool:
    """Host buffers of exact sizes (a `zswap.pool.BufferPool` under the one peak rule, no other limit),
    handed out as views (`take`) and reused once free: nothing but the pool references the buffer and no
    tensor shares its storage."""

    def __init__(self) -> None:
        self._pool = BufferPool(lambda numel, dtype: torch.empty(numel, dtype=dtype))

    @property
    def pooled(self) -> int:
        """Bytes of the buffers the pool keeps (in use or idle)."""
        return self._pool.pooled

    @property
    def peak_pooled(self) -> int:
        """Most bytes pooled at once since the last `reset_peak`."""
        return self._pool.peak_pooled

    @property
    def made(self) -> int:
        """Buffers mapped anew (counters since the pool was made)."""
        return self._pool.made

    @property
    def reused(self) -> int:
        """Outputs served by a buffer already mapped."""
        return self._pool.reused

    def take(self, shape: tuple[int, ...], dtype: torch.dtype) -> torch.Tensor:
        """A contiguous tensor of ``shape`` whose memory no live tensor shares."""
        numel = 1
        for s in shape:
            numel *= s
        return self._pool.take(numel, dtype)[0].view(shape)

    def idle(self) -> int:
        """Bytes of pooled buffers nothing uses now."""
        return self._pool.idle()

    def clear(self) -> None:
        """Forget every buffer (one still in use is freed by its last user) and the peak in use."""
        self._pool.clear()

    def reset_peak(self) -> None:
        self._pool.reset_peak()


def _plain_cpu(a: Any, b: Any) -> bool:
    return (
        type(a) is torch.Tensor
        and type(b) is torch.Tensor
        and a.device.type == "cpu"
        and b.device.type == "cpu"
        and a.layout is torch.strided
        and b.layout is torch.strided
        and a.dtype == b.dtype
    )


class _PooledMatmuls(TorchDispatchMode):
    """Runs ``mm`` / ``bmm`` of plain dense CPU tensors into `OutputPool` buffers; every other op as is."""

    def __init__(self, pool: OutputPool) -> None:
        super().__init__()
        self.pool = pool

    def __torch_dispatch__(
        self, func: Any, types: Any, args: tuple[Any, ...] = (), kwargs: dict[str, Any] | None = None
    ) -> Any:
        if not kwargs and len(args) == 2 and _plain_cpu(*args):
            a, b = args
            if func is _aten.mm.default and a.dim() == 2 and b.dim() == 2:
                shape: tuple[int, ...] = (a.size(0), b.size(1))
                if shape[0] * shape[1] * a.dtype.itemsize >= MIN_BYTES:
                    return _aten.mm.out(a, b, out=self.pool.take(shape, a.dtype))
            elif func is _aten.bmm.default and a.dim() == 3 and b.dim() == 3:
                shape = (a.size(0), a.size(1), b.size(2))
                if shape[0] * shape[1] * shape[2] * a.dtype.itemsize >= MIN_BYTES:
                    return _aten.bmm.out(a, b, out=self.pool.take(shape, a.dtype))
        return func(*args, **(kwargs or {}))


class BackwardOutputs:
    """One engine's pool and the node hooks that route its modules' backward matmuls into it."""

    def __init__(self, *, enabled: Callable[[], bool] = lambda: False) -> None:
        self.pool = OutputPool()
        self._enabled = enabled  # asked at each module call: `zswap.Engine.reuse_backward_outputs`
        self._mode = _PooledMatmuls(self.pool)
        self._closed = False

    def instrument(self, outputs: list[torch.Tensor], inputs: list[torch.Tensor]) -> None:
        """Hook the nodes one module call added to the graph: those reached from ``outputs``' ``grad_fn``
        before ``inputs``' (and before any param's ``AccumulateGrad``)."""
        if self._closed or not self._enabled() or outputs[0].device.type != "cpu":
            return
        stop = {t.grad_fn for t in inputs if t.grad_fn is not None}
        todo = [t.grad_fn for t in outputs]
        seen: set[Any] = set()
        while todo and len(seen) < MAX_NODES:
            fn = todo.pop()
            if fn is None or fn in seen or fn in stop:
                continue
            seen.add(fn)
            if not fn.next_functions and type(fn).__name__ == "AccumulateGrad":
                continue
            meta = cast(dict[str, Any], fn.metadata)  # a dict attribute of the node (stubs: a method)
            # A torch.compile'd region's backward is one node running generated code, whose matmuls
            # write into buffers of its own: nothing to place there, and no mode to put around it.
            if _MARK not in meta and not type(fn).__name__.startswith("CompiledFunction"):
                meta[_MARK] = True  # a nested module's call hooks its nodes before its parent's does
                fn.register_prehook(self._enter)
                fn.register_hook(self._leave)
            todo.extend(nf for nf, _ in fn.next_functions)

    def _enter(self, grad_outputs: Any) -> None:
        if self._closed or self._mode in _get_current_dispatch_mode_stack():
            return
        if torch._C._functorch.peek_interpreter_stack() is not None:
            return  # inside a functorch transform: its wrapped tensors are not ours to place
        _push_mode(self._mode)

    def _leave(self, grad_inputs: Any, grad_outputs: Any) -> None:
        if _get_current_dispatch_mode() is self._mode:
            _pop_mode()

    def end(self) -> None:
        """The outermost backward ended: let go of every buffer."""
        self.pool.clear()

    def close(self) -> None:
        """Hooks left on a graph kept past `close` (``retain_graph``) do nothing from now on."""
        self._closed = True
        self.pool.clear()
