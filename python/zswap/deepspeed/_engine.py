"""`DeepSpeedEngine`: the engine `zswap.deepspeed.initialize` returns — a `zswap.Engine` whose checkpoint
methods take DeepSpeed's arguments and return what DeepSpeed's return, plus the few DeepSpeed engine queries
scripts call. zswap's own `Engine` keeps its own shapes (``load_checkpoint`` returns the client state)."""

from __future__ import annotations

import contextlib
import math
import os
import warnings
import weakref
from collections.abc import Iterable, Iterator, Mapping
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist

from ..checkpoint import _torchsave, statedict
from ..checkpoint._atomic import LATEST, fsync_path, naming_write_errors, temp_name
from ..checkpoint.fp32 import write_script
from ..checkpoint.load import has_latest
from ..errors import ZswapError, ZswapWarning
from ..step import stepping
from ..step.optim import OffloadedAdamW
from ..train import runtime
from . import _backward, _extras
from ._args import refuse
from ._data import training_dataloader


class _StepsWith:
    """A schedule whose ``step()`` passes ``kwargs`` (`DeepSpeedEngine.step`'s ``lr_kwargs``); anything else
    is the schedule's own."""

    def __init__(self, schedule: Any, kwargs: dict[str, Any]) -> None:
        self.schedule, self.kwargs = schedule, kwargs

    def step(self) -> None:
        self.schedule.step(**self.kwargs)

    def __getattr__(self, name: str) -> Any:
        return getattr(self.schedule, name)


def _scale_of(ref: weakref.ref[DeepSpeedEngine]) -> float:
    engine = ref()
    return 1.0 if engine is None else stepping.current_scale(engine)


class NoSyncError(ZswapError, AssertionError):
    """`DeepSpeedEngine.no_sync`: no gradient synchronisation to put off (DeepSpeed asserts with ZeRO-3)."""


class UnmanagedAccumulationError(ZswapError, AssertionError):
    """A call that sets the accumulation boundary under ``managed_gradient_accumulation: false``, where every
    ``step()`` is one (DeepSpeed asserts the same)."""


class CoalesceError(ZswapError, AssertionError):
    """`DeepSpeedEngine.coalesce_grad_reduction` used as DeepSpeed forbids: nested, with ``step()`` inside,
    or with ``managed_gradient_accumulation: false`` (DeepSpeed asserts the same)."""


