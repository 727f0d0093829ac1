"""Shared by the pretrained-weights tests: tiny checkpoints saved with save_pretrained, and their tensors."""

from __future__ import annotations

import warnings
from pathlib import Path
from typing import Any

import torch

import zswap

from .test_hf_models import MODELS


def save(model_name: str, path: Path, *, sharded: bool, seed: int = 0) -> Path:
    """``save_pretrained`` of a tiny model (one file, or shards of at most 20 kB with an index)."""
    torch.manual_seed(seed)
    m = MODELS[model_name]()
    m.save_pretrained(path, max_shard_size="20KB" if sharded else "5GB")
    if sharded:
        assert (path / "model.safetensors.index.json").exists() and len(list(path.glob("*.safetensors"))) > 2
    return path


def file_tensors(path: Path) -> dict[str, torch.Tensor]:
    """Every tensor of every safetensors file under ``path`` (read plainly, for comparison)."""
    from safetensors.torch import load_file

    out: dict[str, torch.Tensor] = {}
    for f in sorted(path.glob("*.safetensors")):
        out.update(load_file(f))
    return out


def init_for(tier: str, tmp_path: Path, **kwargs: Any) -> zswap.Init:
    swap = tmp_path / "swap"
    swap.mkdir(exist_ok=True)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", zswap.ZswapWarning)
        return zswap.Init({"offload_param": {"device": tier, "nvme_path": str(swap)}}, **kwargs)


def gathered_named(model: torch.nn.Module) -> dict[str, torch.Tensor]:
    named = dict(model.named_parameters(remove_duplicate=False))
    with zswap.GatheredParameters(list(named.values())):
        return {n: p.data.clone() for n, p in named.items()}


def nvme_training_config(tmp_path: Path) -> dict[str, Any]:
    """Params and AdamW states on NVMe in ``tmp_path/swap`` (made here), the hyper-parameters the
    fine-tuning tests compare against ``torch.optim.AdamW(lr=3e-3, betas=(0.8, 0.95), weight_decay=0.1)``."""
    swap = tmp_path / "swap"
    swap.mkdir()
    return {
        "zero_optimization": {
            "offload_param": {"device": "nvme", "nvme_path": str(swap)},
            "offload_optimizer": {"device": "nvme", "nvme_path": str(swap)},
            "stage3_param_persistence_threshold": 0,
        },
        "optimizer": {"type": "AdamW", "params": {"lr": 3e-3, "betas": [0.8, 0.95], "weight_decay": 0.1}},
    }
