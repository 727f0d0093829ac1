"""The few torch.distributed calls zswap makes; world = 1 when torch.distributed is not in use."""

from __future__ import annotations

import contextlib
import os
import warnings
import zlib
from collections.abc import Callable, Iterable
from typing import TYPE_CHECKING, Any

import torch

from . import _hostcomm
from .errors import RanksDivergedError, ZswapError, ZswapWarning

if TYPE_CHECKING:
    from torch.distributed import ProcessGroup


def _dist_ready() -> bool:
    return torch.distributed.is_available() and torch.distributed.is_initialized()


def resolve_group(group: ProcessGroup | None) -> tuple[ProcessGroup | None, int, int]:
    """(group, rank in it, its size). An explicit group wins; else the default group when torch.distributed
    is initialised; else no group, rank 0 of 1."""
    if group is None and not _dist_ready():
        return None, 0, 1
    dist = torch.distributed
    return group, dist.get_rank(group), dist.get_world_size(group)


def check_launch(group: ProcessGroup | None) -> None:
    """A multi-process launch (``WORLD_SIZE`` > 1) before ``init_process_group`` would give every rank a
    full copy of every param, silently multiplying memory and disk by the world size. A default group of
    one rank there (initialised by something else before the launch's own) is an error, as DeepSpeed's
    ``zero.Init`` makes it: nothing would partition. A one-rank group passed explicitly is meant."""
    try:
        world = int(os.environ.get("WORLD_SIZE", "1") or "1")
    except ValueError:
        return
    if world > 1 and group is None and _dist_ready() and torch.distributed.get_world_size() == 1:
        raise ZswapError(
            f"the launcher set WORLD_SIZE={world} but torch.distributed's default group has 1 rank (it was "
            "initialised before the launch's own, by another library or init_process_group with "
            "world_size=1): zswap.Init would partition nothing and every rank keep the whole model. "
            f"Initialise the default group with the launcher's {world} ranks "
            "(torch.distributed.init_process_group() from the environment, or "
            "zswap.deepspeed.init_distributed()); to run one model per process, pass a one-rank "
            "process_group explicitly"
        )
    if world > 1 and group is None and not _dist_ready():
        warnings.warn(
            f"WORLD_SIZE={world} but torch.distributed is not initialised: zswap.Init partitions as a single "
            "process, so every rank keeps a full copy of every param; call "
            "torch.distributed.init_process_group() before zswap.Init",
            ZswapWarning,
            stacklevel=3,
        )


def check_partitioned_for_this_world(items: Iterable[tuple[torch.Tensor, Any]]) -> None:
    """Refuse to run params partitioned for one process (``zswap.Init`` ran before
    ``init_process_group``, so they have no group) in a process that is now one of several ranks: every
    rank would train its own full copy, never synchronised. A one-rank group passed as ``process_group``
    says that is meant."""
    if not _dist_ready() or torch.distributed.get_world_size() == 1:
        return
    alone = [st for _, st in items if st.group is None and st.world_size == 1]
    if alone:
        raise ZswapError(
            f"{len(alone)} params were partitioned for a single process (zswap.Init, or from_pretrained "
            f"under it, ran before torch.distributed was initialised) but this process is rank "
            f"{torch.distributed.get_rank()} of {torch.distributed.get_world_size()}: every rank would "
            "train its own full copy, never synchronised. Call torch.distributed.init_process_group() (or "
            "zswap.deepspeed.init_distributed()) before zswap.Init; where each rank is meant to run a model "
            "of its own, pass zswap.Init a one-rank process_group (torch.distributed.new_group([rank]))"
        )


def is_gloo(group: ProcessGroup | None) -> bool:
    """Whether ``group`` (None: the default group) runs on gloo, the CPU backend."""
    return bool(torch.distributed.get_backend(group) == "gloo")


def host_channel(group: ProcessGroup | None) -> _hostcomm.Channel | None:
    """The shared-memory channel of a gloo ``group`` whose ranks share one host (`zswap._hostcomm`), or
    ``None``: gloo carries its collectives. The first call on a group is collective (every rank makes it at
    the same point, as it is made from a gather or a reduction every rank runs)."""
    return _hostcomm.channel(group)


def all_gather_flat(
    out: torch.Tensor,
    local: torch.Tensor,
    group: ProcessGroup | None,
    scratch: Callable[[int, torch.dtype], torch.Tensor] | None = None,
) -> None:
    """Fill ``out`` (world × local.numel() elements) with every rank's ``local``, in rank order: through
    shared memory where the group's ranks share a host (`host_channel`), else through the backend.

    ``scratch(numel, dtype)``: on gloo, a buffer for ``local`` repeated once per rank, sent as one
    all-to-all straight into ``out``. gloo's own all-gather receives into a new flat tensor of the whole
    size and copies it out: with zswap's fixed mmap threshold (`zswap.memory`) both are fresh pages,
    faulted and zeroed at every gather (1.8 M faults a step a rank at 1 GiB of params on two ranks)."""
    dist = torch.distributed
    if local.device != out.device:
        local = local.to(out.device)
    if out.device.type == "cpu" and is_gloo(group):
        ch = host_channel(group)
        if ch is not None:
            ch.all_gather(out, local.reshape(-1))
            return
        if scratch is not None:
            n, world = local.numel(), out.numel() // max(local.numel(), 1)
            sent = scratch(n * world, local.dtype)
            for r in range(world):
                sent[r * n : (r + 1) * n].copy_(local)
            try:
                dist.all_to_all_single(out, sent, group=group)
                return
            except (RuntimeError, NotImplementedError) as exc:
                if not unsupported(exc):
                    raise
    dist.all_gather_into_tensor(out, local, group=group)  # gloo and NCCL both have the flat form


