"""zswap: run and train PyTorch models whose parameters and optimizer states live on NVMe.

The public surface is listed here once; everything else is internal. The code is in layers, each
importing only those below it (docs/architecture.md): base modules here and `config/`; then `store/`,
`parts/`, `fetch/`, `gradients/`, `step/`, `io/` with `checkpoint/`, `build/`, `train/`; the front ends
(`cli`, `demo`, `bench`, `envreport`, `deepspeed/`, `lightning/`) on top. Modules that moved into a layer
package stay importable under their old paths (`zswap._moved`).
"""

from __future__ import annotations

from types import ModuleType

from . import _moved  # installs the finder that resolves old paths to the moved modules themselves
from ._zswap import Handle, __version__
from .build.init import Init
from .checkpoint import save_weights
from .config import ZswapConfig, load_config
from .errors import ConfigError, EngineClosedError, SwapIOError, UnknownKeyError, ZswapError, ZswapWarning
from .gradients.grads import full_grad
from .io.weights import LoadWeightsError, load_weights
from .parts.gather import GatheredParameters
from .parts.params import ParamState, Status, param_state
from .swap import SwapEngine
from .train.runtime import Engine, initialize

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


def __getattr__(name: str) -> ModuleType:
    return _moved.attribute(name)
