"""Checkpoints that resume exactly, at any world size, and consolidated weights that leave zswap.

- `save_checkpoint` / `load_checkpoint` (``engine.save_checkpoint`` / ``engine.load_checkpoint``): each rank
  streams its partitions to safetensors files; a JSON manifest describes them (see `manifest`).
- `save_weights` (``zswap.save_weights``): the Hugging Face layout from a live model, one param at a time.
- `export` (``zswap export``): the same files from a checkpoint folder, offline.
- `statedict`: ``model.state_dict()`` of a partitioned model returns full values.
"""

from __future__ import annotations

from .errors import (
    CheckpointArgumentError,
    CheckpointCorruptError,
    CheckpointMismatchError,
    CheckpointNotFoundError,
)
from .export import export
from .load import load_checkpoint
from .save import save_checkpoint
from .weights import save_weights

__all__ = [
    "CheckpointArgumentError",
    "CheckpointCorruptError",
    "CheckpointMismatchError",
    "CheckpointNotFoundError",
    "export",
    "load_checkpoint",
    "save_checkpoint",
    "save_weights",
]
