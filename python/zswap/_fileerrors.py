"""The errors of reading and writing weight and checkpoint files, in a leaf module: both the safetensors
reader (`zswap._stfile`, under weights loading) and `zswap.checkpoint` raise them, and neither may import
the other's package to get them. ``zswap.checkpoint.errors`` is their public home::

    CheckpointError (ZswapError)                 a checkpoint or weights file zswap refuses
    ├── CheckpointNotFoundError (FileNotFoundError)
    ├── CheckpointCorruptError (ValueError)      a file, manifest or header that is not what was written
    │   └── SafetensorsError                     a safetensors file the ``safetensors`` package refuses
    ├── CheckpointMismatchError (ValueError)     a checkpoint of another model or optimizer
    └── CheckpointArgumentError (ValueError)     a folder or tag argument that names nothing usable
"""

from __future__ import annotations

from .errors import ZswapError


class CheckpointError(ZswapError):
    """Root of the errors a checkpoint load or save, an export, or a weights load or save raises."""


class CheckpointNotFoundError(CheckpointError, FileNotFoundError):
    """A checkpoint folder, tag, manifest or data file that does not exist."""


class CheckpointCorruptError(CheckpointError, ValueError):
    """A checkpoint file whose checksum, size, header or content is not what its manifest says, or a
    manifest that is malformed or was changed after it was written."""


class SafetensorsError(CheckpointCorruptError):
    """A safetensors file that breaks the format's rules (those the ``safetensors`` package enforces):
    refused before any tensor byte is read. The message names the file and the tensor or field."""


class CheckpointMismatchError(CheckpointError, ValueError):
    """A checkpoint of another model (a param whose name, shape or dtype differs), another optimizer, or a
    state that cannot be loaded into this setup."""


class CheckpointArgumentError(CheckpointError, ValueError):
    """A ``save_dir`` / ``load_dir`` that names no folder (``None``, ``""``), a tag that cannot be a folder
    name, or ranks that asked for different tags."""


__all__ = [
    "CheckpointArgumentError",
    "CheckpointCorruptError",
    "CheckpointError",
    "CheckpointMismatchError",
    "CheckpointNotFoundError",
    "SafetensorsError",
]
