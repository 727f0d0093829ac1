"""zswap's configuration: `load_config` and the frozen models it returns.

A config is a DeepSpeed config (``zero_optimization.offload_param`` …) or the trimmed layout with the same
sections at top level; only zswap's sections are read. Module map:

- ``_load``: `load_config` (and `raw_dict`, for front ends that fill a config in; `from_argument`, for a
  command line's ``--config``), the only code that knows a path from a mapping; JSON reading.
- ``_layout``: which sections and keys are read, from where; aliases, conflicts, unknown keys.
- ``_keys``: the key tables (zswap's keys, aliases, DeepSpeed keys accepted and ignored).
- ``_values``: the check of each kind of value (integers, sizes, booleans, paths …).
- ``models``: `ZswapConfig` and its section models.
"""

from __future__ import annotations

from ._load import ConfigSource, from_argument, load_config, parse_json, raw_dict
from .models import (
    AioConfig,
    BF16Config,
    FP16Config,
    LeafModuleConfig,
    OffloadOptimizerConfig,
    OffloadParamConfig,
    OptimizerConfig,
    ZeroConfig,
    ZswapConfig,
)

__all__ = [
    "AioConfig",
    "BF16Config",
    "ConfigSource",
    "FP16Config",
    "LeafModuleConfig",
    "OffloadOptimizerConfig",
    "OffloadParamConfig",
    "OptimizerConfig",
    "ZeroConfig",
    "ZswapConfig",
    "from_argument",
    "load_config",
    "parse_json",
    "raw_dict",
]
