"""`zswap.initialize` and `Engine`: run and train a model whose params zswap partitioned and offloaded.

`initialize` sizes the scheduling budgets from the model and the config, installs the module hooks
(`zswap.hooks`), the gradient hooks (`zswap.grads`) and the prefetching scheduler (`zswap.prefetch`), and
builds the optimizer. After it, ``model(x)`` and ``loss.backward()`` work as on a plain model.
"""

from __future__ import annotations

import contextlib
import inspect
import weakref
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from typing import Any, Literal, TypeVar

import torch
from torch import nn

from . import buffers, earlystep, grads, gradstore, memory, outputs, stepping
from . import device as _device
from . import init as _init
from .config import ZswapConfig, load_config
from .errors import ConfigError, ZswapError
from .gather import Item, no_torch_function
from .gradstore import store_of
from .hooks import ModuleHooks, ModuleInfo
from .init import Init
from .optim import OffloadedAdamW
from .params import NvmeStore, ParamState, managed_params, param_state
from .prefetch import Budget, Scheduler, Slot
from .storage import WriteQueue, step_transaction, undo_arena_bytes

# Defaults, in elements, where the config leaves a knob to zswap (DeepSpeed's own defaults in brackets).
PERSISTENCE_MAX = 100_000  # [1e5]; and at most 1/1000 of the model, so tiny models still stream
PREFETCH_MIN = 50_000_000  # [5e7]; at least two of the largest module's params

_ENGINES: weakref.WeakSet[Engine] = weakref.WeakSet()  # open engines: one per param at a time


def initialize(
    model: nn.Module,
    config: Any = None,
    *,
    optimizer: Any = None,
    lr_scheduler: Any = None,
    device: Any = None,
    max_grad_norm: float | None = None,
) -> Engine:
    """Hook ``model`` up for forward, backward and prefetch; returns the `Engine` that steps it.

    ``model`` was built under `zswap.Init`; params it has that zswap does not manage yet are partitioned
    now, with the config's ``offload_param`` settings (as ``Init(config, module=model)`` would).
    ``config``: a path, mapping, `ZswapConfig` or ``None`` (`zswap.load_config`); its ``zero_optimization``
    knobs size the prefetch and the live budget, each chosen from the model where left out or ``"auto"``.
    ``optimizer``: used as given; else built from the config's ``optimizer`` section with
    ``zswap.optim.OffloadedAdamW.from_config``; else none, and `Engine.step` says so.
    ``lr_scheduler``: a scheduler (``step()``, ``state_dict()``…; a torch one or `zswap.schedules`), or a
    callable taking the optimizer and returning one; else built from the config's ``scheduler`` section
    (`zswap.schedules`); both at once is a `ConfigError`. Stepped once per applied optimizer step.
    ``device``: where modules compute: ``None`` = the current CUDA device when CUDA is available, else
    the CPU; ``"cpu"``, ``"cuda"``, ``"cuda:N"`` or a `torch.device`. Partitions stay on their offload
    tier; gathered params, module buffers and the model's inputs (the caller's) are on this device.
    ``max_grad_norm``: clip the global L2 norm of the gradients (over all ranks) to this before each step;
    default: the config's ``gradient_clipping`` (DeepSpeed's key; 0 or absent = no clipping).
    """
    return build(Engine, model, config, optimizer, lr_scheduler, device, max_grad_norm)


_E = TypeVar("_E", bound="Engine")


def build(
    cls: type[_E],
    model: nn.Module,
    config: Any,
    optimizer: Any,
    lr_scheduler: Any,
    device: Any,
    max_grad_norm: float | None,
) -> _E:
    """`initialize`'s work, making a ``cls`` (an `Engine` subclass: `zswap.deepspeed`'s)."""
    if not isinstance(model, nn.Module):
        raise TypeError(f"initialize takes an nn.Module, not {type(model).__name__}")
    cfg = load_config(config)
    if max_grad_norm is None:
        max_grad_norm = cfg.gradient_clipping or None
    elif (
        isinstance(max_grad_norm, bool) or not isinstance(max_grad_norm, int | float) or not max_grad_norm > 0
    ):
        raise ValueError(f"max_grad_norm must be a positive number or None, got {max_grad_norm!r}")
    dev = _device.resolve(device)
    if any(param_state(p) is None for p in model.parameters()):
        Init(cfg, module=model)
    return cls(model, cfg, optimizer, lr_scheduler=lr_scheduler, max_grad_norm=max_grad_norm, device=dev)


@dataclass(frozen=True)
class Sizing:
    """Element counts chosen for one engine (see `zswap.prefetch`)."""

    total: int
    persistence_threshold: int
    persistent: int
    largest_chain: int
    """Most non-persistent elements one module's forward holds together with its ancestors'."""
    budget: Budget
    resident: frozenset[int] = frozenset()
    """ids of the params ``offload_param.max_in_cpu`` keeps gathered (`zswap.buffers`)."""


