"""The keys zswap reads, their aliases, and the DeepSpeed keys it accepts and ignores, section by section.

A key inside one of these sections that is in none of the sets is a typo or a feature zswap does not know,
and is reported with the closest known key: a silently ignored key is a bug. Keys outside these sections are
DeepSpeed's business and are never looked at.

DeepSpeed keys zswap does not read fall in three kinds, each decided by what DeepSpeed does with it:

- ``warned``: performance, logging or debugging knobs of DeepSpeed's own machinery, which change no result;
  accepted with any value DeepSpeed's schema takes (``deepspeed_types``), and each one present is named in
  one `zswap.ZswapWarning` ("ignored").
- ``defaults_only``: keys that change results in DeepSpeed (quantized communication, bf16 master weights…);
  accepted at DeepSpeed's default (or null / "auto"), any other value is a `ConfigError` saying why.
- ``ignored``: keys whose DeepSpeed meaning zswap already has, or that only apply to ZeRO stages other than
  3 (``stage``, ``elastic_checkpoint``, ``stage3_gather_16bit_weights_on_model_save``): accepted silently
  (a value DeepSpeed's schema refuses is a `ConfigError`, ``stage``'s in `zswap.config._layout`).

The ignored sets were taken from DeepSpeed's own config schema (``deepspeed/runtime/zero/config.py``,
``offload_config.py``, ``swap_tensor/constants.py``, ``runtime/constants.py``), old spellings included, so
that any config DeepSpeed accepts is accepted here too.
"""

from __future__ import annotations

import difflib
from collections.abc import Mapping
from dataclasses import dataclass, field


@dataclass(frozen=True)
class Section:
    """The keys of one config section."""

    path: str
    """Dotted location in the DeepSpeed layout, for messages (``zero_optimization.offload_param``)."""
    fields: tuple[str, ...]
    """Keys zswap reads, spelled as the model field they fill."""
    aliases: Mapping[str, tuple[str, ...]] = field(default_factory=dict)
    """Other spellings, each filling one or more fields (``pipeline`` sets both pipeline flags)."""
    ignored: frozenset[str] = frozenset()
    """DeepSpeed keys that are accepted and dropped."""
    subsections: frozenset[str] = frozenset()
    """Keys holding a nested section, read separately."""
    checked: frozenset[str] = frozenset()
    """Keys the loader validates itself and does not store (``amsgrad`` may only be false)."""
    warned: frozenset[str] = frozenset()
    """DeepSpeed knobs that change no result: accepted and named in a `ZswapWarning`."""
    defaults_only: Mapping[str, tuple[object, str]] = field(default_factory=dict)
    """DeepSpeed keys that change results: key → (the only value accepted, why no other is)."""
    warned_unless: Mapping[str, object] = field(default_factory=dict)
    """Fields kept in the model but without effect: named in the `ZswapWarning` when not this value."""
    deepspeed_types: Mapping[str, str] = field(default_factory=dict)
    """Ignored and warned keys → the type DeepSpeed's schema gives them (`zswap.config._values.DS_TYPES`):
    a value it would refuse is refused here too, though zswap does not read it."""

    def known(self) -> tuple[str, ...]:
        """Every key accepted here, for suggestions."""
        rest = sorted(self.subsections | self.checked | self.ignored | self.warned | set(self.defaults_only))
        return (*self.fields, *self.aliases, *rest)

    def closest(self, key: str) -> str | None:
        """The known key most like ``key``, if any is close enough to be a likely typo."""
        matches = difflib.get_close_matches(key, self.known(), n=1, cutoff=0.6)
        return matches[0] if matches else None


OFFLOAD_PARAM = Section(
    path="zero_optimization.offload_param",
    fields=("device", "nvme_path", "pin_memory", "buffer_count", "buffer_size", "max_in_cpu"),
)

OFFLOAD_OPTIMIZER = Section(
    path="zero_optimization.offload_optimizer",
    fields=("device", "nvme_path", "pin_memory", "buffer_count", "pipeline_read", "pipeline_write"),
    aliases={"pipeline": ("pipeline_read", "pipeline_write")},
    # fast_init: how DeepSpeed first fills its swap files; ratio: the share of states it offloads (the rest
    # stays on the GPU); super_offload, convert_grad_on_cpu, cpuadam_cores_perc: where and on how many
    # cores its CPU Adam runs. None changes an updated weight.
    warned=frozenset({"fast_init", "ratio", "super_offload", "convert_grad_on_cpu", "cpuadam_cores_perc"}),
    deepspeed_types={
        "fast_init": "bool",
        "super_offload": "bool",
        "ratio": "fraction",
        "cpuadam_cores_perc": "fraction",
    },
)

