"""The validated, frozen config models: one per section zswap reads, and `ZswapConfig` holding them.

Every model is frozen, rejects unknown fields, and takes ``None`` or ``"auto"`` for any field to mean its
default; for the fields typed ``X | None`` that default is ``None``, meaning "zswap picks" (from the model
and the pinned-memory budget, or, for an optimizer's ``lr``, from a keyword argument where it is used).
Build them with `zswap.load_config` and derive variants with ``.replace(...)``: both raise `ConfigError`
naming the key. (Calling a model class directly works too, but reports a bad value as pydantic's
``ValidationError``, which is also a ``ValueError``.)

Sizes are bytes where the field says so; DeepSpeed's buffer and bucket sizes count elements, and keep that
meaning here.
"""

from __future__ import annotations

from collections.abc import Iterator, Mapping
from pathlib import Path
from typing import TYPE_CHECKING, Annotated, Any, ClassVar, Literal, TypeVar

from pydantic import BaseModel, ConfigDict, Field, ValidationError, field_validator, model_validator
from pydantic_core import PydanticCustomError

from ..errors import ConfigError
from . import _values as v

if TYPE_CHECKING:
    import torch

CONFLICT = "zswap_conflict"
"""pydantic error type of a check across fields; its message names the keys itself."""

Device = Literal["none", "cpu", "nvme"]
DType = Literal["fp32", "bf16", "fp16"]

_M = TypeVar("_M", bound="_Model")


class _Model(BaseModel):
    model_config = ConfigDict(frozen=True, extra="forbid", strict=True, use_attribute_docstrings=True)

    _auto_refused: ClassVar[frozenset[str]] = frozenset()
    """Fields for which "auto" is an error: choices only the user can make (an offload device)."""

    @model_validator(mode="before")
    @classmethod
    def _defaults_for_auto_and_null(cls, data: Any) -> Any:
        # DeepSpeed configs write null for "not set" and Hugging Face's write "auto" for "choose for me";
        # both select the field's default. A new dict: the caller's mapping is never modified.
        if not isinstance(data, Mapping):
            return data
        return {
            key: value
            for key, value in data.items()
            if not (value is None or (v.is_auto(value) and key not in cls._auto_refused))
        }

    def __repr_args__(self) -> Iterator[tuple[str, Any]]:
        # Only what differs from the defaults: a config read from a 200-line file prints in one line.
        for name, info in type(self).model_fields.items():
            value = getattr(self, name)
            if info.is_required() or value != info.get_default(call_default_factory=True):
                yield name, value

    def replace(self: _M, **changes: Any) -> _M:
        """A validated copy with ``changes`` applied; `ConfigError` naming the field for a bad value.

        (`model_copy` would skip validation.)
        """
        fields = {name: getattr(self, name) for name in type(self).model_fields}
        try:
            return type(self).model_validate({**fields, **changes})
        except ValidationError as exc:
            raise ConfigError(describe(exc)) from None

    def _json_fields(self) -> dict[str, Any]:
        # None is written "auto", except for a path, where "auto" would read as a directory name.
        return {
            name: None if name == "nvme_path" and value is None else _to_json(value)
            for name, value in ((name, getattr(self, name)) for name in type(self).model_fields)
        }


class OffloadParamConfig(_Model):
    """Where parameters live between uses (``zero_optimization.offload_param``)."""

    _auto_refused: ClassVar[frozenset[str]] = frozenset({"device"})

    device: Annotated[Device, v.one_of("none", "cpu", "nvme")] = "none"
    """Offload tier: ``"none"`` keeps params where they are, ``"cpu"`` in host memory, ``"nvme"`` on disk."""
    nvme_path: v.Paths | None = None
    """Swap directory, or several to stripe across drives. Checked to exist and be writable by `Init`."""
    pin_memory: v.StrictBool = False
    """Stage transfers through page-locked host memory (default false)."""
    buffer_count: v.PositiveInt | None = None
    """Number of staging buffers; ``None`` = derived from the model and the pinned-memory budget."""
    buffer_size: v.PositiveInt | None = None
    """Elements per staging buffer (DeepSpeed's unit); ``None`` = derived like ``buffer_count``."""
    max_in_cpu: v.NonNegativeInt = 0
    """Elements kept in host memory besides persistent small params when offloading to NVMe (default 0)."""