class Engine:
    """Runs ``module``'s forward and backward with its params streamed in; `step` applies the optimizer.

    The optimizer is either *partition-aware* (its ``steps_partitions`` attribute is true: it reads the
    partition gradients through `zswap.gradstore.store_of` and updates the stores itself) or an ordinary
    param-based one over the model's params (``torch.optim.AdamW``, `zswap.optim.OffloadedAdamW`), which
    `step_partitions` shows each param's local partition. Also a context manager that calls `close` on exit.
    """

    def __init__(
        self,
        module: nn.Module,
        config: ZswapConfig,
        optimizer: Any = None,
        *,
        lr_scheduler: Any = None,
        max_grad_norm: float | None = None,
        device: Any = "cpu",
    ) -> None:
        memory.bound_heap()  # what torch frees between steps goes back to the kernel (zswap.memory)
        self.module = module
        self.compute_device = _device.resolve(device)
        """The compute device as zswap drives it (`zswap.device`: copy streams, registered buffers);
        `device` is the `torch.device` it computes on."""
        self.config = config
        self.closed = False
        self.max_grad_norm = None if max_grad_norm is None else float(max_grad_norm)
        self.skipped_steps = 0
        """Optimizer steps skipped because an fp16 model's gradients were not finite."""
        self.global_steps = 0
        """Optimizer steps taken (accumulation boundaries), skipped fp16 steps included, as DeepSpeed."""
        self.micro_steps = 0
        """`step` calls so far (one per micro-batch)."""
        self.lr_scheduler: Any = None
        """The learning-rate schedule stepped after each applied optimizer step, or ``None``."""
        self.loss_scaler: Any = None
        """fp16 runs: the `zswap.loss_scale.LossScaler` (with ``state_dict``/``load_state_dict``); else
        ``None``."""
        self._scaled_backward = False  # this accumulation window went through backward(): unscale it
        self.last_grad_norm: float | None = None
        """Global gradient norm seen by the last `step` (when clipping or the fp16 check needed it)."""
        self.early_step = True
        """Let `zswap.earlystep` run the optimizer update in backward where that gives the same result
        (set False to always step after backward; results are the same either way)."""
        self._keep_applied: bool | Literal["auto"] = "auto"  # `keep_applied_grads`
        self._reuse_outputs = outputs.DEFAULT  # `reuse_backward_outputs`
        self._early: earlystep.EarlyStep | None = None
        self._grad_stash = 0  # `grad_stash_bytes`
        self._across = True  # `prefetch_across_passes`
        self._ids: set[int] = set()
        self._items: list[Item] = []
        self._grad_stores: list[gradstore.GradStore] = []
        self.optimizer: Any = None
        self._owns_optimizer = False
        self._wire()
        self._io_base = self._io_counters()
        try:
            self.optimizer, self._owns_optimizer, self._no_optimizer = _optimizer(module, config, optimizer)
            self._gas = config.batch.resolve(stepping.world_size(self._items))[2]
            self._fp16 = config.dtype == "fp16" or any(p.dtype == torch.float16 for p in module.parameters())
            self._fp16 = self._fp16 or any(st.dtype == torch.float16 for _, st in self._items)
            # bf16.check_grad_overflow: skip a step whose gradients are not finite, as fp16 always does. The
            # check needs every gradient before any update, so the early step (in backward) is off.
            bf16 = config.dtype == "bf16" or any(st.dtype == torch.bfloat16 for _, st in self._items)
            self._check_finite = self._fp16 or (bf16 and config.bf16.check_grad_overflow)
            if self._check_finite and not self._fp16:
                self.early_step = False
            self.loss_scaler = stepping.loss_scaler(config, self._fp16)
            self.lr_scheduler = stepping.lr_scheduler(config, self.optimizer, lr_scheduler)
            self._early = self._grads.early = earlystep.for_engine(self)
            self._io_base = self._io_counters()  # now with the gradients' and the optimizer's engines
        except BaseException:
            if self._owns_optimizer and hasattr(self.optimizer, "close"):
                self.optimizer.close()
            self._unwire()
            raise
        _ENGINES.add(self)
        self._sched.read_ahead()  # the first pass's first reads, along the guess (counted from here on)

    # -- training ----------------------------------------------------------------------------------

    def step(self) -> None:
        """One micro-step: at a gradient accumulation boundary (every ``gradient_accumulation_steps``-th
        call, `is_gradient_accumulation_boundary`), apply the optimizer to the accumulated gradients, step
        the learning-rate schedule and clear the gradients; between boundaries only count the call.

        Clipping (``max_grad_norm``) and, for fp16 params, skipping a step whose gradients are not finite
        are decided first, from the gradients of all ranks, before the optimizer reads any state. fp16
        gradients from `backward` are divided by the loss scale (inside the Adam kernel, with the clipping
        factor); an overflow skips the optimizer and the schedule, counts in `skipped_steps` and
        `global_steps`, and lowers a dynamic loss scale (`zswap.loss_scale`)."""
        self._check_open()
        if self.optimizer is None:
            raise ZswapError(self._no_optimizer)
        if not self.is_gradient_accumulation_boundary():
            self.micro_steps += 1
            self._sched.read_ahead()  # nothing was written: the next forward's first reads start now
            return
        self._grads.flush()
        grads.wait(self._items)  # a failed gradient write stops the step here, before anything changes
        self._sched.drop_all()  # the optimizer rewrites partitions: no gathered copy may go stale
        if self._early is not None and self._early.commit(self._items):  # updated in backward already
            self.last_grad_norm = None
            self._finish_step(1.0)
            self._sched.seed(self._early.take_seeds())  # the next forward's first params: no read
            self._sched.read_ahead()  # and the next ones' reads, of the values just committed
            return
        others = [p for p in self.module.parameters() if id(p) not in self._ids]
        chunk = max(1, self.sizing.budget.max_live // 2)  # a chunk's params and grads: the live budget
        loss_scale = self.loss_scale if self._scaled_backward else 1.0
        scale, self.last_grad_norm = grads.global_scale(
            self._items, others, self.max_grad_norm, self._check_finite, chunk, loss_scale=loss_scale
        )
        if scale is None:
            self.skipped_steps += 1
        elif getattr(self.optimizer, "steps_partitions", False):
            if scale != 1.0:  # clipping or an fp16 loss scale: it must apply the factor, never drop it
                self.optimizer.step(grad_scale=scale)
            else:
                self.optimizer.step()
        else:
            if getattr(self.optimizer, "max_grad_norm", None) is not None:
                chunk = self.sizing.total  # its own clipping must see every gradient in one call
            step_partitions(self.optimizer, self._items, others, chunk, scale)
        self._finish_step(scale)
        self._sched.read_ahead()  # the next forward's first reads, of the values just written

    def _finish_step(self, scale: float | None) -> None:
        # The counters, loss scale and schedule move first, with no I/O (no await point) between them and
        # the commit of the weights: an interrupt during the I/O below cannot leave the weights stepped
        # and the counters not.
        self.global_steps += 1
        self.micro_steps += 1
        if self.loss_scaler is not None:
            self.loss_scaler.update(scale is None)
        if scale is not None and self.lr_scheduler is not None:
            self.lr_scheduler.step()
        self.zero_grad()
        self._sched.fetch_persistent([s for s in self._slots.values() if s.persistent])
        memory.trim()  # the step's freed tensors back to the kernel before the next forward

    def backward(self, loss: torch.Tensor, retain_graph: bool = False, scale_wrt_gas: bool = True) -> Any:
        """Run backward on ``loss`` divided by ``gradient_accumulation_steps`` (unless ``scale_wrt_gas`` is
        false) and, in fp16, multiplied by the loss scale; returns the divided loss, as DeepSpeed does."""
        self._check_open()
        if not isinstance(loss, torch.Tensor):
            raise TypeError(f"backward takes the loss tensor, not {type(loss).__name__}")
        if scale_wrt_gas and self._gas > 1:
            loss = loss / self._gas
        scaled = loss
        if self.loss_scaler is not None:
            scaled = loss * self.loss_scaler.loss_scale
            self._scaled_backward = True
        scaled.backward(retain_graph=retain_graph)
        return loss

    def is_gradient_accumulation_boundary(self) -> bool:
        """Whether the next `step` call applies the optimizer (ends an accumulation window)."""
        return (self.micro_steps + 1) % self._gas == 0

    def gradient_accumulation_steps(self) -> int:
        """Micro-batches per optimizer step (the config's ``gradient_accumulation_steps``, or derived from
        ``train_batch_size`` / ``train_micro_batch_size_per_gpu``; default 1)."""
        return self._gas

    @property
    def device(self) -> torch.device:
        """The `torch.device` modules compute on (DeepSpeed's ``engine.device``, for ``batch.to(...)``)."""
        return self.compute_device.torch_device

    def __getattr__(self, name: str) -> Any:
        # DeepSpeed's engine hands attributes it does not have to the module (``engine.config_class``,
        # a model's own methods). Only reached when normal lookup failed; never during __init__'s own
        # attributes, since ``module`` is read from __dict__ directly.
        module = self.__dict__.get("module")
        if module is not None and not name.startswith("__"):
            try:
                return getattr(module, name)
            except AttributeError:
                pass
        raise AttributeError(f"{type(self).__name__!r} object (and its module) has no attribute {name!r}")

    @property
    def loss_scale(self) -> float:
        """The current fp16 loss scale; 1.0 without fp16."""
        return 1.0 if self.loss_scaler is None else float(self.loss_scaler.loss_scale)

    def get_lr(self) -> list[float]:
        """The learning rate of each of the optimizer's param groups."""
        if self.optimizer is None:
            raise ZswapError(self._no_optimizer)
        return [float(group["lr"]) for group in self.optimizer.param_groups]

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        """``module(*args, **kwargs)``; with ``fp16.auto_cast`` floating-point inputs are cast to fp16."""
        if self._fp16 and self.config.fp16.auto_cast:
            args, kwargs = stepping.cast_half(args), stepping.cast_half(kwargs)
        return self.module(*args, **kwargs)

    def train(self, mode: bool = True) -> Engine:
        """Put the module in training (or, ``mode=False``, eval) mode."""
        self.module.train(mode)
        return self

    def eval(self) -> Engine:
        """Put the module in eval mode."""
        self.module.train(False)
        return self

    def adopt_optimizer(self) -> None:
        """Make `close` close the optimizer too: one a caller built for this engine only (as
        `zswap.deepspeed.initialize` builds the config's optimizer over ``model_parameters``)."""
        self._owns_optimizer = True

    @property
    def keep_applied_grads(self) -> bool | Literal["auto"]:
        """Whether the gradients the early step applies in backward are stored as any other (written to
        NVMe past `grad_stash_bytes`). False: they are let go once applied — 1 × the model fewer bytes
        written per step — so what needs them after backward raises `zswap.errors.GradientsNotKeptError`
        (`full_grad`, a second backward, a step the early step cannot be (an lr changed, a partition
        written, clipping turned on between backward and step); README, "The step in backward"). True:
        those fall back to the ordinary step. ``"auto"`` (default): False until this engine's gradients
        are needed between a backward and its step — `full_grad` reads one, or a second backward adds to
        them (both work on the first step, which has no early step) — then True from the next backward
        on. Read at each backward's start; results never differ. Any other value is a `ConfigError`."""
        return self._keep_applied

    @keep_applied_grads.setter
    def keep_applied_grads(self, keep: bool | Literal["auto"]) -> None:
        if not isinstance(keep, bool) and not (isinstance(keep, str) and keep == "auto"):
            raise ConfigError(f'keep_applied_grads must be True, False or "auto", got {keep!r}')
        self._keep_applied = keep

    @property
    def reuse_backward_outputs(self) -> bool:
        """On the CPU, compute backward's large matmul outputs (weight and input gradients of 256 KiB or
        more) into reused memory instead of fresh pages (`zswap.outputs`): about 460 k fewer page faults
        and 1 CPU-second less kernel time a step at 2 GiB of params, bitwise the same results; but peak RSS
        about 30–40 MiB higher on the 6 GiB checkpointed demo, where the memory bound has no room for it
        (benches/README.md, "Step time, stop 24", splits it at the peak). Default False. Any other value
        than a bool is a `ConfigError`."""
        return self._reuse_outputs

    @reuse_backward_outputs.setter
    def reuse_backward_outputs(self, on: bool) -> None:
        if not isinstance(on, bool):
            raise ConfigError(f"reuse_backward_outputs must be True or False, got {on!r}")
        self._reuse_outputs = on
        self._hooks.outputs.enabled = on

    def _keeps_applied_grads(self) -> bool:
        """`keep_applied_grads` resolved: ``"auto"`` is True once a gradient store saw its gradients
        wanted between a backward and the step (`zswap.gradstore.GradStore.wanted`)."""
        if self.keep_applied_grads == "auto":
            return any(gs.wanted for gs in self._grad_stores)
        return bool(self.keep_applied_grads)

    @property
    def prefetch_across_passes(self) -> bool:
        """Whether the swap-ins of the next pass's first params are issued when a pass ends (an inference
        forward's end, `step`'s end, `initialize`'s end), so a pass's first step does not wait for the
        disk (`zswap.prefetch`, "Across passes"). Default True. A read made stale by a write in between is
        dropped unused; results are the same either way. Off: the first step of each pass is read on
        demand."""
        return self._across

    @prefetch_across_passes.setter
    def prefetch_across_passes(self, on: bool) -> None:
        if not isinstance(on, bool):
            raise ValueError(f"prefetch_across_passes must be a bool, got {on!r}")
        self._across = self._sched.across_passes = on
        if not on:
            self._sched.drop_ahead()

    @property
    def grad_stash_bytes(self) -> int:
        """Bytes of partition gradients kept in memory between backward and step instead of being written
        to NVMe, where the optimizer lives there (`zswap.gradstore`). Default 0: every gradient is written,
        which keeps peak RSS within the live budget + optimizer ring + 256 MiB; the live budget's bytes
        saves about 1 × the model of writes per step for as much memory (benches/README.md, "Bytes per
        step"). Results are the same either way."""
        return max((getattr(gs, "stash_cap", 0) for gs in self._grad_stores), default=0)

    @grad_stash_bytes.setter
    def grad_stash_bytes(self, nbytes: int) -> None:
        if isinstance(nbytes, bool) or not isinstance(nbytes, int) or nbytes < 0:
            raise ValueError(f"grad_stash_bytes must be a non-negative int, got {nbytes!r}")
        self._grad_stash = nbytes
        gradstore.size_stash(self._grad_stores, nbytes)

    def zero_grad(self) -> None:
        """Drop every accumulated gradient (partitions of managed params, ``p.grad`` of the others)."""
        self._check_open()
        if self._early is not None:
            self._early.abort()
        self._grads.flush()
        grads.clear(self._items)
        for p in self.module.parameters():
            p.grad = None
        self._scaled_backward = False  # no gradient of a scaled backward is left

    def stats(self, reset: bool = False) -> dict[str, Any]:
        """Counters since `initialize` (or the last ``reset``): swap traffic of the param store
        (``bytes_read``, ``bytes_written``), bytes gathered for compute, seconds compute waited for params
        (``fetch_wait_seconds``), fetches on demand and prefetch hits (``prefetch_hit_rate`` = hits /
        fetches), the peak of elements gathered, the budgets in force, and where the memory is: the
        ``mem_*`` lines, in bytes (`_memory_stats`; README, "Where the memory goes"). Reads issued ahead
        for the next pass are waited for first, so the byte counts include them."""
        self._sched.settle_ahead()
        c = self._sched.counters
        io = self._io_counters()
        fetches = c.demand_fetches + c.prefetch_hits
        b = self.sizing.budget
        out: dict[str, Any] = {
            "bytes_read": io[0] - self._io_base[0],
            "bytes_written": io[1] - self._io_base[1],
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
            "grad_placeholders": self._grads.placeholders,
            "max_live_elements": b.max_live,
            "prefetch_bucket_elements": b.bucket,
            "max_reuse_distance": b.reuse_distance,
            "persistence_threshold": self.sizing.persistence_threshold,
            "persistent_elements": self.sizing.persistent,
            "model_elements": self.sizing.total,
            "grad_stash_bytes": sum(getattr(gs, "stash_bytes", 0) for gs in self._grad_stores),
        }
        size = max((st.dtype.itemsize for _, st in self._items), default=4)
        out.update(
            _device.stats(self.compute_device, (b.max_live + self.sizing.persistent) * size, b.bucket * size)
        )
        out.update(self._memory_stats())
        if reset:
            memory.reset_peaks()
            self._hooks.outputs.pool.reset_peak()
            self.compute_device.reset_peak()
            peak = self._sched.live
            self._sched.counters = type(c)(peak_live=peak, peak_live_lent=peak + self._sched.lent())
            self._grads.placeholders = 0
            self._io_base = io
        return out

    def _memory_stats(self) -> dict[str, int]:
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
        out_pool = self._hooks.outputs.pool
        storages: dict[int, Any] = {}
        for st in self._stores.values():
            if isinstance(st, NvmeStore):
                storages[id(st.storage)] = st.storage
        for gs in self._grad_stores:
            if isinstance(gs, gradstore.NvmeGrads):
                storages[id(gs.storage)] = gs.storage
        opt_store = getattr(self.optimizer, "_store", None)
        if opt_store is not None and hasattr(opt_store, "storage"):
            storages[id(opt_store.storage)] = opt_store.storage
        queues: list[WriteQueue] = [s.queue for s in storages.values()]
        bounce = sum(
            int(s.engine.info.get("bounce_bytes", 0))
            for s in storages.values()
            if not s.closed and isinstance(getattr(s.engine, "info", None), dict)
        )
        pools = [st.pool_bytes for st in self._stores.values() if isinstance(st, NvmeStore)]
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
            "mem_grad_stash": sum(getattr(gs, "stash_bytes", 0) for gs in self._grad_stores),
            "mem_peak_grad_stash": sum(getattr(gs, "stash_peak", 0) for gs in self._grad_stores),
            "mem_fetch_pool_limit": sum(pools),
            "mem_persistent_params": buffers.persistent(self),
            **buffers.fetch_lines(self),  # mem_fetch_buffers by holder: live, early step, seeds, idle, rest
            "mem_bounce": bounce,
            "mem_write_queue": sum(q.queued for q in queues),
            "mem_write_queue_limit": sum(q.limit for q in queues),
            "mem_undo_arena": undo_arena_bytes(),
            "mem_init_touched": _init.touched_bytes(),
            "mem_init_touched_limit": _init.TOUCH_BUDGET_BYTES,
            **{f"mem_{k}": v for k, v in memory.heap().items()},
            "mem_rss": memory.rss(),
        }

    # -- checkpoints (zswap.checkpoint) -------------------------------------------------------------

    def save_checkpoint(
        self, save_dir: Any, tag: str | None = None, client_state: Any = None, *, save_latest: bool = True
    ) -> Any:
        """Save params, optimizer state, scheduler, loss scaler, RNG and ``client_state`` to
        ``save_dir/tag`` (default tag ``global_step{global_steps}``), atomically, then point
        ``save_dir/latest`` at it (unless ``save_latest`` is false). Every rank calls it with the same
        tag; each streams its own partitions. Returns the folder."""
        from .checkpoint import save_checkpoint

        self._check_open()
        return save_checkpoint(self, save_dir, tag, client_state, save_latest=save_latest)

    def load_checkpoint(
        self,
        load_dir: Any,
        tag: str | None = None,
        *,
        load_optimizer_states: bool = True,
        load_module_only: bool = False,
        load_lr_scheduler_states: bool = True,
    ) -> Any:
        """Load ``load_dir/tag`` (default: the tag ``load_dir/latest`` names), saved at any world size;
        returns its ``client_state`` (``None`` with ``load_module_only``). With
        ``load_lr_scheduler_states=False`` the schedule keeps this run's state. Everything is validated
        first: a bad checkpoint raises a `zswap.ZswapError` and changes nothing."""
        from .checkpoint import load_checkpoint

        self._check_open()
        self._sched.drop_all()  # gathered copies would go stale
        if self._early is not None:
            self._early.abort()
        try:
            return load_checkpoint(
                self,
                load_dir,
                tag,
                load_optimizer_states=load_optimizer_states,
                load_module_only=load_module_only,
                load_lr_scheduler_states=load_lr_scheduler_states,
            )
        finally:
            self._sched.fetch_persistent([s for s in self._slots.values() if s.persistent])

    # -- lifetime ----------------------------------------------------------------------------------

    def close(self) -> None:
        """Remove every hook, release every gathered param, drop gradients, close the optimizer if this
        engine built it. Params stay partitioned in their store (which lives as long as they do)."""
        if self.closed:
            return
        self.closed = True
        try:
            if self._early is not None:
                self._early.abort()
            self._teardown()
            grads.clear(self._items)
        finally:
            gradstore.detach(self._items, self._grad_stores)
            if self._owns_optimizer and hasattr(self.optimizer, "close"):
                self.optimizer.close()
            self.optimizer = None
            self._no_optimizer = "this zswap Engine is closed"

    def __enter__(self) -> Engine:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def __repr__(self) -> str:
        state = "closed" if self.closed else f"{len(self._items)} params, {self.sizing.total:,} elements"
        return f"<zswap.Engine {type(self.module).__name__}: {state}>"

    # -- internals ---------------------------------------------------------------------------------

    def _wire(self) -> None:
        """Lay the engine over the module's managed params as they are now: sizing, placement on the
        compute device, slots, scheduler, module and gradient hooks, gradient stores, persistent params
        fetched. `_unwire` undoes it."""
        module, config = self.module, self.config
        items: list[Item] = list(managed_params(iter(_unique(module.parameters()))))
        ids: set[int] = {id(p) for p, _ in items}
        for other in list(_ENGINES):
            if other is not self and not other.closed and ids & other._ids:
                raise ZswapError("these params are already run by another zswap Engine; close() it first")
        self._items, self._ids = items, ids
        self.sizing = _size(module, self._items, config)
        self._homes = _device.place(module, self._items, self.compute_device)
        self._slots = {
            id(p): Slot(p, st, st.numel <= self.sizing.persistence_threshold or id(p) in self.sizing.resident)
            for p, st in self._items
        }
        self._sched = Scheduler(self._slots.values(), self.sizing.budget, self.compute_device)
        self._sched.across_passes = self._across
        infos = {
            id(m): ModuleInfo(
                i, name, [self._slots[id(p)] for p in m.parameters(recurse=False) if id(p) in ids]
            )
            for i, (name, m) in enumerate(module.named_modules(remove_duplicate=True))
        }
        for info in infos.values():
            info.ids.update(id(s.p) for s in info.slots)
        self._sched.order = [(info.index, info.slots) for info in infos.values()]  # first-iteration guess
        self._stores = {id(st.store): st.store for _, st in self._items}
        pool = (self.sizing.budget.max_live + self.sizing.persistent) * max(
            (st.dtype.itemsize for _, st in self._items), default=4
        )
        names = {id(p): name for name, p in module.named_parameters()}
        pool = buffers.fetch_pool_bytes(self._items, config, names, pool)  # offload_param.buffer_count/size
        for store in self._stores.values():
            if isinstance(store, NvmeStore):  # reuse fetch buffers up to what may be live at once
                store.pool_bytes = max(store.pool_bytes, pool)
                if (
                    not self.compute_device.passthrough
                ):  # read buffers registered for one-hop DMA to the device
                    store.host_alloc = self.compute_device.register_alloc(store.engine.empty)
        if isinstance(self.compute_device, _device.CudaDevice | _device.StandInDevice):
            self.compute_device.pool.pool_bytes = pool  # gathered params' device buffers, reused likewise
        self._hooks = ModuleHooks(module, infos, self._sched, self._slot_for)
        self._hooks.outputs.enabled = self._reuse_outputs
        self._grads = grads.GradSink(self._items, self.compute_device)
        self._grad_stores = []
        try:
            self._grad_stores = gradstore.attach(self._items, config)
            gradstore.size_stash(self._grad_stores, self._grad_stash)
            # Weakly: each param's state holds its gradient store for as long as the param lives (its
            # finalizer keeps the state), so a store holding this Engine kept the module and every buffer
            # alive for good once the engine was dropped without `close`.
            me = weakref.ref(self)
            gradstore.want_norms(  # the step's norm from backward: no gradient read for it (gradstore)
                self._grad_stores,
                lambda: (
                    (e := me()) is not None
                    and (e.max_grad_norm is not None or getattr(e, "_check_finite", False))
                ),
            )
            self._grads.land_in(
                grads.landing_alloc(self.compute_device, self._grad_stores, self._stores.values()), pool
            )
            self._sched.fetch_persistent([s for s in self._slots.values() if s.persistent])
            # After the persistent params' fetches: a pool miss unpools idle buffers first, so theirs,
            # made later, unpooled the prefilled ones (and pass 1 and its reads ahead made them anew).
            self._sched.prefill()  # the first pass's read buffers, faulted in now, not under its reads
        except BaseException:
            self._unwire()
            raise

    def _unwire(self) -> None:
        try:
            self._teardown()
        finally:
            gradstore.detach(self._items, self._grad_stores)
            self._grad_stores = []

    @contextlib.contextmanager
    def _rewired(self) -> Iterator[None]:
        """Unwire, let the caller change the shapes of managed params (``resize_token_embeddings``,
        `zswap.module_api`), wire again over them as they are then: budgets, hooks and gradient stores are
        sized anew; the optimizer, schedule, loss scaler and counters are kept. The caller has made sure
        no gradient is accumulated and no optimizer state exists for a param whose shape changes. If the
        wiring fails the engine is closed."""
        self._check_open()
        self._grads.flush()
        grads.wait(self._items)
        counters = self._sched.counters
        if self._early is not None:
            self._early.abort()
        self._unwire()
        try:
            yield
        finally:
            try:
                self._wire()
                self._early = self._grads.early = earlystep.for_engine(self)  # built over the new items
            except BaseException:
                self.closed = True
                if self._owns_optimizer and hasattr(self.optimizer, "close"):
                    self.optimizer.close()
                self.optimizer = None
                self._no_optimizer = "this zswap Engine is closed: wiring it after a change of params failed"
                raise
            self._sched.counters = counters

    def _teardown(self) -> None:
        try:
            self._hooks.remove()
            self._grads.remove()
        finally:
            self._sched.drop_all()
            for store in self._stores.values():
                if isinstance(store, NvmeStore):
                    store.pool_bytes = 0
                    store.host_alloc = None
                    store.trim()
            self.compute_device.close()  # every copy done, every host buffer unregistered
            _device.unplace(self._items, self._homes)

    def _check_open(self) -> None:
        if self.closed:
            raise ZswapError("this zswap Engine is closed")

    def _slot_for(self, p: torch.Tensor, st: ParamState) -> Slot:
        """The slot of a managed param the model uses without owning it (created on first use)."""
        slot = self._sched.slots.get(id(p))
        if slot is None:
            slot = self._sched.slots[id(p)] = Slot(p, st, persistent=False)
        return slot

    def _io_counters(self) -> tuple[int, int]:
        read = written = 0
        # Every engine the step touches, once: params (p/), gradients (g/), optimizer records (o/; its
        # own nvme_path's engine too) and the undo log's spills (u/, on one of those).
        stores = [*self._stores.values(), *getattr(self, "_grad_stores", ())]
        stores.append(getattr(getattr(self, "optimizer", None), "_store", None))
        engines = {id(e): e for e in (getattr(s, "engine", None) for s in stores) if e is not None}
        for engine in engines.values():
            if not getattr(engine, "closed", True):
                s = engine.stats()
                read, written = read + int(s["bytes_read"]), written + int(s["bytes_written"])
        return read, written


