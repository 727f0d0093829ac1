"""``deepspeed.checkpointing``'s call shapes on torch's own activation checkpointing.

`checkpoint` is DeepSpeed's reentrant checkpoint (the segment's forward re-run in backward, its backward an
autograd task inside the outer one), which zswap's update in backward follows (`zswap.step.nesting`);
`non_reentrant_checkpoint` is torch's non-reentrant one. `configure` takes DeepSpeed's arguments and its
config's ``activation_checkpointing`` section; what they switch on beyond the plain checkpoint — partitioning
activations over model-parallel ranks, contiguous buffers, moving checkpoints to CPU memory, synchronising
or timing each call — zswap does not do, so any of them on is a `TypeError` naming it, never dropped.
"""

from __future__ import annotations

import json
import os
from collections.abc import Callable, Mapping
from typing import Any

from torch.utils import checkpoint as _torch

from ._args import not_here, refuse

_configured = False

_SECTION_KEYS = {
    "partition_activations": "partition_activations",
    "contiguous_memory_optimization": "contiguous_checkpointing",
    "cpu_checkpointing": "checkpoint_in_cpu",
    "synchronize_checkpoint_boundary": "synchronize",
    "profile": "profile",
}
"""The config section's switches and `configure`'s keyword for each (``number_checkpoints`` sizes the
contiguous buffers only: read and ignored)."""

_NOT_HERE = {
    "model_parallel_cuda_manual_seed": "model parallelism (Megatron's RNG tracker)",
    "get_cuda_rng_tracker": "model parallelism (Megatron's RNG tracker)",
    "partition_activations_in_checkpoint": "partitioned activations",
    "set_num_layers": "contiguous checkpoint buffers",
    "CheckpointFunction": "DeepSpeed's own autograd Function (use `checkpoint`)",
}


def checkpoint(function: Callable[..., Any], *args: Any, **kwargs: Any) -> Any:
    """DeepSpeed's ``deepspeed.checkpointing.checkpoint``: ``function(*args, **kwargs)`` with its
    activations recomputed in backward (reentrant, the RNG state restored for the re-run). Keyword tensors
    take part in autograd as positional ones do: they are passed on positionally, as DeepSpeed does."""
    if kwargs:
        run, keys, n = function, tuple(kwargs), len(args)

        def function(*all_args: Any) -> Any:
            return run(*all_args[:n], **dict(zip(keys, all_args[n:], strict=True)))

        args = (*args, *kwargs.values())
    return _torch.checkpoint(function, *args, use_reentrant=True)


def non_reentrant_checkpoint(function: Callable[..., Any], *args: Any) -> Any:
    """DeepSpeed's ``non_reentrant_checkpoint``: torch's non-reentrant checkpoint of ``function(*args)``."""
    return _torch.checkpoint(function, *args, use_reentrant=False)


def configure(
    mpu_: Any,
    deepspeed_config: str | os.PathLike[str] | Mapping[str, Any] | None = None,
    partition_activations: bool | None = None,
    contiguous_checkpointing: bool | None = None,
    num_checkpoints: int | None = None,
    checkpoint_in_cpu: bool | None = None,
    synchronize: bool | None = None,
    profile: bool | None = None,
) -> None:
    """DeepSpeed's ``deepspeed.checkpointing.configure``: the keywords override the config's
    ``activation_checkpointing`` section, as in DeepSpeed; only the plain checkpoint is supported."""
    global _configured
    refuse("checkpointing.configure", mpu_=(mpu_, None))
    switches = dict.fromkeys(_SECTION_KEYS.values(), False)
    if deepspeed_config is not None:
        section = _section(deepspeed_config)
        for key, name in _SECTION_KEYS.items():
            switches[name] = bool(section.get(key, False))
    given = {
        "partition_activations": partition_activations,
        "contiguous_checkpointing": contiguous_checkpointing,
        "checkpoint_in_cpu": checkpoint_in_cpu,
        "synchronize": synchronize,
        "profile": profile,
    }
    switches.update({name: bool(value) for name, value in given.items() if value is not None})
    refuse("checkpointing.configure", **{name: (on, False) for name, on in switches.items()})
    del num_checkpoints  # sizes DeepSpeed's contiguous buffers, which are refused above
    _configured = True


def is_configured() -> bool:
    """Whether `configure` ran (DeepSpeed's ``is_configured``)."""
    return _configured


def reset() -> None:
    """DeepSpeed's ``reset`` frees its contiguous checkpoint buffers; zswap keeps none."""


def _section(config: str | os.PathLike[str] | Mapping[str, Any]) -> Mapping[str, Any]:
    if isinstance(config, Mapping):
        raw: Any = config
    else:
        with open(config, encoding="utf-8") as f:
            raw = json.load(f)
    section = raw.get("activation_checkpointing", {}) if isinstance(raw, Mapping) else {}
    if not isinstance(section, Mapping):
        raise TypeError(f"activation_checkpointing must be a JSON object, got {type(section).__name__}")
    return section


__getattr__ = not_here(__name__, _NOT_HERE)
