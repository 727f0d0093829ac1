"""The offloaded optimizer: a SIMD CPU Adam/AdamW kernel and `OffloadedAdamW`, whose float32 master weights
and moments live in CPU memory or on NVMe and are streamed through the kernel sub-group by sub-group.

Module map: ``_kernel`` (`cpu_adam_step`, the checked entry to the Rust kernel), ``_layout`` (sub-groups and
their records), ``_store`` (CPU and NVMe record stores, the pipelined walk), ``_state`` (state dicts),
``_build`` (settings checks, `from_config`), ``adamw`` (`OffloadedAdamW`), ``adopt`` (a user's torch
Adam / AdamW rebuilt as one).
"""

from __future__ import annotations

from ._kernel import cpu_adam_step, kernel_isa
from ._layout import Segment, SubGroup
from .adamw import OffloadedAdamW

__all__ = ["OffloadedAdamW", "Segment", "SubGroup", "cpu_adam_step", "kernel_isa"]