def step_partitions(
    optimizer: Any, items: list[Item], others: Sequence[torch.Tensor], chunk: int, grad_scale: float = 1.0
) -> None:
    """Step a param-based optimizer on the local partitions of ``items``.

    While it steps, each managed param with a gradient holds its partition as ``.data`` (1-D, so the
    optimizer's state has the partition's shape, step after step) and its partition gradient as ``.grad``;
    the updated partitions are then stored back. Params go through in chunks of about ``chunk`` elements,
    one ``optimizer.step()`` each, so at most that much is loaded at once: optimizers skip params without a
    gradient and count steps per param, so the result is that of one step over all of them. Unmanaged
    params (``others``) step with the first chunk only. ``grad_scale`` (clipping) multiplies every gradient:
    inside the kernel for an optimizer whose ``step`` takes ``grad_scale`` (`zswap.optim.OffloadedAdamW`),
    else in place before the step, as ``clip_grad_norm_`` does.

    All or nothing: the whole call is one `zswap.storage` step transaction. Partitions written back to
    NVMe are staged copy-on-write and made live only once every one of them (and every optimizer record)
    landed. When any I/O takes part, what the step changes in memory is saved to the transaction's undo
    log before it changes: in-memory partitions and gradients, the unmanaged params and their gradients,
    and — for an optimizer that does not keep its own (``transactional``) — each stepped param's
    ``optimizer.state[p]`` (tensors by value, other entries by identity; a param without state loses the
    state its failed first step created). So a failure leaves params, gradients and that state as they
    were. Not covered: state an optimizer keeps outside ``optimizer.state[p]`` (LBFGS-style globals).
    """
    takes_scale = "grad_scale" in inspect.signature(optimizer.step).parameters
    own_undo = bool(getattr(optimizer, "transactional", False))
    with step_transaction() as txn:
        for _, st in items:
            if isinstance(st.store, NvmeStore):
                txn.uses(st.store.storage)
            gs = store_of(st)
            if isinstance(gs, gradstore.NvmeGrads):
                txn.uses(gs.storage)
        with no_torch_function():
            if txn.fallible:
                for p in others:
                    if p.grad is not None:
                        txn.save(p.data)
                        txn.save(p.grad)
                        if not own_undo:
                            _save_state(txn, optimizer, p)
                grads_before = [(p, p.grad) for p in others]
                txn.on_abort(lambda: _put_grads(grads_before))
            if grad_scale != 1.0 and not takes_scale:
                for p in others:
                    if p.grad is not None:
                        p.grad.mul_(grad_scale)
        todo = [(p, st) for p, st in items if store_of(st).has(st)]
        for i, batch in enumerate(grads.chunks(todo, chunk) or [[]]):  # one step even with no partitions
            _step_batch(optimizer, batch, grad_scale, takes_scale, txn, own_undo)
            if i == 0:
                for p in others:
                    p.grad = None