class DeepSpeedEngine(runtime.Engine):
    """A `zswap.Engine` with DeepSpeed's checkpoint signatures:

    - ``save_checkpoint(save_dir, tag=None, client_state={}, save_latest=True,
      exclude_frozen_parameters=False)`` returns ``True``;
    - ``load_checkpoint(load_dir, tag=None, load_module_strict=True, load_optimizer_states=True,
      load_lr_scheduler_states=True, load_module_only=False, custom_load_fn=None)`` returns
      ``(checkpoint folder, client_state)``, and ``(None, None)`` with a `ZswapWarning` when no tag is given
      and ``load_dir/latest`` does not exist — DeepSpeed's "nothing to resume from", so a script that
      always tries to resume runs its first time too. Any other failure (a tag that does not exist, another
      model, a corrupt file) raises, as in `zswap.Engine.load_checkpoint`.

    ``load_module_strict=False``, ``custom_load_fn`` and ``exclude_frozen_parameters=True`` are not
    supported: a `TypeError` naming the argument.

    DeepSpeed's queries scripts branch on: ``fp16_enabled()``, ``bfloat16_enabled()``,
    ``zero_optimization_stage()`` (3), ``was_step_applied()``, ``global_rank``, ``local_rank``,
    ``world_size`` / ``dp_world_size``, ``train_batch_size()``, ``get_global_grad_norm()``,
    ``gradient_clipping()``, ``get_mom()``, ``global_samples``, ``managed_gradient_accumulation()``,
    ``get_batch_info()``, ``zero_offload_param()`` / ``zero_offload_optimizer()`` (the sections, ``None``
    where nothing is offloaded), ``zero_cpu_offload()``, ``module_state_dict()``, ``save_fp16_model``;
    ``set_gradient_accumulation_boundary(b)`` says which backward ends the accumulation window, as
    DeepSpeed's does (until called again); ``coalesce_grad_reduction()`` holds the backwards of one step;
    ``deepspeed_io(dataset)`` builds DeepSpeed's loader, ``save_16bit_model`` writes the whole state dict;
    ``destroy()`` is `close`; ``no_sync()`` raises as DeepSpeed's does under ZeRO-3; ``step(lr_kwargs=…)``
    hands its keywords to the schedule's ``step``; ``get_data_parallel_rank()``, ``set_train_batch_size`` /
    ``set_train_micro_batch_size``, ``load_module_state_dict`` and ``offload_states`` / ``reload_states``
    behave as DeepSpeed's (`zswap.deepspeed._extras`). A backward through the
    tensors ``engine(...)`` returned that `backward` does not run is DeepSpeed's (divided by the
    accumulation steps; under fp16 scaled by ``scale(loss)`` or refused).
    """

    _in_backward = False
    """`backward` is running: the output hooks leave its gradients alone (it scaled the loss itself)."""
    _loss_scaled = False
    """``scale(loss)`` scaled the loss of the backward to come (`_backward`)."""
    collate_fn: Any = None
    """The ``collate_fn`` given to ``initialize``: `deepspeed_io`'s where it is given none (DeepSpeed's)."""
    _boundary: bool | None = None
    """`set_gradient_accumulation_boundary`'s override (``None``: the micro-batches are counted)."""
    global_samples = 0
    """Samples the optimizer steps have applied over all ranks, DeepSpeed's counter: ``train_batch_size()`` a
    step (with ``managed_gradient_accumulation: false``, the micro-batches ``backward`` ran since the last
    one); after ``load_checkpoint``, ``global_steps × train_batch_size()`` (DeepSpeed's value for a
    checkpoint without it)."""
    norm_over_optimizer = True
    """The global gradient norm (clipping, ``get_global_grad_norm``) covers the params the optimizer steps
    only, as DeepSpeed's ZeRO-3 takes it over its optimizer's groups (`zswap.step.stepping.normed`)."""
    _lr_kwargs = True  # `step(lr_kwargs=...)` hands the schedule its keywords (ReduceLROnPlateau's metric)
    _backwards = 0
    """``backward`` calls since the last ``step()``."""
    _coalescing = False
    """Inside `coalesce_grad_reduction`."""
    _micro_open = False
    """A backward set as no boundary ran and no ``step()`` followed (Accelerate's loop calls none there):
    the next forward ends its micro-batch first, as ``step()`` would have."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        # DeepSpeed's ZeRO-3 takes the global gradient norm at every step and skips a step whose norm is
        # not finite, in every precision (0.19.8: ``is_invalid_grad_norm`` in stage 3's ``step``), so one
        # batch of NaN gradients costs a step, not the model. zswap's own Engine keeps PyTorch's way (an
        # fp32 or bf16 step applies what it is given; fp16 skips); the norm is noted as each gradient lands.
        self._check_finite = True
        if isinstance(self.optimizer, OffloadedAdamW):  # DeepSpeed's optimizer.cur_scale, without a cycle
            ref = weakref.ref(self)
            self.optimizer.scale_source = lambda: _scale_of(ref)

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        """The module's forward; what a backward through its outputs gets is DeepSpeed's (`_backward`)."""
        if self._micro_open and not self.closed:
            self._micro_open = False
            self._micro_batch_end()  # the next forward's first params, seeded or read ahead
        return _backward.wrap_outputs(self, super().__call__(*args, **kwargs))

    def backward(self, loss: torch.Tensor, retain_graph: bool = False, scale_wrt_gas: bool = True) -> Any:
        self._in_backward = True
        try:
            out = super().backward(loss, retain_graph=retain_graph, scale_wrt_gas=scale_wrt_gas)
        finally:
            self._in_backward = False
        self._micro_open = self._boundary is False
        self._backwards += 1
        return out

    def allreduce_gradients(self, bucket_size: Any = None) -> None:
        """DeepSpeed's: reduce the gradients over the ranks. zswap reduces each param's gradient in backward,
        once it is complete (``bucket_size`` has nothing to size): nothing is left to do here."""
        self._check_open()

    def scale(self, loss: Any) -> torch.Tensor:
        """DeepSpeed's ``engine.scale(loss)``: the loss times the fp16 loss scale (as it is without one), for
        ``.backward()`` by the caller; the gradients reaching the engine's outputs are divided by
        ``gradient_accumulation_steps`` and unscaled at the step, as `backward`'s are."""
        return _backward.scale(self, loss)

    def save_checkpoint(
        self,
        save_dir: Any,
        tag: Any = None,
        client_state: Any = None,
        save_latest: bool = True,
        exclude_frozen_parameters: bool = False,
    ) -> bool:
        refuse(
            "DeepSpeedEngine.save_checkpoint", exclude_frozen_parameters=(exclude_frozen_parameters, False)
        )
        tag = None if tag is None else str(tag)  # DeepSpeed takes any tag and formats it
        super().save_checkpoint(save_dir, tag, client_state or {}, save_latest=bool(save_latest))
        if self.global_rank == 0:
            write_script(save_dir)  # DeepSpeed leaves its zero_to_fp32.py there; scripts run it
        return True

    def load_checkpoint(
        self,
        load_dir: Any,
        tag: Any = None,
        load_module_strict: bool = True,
        load_optimizer_states: bool = True,
        load_lr_scheduler_states: bool = True,
        load_module_only: bool = False,
        custom_load_fn: Any = None,
    ) -> tuple[str | None, Any]:
        refuse(
            "DeepSpeedEngine.load_checkpoint",
            load_module_strict=(load_module_strict, True),
            custom_load_fn=(custom_load_fn, None),
        )
        if tag is None and load_dir not in (None, "") and not has_latest(self, load_dir):
            warnings.warn(
                f"load_checkpoint: no {LATEST!r} file in {os.fspath(load_dir)!r}: nothing loaded, "
                f"returning (None, None) as DeepSpeed does (pass tag= to load a given checkpoint)",
                ZswapWarning,
                stacklevel=2,
            )
            return None, None
        tag = None if tag is None else str(tag)
        client_state = super().load_checkpoint(
            load_dir,
            tag,
            load_optimizer_states=load_optimizer_states,
            load_module_only=load_module_only,
            load_lr_scheduler_states=load_lr_scheduler_states,
        )
        if tag is None:
            tag = (Path(os.fspath(load_dir)) / LATEST).read_text().strip()
        if not load_module_only:  # the counters came with the checkpoint (a new window began there)
            self.global_samples = self.global_steps * (self.train_batch_size() or 0)
        return os.path.join(os.fspath(load_dir), tag), client_state

    def empty_partition_cache(self) -> None:
        """Release every param the engine holds gathered, the persistent small ones too, as DeepSpeed's
        does (each is gathered again where it is next used)."""
        self._check_open()
        self._sched.drop_all()

    def train_batch_size(self) -> int | None:
        """Samples per optimizer step over all ranks (the config's, or derived; ``None`` if it gives none)."""
        return self.config.batch.resolve(self._world())[0]

    def train_micro_batch_size_per_gpu(self) -> int | None:
        """Samples per forward/backward on this rank (the config's, or derived; ``None`` if it gives none)."""
        return self.config.batch.resolve(self._world())[1]

    def get_batch_info(self) -> tuple[int | None, int | None, int]:
        """``(train_batch_size(), train_micro_batch_size_per_gpu(), gradient_accumulation_steps())``."""
        return (
            self.train_batch_size(),
            self.train_micro_batch_size_per_gpu(),
            self.gradient_accumulation_steps(),
        )

    def zero_offload_param(self) -> Any:
        """The config's ``offload_param`` section, ``None`` where params stay on their device."""
        return None if self.config.offload_param.device == "none" else self.config.offload_param

    def zero_offload_optimizer(self) -> Any:
        """The config's ``offload_optimizer`` section, ``None`` where states stay on the device."""
        return None if self.config.offload_optimizer.device == "none" else self.config.offload_optimizer

    def zero_use_cpu_optimizer(self) -> bool:
        """Whether the optimizer states are offloaded (CPU memory or NVMe): the step runs on the CPU."""
        return self.zero_offload_optimizer() is not None

    def zero_cpu_offload(self) -> bool:
        """Whether the optimizer states live in CPU memory (``offload_optimizer.device`` "cpu")."""
        return self.config.offload_optimizer.device == "cpu"

    mp_world_size = 1
    """Model-parallel ranks: zswap partitions over data-parallel ranks only."""
    mpu: Any = None
    """DeepSpeed's model-parallel unit: zswap has none (``initialize(mpu=...)`` is refused)."""

    def get_data_parallel_rank(self) -> int:
        """This rank among the data-parallel ranks: its global rank (zswap has no other parallelism)."""
        return self.global_rank

    def get_model_parallel_rank(self) -> int:
        """0: zswap has no model (tensor) parallelism."""
        return 0

    get_tensor_parallel_rank = get_model_parallel_rank

    def set_train_batch_size(self, train_batch_size: int) -> None:
        """Make ``train_batch_size`` samples an optimizer step by changing ``gradient_accumulation_steps``,
        the micro batch kept, as DeepSpeed's does: a `ValueError` unless it is a multiple of micro batch ×
        world size. The boundary is then counted with the new steps (call it at a boundary to start a
        whole window), and each loss `backward` scales is divided by them."""
        _extras.set_train_batch_size(self, train_batch_size)

    def set_train_micro_batch_size(self, micro_batch_size: int) -> None:
        """Make ``micro_batch_size`` samples a micro-batch on each rank, ``gradient_accumulation_steps`` kept:
        ``train_batch_size()`` becomes micro batch × accumulation steps × world size, as DeepSpeed's does.
        It changes what the engine reports (and ``deepspeed_io``'s loaders made after it), not the batches
        you feed it."""
        _extras.set_train_micro_batch_size(self, micro_batch_size)

    def module_state_dict(
        self,
        destination: Any = None,
        prefix: str = "",
        keep_vars: bool = False,
        exclude_frozen_parameters: bool = False,
    ) -> Any:
        """The module's ``state_dict`` (full values, gathered one param at a time), frozen params left out
        where asked — under every name a tied param has, as in `save_16bit_model`."""
        state = self.module.state_dict(destination=destination, prefix=prefix, keep_vars=keep_vars)
        if exclude_frozen_parameters:
            for name, p in self.module.named_parameters(remove_duplicate=False):
                if not p.requires_grad:
                    state.pop(prefix + name, None)
        return state

    def load_module_state_dict(
        self,
        checkpoint: Mapping[str, Any],
        strict: bool = True,
        custom_load_fn: Any = None,
        fetch_z3_params: bool = False,
        z3_params_to_fetch: Any = None,
        allowed_missing_keys: Iterable[str] | None = None,
    ) -> None:
        """Load ``checkpoint["module"]`` (a state dict of full values) into the module, as DeepSpeed's
        does: each param is written through to its partitions and swap files, so the fetch keywords change
        nothing (every param is gathered where it is written). With ``allowed_missing_keys`` a strict load
        lets those keys be missing and nothing else: a `RuntimeError` naming the rest."""
        _extras.load_module_state_dict(self, checkpoint, strict, custom_load_fn, allowed_missing_keys)

    def offload_states(
        self,
        include: Iterable[Any] | None = None,
        device: Any = "cpu",
        pin_memory: bool = True,
        non_blocking: bool = False,
    ) -> None:
        """DeepSpeed's call to free the device between phases (generation in RL loops, another model's
        turn). zswap keeps optimizer states, fp32 masters and gradient partitions off the device at all
        times (on NVMe or in CPU memory); what the device holds between steps is gathered params: those of
        ``lp_params`` (or every state, ``include`` None) are let go here, as `empty_partition_cache` does,
        and gathered again where next used. ``device`` must be ``"cpu"`` (DeepSpeed's only choice;
        ``"nvme"`` is its `ValueError`); ``include`` names DeepSpeed's ``OffloadStateTypeEnum`` values."""
        _extras.offload_states(self, include, device)

    def reload_states(self, non_blocking: bool = False) -> None:
        """The end of an `offload_states` phase: nothing to copy back, each param is gathered where it is
        next used (the next forward's first ones are read ahead as ever)."""
        self._check_open()

    def gradient_clipping(self) -> float:
        """The clip norm `step` applies to the gradients' global L2 norm (0.0: none)."""
        return float(self.max_grad_norm or 0.0)

    def deepspeed_io(
        self,
        dataset: Any,
        batch_size: int | None = None,
        route: str = "train",
        pin_memory: bool = True,
        data_sampler: Any = None,
        collate_fn: Any = None,
        num_local_io_workers: int | None = None,
    ) -> Any:
        """DeepSpeed's loader over ``dataset``: the micro batch size (or ``batch_size``), ``data_sampler``
        or DeepSpeed's default (this rank's share, shuffled — in order for ``route`` eval / predict, as
        DeepSpeed's), ``collate_fn`` or the one given to ``initialize``, the config's
        ``dataloader_drop_last``; batches pinned where asked and the engine computes on CUDA."""
        if route not in ("train", "eval", "predict", "encode"):
            raise ValueError(f"deepspeed_io: route must be train, eval, predict or encode, got {route!r}")
        return training_dataloader(
            dataset,
            self.config,
            self,
            collate_fn if collate_fn is not None else self.collate_fn,
            batch_size=batch_size,
            sampler=data_sampler,
            shuffle=route not in ("eval", "predict"),
            pin_memory=pin_memory and self.device.type == "cuda",  # (pinning serves copies to a GPU)
            num_workers=num_local_io_workers or 0,
        )

    def save_16bit_model(
        self, save_dir: Any, save_filename: str = "pytorch_model.bin", exclude_frozen_parameters: bool = False
    ) -> bool:
        """DeepSpeed's: the module's whole state dict, params in their own dtype (bf16 / fp16 / fp32),
        written by rank 0 as ``torch.save`` writes it to ``save_dir/save_filename`` (complete before it
        takes its name); a collective — every rank calls it (each param is gathered). The params are
        gathered one at a time as the file is written (`zswap.checkpoint._torchsave`): memory holds one
        param, never the model. Saves whatever ``stage3_gather_16bit_weights_on_model_save`` says (where
        false, DeepSpeed saves nothing and returns ``False``: its partitions would be a bogus model, and
        zswap's save is always whole). Returns ``True``."""
        self._check_open()
        with statedict.deferred():
            state = self.module.state_dict()  # partitioned params: placeholders, gathered as written
        if exclude_frozen_parameters:
            named = self.module.named_parameters(remove_duplicate=False)
            frozen = {n for n, p in named if not p.requires_grad}
            meta = getattr(state, "_metadata", None)
            state = type(state)((k, v) for k, v in state.items() if k not in frozen)
            if meta is not None:
                state._metadata = meta  # type: ignore[attr-defined]
        if self.global_rank == 0:
            os.makedirs(save_dir, exist_ok=True)
            path = Path(save_dir) / save_filename
            tmp = path.with_name(temp_name(path.name))  # the checkpoints' temp names: stale ones are known
            try:
                with naming_write_errors(path), open(tmp, "wb") as f:
                    _torchsave.save(state, f)
                fsync_path(tmp)
                os.replace(tmp, path)
            finally:
                tmp.unlink(missing_ok=True)
        else:
            _torchsave.save(state, None)  # this rank's part of each gather
        if dist.is_initialized() and self._world() > 1:
            dist.barrier()  # the file is complete when any rank returns
        return True

    def save_fp16_model(self, save_dir: Any, save_filename: str = "pytorch_model.bin") -> bool:
        """DeepSpeed's old name for `save_16bit_model`."""
        return self.save_16bit_model(save_dir, save_filename)

    def get_global_grad_norm(self) -> torch.Tensor | float | None:
        """The gradients' global L2 norm at the last optimizer step, taken at every step as DeepSpeed's
        (clipping or not), in DeepSpeed's types: a 0-d float32 tensor (scripts call ``.item()`` on it), the
        float ``inf`` where it was not finite and that step was skipped, ``None`` before the first step.
        ``engine.last_grad_norm`` has it as a float."""
        norm = self.last_grad_norm
        if norm is None:
            return None
        return torch.tensor(norm, dtype=torch.float32) if math.isfinite(norm) else math.inf

    def set_gradient_accumulation_boundary(self, is_boundary: bool | None) -> None:
        """Whether the backward to come ends the accumulation window, whatever ``gradient_accumulation_steps``
        counts (DeepSpeed's override, kept until set again): its gradients are summed with those of the
        backwards since the last optimizer step, and ``step()`` applies the optimizer only after a
        boundary (before one it ends a micro-batch). A ``gradient_accumulation_steps`` above 1 still
        divides each loss by it. ``None`` goes back to counting micro-batches."""
        if not self.managed_gradient_accumulation():
            raise UnmanagedAccumulationError(
                "set_gradient_accumulation_boundary() is not supported with managed_gradient_accumulation: "
                "false: every engine.step() ends the accumulation window there (drop the call, or set "
                "managed_gradient_accumulation to true)"
            )
        self._boundary = None if is_boundary is None else bool(is_boundary)
        # The early step sums the window's gradients up to the backward this says ends it.
        self.window_ends = None if is_boundary is None else self.is_gradient_accumulation_boundary

    def is_gradient_accumulation_boundary(self) -> bool:
        if self._boundary is not None:
            return self._boundary
        window = self.micro_steps - self._window_from + 1  # micro-batches in it with the next one
        return not self.managed_gradient_accumulation() or window >= self.gradient_accumulation_steps()

    def managed_gradient_accumulation(self) -> bool:
        """Whether the engine counts micro-batches to the accumulation boundary (the config's
        ``managed_gradient_accumulation``; false: every ``step()`` is one)."""
        return self.config.batch.managed_gradient_accumulation

    @contextlib.contextmanager
    def coalesce_grad_reduction(self) -> Iterator[None]:
        """DeepSpeed's block of several ``backward`` calls before one ``step()``, which DeepSpeed uses to
        reduce their gradients once at its exit instead of at each backward. zswap reduces each param's
        gradient into its partition as backward finishes with it (the partitions sum the backwards, as
        without the block), so there is no reduction to put off: the block keeps DeepSpeed's rules —
        ``step()`` inside it, nesting it, or ``managed_gradient_accumulation: false`` raise a
        `CoalesceError` — and the results are those of the same backwards without it. The boundary is
        what ``gradient_accumulation_steps`` or ``set_gradient_accumulation_boundary`` say, as in
        DeepSpeed."""
        self._check_open()
        if not self.managed_gradient_accumulation():
            raise CoalesceError(
                "coalesce_grad_reduction is not supported with managed_gradient_accumulation: false: "
                "engine.step() already ends the accumulation window there (drop the block)"
            )
        if self._coalescing:
            raise CoalesceError("coalesce_grad_reduction cannot be nested")
        self._coalescing = True
        try:
            yield
        finally:
            self._coalescing = False

    def step(self, lr_kwargs: dict[str, Any] | None = None) -> None:
        """`zswap.Engine.step`; ``lr_kwargs``: DeepSpeed's keywords for the schedule's ``step`` (a
        ``last_batch_iteration``, a Megatron-style ``increment``…), passed where the schedule steps — after
        an applied optimizer step, not a skipped one nor a micro-step between boundaries."""
        if self._coalescing:
            raise CoalesceError(
                "engine.step() inside coalesce_grad_reduction(): the block holds one step's backwards; call "
                "step() after it"
            )
        self._micro_open = False  # a step between boundaries ends the micro-batch itself
        skipped, boundary = self.skipped_steps, self.is_gradient_accumulation_boundary()
        self._step_applied = False  # as DeepSpeed's: a micro-step between boundaries applies nothing
        schedule = self.lr_scheduler
        if lr_kwargs and schedule is not None:
            self.lr_scheduler = _StepsWith(schedule, dict(lr_kwargs))  # for this step's schedule step only
        try:
            super().step()
        finally:
            self.lr_scheduler = schedule
        if boundary:
            self._window_from = self.micro_steps
            self._step_applied = self.skipped_steps == skipped
            if isinstance(self.optimizer, OffloadedAdamW):
                self.optimizer.overflow = not self._step_applied
            batch = self.train_batch_size() or 0
            if not self.managed_gradient_accumulation():
                batch = batch // self.gradient_accumulation_steps() * self._backwards
            self.global_samples += batch
            self._backwards = 0

    def get_mom(self) -> list[Any]:
        """Each param group's Adam ``betas`` (DeepSpeed's momentum query; ``[]`` without an optimizer)."""
        return [] if self.optimizer is None else [g.get("betas", 0.0) for g in self.optimizer.param_groups]

    def was_step_applied(self) -> bool:
        """Whether the last ``step()`` applied an optimizer step (changed the params): false before the
        first, after a micro-step between accumulation boundaries, and after a step skipped for gradients
        that were not finite (an fp16 overflow, a NaN)."""
        return getattr(self, "_step_applied", False)

    def fp16_enabled(self) -> bool:
        return self.config.dtype == "fp16"

    def loss_scale(self) -> float:  # type: ignore[override]
        """DeepSpeed's ``engine.loss_scale()``: the config's static ``fp16.loss_scale`` (0: dynamic). The
        scale in use is ``engine.optimizer.cur_scale``, as in DeepSpeed (`zswap.Engine.loss_scale`, a
        property there, is this engine's ``loss_scaler.loss_scale``)."""
        return float(self.config.fp16.loss_scale)

    def bfloat16_enabled(self) -> bool:
        return self.config.dtype == "bf16"

    def zero_optimization(self) -> bool:
        return True  # zswap always partitions params, gradients and optimizer states

    def zero_optimization_stage(self) -> int:
        return 3

    @property
    def global_rank(self) -> int:
        return dist.get_rank() if dist.is_initialized() else 0

    @property
    def world_size(self) -> int:
        """Ranks the params are partitioned over (DeepSpeed's data-parallel world; no other parallelism)."""
        return self._world()

    dp_world_size = world_size

    @property
    def local_rank(self) -> int:
        return int(os.environ.get("LOCAL_RANK", 0))

    def destroy(self) -> None:
        """DeepSpeed's name for `close`."""
        self.close()

    def no_sync(self) -> Any:
        raise NoSyncError(
            "engine.no_sync(): zswap partitions every gradient across the ranks (ZeRO stage 3), so there is "
            "no all-reduce to put off; DeepSpeed's no_sync context manager is incompatible with gradient "
            "partitioning (ZeRO stages 2 and 3) too. Accumulate with gradient_accumulation_steps (or run "
            "backward several times before engine.step())"
        )

    def _world(self) -> int:
        from ..step import stepping

        return stepping.world_size(self._items)


__all__ = ["CoalesceError", "DeepSpeedEngine", "NoSyncError", "UnmanagedAccumulationError"]
