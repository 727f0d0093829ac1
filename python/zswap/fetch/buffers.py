"""What ``offload_param.buffer_count``, ``buffer_size`` and ``max_in_cpu`` do to a running engine.

These are DeepSpeed's keys for the NVMe tier of params (they mean nothing for the ``cpu`` or ``none`` tiers,
in DeepSpeed as here):

- ``buffer_size`` (elements): the size of one fetch buffer — the largest param partition that can be read
  from NVMe. A partition larger than it is a `ConfigError` at `zswap.initialize` naming the param (as
  DeepSpeed refuses a param larger than its swap buffers), so a size chosen for one model is not silently
  outgrown by another.
- ``buffer_count``: how many fetch buffers are kept for reuse (page-aligned engine memory that later
  fetches read into without faulting in fresh pages): ``buffer_count × buffer_size`` elements (``×`` the
  largest NVMe partition when ``buffer_size`` is left out). Without it zswap keeps what its live budget
  can hold at once. Fetches beyond the pool still work: their buffers are allocated and freed.
- ``max_in_cpu`` (elements): params kept gathered in host memory between uses, on top of the small
  persistent ones, so they are read from NVMe once instead of at every forward and backward. Taken in
  ``model.parameters()`` order, each param that still fits. The ordinary step updates them, like the
  persistent ones, in their gathered copy and writes that to NVMe in the step's transaction, so a warm
  step reads nothing for them (`zswap.train.resident`).
"""

from __future__ import annotations

import os
from collections.abc import Mapping
from typing import Any

from .. import memory
from ..config import ZswapConfig
from ..errors import ConfigError
from ..memory import ENGINE_COPY
from ..parts.params import Item, NvmeStore, Status


def resident(items: list[Item], cfg: ZswapConfig, threshold: int) -> frozenset[int]:
    """ids of the NVMe params ``max_in_cpu`` keeps gathered (those above the persistence ``threshold``)."""
    left = cfg.offload_param.max_in_cpu
    out: set[int] = set()
    for p, st in items:
        if st.tier == "nvme" and st.numel > threshold and st.numel <= left:
            out.add(id(p))
            left -= st.numel
    return frozenset(out)


def fetch_pool_bytes(items: list[Item], cfg: ZswapConfig, names: Mapping[int, str], default: int) -> int:
    """Bytes of fetch buffers an NVMe param store keeps for reuse: ``buffer_count × buffer_size`` elements
    when the config sets them, else ``default``. `ConfigError` for a partition larger than
    ``buffer_size``, naming it."""
    off = cfg.offload_param
    nvme = [(p, st) for p, st in items if st.tier == "nvme"]
    if not nvme:
        return default
    itemsize = max(st.dtype.itemsize for _, st in nvme)
    largest_p, largest = max(nvme, key=lambda item: item[1].partition_numel)
    if off.buffer_size is not None and largest.partition_numel > off.buffer_size:
        name = names.get(id(largest_p), "a param")
        raise ConfigError(
            f"zero_optimization.offload_param.buffer_size={off.buffer_size} elements is smaller than the "
            f"partition of {name!r} ({largest.partition_numel} elements); raise it to at least "
            f"{largest.partition_numel} or leave it out"
        )
    if off.buffer_count is None:
        return default
    per_buffer = off.buffer_size if off.buffer_size is not None else largest.partition_numel
    return off.buffer_count * per_buffer * itemsize


HUGE_PAGE = 2 << 20
PAGE = os.sysconf("SC_PAGE_SIZE")


