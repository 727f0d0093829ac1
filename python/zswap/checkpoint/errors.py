"""The errors a checkpoint load, an export or a weights save raises; each names the folder, file or param."""

from __future__ import annotations

from ..errors import ZswapError


class CheckpointNotFoundError(ZswapError, FileNotFoundError):
    """A checkpoint folder, tag, manifest or data file that does not exist."""


class CheckpointCorruptError(ZswapError, ValueError):
    """A checkpoint file whose checksum, size or header is not what its manifest says."""


class CheckpointMismatchError(ZswapError, ValueError):
    """A checkpoint of another model (a param whose name, shape or dtype differs), another optimizer, or a
    state that cannot be loaded into this setup."""


class CheckpointArgumentError(ZswapError, ValueError):
    """A ``save_dir`` / ``load_dir`` that names no folder (``None``, ``""``), a tag that cannot be a folder
    name, or ranks that asked for different tags."""


__all__ = [
    "CheckpointArgumentError",
    "CheckpointCorruptError",
    "CheckpointMismatchError",
    "CheckpointNotFoundError",
]
