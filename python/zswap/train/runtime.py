"""`zswap.initialize` and `Engine`: run and train a model whose params zswap partitioned and offloaded.

`initialize` builds an `Engine`, which lays itself over the model (`zswap.train.wiring`: budgets from
`zswap.train.sizing`, module hooks, gradient hooks, the prefetching scheduler), builds or adopts the
optimizer (`zswap.train.bridge`) and reports its counters (`zswap.train.stats`). After it, ``model(x)``
and ``loss.backward()`` work as on a plain model. The old path ``zswap.runtime`` is this module.
"""

from __future__ import annotations

import contextlib
import functools
from collections.abc import Callable, Mapping
from typing import TYPE_CHECKING, Any, Literal, TypeVar

import torch
from torch import nn

from .. import device as _device
from .. import memory
from .._interrupts import deferred
from ..build.init import partition_rest
from ..config import ZswapConfig, load_config
from ..errors import ConfigError, EngineClosedError, ZswapError
from ..fetch import outputs
from ..fetch.prefetch import Seed, Slot
from ..gradients import grads, gradstore
from ..parts import guards as _guards
from ..parts.params import Item, ParamState
from ..parts.runners import RUNNERS
from ..step import early_build, earlystep, stepping
from . import bridge, dtypes, placement, resident, resize, stats, wiring
from .sizing import grad_room, refuse_meta