def capacity(nbytes: int) -> int:
    """Bytes an engine buffer of ``nbytes`` maps, which the ledger counts (`zswap.memory.track`): rounded up
    to 2 MiB from 2 MiB on (huge pages), else to the page size — `AlignedBuf::new`'s rule (src/buffer.rs)."""
    n = max(nbytes, 1)
    unit = HUGE_PAGE if n >= HUGE_PAGE else PAGE
    return -(-n // unit) * unit


def pool_idle(store: NvmeStore) -> int:
    """Bytes of ``store``'s pooled fetch buffers nothing uses now (what `NvmeStore._buffer` would reuse)."""
    return sum(capacity(numel * dtype.itemsize) for numel, dtype in store.pool.idle_sizes())


def persistent(engine: Any) -> int:
    """Bytes of the persistent (and ``max_in_cpu``) NVMe params gathered now (``mem_persistent_params``),
    within ``mem_fetch_buffers``, each buffer as mapped: they grow with the model's count of small params
    (biases, norms). Memory tiers hand out the partition itself, so theirs cost nothing more; on a compute
    device the gathered copies are the device's, their host buffers let go once copied over."""
    if not engine.compute_device.passthrough:
        return 0
    kept = [s for s in engine._slots.values() if s.persistent and s.ours and s.st.tier == "nvme"]
    return sum(capacity(s.st.partition_numel * s.st.dtype.itemsize) for s in kept)


def fetch_lines(engine: Any) -> dict[str, int]:
    """``mem_fetch_buffers`` of `zswap.Engine.stats` split by who holds each buffer now, in disjoint lines
    that add up to it with ``mem_persistent_params`` (`persistent`), each buffer at what it maps
    (`capacity`):

    - ``mem_fetch_live``: the NVMe params the scheduler has gathered or is reading (prefetches, reads
      ahead for the next pass, seeds planted), persistent ones aside — what its live budget counts (a
      planted seed under `ENGINE_COPY` is an ordinary tensor, counted here all the same);
    - ``mem_early_step_copies``: the early step's param copies waiting for their record or kept as seeds
      in backward (`zswap.earlystep.EarlyStep.pooled`); ``mem_early_step_writing``: those being written
      (`EarlyStep.in_flight`) — both counted in the live budget too (`Scheduler.lent`);
    - ``mem_fetch_seeds``: seeds an `Engine.step` committed, waiting for the next pass to gather them;
    - ``mem_fetch_pool_idle``: pooled buffers nothing uses (kept for reuse, within the pool's limit);
    - ``mem_fetch_elsewhere``: the rest — a buffer the scheduler let go that a tensor still views
      (autograd's saved weights until backward frees them, a `GatheredParameters` block's, a user's), or
      another engine's in this process (the ledger is the process's). Between passes an engine has none
      of its own there.
    """
    sched, early = engine._sched, engine._early
    on_host = engine.compute_device.passthrough  # else a gathered copy is the device's: only reads count
    live = sum(
        capacity(s.st.partition_numel * s.st.dtype.itemsize)
        for s in sched.slots.values()
        if s.ours and not s.persistent and s.st.tier == "nvme" and (on_host or s.st.status is Status.INFLIGHT)
    )
    live += sum(capacity(e.data.nbytes) for e in sched.next.reads())
    seeds = [e.data for e in sched.next.values()]
    copies = writing = 0
    if early is not None:
        seeds += [copy for _, copy in early._committed_seeds]
        held = [c for _, c, _, _ in early.ready.values() if not c.is_meta] + [c for _, c in early.seeds]
        copies = sum(capacity(c.nbytes) for c in held if c.nbytes >= ENGINE_COPY)
        writing = sum(capacity(n - small) for n, small, w in early.copies if n > small and not w.settled)
    lines = {
        "mem_fetch_live": live,
        "mem_early_step_copies": copies,
        "mem_early_step_writing": writing,
        "mem_fetch_seeds": sum(capacity(t.nbytes) for t in seeds if t.nbytes >= ENGINE_COPY),
        "mem_fetch_pool_idle": sum(
            pool_idle(st) for st in engine._stores.values() if isinstance(st, NvmeStore)
        ),
    }
    lines["mem_fetch_elsewhere"] = memory.live()["fetch"] - persistent(engine) - sum(lines.values())
    return lines
