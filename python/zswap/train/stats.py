"""What `Engine.stats` reports: the swap traffic, fetch and prefetch counters, budgets in force, and where
the memory is (the ``mem_*`` lines). Reads the engine's collaborators; changes nothing but the counters a
``reset`` starts anew."""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from .. import device as _device
from .. import memory
from ..build import init as _init
from ..fetch import buffers
from ..gradients import gradstore
from ..parts.params import NvmeStore
from ..store.queue import WriteQueue
from ..store.storage import undo_arena_bytes

if TYPE_CHECKING:
    from .runtime import Engine


def engine_stats(engine: Engine, reset: bool = False) -> dict[str, Any]:
    """Counters since `initialize` (or the last ``reset``): swap traffic of the param store
    (``bytes_read``, ``bytes_written``), bytes gathered for compute, seconds compute waited for params
    (``fetch_wait_seconds``), fetches on demand and prefetch hits (``prefetch_hit_rate`` = hits /
    fetches), the peak of elements gathered, the budgets in force, and where the memory is: the
    ``mem_*`` lines, in bytes (`_memory_stats`; README, "Where the memory goes"); how the optimizer
    steps ran, the ``steps_*`` lines (`zswap.step.stepping.Tally`: in backward, deferred, ordinary and
    why, redone, dropped for an overflow). Reads issued ahead for the next pass are waited for first, so
    the byte counts include them."""
    engine._sched.settle_ahead()
    c = engine._sched.counters
    io = io_counters(engine)
    fetches = c.demand_fetches + c.prefetch_hits
    b = engine.sizing.budget
    out: dict[str, Any] = {
        "bytes_read": io[0] - engine._io_base[0],
        "bytes_written": io[1] - engine._io_base[1],
        "bytes_fetched": c.bytes_fetched,
        "fetch_wait_seconds": c.wait_seconds,
        "fetches": fetches,
        "demand_fetches": c.demand_fetches,
        "prefetch_hits": c.prefetch_hits,
        "prefetch_hit_rate": c.prefetch_hits / fetches if fetches else 0.0,
        "prefetch_dropped": c.prefetch_dropped,
        "prefetch_issued": c.prefetch_issued,
        "peak_live_elements": c.peak_live,
        "peak_live_lent_elements": c.peak_live_lent,
        "iterations": c.iterations,
        "traces_recorded": c.traces_recorded,
        "off_trace": c.off_trace,
        "budget_exceeded": c.budget_exceeded,
        "guessed_iterations": c.guessed_iterations,
        "read_ahead_issued": c.read_ahead_issued,
        "read_ahead_used": c.read_ahead_used,
        "read_ahead_dropped": c.read_ahead_dropped,
        "grad_placeholders": engine._grads.placeholders,
        "max_live_elements": b.max_live,
        "prefetch_bucket_elements": b.bucket,
        "max_reuse_distance": b.reuse_distance,
        "persistence_threshold": engine.sizing.persistence_threshold,
        "persistent_elements": engine.sizing.persistent,
        "model_elements": engine.sizing.total,
        "grad_stash_bytes": sum(getattr(gs, "stash_bytes", 0) for gs in engine._grad_stores),
        **engine._tally.stats(),  # how the optimizer steps ran (`zswap.step.stepping.Tally`)
    }
    size = max((st.dtype.itemsize for _, st in engine._items), default=4)
    out.update(_device.stats(engine.compute_device, engine.sizing.allowances.live, b.bucket * size))
    out.update(memory_stats(engine))
    if reset:
        memory.reset_peaks()
        engine._hooks.outputs.pool.reset_peak()
        engine.compute_device.reset_peak()
        engine._sched.reset_counters()
        engine._grads.placeholders = 0
        engine._tally.reset()
        engine._io_base = io
    return out