_LEDGERS: dict[int, list[int]] = {}
"""Per process group (by ``id``): [collectives noted, running hash of what each was over] since the
group's last `check_same`."""
_MODULUS = (1 << 61) - 1


def small_tensor_device(group: ProcessGroup | None) -> torch.device:
    """Where a small bookkeeping tensor for a collective over ``group`` lives: NCCL's take CUDA memory."""
    if torch.distributed.get_backend(group) == "nccl":
        return torch.device("cuda", torch.cuda.current_device())
    return torch.device("cpu")


def note(group: ProcessGroup | None, key: str, kind: int) -> None:
    """Note one collective over the partitions of the param stored under ``key`` (``kind``: 0 a gather,
    1 a gradient reduction), for `check_same`. Deterministic across processes (no salted ``hash``)."""
    ledger = _LEDGERS.setdefault(id(group), [0, 0])
    ledger[0] += 1
    ledger[1] = (ledger[1] * 1_000_003 + 2 * zlib.crc32(key.encode()) + kind) % _MODULUS


def noted(group: ProcessGroup | None) -> int:
    """Collectives noted over ``group`` since its last `check_same`."""
    return _LEDGERS.get(id(group), [0, 0])[0]


AT_STEP = (
    "in the forwards and backwards since the last step",
    "Nothing was stepped: call engine.zero_grad() before going on",
)
"""`check_same`'s ``when`` at an optimizer step: which passes, and what the caller does next."""

AT_FORWARD = (
    "in this forward, which no backward follows",
    "Its outputs were computed from mixed weights: do not use them",
)
"""`check_same`'s ``when`` at the end of a forward with no backward (an evaluation, a generation)."""


def check_same(group: ProcessGroup | None, when: tuple[str, str] = AT_STEP) -> None:
    """Whether every rank of ``group`` noted the same collectives since its last check (a collective
    itself: every rank calls it at the same point); raises `RanksDivergedError` if not, its message saying
    ``when`` (`AT_STEP`, `AT_FORWARD`). Clears the ledger."""
    count, digest = _LEDGERS.pop(id(group), [0, 0])
    dist = torch.distributed
    device = small_tensor_device(group)
    world = dist.get_world_size(group)
    every = torch.empty(2 * world, dtype=torch.int64, device=device)
    ch = _hostcomm.opened(group) if device.type == "cpu" and is_gloo(group) else None
    with ch.checking() if ch is not None else contextlib.nullcontext():
        dist.all_gather_into_tensor(
            every, torch.tensor([count, digest], dtype=torch.int64, device=device), group=group
        )
    rows = every.view(world, 2).tolist()
    if any(row != rows[0] for row in rows):
        counts = ", ".join(f"rank {r}: {c}" for r, (c, _) in enumerate(rows))
        raise RanksDivergedError(
            f"the ranks did not gather the same params in the same order {when[0]} (gathers and gradient "
            f"reductions, {counts}; or the same number of different ones), so those passes paired "
            "partitions of different params: every rank must run the same modules — not a branch that "
            "depends on the rank or the data, such as a mixture-of-experts layer running only the experts "
            "its tokens pick. Mark such a module as a leaf, whose params are gathered together whatever "
            "runs inside it (zswap.deepspeed.utils.set_z3_leaf_modules(model, [cls]), or the config's "
            f"zero_optimization.leaf_module). {when[1]}"
        )


def unsupported(exc: BaseException) -> bool:
    """Whether a collective failed because this backend does not have it (not for another reason)."""
    text = str(exc).lower()
    return "support" in text or "implement" in text


def broadcast(t: torch.Tensor, src_group_rank: int, group: ProcessGroup | None) -> None:
    dist = torch.distributed
    src = src_group_rank if group is None else dist.get_global_rank(group, src_group_rank)
    dist.broadcast(t, src, group=group)


def first_ranks_slice(
    flat: torch.Tensor, rank: int, part_numel: int, group: ProcessGroup | None
) -> torch.Tensor:
    """This rank's ``part_numel`` elements of the group's rank 0's ``flat`` (zero-filled past its end), every
    rank passing its own ``flat`` of the same size: what a param built under `zswap.Init` holds on every
    rank whatever each rank's random generator gave (DeepSpeed broadcasts from rank 0 there too). Rank 0
    scatters one slice to each rank, so each receives only its own."""
    dist = torch.distributed
    world = dist.get_world_size(group)
    nccl = dist.get_backend(group) == "nccl"
    device = torch.device("cuda", torch.cuda.current_device()) if nccl else flat.device
    out = torch.empty(part_numel, dtype=flat.dtype, device=device)
    pieces = None
    if rank == 0:
        padded = flat.new_zeros(part_numel * world)
        padded[: flat.numel()] = flat
        pieces = list(padded.to(device).chunk(world))
    src = 0 if group is None else dist.get_global_rank(group, 0)
    dist.scatter(out, pieces, src=src, group=group)
    return out.to(flat.device) if nccl else out