class OffloadOptimizerConfig(_Model):
    """Where optimizer states live (``zero_optimization.offload_optimizer``)."""

    _auto_refused: ClassVar[frozenset[str]] = frozenset({"device"})

    device: Annotated[Device, v.one_of("none", "cpu", "nvme")] = "none"
    """Offload tier for optimizer states, as for params."""
    nvme_path: v.Paths | None = None
    """Swap directory, or several to stripe across drives."""
    pin_memory: v.StrictBool = False
    """Stage transfers through page-locked host memory (default false)."""
    buffer_count: v.PositiveInt | None = None
    """Number of staging buffers; ``None`` = derived."""
    pipeline_read: v.StrictBool = True
    """Read the next sub-group's states while the current one is updated (default true; DeepSpeed: false)."""
    pipeline_write: v.StrictBool = True
    """Write the previous sub-group's states while the current one is updated (default true)."""


class LeafModuleConfig(_Model):
    """``zero_optimization.leaf_module``: modules whose params are gathered together when they run, whatever
    runs inside them (`zswap.fetch.leaves`): a mixture-of-experts block over several ranks needs it."""

    classes: v.Names | None = None
    """Classes, by name (``MixtralSparseMoeBlock``) or fully qualified; ``None``: DeepSpeed's default list
    (the Mixtral, Qwen2-MoE and Qwen3-MoE sparse blocks), applied where the params span several ranks."""
    names: v.Names = ()
    """Module names as ``model.named_modules()`` gives them."""
    name_suffixes: v.Names = ()
    """Every module whose name ends with one of these."""


class ZeroConfig(_Model):
    """The stage-3 scheduling knobs of ``zero_optimization``. Counts are elements; ``None`` = zswap picks."""

    stage3_prefetch_bucket_size: v.NonNegativeInt | None = None
    """Elements fetched ahead of use; 0 disables prefetch."""
    stage3_param_persistence_threshold: v.NonNegativeInt | None = None
    """Params with fewer elements stay gathered between uses at run time."""
    stage3_max_live_parameters: v.NonNegativeInt | None = None
    """Most elements gathered at once before older params are released."""
    stage3_max_reuse_distance: v.NonNegativeInt | None = None
    """A param reused within this many elements of fetches is not released in between."""
    sub_group_size: v.PositiveInt | None = None
    """Elements per optimizer sub-group (the unit the optimizer swaps and steps)."""
    leaf_module: LeafModuleConfig = Field(default_factory=LeafModuleConfig)
    """Leaf modules (DeepSpeed's keys ``classes``, ``names``, ``name_suffixes``)."""


class AioConfig(_Model):
    """The I/O engine (``aio``). DeepSpeed's keys plus zswap's ``backend``, ``direct``, ``checksum`` and
    ``pinned_memory_budget``.

    ``single_submit`` and ``overlap_events`` are libaio tuning knobs: accepted and kept, but io_uring batches
    submissions and completions by itself, so they have no effect.
    """

    block_size: v.BlockSize | None = None
    """Bytes per I/O request, a power of two from 4 KiB to 64 MiB; ``None`` = chosen for the drive."""
    queue_depth: Annotated[int, v.int_between(1, 4096)] | None = None
    """Requests in flight per worker thread (1..4096); ``None`` = chosen by the engine."""
    thread_count: Annotated[int, v.int_between(1, 256)] | None = None
    """I/O worker threads (1..256), also spelled ``intra_op_parallelism`` / ``num_threads``."""
    single_submit: v.StrictBool = False
    """Accepted for DeepSpeed compatibility; no effect with io_uring."""
    overlap_events: v.StrictBool = True
    """Accepted for DeepSpeed compatibility; no effect with io_uring."""
    backend: Annotated[Literal["auto", "io_uring", "psync"], v.one_of("auto", "io_uring", "psync")] = "auto"
    """``"io_uring"``, ``"psync"`` (thread pool of pread/pwrite), or ``"auto"``: io_uring where the kernel
    allows it, else psync with a `ZswapWarning`."""
    direct: v.AutoOrBool = "auto"
    """O_DIRECT I/O: true, false, or ``"auto"`` (direct where the filesystem supports it)."""
    checksum: Annotated[Literal["off", "crc32c"], v.one_of("off", "crc32c")] = "off"
    """Per-block checksum verified on every read: ``"off"`` or ``"crc32c"``."""
    pinned_memory_budget: v.ByteSize | None = None
    """Bytes of page-locked staging memory the engine may use, e.g. ``"4GiB"``; ``None`` = zswap picks."""
    use_gds: Annotated[bool, v.only_false("GPUDirect Storage is not supported by zswap")] = False
    """DeepSpeed's GPUDirect Storage switch; only false is accepted."""

    def engine_kwargs(self) -> dict[str, Any]:
        """Keyword arguments for `zswap.SwapEngine`; the settings left to zswap (``None``) are omitted."""
        kwargs = {
            "block_size": self.block_size,
            "queue_depth": self.queue_depth,
            "threads": self.thread_count,
            "backend": self.backend,
            "direct": self.direct,
            "checksum": self.checksum,
            "pinned_memory_budget": self.pinned_memory_budget,
        }
        return {name: value for name, value in kwargs.items() if value is not None}