STAGE3_KNOBS = (
    "stage3_prefetch_bucket_size",
    "stage3_param_persistence_threshold",
    "stage3_max_live_parameters",
    "stage3_max_reuse_distance",
    "sub_group_size",
    "leaf_module",
)
"""The `zero_optimization` keys zswap reads; in the trimmed layout they may also stand at top level."""

CPU_OFFLOAD = {"cpu_offload": "offload_optimizer", "cpu_offload_param": "offload_param"}
"""DeepSpeed's deprecated switches: ``true`` means that section with ``device: "cpu"`` (``_layout``)."""

CPU_OFFLOAD_OLD = {"cpu_offload_params": "cpu_offload_param"}
"""Older spellings of the deprecated switches."""

_DS_BOOLS = (
    "elastic_checkpoint", "stage3_gather_16bit_weights_on_model_save",
    "gather_16bit_weights_on_model_save", "stage3_gather_fp16_weights_on_model_save",
    "ignore_unused_parameters", "legacy_stage1", "memory_efficient_linear",
    "cpu_offload_use_pin_memory", "contiguous_gradients", "overlap_comm", "reduce_scatter",
    "allgather_partitions", "use_multi_rank_bucket_allreduce", "round_robin_gradients",
    "stage3_use_all_reduce_for_fetch_params", "use_all_reduce_for_fetch_params",
    "stage3_allgather_sequential", "allgather_sequential", "pipeline_loading_checkpoint",
    "save_muon_momentum_buffer_in_memory", "parameter_alignment", "override_module_apply",
    "log_trace_cache_warnings",
)  # fmt: skip
"""The ignored and warned `zero_optimization` keys DeepSpeed's schema types as booleans."""

