"""DeepSpeed's ``deepspeed.comm`` on torch.distributed: ``import zswap.deepspeed.comm as dist`` in a script
ported from DeepSpeed.

zswap partitions over torch.distributed's own process groups, so each collective here is torch's, called with
DeepSpeed's signature: DeepSpeed adds ``prof``, ``log_name`` and ``debug`` to every collective for its
communication logger, which zswap does not have. ``log_name`` and ``debug`` only label what that logger would
record and are dropped; ``prof=True`` asks for a record zswap cannot make, a `TypeError` naming
``torch.profiler`` (the rule of `zswap.deepspeed`: a keyword with no equivalent is refused unless it has its
default). DeepSpeed's own names (`get_local_rank`, `get_world_group`, `get_all_ranks_from_group`,
`allgather_fn`, `reduce_scatter_fn`, `inference_all_reduce`, the ``has_*`` probes) keep DeepSpeed's meaning.
A name DeepSpeed's module has and this one does not (its comms logger: ``log_summary``, ``configure``…) is an
`AttributeError` saying so, not a silent no-op.
"""

from __future__ import annotations

import functools
import os
from collections.abc import Callable
from typing import Any

import torch
import torch.distributed as _torch_dist

from ._launch import init_distributed

ReduceOp = _torch_dist.ReduceOp
P2POp = _torch_dist.P2POp
ProcessGroup = _torch_dist.ProcessGroup

_TORCH_NAMES = (
    "all_gather", "all_gather_into_tensor", "all_gather_object", "all_reduce", "all_to_all",
    "all_to_all_single", "barrier", "batch_isend_irecv", "broadcast", "broadcast_object_list",
    "destroy_process_group", "gather", "get_global_rank", "get_rank", "get_world_size", "irecv",
    "is_initialized", "isend", "monitored_barrier", "new_group", "recv", "reduce", "reduce_scatter",
    "reduce_scatter_tensor", "scatter", "send",
)  # fmt: skip
"""Collectives and queries whose DeepSpeed signature is torch's plus ``prof`` / ``log_name`` / ``debug``."""


def _on_torch(name: str) -> Callable[..., Any]:
    target = getattr(_torch_dist, name)

    @functools.wraps(target)
    def call(
        *args: Any, prof: bool = False, log_name: str | None = None, debug: Any = None, **kwargs: Any
    ) -> Any:
        _refuse_prof(name, prof)
        return target(*args, **kwargs)

    call.__module__ = __name__
    return call


def _refuse_prof(name: str, prof: bool) -> None:
    if prof:
        raise TypeError(
            f"zswap.deepspeed.comm.{name}(prof=True): DeepSpeed's communication logger has no zswap "
            "equivalent; time collectives with torch.profiler (or leave prof at its default, False)"
        )


for _name in _TORCH_NAMES:
    globals()[_name] = _on_torch(_name)
del _name


def is_available() -> bool:
    """Whether torch.distributed is built in (DeepSpeed's answer for its comm package)."""
    return bool(_torch_dist.is_available())


def get_local_rank() -> int:
    """This process's rank on its node, as DeepSpeed reads it from its launcher: ``LOCAL_RANK`` (torchrun,
    deepspeed), else Open MPI's ``OMPI_COMM_WORLD_LOCAL_RANK``, else 0."""
    value = os.environ.get("LOCAL_RANK", os.environ.get("OMPI_COMM_WORLD_LOCAL_RANK", "0"))
    return int(value)


def get_world_group() -> Any:
    """The default process group (``torch.distributed.group.WORLD``)."""
    return _torch_dist.group.WORLD


def get_all_ranks_from_group(group: Any = None) -> list[int]:
    """The global ranks of ``group``'s members in group-rank order (``None``: the default group)."""
    return list(_torch_dist.get_process_group_ranks(_torch_dist.group.WORLD if group is None else group))


def has_all_gather_into_tensor() -> bool:
    return True


def has_reduce_scatter_tensor() -> bool:
    return True


def allgather_fn(
    output_tensor: torch.Tensor,
    input_tensor: torch.Tensor,
    group: Any = None,
    async_op: bool = False,
    debug: Any = None,
) -> Any:
    """DeepSpeed's flat all-gather: ``torch.distributed.all_gather_into_tensor``."""
    return _torch_dist.all_gather_into_tensor(output_tensor, input_tensor, group=group, async_op=async_op)


def reduce_scatter_fn(
    output_tensor: torch.Tensor,
    tensor: torch.Tensor,
    op: Any = ReduceOp.SUM,
    group: Any = None,
    async_op: bool = False,
    prof: bool = False,
    debug: Any = None,
) -> Any:
    """DeepSpeed's flat reduce-scatter: ``torch.distributed.reduce_scatter_tensor``."""
    _refuse_prof("reduce_scatter_fn", prof)
    return _torch_dist.reduce_scatter_tensor(output_tensor, tensor, op=op, group=group, async_op=async_op)


def inference_all_reduce(
    tensor: torch.Tensor,
    op: Any = ReduceOp.SUM,
    group: Any = None,
    async_op: bool = False,
    prof: bool = False,
    log_name: str | None = None,
    debug: Any = None,
) -> Any:
    """DeepSpeed's all-reduce for inference kernels: a plain ``all_reduce`` (DeepSpeed's waits too)."""
    _refuse_prof("inference_all_reduce", prof)
    return _torch_dist.all_reduce(tensor, op=op, group=group)


def __getattr__(name: str) -> Any:
    raise AttributeError(
        f"zswap.deepspeed.comm has no {name!r}: it maps DeepSpeed's collectives and rank queries onto "
        "torch.distributed (the names in zswap.deepspeed.comm.__all__), and has no communication logger "
        "(log_summary, configure, comms_logger: time collectives with torch.profiler); anything else "
        "torch.distributed has is called there"
    )


__all__ = [
    *_TORCH_NAMES,
    "P2POp",
    "ProcessGroup",
    "ReduceOp",
    "allgather_fn",
    "get_all_ranks_from_group",
    "get_local_rank",
    "get_world_group",
    "has_all_gather_into_tensor",
    "has_reduce_scatter_tensor",
    "inference_all_reduce",
    "init_distributed",
    "is_available",
    "reduce_scatter_fn",
]
