"""zswap: run and train PyTorch models whose parameters and optimizer states live on NVMe.

The public surface is listed here once; everything else is internal.
"""

from __future__ import annotations

from ._zswap import Handle, __version__
from .checkpoint import save_weights
from .config import ZswapConfig, load_config
from .errors import ConfigError, EngineClosedError, SwapIOError, UnknownKeyError, ZswapError, ZswapWarning
from .gather import GatheredParameters
from .grads import full_grad
from .init import Init
from .params import ParamState, Status, param_state
from .runtime import Engine, initialize
from .swap import SwapEngine
from .weights import LoadWeightsError, load_weights

__all__ = [
    "ConfigError",
    "Engine",
    "EngineClosedError",
    "GatheredParameters",
    "Handle",
    "Init",
    "LoadWeightsError",
    "ParamState",
    "Status",
    "SwapEngine",
    "SwapIOError",
    "UnknownKeyError",
    "ZswapConfig",
    "ZswapError",
    "ZswapWarning",
    "__version__",
    "full_grad",
    "initialize",
    "load_config",
    "load_weights",
    "param_state",
    "save_weights",
]