def _put_grads(saved: list[tuple[torch.Tensor, torch.Tensor | None]]) -> None:
    for p, g in saved:
        p.grad = g


def _save_state(txn: Any, optimizer: Any, p: torch.Tensor) -> None:
    """Save ``optimizer.state[p]`` so that an abort puts it back as it was (or drops it if it is new)."""
    state = getattr(optimizer, "state", None)
    if state is None:
        return
    if p not in state:
        txn.on_abort(lambda: state.pop(p, None))
        return
    entry = state[p]
    saved = dict(entry)
    for v in saved.values():
        if isinstance(v, torch.Tensor):
            txn.save(v)

    def restore() -> None:
        entry.clear()
        entry.update(saved)

    txn.on_abort(restore)


def _step_batch(
    optimizer: Any, batch: list[Item], grad_scale: float, takes_scale: bool, txn: Any, own_undo: bool
) -> None:
    with no_torch_function():
        loads: list[tuple[torch.Tensor, Any]] = []
        try:
            # Param and gradient partitions: reads issued together, waited together.
            for _, st in batch:
                loads.append(st.store.load(st.key, st.partition_numel, st.dtype))
                loads.append(store_of(st).load(st))
            for _, handle in loads:
                if handle is not None:
                    handle.wait()
            for i, (p, _) in enumerate(batch):
                p.data = loads[2 * i][0]
                p.grad = grads.step_grad(p, loads[2 * i + 1][0], isinstance(optimizer, OffloadedAdamW))
                if loads[2 * i][1] is not None:  # read into a scratch buffer: free to change
                    txn.scratch(p.data)
                elif not own_undo:
                    txn.save(p.data)  # the stored partition itself: changed in place
                if loads[2 * i + 1][1] is not None:
                    txn.scratch(p.grad)
                elif grad_scale != 1.0 and not takes_scale:
                    txn.save(p.grad)
                if not own_undo and txn.fallible:
                    _save_state(txn, optimizer, p)
                if grad_scale != 1.0 and not takes_scale:
                    p.grad.mul_(grad_scale)  # in place, as clip_grad_norm_ does
            if takes_scale:
                optimizer.step(grad_scale=grad_scale)
            else:
                optimizer.step()
            for p, st in batch:
                st.store.put(st.key, p.data)  # staged in the transaction (in place for memory stores)
        finally:
            for _, handle in loads:
                if handle is not None:
                    with contextlib.suppress(Exception):
                        handle.wait()  # engine buffers must not be dropped under a running read
            for p, st in batch:
                grads.clear_step_grad(p, st.dtype)
                p.data = torch.empty(0, dtype=st.dtype, device=st.device)