ZERO = Section(
    path="zero_optimization",
    fields=STAGE3_KNOBS,
    # DeepSpeed's schema accepts its field names next to the stage3_ spellings.
    aliases={
        "prefetch_bucket_size": ("stage3_prefetch_bucket_size",),
        "param_persistence_threshold": ("stage3_param_persistence_threshold",),
        "max_live_parameters": ("stage3_max_live_parameters",),
        "max_reuse_distance": ("stage3_max_reuse_distance",),
    },
    subsections=frozenset({"offload_param", "offload_optimizer"}),
    checked=frozenset({*CPU_OFFLOAD, *CPU_OFFLOAD_OLD}),
    ignored=frozenset(
        {
            # zswap is ZeRO stage 3 whatever the stage says: partitioning changes no result.
            "stage",
            # Only read by DeepSpeed's stages 1 and 2.
            "ignore_unused_parameters",
            "legacy_stage1",
            # What zswap always does: checkpoints load at any world size, zswap.save_weights consolidates,
            # gathered weights are never kept for backward (memory-efficient linear).
            "elastic_checkpoint",
            "stage3_gather_16bit_weights_on_model_save",
            "gather_16bit_weights_on_model_save",
            "stage3_gather_fp16_weights_on_model_save",
            "memory_efficient_linear",
            # DeepSpeed lists it as deprecated with no replacement and no effect.
            "cpu_offload_use_pin_memory",
        },
    ),
    # Their DeepSpeed default is what zswap does; the other value (an error on unused params in stage 2, a
    # plain F.linear) is not, and is named in the warning.
    warned_unless={"ignore_unused_parameters": True, "memory_efficient_linear": True},
    # DeepSpeed 0.19.8's DeepSpeedZeroConfig (the old spellings it no longer has stay unchecked).
    deepspeed_types={
        **dict.fromkeys(_DS_BOOLS, "bool"),
        "reduce_bucket_size": "int>0",
        "allgather_bucket_size": "int>=0",
        "zero_hpz_partition_size": "int>=0",
        "stage3_model_persistence_threshold": "int>=0",
        "model_persistence_threshold": "int>=0",
        "stage3_module_granularity_threshold": "int",
        "module_granularity_threshold": "int",
    },
    warned=frozenset(
        {
            # Communication bucketing, overlap and collectives.
            "contiguous_gradients",
            "overlap_comm",
            "reduce_scatter",
            "reduce_bucket_size",
            "allgather_partitions",
            "allgather_bucket_size",
            "use_multi_rank_bucket_allreduce",
            "round_robin_gradients",
            "zero_hpz_partition_size",
            "mics_shard_size",
            "mics_hierarchical_params_gather",
            "stage3_use_all_reduce_for_fetch_params",
            "use_all_reduce_for_fetch_params",
            "stage3_allgather_sequential",
            "allgather_sequential",
            # Fetch granularity and persistence of DeepSpeed's own scheduler.
            "stage3_model_persistence_threshold",
            "model_persistence_threshold",
            "stage3_module_granularity_threshold",
            "module_granularity_threshold",
            "stage3_partition_stream_chunk_size",
            "partition_stream_chunk_size",
            "pipeline_loading_checkpoint",
            "save_muon_momentum_buffer_in_memory",
            # Stage 1 / 2 flat-buffer padding (memory layout only).
            "parameter_alignment",
            # zswap always catches writes under Init (so the switch is moot).
            "override_module_apply",
            "log_trace_cache_warnings",
            # An old key of unknown meaning in DeepSpeed's history: said to be ignored rather than guessed.
            "offload_params",
        },
    ),
    defaults_only={
        "load_from_fp32_weights": (True, "zswap always restores the fp32 master weights from a checkpoint"),
        "zero_quantized_weights": (
            False,
            "zswap gathers full-precision weights (quantizing changes results)",
        ),
        "zero_quantized_nontrainable_weights": (
            False,
            "zswap gathers full-precision weights (quantizing changes results)",
        ),
        "zero_quantized_gradients": (
            False,
            "zswap reduces full-precision gradients (quantizing changes results)",
        ),
        "zeropp_loco_param": (None, "zswap does not quantize gradients, so LoCo has nothing to correct"),
        "zenflow": (None, "ZenFlow's deferred updates of unimportant params are not implemented by zswap"),
        "enable_sanity_checks": (
            False,
            "zswap's checks are always on, and a change made inside GatheredParameters without modifier_rank "
            "is dropped with a ZswapWarning rather than raised (make it an error with "
            "-W error::zswap.ZswapWarning); every step checks that the ranks ran the same passes",
        ),
        "compute_grad_norm": (
            True,
            "false is for ZeRO stages 1 and 2 (DeepSpeed refuses it with stage 3, which zswap always is); "
            "zswap.deepspeed's engine takes the norm at every step (DeepSpeed's), zswap.initialize's where "
            "clipping or the finite check needs it",
        ),
    },
)

AIO = Section(
    path="aio",
    fields=(
        "block_size",
        "queue_depth",
        "thread_count",
        "single_submit",
        "overlap_events",
        "use_gds",
        "backend",
        "direct",
        "checksum",
        "pinned_memory_budget",
    ),
    # DeepSpeed renamed thread_count to intra_op_parallelism; num_threads is DeepNVMe's spelling.
    aliases={"intra_op_parallelism": ("thread_count",), "num_threads": ("thread_count",)},
    # libaio's submission and completion knobs: kept in the model, but io_uring batches by itself.
    warned_unless={"single_submit": False, "overlap_events": True},
)

OPTIMIZER = Section(
    path="optimizer",
    fields=("type",),
    subsections=frozenset({"params"}),
    warned=frozenset({"legacy_fusion"}),  # how DeepSpeed fuses its fp16 optimizer's kernels
)

OPTIMIZER_PARAMS = Section(
    path="optimizer.params",
    fields=("lr", "betas", "eps", "weight_decay"),
    # adam_w_mode fills the model's decoupled_weight_decay; amsgrad and bias_correction are checked only;
    # torch_adam picks torch's AdamW, whose default weight decay (0.01) is not DeepSpeed's own Adams' (0).
    aliases={"adam_w_mode": ("decoupled_weight_decay",)},
    checked=frozenset({"amsgrad", "bias_correction", "torch_adam"}),
    # Whether torch's Adam runs fused, or over lists of tensors (torch_adam's foreach): the same algorithm.
    warned=frozenset({"fused", "foreach"}),
    defaults_only={
        "fp32_optimizer_states": (True, "zswap always keeps AdamW's moments in float32 (DeepSpeed's default)")
    },
)

