"""Top-level keys that look like a misspelled zswap section.

A full DeepSpeed / Hugging Face config carries many top-level keys zswap has no use for (``steps_per_print``,
``wandb`` …), and those are never looked at. But a near miss of a section zswap reads (``zero_optimisation``,
``optimiser``, ``bf_16``) would be ignored just the same, and the run would go on with nothing offloaded and
no warning. So a top-level key that is not one zswap reads, not one DeepSpeed defines, and is close to one
zswap reads (same letters up to case, ``_`` and a few edits: `difflib` ratio at least `CUTOFF`) is a
`ConfigError` naming the section it resembles.
"""

from __future__ import annotations

import difflib
from collections.abc import Mapping
from typing import Any

from ..errors import ConfigError
from . import _keys as k

SECTIONS = (
    "zero_optimization",
    "offload_param",
    "offload_optimizer",
    "aio",
    "optimizer",
    "scheduler",
    "bf16",
    k.BF16_OLD_NAME,
    "fp16",
    "gradient_clipping",
    "torch_autocast",
    "data_types",
    "communication_data_type",
    *k.BATCH_KEYS,
)
"""Top-level sections (and DeepSpeed's top-level settings) zswap reads: the targets of a near miss. The
stage-3 knobs zswap also reads at top level are not among them: DeepSpeed's own spellings of those
(``max_live_parameters`` …) belong inside ``zero_optimization``, and at top level are left alone."""

READ = (*SECTIONS, *k.STAGE3_KNOBS)
"""Every top-level key zswap reads (DeepSpeed layout and the trimmed one)."""

DEEPSPEED = frozenset(
    {
        # deepspeed/runtime/constants.py and the configs of its subsystems: top-level keys it defines.
        "sparse_gradients", "zero_allow_untested_optimizer", "zero_force_ds_cpu_optimizer", "steps_per_print",
        "dump_state", "wall_clock_breakdown", "memory_breakdown", "amp", "gradient_predivide_factor",
        "prescale_gradients", "communication_data_type", "seq_parallel_communication_data_type",
        "disable_allgather", "sparse_attention", "activation_checkpointing", "flops_profiler", "tensorboard",
        "wandb", "csv_monitor", "comet", "comms_logger", "elasticity", "pipeline", "pld",
        "progressive_layer_drop", "curriculum_learning", "data_efficiency", "compression_training",
        "checkpoint", "data_types", "autotuning", "nebula", "eigenvalue", "quantize_training",
        "timers", "graph_harvesting", "hybrid_engine", "weight_quantization",
        "compile", "tensor_parallel", "sequence_parallel_size", "fp8",
        "gradient_accumulation_dtype", "use_data_before_expert_parallelism", "zero_optimization_stage",
        "gradient_allreduce_op", "expert_parallel",
    }
)  # fmt: skip
"""DeepSpeed's own top-level keys: never a near miss, whatever they resemble."""

CUTOFF = 0.8
"""`difflib.SequenceMatcher` ratio from which an unknown key counts as a misspelling of a zswap section."""


def check(raw: Mapping[Any, Any]) -> None:
    """Raise `ConfigError` for the first top-level key of ``raw`` that is a near miss of a zswap section."""
    for key in raw:
        if not isinstance(key, str) or key in READ or key in DEEPSPEED:
            continue
        # Letters swapped ("aoi") score low on a short name, so a same-letters key is a near miss too.
        near = [s for s in SECTIONS if sorted(s) == sorted(key.lower())]
        near = near or difflib.get_close_matches(key.lower(), SECTIONS, n=1, cutoff=CUTOFF)
        if near:
            raise ConfigError(
                f"unknown top-level key {key!r}: did you mean {near[0]!r}? zswap reads {near[0]!r} and would "
                f"ignore {key!r} (keys outside zswap's sections are left to DeepSpeed)"
            )