if TYPE_CHECKING:
    from ..fetch.hooks import ModuleHooks
    from ..fetch.prefetch import Scheduler
    from .sizing import Sizing


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
    now with the config's ``offload_param`` settings, in the config's dtype but where their own is kept
    (PEFT's adapters; every one under ``torch_autocast``: `zswap.build.init.partition_rest`).
    ``config``: a path, mapping, `ZswapConfig` or ``None`` (`zswap.load_config`); its ``zero_optimization``
    knobs size the prefetch and the live budget, each chosen from the model where left out or ``"auto"``.
    ``optimizer``: a torch Adam / AdamW becomes zswap's `OffloadedAdamW` over its groups, another is used
    as given; else built from the config's ``optimizer`` section (both: a `ConfigError`); else none.
    ``lr_scheduler``: a scheduler (``step()``, ``state_dict()``…; a torch one or `zswap.schedules`), or a
    callable taking the optimizer and returning one; else built from the config's ``scheduler`` section
    (`zswap.schedules`); both at once is a `ConfigError`. Stepped once per applied optimizer step.
    ``device``: where modules compute: ``None`` = the current CUDA device when CUDA is available, else
    the CPU; ``"cpu"``, ``"cuda"``, ``"cuda:N"`` or a `torch.device`. Partitions stay on their offload
    tier; gathered params, module buffers and the model's inputs (the caller's) are on this device.
    ``max_grad_norm``: clip the global L2 norm of the gradients (over all ranks) to this before each step;
    default: the config's ``gradient_clipping`` (DeepSpeed's key; 0 or absent = no clipping, as in
    PyTorch — `zswap.deepspeed.initialize` instead clips at 1.0 when the key is absent, as DeepSpeed does).
    """
    cfg = bridge.one_optimizer(config, optimizer)
    return build(Engine, model, cfg, optimizer, lr_scheduler, device, max_grad_norm)


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
        max_grad_norm = cfg.own_clipping()
    elif (
        isinstance(max_grad_norm, bool) or not isinstance(max_grad_norm, int | float) or not max_grad_norm > 0
    ):
        raise ValueError(f"max_grad_norm must be a positive number or None, got {max_grad_norm!r}")
    dev = _device.resolve(device)
    refuse_meta(model)
    placement.check(cfg, model)
    partition_rest(cfg, model)
    return cls(model, cfg, optimizer, lr_scheduler=lr_scheduler, max_grad_norm=max_grad_norm, device=dev)


class Engine:
    """Runs ``module``'s forward and backward with its params streamed in; `step` applies the optimizer.

    The optimizer is *partition-aware* (``steps_partitions`` true: it reads the partition gradients through
    `zswap.gradstore.store_of` and updates the stores itself) or an ordinary one over the model's params
    (``torch.optim.AdamW``, `zswap.optim.OffloadedAdamW`), shown each param's local partition by
    `step_partitions`. Also a context manager that calls `close` on exit."""

    # Laid over the model by `zswap.train.wiring.wire` (again after a change of params' shapes).
    sizing: Sizing
    _homes: dict[int, Any]
    _slots: dict[int, Slot]
    _sched: Scheduler
    _stores: dict[int, Any]
    _hooks: ModuleHooks
    _grads: grads.GradSink
    _window_from = 0  # `micro_steps` where the accumulation window began (a load begins a new one)
    _lr_kwargs = False  # `step` hands the schedule keywords (`zswap.deepspeed`'s)

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
        """The compute device as zswap drives it (copy streams, registered buffers); `device`: its torch's."""
        self.config, self.closed = config, False
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
        """fp16 runs: the `zswap.loss_scale.LossScaler` (``state_dict``/``load_state_dict``); else None."""
        self._scaled_backward = False  # this accumulation window went through backward(): unscale it
        self.last_grad_norm: float | None = None
        """Global gradient norm seen by the last `step` (when clipping or the finite check needed it)."""
        self.early_step = True
        """Escape hatch (docs/configuration.md): False for a loop that changes the lr, clipping or params
        between backward and step as a rule (`zswap.step.earlystep`'s work then wasted). Same results."""
        self.clipping_after_backward = False
        """For a front end that learns a step's clip norm after its backward (Lightning's
        ``configure_gradient_clipping``) and sets ``max_grad_norm`` for `step`: the early step keeps the
        gradients as under ``max_grad_norm``, so a step that clips is redone from them."""
        self.window_ends: Callable[[], bool] | None = None
        """For a front end that accumulates itself (``gradient_accumulation_steps`` 1 here, `step` at the
        end of its windows only): whether the backward about to run ends a window (asked again at the
        step). The early step sums a window's earlier backwards and runs in its last one."""
        self._keep_applied: bool | Literal["auto"] = "auto"  # `keep_applied_grads`
        self._reuse_outputs = outputs.DEFAULT  # `reuse_backward_outputs`
        self._early: earlystep.EarlyStep | None = None
        self._early_off = ""  # why there is no early step (`zswap.step.speculation.why_not`)
        self._clipped = False  # the last applied step's clipping bit: the next one is not speculated
        self._tally = stepping.Tally()
        self._grad_stash: int | None = None  # `grad_stash_bytes`, where set
        self._across = True  # `prefetch_across_passes`
        self._ids: set[int] = set()
        self._items: list[Item] = []
        self._grad_stores: list[gradstore.GradStore] = []
        self.optimizer: Any = None
        self._owns_optimizer = False
        wiring.wire(self)
        self._io_base = stats.io_counters(self)
        try:
            self.optimizer, self._owns_optimizer, self._no_optimizer = bridge.build_optimizer(
                module, config, optimizer, lr_scheduler
            )
            self._gas = config.batch.resolve(stepping.world_size(self._items))[2]
            dtypes.check_accumulation(self, self._gas)
            self._fp16 = config.dtype == "fp16" or any(p.dtype == torch.float16 for p in module.parameters())
            self._fp16 = self._fp16 or any(st.dtype == torch.float16 for _, st in self._items)
            # bf16.check_grad_overflow: skip a step whose gradients are not finite, as fp16 always does
            # (an early step then runs ahead of the check and is dropped: `zswap.step.speculation`).
            bf16 = config.dtype == "bf16" or any(st.dtype == torch.bfloat16 for _, st in self._items)
            self.loss_scaler = stepping.loss_scaler(config, self._fp16, self.device.type)
            self._check_finite = self.loss_scaler is not None or (bf16 and config.bf16.check_grad_overflow)
            self.lr_scheduler = stepping.lr_scheduler(config, self.optimizer, lr_scheduler, self._lr_kwargs)
            self._early = early_build.for_engine(self)
            self._grads.hand_first_to(self._early)
            self._io_base = stats.io_counters(self)  # now with the gradients' and the optimizer's engines
        except BaseException:
            if self._owns_optimizer and hasattr(self.optimizer, "close"):
                self.optimizer.close()
            wiring.unwire(self)
            raise
        RUNNERS.add(self)  # the open engines (one per param at a time) the layers below ask
        _guards.install()  # optimizer steps, clipping and forwards outside an engine are refused
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
        # The optimizer may step (and clip) over the managed params here; a first Ctrl-C waits for the
        # step to finish or abort (`zswap._interrupts`), so it never lands between weights and counters.
        with _guards.engine_step(), deferred():
            self._step()

    def _step(self) -> None:
        if not self.is_gradient_accumulation_boundary():
            self.micro_steps += 1
            self._micro_batch_end()
            return
        self._grads.flush()
        stepping.before_step(self.module, self._items, self._grads.frozen)  # no .grad by hand; ranks alike
        grads.wait(self._items)  # a failed gradient write stops the step here, before anything changes
        held = resident.take(self)  # resident params: stepped in their gathered copy (no read)
        self._sched.drop_all()  # the optimizer rewrites partitions: no gathered copy may go stale
        early = self._early
        if early is not None:
            early.prepare(self._items)  # kept only if it ran ahead of this very step (or raises)
        others = stepping.unmanaged(self.module, self._ids, self.optimizer)  # (made after initialize)
        items, normed = stepping.normed(self, others)  # the params the clip norm covers
        chunk = max(1, self.sizing.live_elements // 2)  # a chunk's params and grads: the live budget
        loss_scale = stepping.current_scale(self) if self._scaled_backward else 1.0
        # From the norms noted in backward where it ran early (no gradient read), else from the store.
        scale, self.last_grad_norm = grads.global_scale(
            items, normed, self.max_grad_norm, self._check_finite, chunk, loss_scale=loss_scale
        )
        # Updated in backward already; deferred, what did not fit its cap is stepped here, in its commit.
        try:
            committed = early is not None and early.commit(
                scale, functools.partial(bridge.step_indices, self.optimizer, self._items, chunk, held)
            )
        except BaseException:
            resident.reinstall(held)  # as they were: the step's transaction was aborted
            raise
        self._clipped = self._clipped if scale is None else scale != 1.0 / loss_scale  # (skipped: kept)
        if committed:
            assert early is not None
            updated = early.take_resident()
            resident.refresh(held, updated)  # gathered again from the committed copies
            self._finish_step(scale, resident.values(held, updated))  # a device's: from them, no read
            self._sched.seed(early.take_seeds())  # the next forward's first params: no read
            self._sched.read_ahead()  # and the next ones' reads, of the values just committed
            return
        self._tally.ordinary_step(early.why if early is not None else self._early_off, scale)
        seeds: list[Seed] = []
        if scale is None:
            self.skipped_steps += 1
            resident.reinstall(held)  # nothing changed them
        elif getattr(self.optimizer, "steps_partitions", False):  # a factor != 1 is applied, never dropped
            self.optimizer.step(**({"grad_scale": scale} if scale != 1.0 else {}))
        else:
            if getattr(self.optimizer, "max_grad_norm", None) is not None:
                chunk = self.sizing.total  # its own clipping must see every gradient in one call
            plan = self._sched.seed_plan()  # the next forward's first params: kept as written, no read
            seeds = bridge.step_partitions(self.optimizer, self._items, others, chunk, scale, held, plan)
        self._finish_step(scale, resident.values(held, {}))
        self._sched.seed(seeds)
        self._sched.read_ahead()  # the next forward's next reads, of the values just written

    def end_micro_batch(self) -> None:
        """For a front end that accumulates itself: after a backward `window_ends` said was not a window's
        last, what `step` does between accumulation boundaries (nothing else is to be done there)."""
        self._check_open()
        if self.window_ends is not None and not self.window_ends():
            self._micro_batch_end()

    def _micro_batch_end(self) -> None:
        if self._early is not None:  # the next forward's first params, kept as they were: no read
            self._sched.seed(self._early.take_micro_seeds())
        self._sched.read_ahead()  # nothing was written: the next forward's next reads start now

    def _finish_step(self, scale: float | None, updated: Mapping[int, torch.Tensor] | None = None) -> None:
        # The counters, loss scale and schedule move first, with no I/O (no await point) between them and
        # the commit of the weights; `step` holds a Ctrl-C back until they have moved.
        self.global_steps += 1
        self.micro_steps += 1
        if self.loss_scaler is not None:
            self.loss_scaler.update(scale is None)
        try:
            stepping.schedule_and_clear(self, scale)
        finally:  # persistent params the step dropped, gathered again: from ``updated`` or read
            self._sched.fetch_persistent([s for s in self._slots.values() if s.persistent], updated)
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
        managed = self.config.batch.managed_gradient_accumulation
        return not managed or (self.micro_steps - self._window_from + 1) % self._gas == 0

    def gradient_accumulation_steps(self) -> int:
        """Micro-batches per optimizer step (the config's ``gradient_accumulation_steps``, or derived from
        ``train_batch_size`` / ``train_micro_batch_size_per_gpu``; default 1)."""
        return self._gas

    @property
    def device(self) -> torch.device:
        """The `torch.device` modules compute on (DeepSpeed's ``engine.device``, for ``batch.to(...)``)."""
        return self.compute_device.torch_device

    def __getattr__(self, name: str) -> Any:
        # Attributes the engine lacks come from the module, as DeepSpeed's (``module`` read from __dict__).
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
        return stepping.current_scale(self)

    def get_lr(self) -> list[float]:
        """The learning rate of each of the optimizer's param groups."""
        self._check_open()
        if self.optimizer is None:
            raise ZswapError(self._no_optimizer)
        return [float(group["lr"]) for group in self.optimizer.param_groups]

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        """``module(*args, **kwargs)``; with ``fp16.auto_cast`` floating-point inputs are cast to fp16."""
        if self._fp16 and self.config.fp16.auto_cast:
            args, kwargs = stepping.cast_half(args), stepping.cast_half(kwargs)
        return self.module(*args, **kwargs)

    def forward(self, *args: Any, **kwargs: Any) -> Any:
        """``engine(*args, **kwargs)``: the module with its hooks (its bare ``forward`` would skip them)."""
        return self(*args, **kwargs)

    def train(self, mode: bool = True) -> Engine:
        """Put the module in training (or, ``mode=False``, eval) mode."""
        self.module.train(mode)
        return self

    def eval(self) -> Engine:
        """Put the module in eval mode."""
        return self.train(False)

    def adopt_optimizer(self) -> None:
        """Make `close` close the optimizer too (built for this engine only: `zswap.deepspeed.initialize`)."""
        self._owns_optimizer = True

    @property
    def keep_applied_grads(self) -> bool | Literal["auto"]:
        """Escape hatch (docs/configuration.md): True for a loop that now and then reads a gradient or
        changes what the step depends on between backward and step. Whether the gradients the early step
        applies in backward are stored as any other (written to NVMe past `grad_stash_bytes`). False: they
        are let go once applied — 1 × the model fewer bytes written per step — so what needs them after
        backward raises `zswap.errors.GradientsNotKeptError`
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
        """Escape hatch (docs/configuration.md): True where peak memory has tens of MiB to spare.
        On the CPU, compute backward's large matmul outputs (weight and input gradients of 256 KiB or
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
        self._reuse_outputs = on  # the module hooks ask at each call

    def _keeps_applied_grads(self) -> bool:
        """`keep_applied_grads` resolved: ``"auto"`` is True once a gradient store saw its gradients
        wanted between a backward and the step (`zswap.gradstore.GradStore.wanted`)."""
        if self.keep_applied_grads == "auto":
            return any(gs.wanted for gs in self._grad_stores)
        return bool(self.keep_applied_grads)

    @property
    def prefetch_across_passes(self) -> bool:
        """Escape hatch (docs/configuration.md): False when no pass follows soon, so no read holds memory.
        Whether the swap-ins of the next pass's first params are issued when a pass ends (an inference
        forward's end, `step`'s end, `initialize`'s end), so a pass's first step does not wait for the
        disk (`zswap.fetch.nextpass`). Default True. A read made stale by a write in between is dropped
        unused; results are the same either way. Off: the first step of each pass is read on demand."""
        return self._across

    @prefetch_across_passes.setter
    def prefetch_across_passes(self, on: bool) -> None:
        if not isinstance(on, bool):
            raise ValueError(f"prefetch_across_passes must be a bool, got {on!r}")
        self._across = on  # the scheduler asks at each pass's end
        if not on:
            self._sched.drop_ahead()

    @property
    def grad_stash_bytes(self) -> int:
        """Escape hatch (docs/configuration.md): for a machine with memory to spare, to write less.
        Bytes of partition gradients kept in memory between backward and step instead of being written
        to NVMe, where the optimizer lives there (`zswap.gradstore`). Default 0: every gradient is written
        — but those a step with clipping or accumulation may need, which the early step keeps in memory up
        to the live budget's elements (`sizing.grad_room`) — which keeps peak RSS within the live budget
        + optimizer ring + 256 MiB; the live budget's bytes saves about 1 × the model of writes per step for
        as much memory (benches/README.md, "Bytes per step"). Set (0 included), it bounds every gradient
        kept in memory, the early step's too. Results are the same either way."""
        return max((getattr(gs, "stash_cap", 0) for gs in self._grad_stores), default=0)

    @grad_stash_bytes.setter
    def grad_stash_bytes(self, nbytes: int) -> None:
        if isinstance(nbytes, bool) or not isinstance(nbytes, int) or nbytes < 0:
            raise ValueError(f"grad_stash_bytes must be a non-negative int, got {nbytes!r}")
        self._grad_stash = nbytes  # the gradient stores ask at each gradient

    def _resident_ids(self) -> frozenset[int]:
        return resident.ids(self)

    def _grad_room(self) -> int:
        """Bytes of gradients the early step keeps in memory past the stash (`sizing.grad_room`)."""
        return grad_room(self)

    def zero_grad(self) -> None:
        """Drop every accumulated gradient (partitions of managed params, ``p.grad`` of the others)."""
        self._check_open()
        if self._early is not None:
            self._early.zero_grad()
        self._grads.flush()
        self._grads.drop_waiting()
        grads.clear(self._items)
        for p in self.module.parameters():
            p.grad = None
        self._scaled_backward = False  # no gradient of a scaled backward is left

    def stats(self, reset: bool = False) -> dict[str, Any]:
        """Counters since `initialize` (or the last ``reset``): swap traffic of the param store
        (``bytes_read``, ``bytes_written``), bytes gathered for compute, seconds compute waited for params
        (``fetch_wait_seconds``), fetches on demand and prefetch hits (``prefetch_hit_rate`` = hits /
        fetches), the peak of elements gathered, the budgets in force, and where the memory is: the
        ``mem_*`` lines, in bytes (`zswap.train.stats.memory_stats`; README, "Where the memory goes").
        Reads issued ahead for the next pass are waited for first, so the byte counts include them."""
        return stats.engine_stats(self, reset)

    # -- checkpoints (zswap.checkpoint) -------------------------------------------------------------

    def save_checkpoint(
        self, save_dir: Any, tag: str | None = None, client_state: Any = None, *, save_latest: bool = True
    ) -> Any:
        """Save params, optimizer state, scheduler, loss scaler, RNG and ``client_state`` to
        ``save_dir/tag`` (default tag ``global_step{global_steps}``), atomically, then point
        ``save_dir/latest`` at it (unless ``save_latest`` is false). Every rank calls it with the same
        tag; each streams its own partitions. Returns the folder."""
        from ..checkpoint import save_checkpoint

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
        returns its ``client_state`` (with ``load_module_only`` too, as DeepSpeed). With
        ``load_lr_scheduler_states=False`` the schedule keeps this run's state. Everything is validated
        first: a bad checkpoint raises a `zswap.ZswapError` and changes nothing."""
        from ..checkpoint import load_checkpoint

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
            wiring.teardown(self)
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

    # -- zswap.runners.Runner: what the layers below ask of an open engine ---------------------------

    def runs(self, ids: set[int]) -> bool:
        return bool(ids & self._ids)

    def yield_prefetch(self, p: torch.Tensor) -> bool:
        return bool(self._sched.yield_prefetch(p))

    def drop_gathered(self) -> None:
        self._sched.drop_all()

    def mastered(self) -> set[int]:
        records = resize.records_of(self.optimizer)
        if records is None:
            return set()
        params, steps = records.params, records.steps  # (not yet stepped: a write is seen and stepped from)
        return {
            id(params[seg.param]) for sg in records.sub_groups for seg in sg.segments
            if params[seg.param].dtype != torch.float32 and steps[seg.param] > 0
        }  # fmt: skip

    def check_resizable(self, params: list[torch.Tensor]) -> None:
        resize.check_resizable(self, params)

    def rewired(self) -> contextlib.AbstractContextManager[None]:
        return wiring.rewired(self)

    def swap_params(self, new: dict[int, torch.Tensor]) -> None:
        resize.swap_params(self, new)

    # -- internals ---------------------------------------------------------------------------------

    def _check_open(self) -> None:
        if self.closed:
            raise EngineClosedError("this zswap Engine is closed: build a new one with initialize()")

    def _slot_for(self, p: torch.Tensor, st: ParamState) -> Slot:
        """The slot of a managed param the model uses without owning it (created on first use)."""
        slot = self._sched.slots.get(id(p))
        if slot is None:
            slot = self._sched.slots[id(p)] = Slot(p, st, persistent=False)
        return slot