BF16 = Section(
    path="bf16",
    fields=("enabled", "check_grad_overflow"),
    aliases={"check_overflow": ("check_grad_overflow",)},  # its older name
    # DeepSpeed's bf16 optimizer (ZeRO 0/1) applying gradients as they come: zswap accumulates them in fp32
    # where they land and updates once per step.
    warned=frozenset({"immediate_grad_update"}),
    deepspeed_types={"immediate_grad_update": "bool"},
    defaults_only={
        "bf16_master_weights_and_grads": (False, "zswap always keeps fp32 master weights for bf16 params"),
        "bf16_optimizer_states": (False, "zswap keeps Adam's moments in fp32"),
    },
)

FP16 = Section(
    path="fp16",
    fields=(
        "enabled",
        "loss_scale",
        "initial_scale_power",
        "loss_scale_window",
        "hysteresis",
        "min_loss_scale",
        "consecutive_hysteresis",
        "auto_cast",
        "fp16_master_weights_and_grads",
    ),
)

BATCH_KEYS = (
    "train_batch_size",
    "train_micro_batch_size_per_gpu",
    "gradient_accumulation_steps",
    "dataloader_drop_last",
    "managed_gradient_accumulation",
)
"""DeepSpeed's top-level batch keys; train_batch_size = micro batch × accumulation steps × world size;
``dataloader_drop_last`` shapes `zswap.deepspeed.initialize`'s loader; ``managed_gradient_accumulation``
false makes every ``step()`` an accumulation boundary."""

TORCH_AUTOCAST = Section(path="torch_autocast", fields=("enabled", "dtype", "lower_precision_safe_modules"))

DATA_TYPES = Section(
    path="data_types", fields=("grad_accum_dtype", "param_dtype", "buffer_dtype", "keep_in_fp32_modules")
)

SCHEDULER = Section(path="scheduler", fields=("type",), subsections=frozenset({"params"}))

BY_PATH = {spec.path: spec for spec in (OFFLOAD_PARAM, OFFLOAD_OPTIMIZER, OPTIMIZER_PARAMS)}
"""The sections nested in another, by dotted path: a key of theirs written one level up is named there."""

REQUIRED = object()
"""Marks a schedule parameter DeepSpeed gives no default (it must be set, "auto" is refused)."""

OPTIMIZER_LR = object()
"""Marks a default taken from the optimizer's learning rate (WarmupLR's warmup_max_lr)."""

SCHEDULES: dict[str, dict[str, object]] = {
    # DeepSpeed's parameter names and defaults (deepspeed/runtime/lr_schedules.py), in its argument order.
    "WarmupLR": {
        "warmup_min_lr": 0.0,
        "warmup_max_lr": OPTIMIZER_LR,
        "warmup_num_steps": 1000,
        "warmup_type": "log",
        "last_batch_iteration": -1,
    },
    "WarmupDecayLR": {
        "total_num_steps": REQUIRED,
        "warmup_min_lr": 0.0,
        "warmup_max_lr": 0.001,
        "warmup_num_steps": 1000,
        "warmup_type": "log",
        "last_batch_iteration": -1,
    },
    "WarmupCosineLR": {
        "total_num_steps": REQUIRED,
        "warmup_min_ratio": 0.0,
        "warmup_num_steps": 1000,
        "cos_min_ratio": 0.0001,
        "warmup_type": "log",
        "last_batch_iteration": -1,
    },
    "OneCycle": {
        "cycle_min_lr": REQUIRED,
        "cycle_max_lr": REQUIRED,
        "decay_lr_rate": 0.0,
        "cycle_first_step_size": 2000,
        "cycle_second_step_size": None,
        "cycle_first_stair_count": 0,
        "cycle_second_stair_count": None,
        "decay_step_size": 0,
        "cycle_momentum": True,
        "cycle_min_mom": 0.8,
        "cycle_max_mom": 0.9,
        "decay_mom_rate": 0.0,
        "last_batch_iteration": -1,
    },
    "LRRangeTest": {
        "lr_range_test_min_lr": 1e-3,
        "lr_range_test_step_size": 2000,
        "lr_range_test_step_rate": 1.0,
        "lr_range_test_staircase": False,
        "last_batch_iteration": -1,
    },
}
"""The five DeepSpeed schedules: parameter → default (`REQUIRED`, `OPTIMIZER_LR`, or a value)."""

BF16_OLD_NAME = "bfloat16"
"""DeepSpeed still reads ``bfloat16`` as the old name of the ``bf16`` section."""