def _unique(params: Any) -> list[torch.Tensor]:
    seen: dict[int, torch.Tensor] = {}
    for p in params:
        seen.setdefault(id(p), p)
    return list(seen.values())


def _size(module: nn.Module, items: list[Item], cfg: ZswapConfig) -> Sizing:
    z = cfg.zero
    total = sum(st.numel for _, st in items)
    threshold = z.stage3_param_persistence_threshold
    if threshold is None:
        threshold = min(PERSISTENCE_MAX, total // 1000)
    resident = buffers.resident(items, cfg, threshold)  # offload_param.max_in_cpu
    numel = {id(p): st.numel for p, st in items if st.numel > threshold and id(p) not in resident}
    chain, where = _largest_chain(module, numel)
    own = max(
        (sum(numel.get(id(p), 0) for p in m.parameters(recurse=False)) for m in module.modules()), default=0
    )
    streamed = sum(numel.values())
    bucket = z.stage3_prefetch_bucket_size
    if bucket is None:
        bucket = min(streamed, max(2 * own, PREFETCH_MIN))
    max_live = z.stage3_max_live_parameters
    if max_live is None:
        max_live = min(streamed, chain + bucket)
    elif max_live < chain:
        raise ConfigError(
            f"zero_optimization.stage3_max_live_parameters={max_live} is below the {chain} elements that "
            f"module {where!r} and its parents hold during its forward; raise it to at least {chain}"
        )
    reuse = z.stage3_max_reuse_distance
    if reuse is None:
        reuse = bucket
    return Sizing(total, threshold, total - streamed, chain, Budget(bucket, max_live, reuse), resident)


def _largest_chain(module: nn.Module, numel: dict[int, int]) -> tuple[int, str]:
    best = (0, "")

    def walk(m: nn.Module, name: str, held: dict[int, int]) -> None:
        nonlocal best
        held = {**held, **{id(p): numel[id(p)] for p in m.parameters(recurse=False) if id(p) in numel}}
        if sum(held.values()) > best[0]:
            best = (sum(held.values()), name)
        for child_name, child in m.named_children():
            walk(child, f"{name}.{child_name}" if name else child_name, held)

    walk(module, "", {})
    return best


def _optimizer(module: nn.Module, cfg: ZswapConfig, given: Any) -> tuple[Any, bool, str]:
    """(optimizer, built here, why there is none)."""
    if given is not None:
        return given, False, ""
    if cfg.optimizer is None:
        return None, False, "no optimizer: pass optimizer= or add an 'optimizer' section to the config"
    return OffloadedAdamW.from_config(list(module.parameters()), cfg), True, ""