class OptimizerConfig(_Model):
    """The optimizer (``optimizer``: ``type`` plus ``params``). Only Adam and AdamW are offered.

    As in DeepSpeed, ``"Adam"`` decouples weight decay (AdamW) unless ``params.adam_w_mode`` is false;
    ``decoupled_weight_decay`` records the outcome.
    """

    _auto_refused: ClassVar[frozenset[str]] = frozenset({"type"})

    type: Annotated[Literal["Adam", "AdamW"], v.one_of("Adam", "AdamW")]
    """``"Adam"`` or ``"AdamW"``, any case in the file."""
    lr: v.NonNegativeFloat | None = None
    """Learning rate; ``None`` ("auto") must be supplied by a keyword where the optimizer is built."""
    betas: v.Betas = (0.9, 0.999)
    """Decay rates of the first and second moment estimates; "auto" = the default."""
    eps: v.PositiveFloat = 1e-8
    """Term added to the denominator for stability; "auto" = the default."""
    weight_decay: v.NonNegativeFloat | None = None
    """Weight decay; ``None`` ("auto") = 0.0 unless a keyword supplies it."""
    decoupled_weight_decay: v.StrictBool = True
    """Decay applied to the weights (AdamW) rather than added to the gradient; DeepSpeed's ``adam_w_mode``."""

    @model_validator(mode="after")
    def _adamw_is_decoupled(self) -> OptimizerConfig:
        if self.type == "AdamW" and not self.decoupled_weight_decay:
            raise PydanticCustomError(
                CONFLICT,
                "optimizer type 'AdamW' always decouples weight decay; "
                "decoupled_weight_decay (adam_w_mode) cannot be false",
            )
        return self


class FP16Config(_Model):
    """Loss scaling for fp16 training (``fp16``, besides ``enabled``, which sets `ZswapConfig.dtype`)."""

    loss_scale: v.NonNegativeFloat = 0.0
    """Static loss scale; 0 (the default) selects dynamic loss scaling."""
    initial_scale_power: Annotated[int, v.int_between(0, 64)] = 16
    """Dynamic scaling starts at 2**initial_scale_power (default 16)."""
    loss_scale_window: v.Integer = 1000
    """Steps without overflow before the scale is raised (default 1000); positive where the scale is dynamic
    (`dynamic_problem`)."""
    hysteresis: v.PositiveInt = 2
    """Overflows tolerated before the scale is lowered (default 2)."""
    min_loss_scale: v.Number = 1.0
    """Floor of the dynamic loss scale (default 1); positive where the scale is dynamic."""
    consecutive_hysteresis: v.StrictBool = False
    """Refill the hysteresis after every step without overflow, not only when the scale is raised."""
    auto_cast: v.StrictBool = False
    """Cast the floating-point inputs of ``engine(...)`` to fp16 before calling the module (default false)."""
    fp16_master_weights_and_grads: Annotated[
        bool, v.only_false("zswap always keeps fp32 master weights for fp16 params")
    ] = False
    """DeepSpeed's fp16 master weights switch; only false is accepted."""

    def dynamic(self) -> bool:
        """Whether the loss scale is dynamic (``loss_scale`` 0) rather than static."""
        return self.loss_scale == 0

    def dynamic_problem(self) -> str | None:
        """Why this section cannot drive a dynamic loss scale, else ``None``. Only a dynamic scale reads the
        window and the floor, so a static scale or fp16 off leaves any value there alone, as DeepSpeed's
        config does (0.19.8: old configs carry zeros there)."""
        if self.loss_scale_window < 1:
            return f"fp16.loss_scale_window must be a positive integer, got {self.loss_scale_window}"
        if not self.min_loss_scale > 0:
            return f"fp16.min_loss_scale must be a positive number, got {self.min_loss_scale:g}"
        return None


