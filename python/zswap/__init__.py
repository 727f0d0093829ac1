"""zswap: run and train PyTorch models whose parameters and optimizer states live on NVMe.

The public surface is listed here once; everything else is internal.
"""

from __future__ import annotations

from ._zswap import Handle
from .config import ZswapConfig, load_config
from .errors import ConfigError, EngineClosedError, SwapIOError, UnknownKeyError, ZswapError, ZswapWarning
from .swap import SwapEngine

__version__ = "0.1.0"

__all__ = [
    "ConfigError",
    "EngineClosedError",
    "Handle",
    "SwapEngine",
    "SwapIOError",
    "UnknownKeyError",
    "ZswapConfig",
    "ZswapError",
    "ZswapWarning",
    "__version__",
    "load_config",
]
