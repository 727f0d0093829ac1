"""The errors a checkpoint load, an export or a weights save raises; each names the folder, file or param.

Defined in `zswap._fileerrors` (the safetensors reader under weights loading raises them too, and must not
import this package); this is their public home.
"""

from __future__ import annotations

from .._fileerrors import (
    CheckpointArgumentError,
    CheckpointCorruptError,
    CheckpointError,
    CheckpointMismatchError,
    CheckpointNotFoundError,
    SafetensorsError,
)

__all__ = [
    "CheckpointArgumentError",
    "CheckpointCorruptError",
    "CheckpointError",
    "CheckpointMismatchError",
    "CheckpointNotFoundError",
    "SafetensorsError",
]