class BF16Config(_Model):
    """``bf16`` besides ``enabled`` (which sets `ZswapConfig.dtype`)."""

    check_grad_overflow: v.StrictBool = False
    """Skip an optimizer step whose gradients are not finite (counted in ``engine.skipped_steps``) under
    `zswap.initialize`, as DeepSpeed's stage 1 / 2 bf16 optimizer does when asked; also spelled
    ``check_overflow``. Default false: PyTorch's way. `zswap.deepspeed.initialize` always checks, in every
    precision, as DeepSpeed 0.19.8's stage 3 does (it skips a step whose gradient norm is not finite)."""


class AutocastConfig(_Model):
    """``torch_autocast``: the engine's forward runs under `torch.autocast`, as DeepSpeed's does."""

    enabled: v.StrictBool = False
    dtype: v.DTypeName | None = None
    """The autocast dtype; ``None``: torch's default for the compute device (bf16 on CPU, fp16 on CUDA)."""
    lower_precision_safe_modules: v.Names | None = None
    """Module classes, fully qualified, whose params DeepSpeed gathers and reduces in ``dtype``. zswap
    gathers every param in its own dtype (autocast casts it in the forward: the same values) and reduces
    gradients in their params' dtype; the names are checked to import."""

    @field_validator("lower_precision_safe_modules")
    @classmethod
    def _modules_import(cls, names: tuple[str, ...] | None) -> tuple[str, ...] | None:
        import importlib

        for name in names or ():
            package, _, attr = name.rpartition(".")
            try:
                found = getattr(importlib.import_module(package), attr) if package else None
            except (ImportError, AttributeError, ValueError):
                found = None
            if not isinstance(found, type):
                raise v.invalid(f"must name classes by their full import path ({name!r} imports none)")
        return names

    def torch_dtype(self) -> torch.dtype | None:
        """``dtype`` as a `torch.dtype`; ``None``: torch's default for the device."""
        return _as_torch(self.dtype)


class DataTypesConfig(_Model):
    """DeepSpeed's ``data_types``: the dtypes beside the params' (which the bf16 / fp16 sections fix)."""

    grad_accum_dtype: v.DTypeName | None = None
    """The dtype gradients are summed in over micro-batches. ``fp32``: bf16 / fp16 gradients are summed in
    float32 on the CPU too (from a compute device they always are); on the CPU the params' own dtype
    (zswap's default there); any other is refused by `zswap.initialize` where it accumulates."""
    param_dtype: v.DTypeName | None = None
    """The params' dtype: must be the one the bf16 / fp16 sections fix (fp32 with neither on)."""
    buffer_dtype: v.DTypeName | None = None
    """`zswap.initialize` casts every floating buffer to this (but those kept in float32); ``None``: the
    buffers keep their dtype (an ``Init`` with a dtype gives it to those a build with it as the default
    dtype makes in it: `zswap.build._lineage`)."""
    keep_in_fp32_modules: v.Names | None = None
    """Buffer name patterns kept in float32 under bf16 / fp16 (``*``: any characters, matched anywhere in
    the name; ``[]``: none); ``None`` (``"auto"``): a Hugging Face model's ``_keep_in_fp32_modules_strict``
    (and ``_keep_in_fp32_modules`` under fp16)."""

    def torch_dtype(self, name: DType | None) -> torch.dtype | None:
        """One of this section's dtype names as a `torch.dtype`."""
        return _as_torch(name)


