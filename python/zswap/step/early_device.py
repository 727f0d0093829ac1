"""The early step on a compute device (`zswap.device`: CUDA, or the suite's stand-in).

There the gathered param and its gradient are on the device when the gradient is complete. Both are
copied to the host on the device's copy stream — the param's partition into the early step's copy (a
page-aligned fetch-pool buffer, registered with the device where it is large enough; none for a param the
update only writes, one with a float32 master: `early_memory.copy_of`), the gradient into a landing
buffer as `zswap.gradients.grads.GradSink` lands any — and once both have landed the record update
runs on the host as on the CPU path: the same kernel on the same bytes (the device's gathered param is the
stored partition, copied over without change; the gradient lands in its own dtype, as the store would
receive it). Backward never waits for a copy: landed ones are taken at later gradients, the rest at
backward's end. The updated partition goes to its tier from the host copy; nothing is copied back to the
device (the next forward gathers it as any param).
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any, cast

import torch

from ..parts.gather import no_torch_function
from ..parts.params import GradStore, ParamState, local_slice
from . import early_memory

if TYPE_CHECKING:
    from .earlystep import EarlyStep


def take_later(es: EarlyStep, i: int, p: torch.Tensor, st: ParamState, part: torch.Tensor, sink: Any) -> None:
    """Start the device-to-host copies of param ``i``'s partition and of its gradient ``part`` (both on
    the device); `land` takes them over once they completed."""
    dev = sink.device
    with no_torch_function():
        data = p.data.reshape(-1)
        if st.world_size > 1:  # this rank's partition: its slice, zero past the param's end as stored
            data = local_slice(data, st.rank, st.partition_numel)
        # Where the update only writes the param, nothing is copied over (`early_memory.blank`).
        param_copy: Any = early_memory.blank(es, i, st, data)
        if param_copy is None:
            param_copy = dev.d2h(data.contiguous(), early_memory.alloc(st, data, dev))
        part = part.reshape(-1).contiguous()
        grad_copy = dev.d2h(part, sink.host_buffer(st, part.numel(), part.dtype))
    es.device = dev
    es.landing.append((i, st, param_copy, grad_copy, early_memory.version(st)))
    land(es, block=False)


def land(es: EarlyStep, block: bool) -> None:
    """Take over the copies that completed, in issue order (all of them, waiting, if ``block``): each
    param's gradient is stored or noted as applied, then its copy joins the pipeline (`EarlyStep._arrive`)."""
    dev = es.device
    while es.landing and es.state == "running":
        i, st, param_copy, grad_copy, version = es.landing[0]
        ready = isinstance(param_copy, torch.Tensor)  # `early_memory.blank`: no copy to wait for
        if not block and not ((ready or dev.query(param_copy)) and dev.query(grad_copy)):
            return
        es.landing.popleft()
        grad = dev.synchronize(grad_copy)
        copy = param_copy if ready else dev.synchronize(param_copy)
        placed = es._place(st, grad, cast(GradStore, es.gs).add_fp32)
        if placed is None:
            return
        es._arrive(i, st, copy, placed, version, es.task)


def drain(es: EarlyStep) -> list[tuple[ParamState, torch.Tensor]]:
    """The gradients of copies not taken over yet, landed (waited for): for the store when the early step
    gives up. Their param copies are dropped."""
    out = []
    while es.landing:
        _, st, param_copy, grad_copy, _ = es.landing.popleft()
        if not isinstance(param_copy, torch.Tensor):  # (a tensor: `early_memory.blank`, nothing copied)
            es.device.synchronize(param_copy)  # its buffer must not be reused under a running copy
        out.append((st, es.device.synchronize(grad_copy)))
    return out
