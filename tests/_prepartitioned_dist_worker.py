"""Params partitioned before ``init_process_group`` under a two-rank launch (``WORLD_SIZE`` 2): `zswap.Init`
warns, and `zswap.initialize` refuses them once the ranks are up (each would train a full copy of its own,
never synchronised); a one-rank ``process_group`` says each rank is meant to run its own model, which then
trains as plain torch does."""

from __future__ import annotations

import sys
import warnings

import pytest
import torch
import torch.distributed as dist
from torch import nn

import zswap

CFG = {
    "train_micro_batch_size_per_gpu": 2,
    "optimizer": {"type": "AdamW", "params": {"lr": 1e-2, "weight_decay": 0.01}},
}


def build(group: object = None) -> nn.Module:
    torch.manual_seed(0)
    with zswap.Init(CFG, process_group=group):
        return nn.Sequential(nn.Linear(8, 8), nn.Tanh(), nn.Linear(8, 1))


def main() -> None:
    rank, world, init_file = int(sys.argv[1]), int(sys.argv[2]), sys.argv[3]
    launched = f"WORLD_SIZE={world} but torch.distributed is not initialised"
    with pytest.warns(zswap.ZswapWarning, match=launched):
        early = build()
    dist.init_process_group("gloo", init_method=f"file://{init_file}", rank=rank, world_size=world)
    try:
        refused = f"partitioned for a single process .* rank {rank} of {world}"
        with pytest.raises(zswap.ZswapError, match=refused):
            zswap.initialize(early, CFG)
        alone = [dist.new_group([r]) for r in range(world)][rank]  # every rank makes every group
        model = build(alone)
        torch.manual_seed(0)
        ref = nn.Sequential(nn.Linear(8, 8), nn.Tanh(), nn.Linear(8, 1))
        opt = torch.optim.AdamW(ref.parameters(), lr=1e-2, fused=True)
        x = torch.randn(2, 8, generator=torch.Generator().manual_seed(rank))  # each rank its own data
        with warnings.catch_warnings():
            warnings.simplefilter("ignore", zswap.ZswapWarning)
            engine = zswap.initialize(model, CFG)
        with engine:
            for _ in range(3):
                engine.backward(model(x).sum())
                engine.step()
                ref(x).sum().backward()
                opt.step()
                opt.zero_grad()
            params = list(model.parameters())
            with zswap.GatheredParameters(params):
                assert all(torch.equal(p, q) for p, q in zip(params, ref.parameters(), strict=True))
        dist.barrier()
    finally:
        dist.destroy_process_group()


if __name__ == "__main__":
    from _worker_exit import run_then_exit  # the script's folder, tests/, is on sys.path

    run_then_exit(main)
