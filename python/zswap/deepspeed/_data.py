"""The training data loader `zswap.deepspeed.initialize` returns, shaped as DeepSpeed's."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch
from torch.utils.data import DataLoader, DistributedSampler

from ..config import ZswapConfig
from ..errors import ConfigError


def training_dataloader(
    data: Any,
    cfg: ZswapConfig,
    engine: Any,
    collate_fn: Callable[..., Any] | None,
    *,
    batch_size: int | None = None,
    sampler: Any = None,
    shuffle: bool = True,
    **loader: Any,
) -> DataLoader[Any]:
    """``data`` in batches of the config's micro batch size (or ``batch_size``): ``sampler``, else a
    `DistributedSampler` (this rank's share; on one rank the whole, in its seed-0 order, ``set_epoch``
    reshuffling) — DeepSpeed's default under its launcher or ``init_distributed``, which scripts run it
    with; a last batch smaller than the batch size is dropped where the config's ``dataloader_drop_last``
    says so, as in DeepSpeed; ``shuffle`` false: in order (DeepSpeed's eval / predict routes). The loader's
    ``data_sampler`` is its sampler, as on DeepSpeed's loader (scripts call
    ``loader.data_sampler.set_epoch(epoch)``). ``loader``: more `DataLoader` keywords."""
    dist = torch.distributed
    ranks = dist.get_world_size() if dist.is_available() and dist.is_initialized() else 1
    micro = cfg.batch.resolve(ranks)[1] if batch_size is None else batch_size
    if micro is None:
        raise ConfigError(
            "training_data needs a batch size: set train_micro_batch_size_per_gpu or train_batch_size in "
            "the config"
        )
    if sampler is None:
        rank = dist.get_rank() if ranks > 1 else 0
        sampler = DistributedSampler(data, num_replicas=ranks, rank=rank, shuffle=shuffle)
    out = DataLoader(
        data,
        batch_size=micro,
        sampler=sampler,
        collate_fn=collate_fn,
        drop_last=cfg.batch.dataloader_drop_last,
        **loader,
    )
    out.data_sampler = sampler
    return out


class RepeatingLoader:
    """DeepSpeed's ``RepeatingLoader``: iterates ``loader`` over and over (a new pass begins where one
    ends, so a sampler's shuffle and ``set_epoch`` apply as they would to a plain new pass); for loops
    counted in steps rather than epochs. A ``loader`` that yields nothing in a fresh pass raises
    `StopIteration`, as DeepSpeed's does, instead of looping forever."""

    def __init__(self, loader: Any) -> None:
        self.loader = loader
        self.data_iter = iter(loader)

    def __iter__(self) -> RepeatingLoader:
        return self

    def __next__(self) -> Any:
        try:
            return next(self.data_iter)
        except StopIteration:
            self.data_iter = iter(self.loader)
            return next(self.data_iter)