def memory_stats(engine: Engine) -> dict[str, int]:
    """The ``mem_*`` lines of `stats`, in bytes (README, "Where the memory goes").

    Engine buffers by purpose (``mem_fetch_buffers``: gathered params and the pool kept for reuse, at
    most ``mem_fetch_pool_limit`` pooled; ``mem_grad_buffers``: gradient partitions read for a step or
    accumulated; ``mem_optimizer_ring``: the optimizer's sub-group ring; ``mem_early_step_buffers``:
    purpose "early_step" (the early step's copies are fetch-pool buffers); ``mem_other_buffers``: any
    other) add up to
    ``mem_engine_buffers``, every engine buffer the process maps (`zswap.memory`); ``mem_peak_*`` are
    their high-water marks since the last reset. Ordinary tensors zswap holds past their use are on
    their own line, ``mem_early_step_tensors`` (the early step's gradients and smaller copies, waiting
    for the rest of their optimizer record, or being written), with its ``mem_peak_``, and
    ``mem_output_pool_idle``, the idle part of ``mem_output_pool``: the memory backward's large matmul
    outputs are placed in on the CPU (`zswap.outputs`, emptied when the backward ends; its in-use part
    is a gradient or activation counted where it is held — the early step's gradients in
    ``mem_early_step_tensors`` — or autograd's own), with ``mem_peak_output_pool``;
    ``mem_fetch_buffers`` is split by holder (`zswap.buffers.fetch_lines`). Beside them: the engines'
    bounce buffers (``mem_bounce``), the source bytes writes in flight hold (``mem_write_queue``, at most
    ``mem_write_queue_limit``; engine buffers among them are counted above too), the undo log's
    arena (``mem_undo_arena``), glibc's heap (``mem_heap_*``) and the process's ``mem_rss``."""
    live = memory.live()
    peaks = memory.peaks()
    held, held_peaks = memory.held(), memory.held_peaks()
    out_pool = engine._hooks.outputs.pool
    storages: dict[int, Any] = {}
    for st in engine._stores.values():
        if isinstance(st, NvmeStore):
            storages[id(st.storage)] = st.storage
    for gs in engine._grad_stores:
        if isinstance(gs, gradstore.NvmeGrads):
            storages[id(gs.storage)] = gs.storage
    opt_store = getattr(engine.optimizer, "_store", None)
    if opt_store is not None and hasattr(opt_store, "storage"):
        storages[id(opt_store.storage)] = opt_store.storage
    queues: list[WriteQueue] = [s.queue for s in storages.values()]
    bounce = sum(
        int(s.engine.info.get("bounce_bytes", 0))
        for s in storages.values()
        if not s.closed and isinstance(getattr(s.engine, "info", None), dict)
    )
    pools = [st.pool_bytes for st in engine._stores.values() if isinstance(st, NvmeStore)]
    return {
        "mem_fetch_buffers": live["fetch"],
        "mem_grad_buffers": live["grads"],
        "mem_optimizer_ring": live["optimizer"],
        "mem_early_step_buffers": live["early_step"],
        "mem_other_buffers": live["other"],
        "mem_engine_buffers": sum(live.values()),
        "mem_peak_fetch_buffers": peaks["fetch"],
        "mem_peak_grad_buffers": peaks["grads"],
        "mem_peak_optimizer_ring": peaks["optimizer"],
        "mem_peak_early_step_buffers": peaks["early_step"],
        "mem_peak_other_buffers": peaks["other"],
        "mem_peak_engine_buffers": peaks["total"],
        "mem_early_step_tensors": held["early_step"],
        "mem_peak_early_step_tensors": held_peaks["early_step"],
        "mem_output_pool": out_pool.pooled,
        "mem_output_pool_idle": out_pool.idle(),
        "mem_peak_output_pool": out_pool.peak_pooled,
        "mem_grad_stash": sum(getattr(gs, "stash_bytes", 0) for gs in engine._grad_stores),
        "mem_peak_grad_stash": sum(getattr(gs, "stash_peak", 0) for gs in engine._grad_stores),
        "mem_fetch_pool_limit": sum(pools),
        "mem_persistent_params": buffers.persistent(engine),
        **buffers.fetch_lines(engine),  # mem_fetch_buffers by holder: live, early step, seeds, idle, rest
        "mem_bounce": bounce,
        "mem_write_queue": sum(q.queued for q in queues),
        "mem_write_queue_limit": sum(q.limit for q in queues),
        "mem_undo_arena": undo_arena_bytes(),
        "mem_init_touched": _init.touched_bytes(),
        "mem_init_touched_limit": _init.TOUCH_BUDGET_BYTES,
        **{f"mem_{k}": v for k, v in memory.heap().items()},
        "mem_rss": memory.rss(),
    }


def io_counters(engine: Engine) -> tuple[int, int]:
    read = written = 0
    # Every engine the step touches, once: params (p/), gradients (g/), optimizer records (o/; its
    # own nvme_path's engine too) and the undo log's spills (u/, on one of those).
    stores = [*engine._stores.values(), *getattr(engine, "_grad_stores", ())]
    stores.append(getattr(getattr(engine, "optimizer", None), "_store", None))
    engines = {id(e): e for e in (getattr(s, "engine", None) for s in stores) if e is not None}
    for engine in engines.values():
        if not getattr(engine, "closed", True):
            s = engine.stats()
            read, written = read + int(s["bytes_read"]), written + int(s["bytes_written"])
    return read, written