class BatchConfig(_Model):
    """DeepSpeed's top-level batch keys. ``None`` = not given (derived from the others where possible)."""

    train_batch_size: v.PositiveInt | None = None
    """Samples per optimizer step over all ranks: micro batch × accumulation steps × world size."""
    train_micro_batch_size_per_gpu: v.PositiveInt | None = None
    """Samples per forward/backward on one rank (the batch size of `zswap.deepspeed.initialize`'s loader)."""
    gradient_accumulation_steps: v.PositiveInt | None = None
    """Micro-batches whose gradients are summed before each optimizer step (default 1)."""
    dataloader_drop_last: v.StrictBool = False
    """`zswap.deepspeed.initialize`'s loader drops a last batch smaller than the micro batch."""
    managed_gradient_accumulation: v.StrictBool = True
    """DeepSpeed's: false, the caller owns the boundary: every ``step()`` applies the optimizer to what the
    backwards since the last one summed (each loss still divided by ``gradient_accumulation_steps``)."""

    def resolve(self, world_size: int) -> tuple[int | None, int | None, int]:
        """``(train_batch_size, micro_batch, gradient_accumulation_steps)`` at ``world_size`` ranks, the
        missing ones derived as DeepSpeed does; `ConfigError` naming the three keys when they disagree."""
        train, micro, gas = (
            self.train_batch_size,
            self.train_micro_batch_size_per_gpu,
            self.gradient_accumulation_steps,
        )
        if train is not None and micro is not None and gas is None:
            gas = max(1, train // (micro * world_size))
        elif train is not None and gas is not None and micro is None:
            micro = max(1, train // (gas * world_size))
        elif train is not None and micro is None and gas is None:
            gas, micro = 1, max(1, train // world_size)
        gas = 1 if gas is None else gas
        if train is None and micro is not None:
            train = micro * gas * world_size
        if train is not None and micro is not None and train != micro * gas * world_size:
            if self.train_micro_batch_size_per_gpu is None or self.gradient_accumulation_steps is None:
                m = self.train_micro_batch_size_per_gpu is not None  # given: the steps are the missing key
                name, n = (
                    ("train_micro_batch_size_per_gpu", micro) if m else ("gradient_accumulation_steps", gas)
                )
                msg = f"is not a multiple of {name} ({n}) × world size ({world_size}) = {n * world_size}"
                raise ConfigError(
                    f"train_batch_size ({train}) {msg}, from which the batch keys not given are derived"
                )
            product = f"({gas}) × world size ({world_size}) = {micro * gas * world_size}"
            raise ConfigError(
                f"train_batch_size ({train}) must equal train_micro_batch_size_per_gpu ({micro}) × "
                f'gradient_accumulation_steps {product}; fix one of the three (or set it to "auto")'
            )
        return train, micro, gas


class SchedulerConfig(_Model):
    """DeepSpeed's ``scheduler`` section: ``type`` (one of its five schedules) and its ``params``.

    ``params`` holds the values given, checked against the schedule's parameter names; ``"auto"`` or null
    leave a parameter at its default (see `zswap.schedules`)."""

    _auto_refused: ClassVar[frozenset[str]] = frozenset({"type"})

    type: Annotated[
        Literal["WarmupLR", "WarmupDecayLR", "WarmupCosineLR", "OneCycle", "LRRangeTest"],
        v.one_of("WarmupLR", "WarmupDecayLR", "WarmupCosineLR", "OneCycle", "LRRangeTest"),
    ]
    """``"WarmupLR"``, ``"WarmupDecayLR"``, ``"WarmupCosineLR"``, ``"OneCycle"`` or ``"LRRangeTest"``."""
    params: tuple[tuple[str, Any], ...] = ()
    """Parameter name → value as given (DeepSpeed's names). "auto" or null leave a parameter at DeepSpeed's
    default, except ``warmup_max_lr: "auto"``, which is the optimizer's lr (as Hugging Face fills it in)."""

    @field_validator("params", mode="before")
    @classmethod
    def _pairs(cls, value: Any) -> Any:
        # Kept as (name, value) pairs so that the config stays hashable; `param_values` gives a dict.
        return tuple(value.items()) if isinstance(value, Mapping) else value

    def param_values(self) -> dict[str, Any]:
        """The parameters given, name → value (a list as a tuple)."""
        return dict(self.params)

    @model_validator(mode="after")
    def _known_params(self) -> SchedulerConfig:
        from . import _keys

        spec = _keys.SCHEDULES[self.type]
        checked: dict[str, Any] = {}
        for name, value in self.params:
            if name not in spec:
                close = _keys.Section("scheduler.params", tuple(spec)).closest(name)
                hint = f"; did you mean {close!r}?" if close else f"; {self.type} takes {', '.join(spec)}"
                raise PydanticCustomError(CONFLICT, f"unknown key {name!r} in scheduler.params{hint}")
            if value is None or (v.is_auto(value) and name != "warmup_max_lr"):
                continue
            if v.is_auto(value):  # Hugging Face's "the optimizer's lr"
                checked[name] = "auto"
                continue
            try:
                checked[name] = v.schedule_value(name, value)
            except PydanticCustomError as exc:
                raise PydanticCustomError(
                    CONFLICT, f"scheduler.params.{name} {exc.message()}, got {v.show(value)}"
                ) from None
        object.__setattr__(self, "params", tuple(checked.items()))
        return self


_TORCH_DTYPES = {"fp32": "float32", "bf16": "bfloat16", "fp16": "float16"}


class ZswapConfig(_Model):
    """Everything zswap reads from a DeepSpeed-style config. Build it with `zswap.load_config`.

    ``dtype`` is the dtype params are kept in: ``"bf16"`` when ``bf16.enabled`` is true, ``"fp16"`` when
    ``fp16.enabled`` is true, ``"fp32"`` when they are false, and ``None`` (keep the dtype the params were
    built with) when neither says, or either says ``"auto"``.
    """

    offload_param: OffloadParamConfig = Field(default_factory=OffloadParamConfig)
    offload_optimizer: OffloadOptimizerConfig = Field(default_factory=OffloadOptimizerConfig)
    zero: ZeroConfig = Field(default_factory=ZeroConfig)
    aio: AioConfig = Field(default_factory=AioConfig)
    optimizer: OptimizerConfig | None = None
    """``None`` when the config has no ``optimizer`` section."""
    dtype: Annotated[DType, v.one_of("fp32", "bf16", "fp16")] | None = None
    """Param dtype ``"fp32"``, ``"bf16"`` or ``"fp16"``; ``None`` = keep the dtype params were built with."""
    fp16: FP16Config = Field(default_factory=FP16Config)
    bf16: BF16Config = Field(default_factory=BF16Config)
    gradient_clipping: v.NonNegativeFloat | None = None
    """DeepSpeed's top-level ``gradient_clipping``: clip the gradients' global L2 norm to this before each
    step; 0 = no clipping. ``None``: no clipping under `zswap.initialize`, 1.0 under `zswap.deepspeed`'s
    (DeepSpeed's default since 0.19.3); ``"auto"`` too, flagged (Hugging Face's: `own_clipping`)."""
    gradient_clipping_auto: v.StrictBool = False
    """``gradient_clipping`` was ``"auto"``."""
    batch: BatchConfig = Field(default_factory=BatchConfig)
    """The top-level batch keys (gradient accumulation)."""
    scheduler: SchedulerConfig | None = None
    """``None`` when the config has no ``scheduler`` section."""
    torch_autocast: AutocastConfig = Field(default_factory=AutocastConfig)
    data_types: DataTypesConfig = Field(default_factory=DataTypesConfig)
    communication_data_type: v.DTypeName | None = None
    """DeepSpeed's dtype for reducing gradients over ranks: each rank's gradient is rounded to it, summed and
    divided in it, and the average rounded back to the params' dtype (kept in float32 where
    ``grad_accum_dtype`` is float32 too); ``None``: the params' own."""

    @model_validator(mode="after")
    def _dynamic_scale_readable(self) -> ZswapConfig:
        problem = self.fp16.dynamic_problem() if self.dtype == "fp16" and self.fp16.dynamic() else None
        if problem:
            raise PydanticCustomError(CONFLICT, problem)
        return self

    def torch_dtype(self) -> torch.dtype | None:
        """``dtype`` as a `torch.dtype`, or ``None`` to keep the dtype the params were built with."""
        return _as_torch(self.dtype)

    def own_clipping(self) -> float | None:
        """`zswap.initialize`'s clip norm where no ``max_grad_norm=`` is given: ``gradient_clipping`` (0 or
        absent: none); ``"auto"`` (the Hugging Face Trainer's ``max_grad_norm``) is a `ConfigError`."""
        if self.gradient_clipping_auto:
            raise ConfigError(
                'gradient_clipping is "auto", which the Hugging Face Trainer fills in from its '
                "max_grad_norm; in your own loop write a number (1.0 clips as the Trainer does by default, 0 "
                "does not clip) or pass initialize(..., max_grad_norm=...)"
            )
        return self.gradient_clipping or None

    def to_dict(self) -> dict[str, Any]:
        """This config in the trimmed layout (zswap's sections at top level), as plain JSON values.

        ``None`` is written as ``"auto"`` (``null`` for an unset ``nvme_path``), so that
        ``load_config(cfg.to_dict()) == cfg``.
        """
        out: dict[str, Any] = {
            "offload_param": self.offload_param._json_fields(),
            "offload_optimizer": self.offload_optimizer._json_fields(),
            **self.zero._json_fields(),
            "aio": self.aio._json_fields(),
        }
        if self.optimizer is not None:
            params = self.optimizer._json_fields()
            out["optimizer"] = {"type": params.pop("type"), "params": params}
            params["adam_w_mode"] = params.pop("decoupled_weight_decay")
        enabled: dict[DType | None, tuple[bool | str, bool | str]] = {
            None: ("auto", "auto"),
            "fp32": (False, False),
            "bf16": (True, False),
            "fp16": (False, True),
        }
        bf16, fp16 = enabled[self.dtype]
        out["bf16"] = {"enabled": bf16, **self.bf16._json_fields()}
        out["fp16"] = {"enabled": fp16, **self.fp16._json_fields()}
        if self.gradient_clipping is not None or self.gradient_clipping_auto:  # absent stays absent
            out["gradient_clipping"] = _to_json(self.gradient_clipping)
        out.update(self.batch._json_fields())
        out["torch_autocast"] = self.torch_autocast._json_fields()
        out["data_types"] = self.data_types._json_fields()
        out["communication_data_type"] = _to_json(self.communication_data_type)
        if self.scheduler is not None:
            out["scheduler"] = {
                "type": self.scheduler.type,
                "params": _to_json(self.scheduler.param_values()),
            }
        return out


def _as_torch(name: DType | None) -> torch.dtype | None:
    if name is None:
        return None
    import torch  # zswap.config itself must stay importable without paying for torch

    dtype: torch.dtype = getattr(torch, _TORCH_DTYPES[name])
    return dtype


def _to_json(value: Any) -> Any:
    if value is None:
        return "auto"
    if isinstance(value, _Model):
        return value._json_fields()
    if isinstance(value, tuple):
        return [_to_json(item) for item in value]
    if isinstance(value, dict):
        return {key: _to_json(item) for key, item in value.items()}
    if isinstance(value, Path):
        return str(value)
    return value


def describe(exc: ValidationError, origins: Mapping[tuple[str, ...], str] | None = None) -> str:
    """One message for all of ``exc``'s errors, each naming the key as the user wrote it.

    ``origins`` maps a model location (``("aio", "thread_count")``) to the dotted key it came from
    (``"aio.num_threads"``); without it the location itself is printed.
    """
    messages = []
    for error in exc.errors(include_url=False):
        loc = tuple(str(part) for part in error["loc"])
        key = _dotted(loc, origins or {})
        kind, value = error["type"], error.get("input")
        if kind == v.INVALID:
            messages.append(f"{key} {error['msg']}, got {v.show(value)}")
        elif kind == CONFLICT:
            messages.append(error["msg"])
        elif kind == "missing":
            messages.append(f"{key} is required")
        elif kind == "extra_forbidden":
            messages.append(f"unknown key {loc[-1]!r} in {_dotted(loc[:-1], origins or {})}")
        elif kind in {"model_type", "model_attributes_type", "dict_type"}:
            messages.append(f"{key} must be an object, got {v.show(value)}")
        else:  # a pydantic check of its own; kept readable, never raised as ValidationError
            messages.append(f"{key}: {error['msg']}, got {v.show(value)}")
    return "; ".join(messages)


def _dotted(loc: tuple[str, ...], origins: Mapping[tuple[str, ...], str]) -> str:
    for end in range(len(loc), 0, -1):
        if loc[:end] in origins:
            return ".".join((origins[loc[:end]], *loc[end:]))
    return ".".join(loc) or "the config"


__all__ = [
    "AioConfig",
    "BF16Config",
    "BatchConfig",
    "FP16Config",
    "LeafModuleConfig",
    "OffloadOptimizerConfig",
    "OffloadParamConfig",
    "OptimizerConfig",
    "SchedulerConfig",
    "ZeroConfig",
    "ZswapConfig",
]
