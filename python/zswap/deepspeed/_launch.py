"""`init_distributed`: DeepSpeed's ``deepspeed.init_distributed`` (also ``deepspeed.comm.init_distributed``)
on torch.distributed."""

from __future__ import annotations

import os
from datetime import timedelta
from typing import Any

import torch

from ..errors import ZswapError

TORCH_DISTRIBUTED_DEFAULT_PORT = 29500
"""DeepSpeed's default ``distributed_port``."""


def init_distributed(
    dist_backend: str | None = None,
    auto_mpi_discovery: bool = True,
    distributed_port: int = TORCH_DISTRIBUTED_DEFAULT_PORT,
    verbose: bool = True,
    timeout: timedelta | None = None,
    init_method: str | None = None,
    dist_init_required: bool | None = None,
    config: Any = None,
    rank: int = -1,
    world_size: int = -1,
) -> None:
    """DeepSpeed's ``deepspeed.init_distributed`` on torch.distributed.

    ``dist_init_required`` ``None`` (as DeepSpeed: required where torch.distributed is not initialised)
    and ``True``: initialise — from the launcher's environment (``torchrun``, ``deepspeed``), else a
    group of one on ``127.0.0.1:distributed_port``, so that the script's ``deepspeed.comm.get_rank()`` /
    ``barrier()`` after it work (DeepSpeed, without a launcher, looks for MPI); ``False``: do nothing, but
    raise where a launcher set ``WORLD_SIZE`` > 1 and nothing initialised torch.distributed (each rank
    would train a model of its own, as DeepSpeed refuses: "Distributed backend is not initialized").
    ``dist_backend`` defaults to nccl where CUDA is available (as DeepSpeed picks its accelerator's
    backend), else gloo. ``rank`` / ``world_size`` (-1: from the environment), ``init_method`` and
    ``timeout`` go to ``init_process_group``. ``auto_mpi_discovery``:
    DeepSpeed's fallback when no launcher set the environment, reading ranks from mpi4py; zswap has none,
    so ``True`` (the default) means the same as ``False`` — the environment or the single-process defaults
    decide. ``verbose`` (DeepSpeed's log lines) and ``config`` (read by DeepSpeed for its comms logger)
    change nothing zswap does.
    """
    dist = torch.distributed
    if dist.is_initialized():
        return
    if dist_init_required is False:
        launched_world = os.environ.get("WORLD_SIZE", "1")
        if launched_world.isdigit() and int(launched_world) > 1:
            raise ZswapError(
                f"dist_init_required=False, but the launcher set WORLD_SIZE={launched_world} and "
                "torch.distributed is not initialised: each rank would train a model of its own. "
                "Initialise it before initialize (torch.distributed.init_process_group() or "
                "zswap.deepspeed.init_distributed()), or leave dist_init_required unset"
            )
        return
    _start(dist_backend, distributed_port, timeout, init_method, rank, world_size)


def init_for_initialize(distributed_port: int, dist_init_required: bool | None) -> None:
    """What ``initialize`` does first (DeepSpeed calls ``init_distributed`` there): ``dist_init_required``
    as `init_distributed` takes it, but ``None`` initialises only where a launcher set ``WORLD_SIZE``: a
    single process needs no group, and zswap makes none behind the script's back."""
    if dist_init_required is None and ("WORLD_SIZE" not in os.environ or torch.distributed.is_initialized()):
        return
    init_distributed(distributed_port=distributed_port, dist_init_required=dist_init_required)


def _start(
    dist_backend: str | None,
    distributed_port: int,
    timeout: timedelta | None,
    init_method: str | None,
    rank: int,
    world_size: int,
) -> None:
    """``init_process_group`` from the launcher's environment, or, without one, a group of one on
    ``127.0.0.1:distributed_port`` (the port set as DeepSpeed sets it then, whatever ``MASTER_PORT`` the
    shell left). A failure (the port taken) leaves the environment as it was, so a retry with another
    port uses it."""
    dist = torch.distributed
    before = {key: os.environ.get(key) for key in ("MASTER_ADDR", "MASTER_PORT", "RANK", "WORLD_SIZE")}
    if before["WORLD_SIZE"] is None:  # no launcher
        os.environ.update(MASTER_PORT=str(distributed_port), RANK="0", WORLD_SIZE="1")
    for key, value in (("MASTER_ADDR", "127.0.0.1"), ("MASTER_PORT", str(distributed_port)), ("RANK", "0")):
        os.environ.setdefault(key, value)
    backend = dist_backend or ("nccl" if torch.cuda.is_available() else "gloo")
    kwargs: dict[str, Any] = {"backend": backend}
    if init_method is not None:
        kwargs["init_method"] = init_method
    if timeout is not None:
        kwargs["timeout"] = timeout
    if rank != -1:
        kwargs["rank"] = rank
    if world_size != -1:
        kwargs["world_size"] = world_size
    try:
        dist.init_process_group(**kwargs)
    except BaseException:
        for key, was in before.items():
            if was is None:
                os.environ.pop(key, None)
            else:
                os.environ[key] = was
        raise
