"""Building `OffloadedAdamW`: checks of its settings, its state store, and its arguments from a config."""

from __future__ import annotations

import os
from typing import Any, Literal

import torch

from ...errors import ConfigError
from ._store import CpuStore, NvmeStore

Pipeline = bool | Literal["read", "write"]
PathArg = str | os.PathLike[str]


def config_kwargs(
    config: Any, *, lr: float | None, weight_decay: float | None, engine: Any
) -> tuple[dict[str, Any], bool]:
    """`OffloadedAdamW` keyword arguments from a config (anything `load_config` takes), and whether the
    engine among them was built here (and so belongs to the optimizer)."""
    from ...config import load_config
    from ...store.storage import open_dir

    cfg = load_config(config)
    opt = cfg.optimizer
    if lr is None and opt is not None:
        lr = opt.lr
    if lr is None:
        raise ConfigError(
            "optimizer.params.lr is 'auto' (or missing) and zswap cannot choose a learning rate: set it in "
            "the config, pass lr= to zswap.optim.OffloadedAdamW.from_config, or pass optimizer= to "
            "zswap.initialize (a torch optimizer, or that OffloadedAdamW)"
        )
    if weight_decay is None:
        weight_decay = opt.weight_decay if opt is not None and opt.weight_decay is not None else 0.0
    off = cfg.offload_optimizer
    device: Literal["cpu", "nvme"] = "nvme" if off.device == "nvme" else "cpu"
    owned = False
    if device == "nvme" and engine is None:
        if not off.nvme_path:
            raise ConfigError(
                "offload_optimizer.nvme_path is required when offload_optimizer.device is 'nvme'"
            )
        # Shared with params and gradients on the same paths.
        engine = open_dir(list(off.nvme_path), cfg.aio, "offload_optimizer.nvme_path")
        owned = True
    read, write = off.pipeline_read, off.pipeline_write
    if off.buffer_count is not None:
        # The NVMe walk holds one buffer being updated, one read ahead, one being written: fewer buffers
        # give up the write-behind first, then the read-ahead.
        write = write and off.buffer_count >= 2 + int(read)
        read = read and off.buffer_count >= 2
    pipeline: Pipeline = True if read and write else "read" if read else "write" if write else False
    kwargs = {
        "lr": lr,
        "betas": opt.betas if opt is not None else (0.9, 0.999),
        "eps": opt.eps if opt is not None else 1e-8,
        "weight_decay": weight_decay,
        "decoupled_weight_decay": opt.decoupled_weight_decay if opt is not None else True,
        "device": device,
        "engine": engine if device == "nvme" else None,
        "sub_group_size": cfg.zero.sub_group_size,
        "pipeline": pipeline,
        "pin_memory": off.pin_memory,
    }
    return kwargs, owned


HYPER_KEYS = frozenset({"lr", "betas", "eps", "weight_decay", "decoupled_weight_decay"})


class ParamGroup(dict[str, Any]):
    """A param group of `OffloadedAdamW`: a dict, as torch's, that also counts the assignments to its
    hyper-parameters (``group["lr"] = ...``), same value or not. The early step reads the count to tell a
    loop that sets them between backward and step — from its first step, when the value set may still
    equal the one it replaces (`zswap.step.early_commit.prepare`)."""

    writes = 0

    def __setitem__(self, key: str, value: Any) -> None:
        super().__setitem__(key, value)
        if key in HYPER_KEYS:
            self.writes += 1

    def update(self, *args: Any, **kwargs: Any) -> None:
        """``dict.update`` and ``|=`` do not go through `__setitem__`: each key they set does."""
        for key, value in dict(*args, **kwargs).items():
            self[key] = value

    def __ior__(self, other: Any) -> ParamGroup:  # type: ignore[override,misc]
        self.update(other)
        return self


def check_hyper(lr: Any, betas: Any, eps: Any, weight_decay: Any) -> None:
    if isinstance(lr, torch.Tensor):
        lr = float(lr)
    if not lr >= 0.0:
        raise ValueError(f"Invalid learning rate: {lr}")
    if not eps >= 0.0:
        raise ValueError(f"Invalid epsilon value: {eps}")
    if len(tuple(betas)) != 2 or not all(0.0 <= b < 1.0 for b in betas):
        raise ValueError(f"betas must be two values in [0, 1), got {betas!r}")
    if not weight_decay >= 0.0:
        raise ValueError(f"Invalid weight_decay value: {weight_decay}")


def make_store(
    device: str, nvme_path: Any, engine: Any, pipeline: Pipeline, pin_memory: bool = False
) -> CpuStore | NvmeStore:
    if pipeline not in (True, False, "read", "write"):
        raise ValueError(f"pipeline must be True, False, 'read' or 'write', got {pipeline!r}")
    if device == "cpu":
        if engine is not None or nvme_path is not None:
            raise ValueError("engine and nvme_path are for device='nvme'")
        return CpuStore(pin_memory=pin_memory)
    if device != "nvme":
        raise ValueError(f"device must be 'cpu' or 'nvme', got {device!r}")
    if (engine is None) == (nvme_path is None):
        raise ValueError(
            "device='nvme' needs exactly one of nvme_path= (a directory) or engine= (a SwapEngine)"
        )
    owns = engine is None
    if owns:
        from ...store.storage import open_dir

        engine = open_dir(nvme_path)
    return NvmeStore(
        engine,
        owns_engine=owns,
        read_ahead=pipeline in (True, "read"),
        write_behind=pipeline in (True, "write"),
    )
