"""What a checkpoint needs from training: `TrainingState`.

Saving and loading read and restore these attributes of the object they are given (`zswap.Engine` is
one); nothing else. So the checkpoint code imports nothing above it, and a checkpoint of any object with
these attributes (a front end's own engine) is the same files.
"""

from __future__ import annotations

from typing import Any, Protocol

from torch import nn


class TrainingState(Protocol):
    module: nn.Module
    """The model: its params (partitioned or not) and persistent buffers are saved and loaded."""
    optimizer: Any
    """The optimizer whose state is saved (``None``: none); `zswap.optim.OffloadedAdamW` streams its own."""
    global_steps: int
    skipped_steps: int
    micro_steps: int
    _window_from: int
    """``micro_steps`` where the accumulation window began (a load begins one)."""
    lr_scheduler: Any
    """Saved and restored through ``state_dict``/``load_state_dict`` when not ``None``."""
    loss_scaler: Any
    """Likewise."""
