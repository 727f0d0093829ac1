"""One rank of tests/test_accumulation.py's two-rank test: ``python _stepping_dist_worker.py RANK WORLD
INIT_FILE SWAP_ROOT``.

- The batch keys resolve with the world size: train_batch_size 8 = micro 2 × GAS × 2 ranks → GAS 2, and
  `zswap.deepspeed.initialize`'s loader gives each rank its own share (a DistributedSampler).
- fp16 with dynamic loss scaling: an overflow on one rank only skips the step on both, and both loss
  scalers move the same way.
"""

from __future__ import annotations

import sys
import warnings
from pathlib import Path

import torch
import torch.distributed as dist
from torch.utils.data import DistributedSampler, TensorDataset

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import zswap
import zswap.deepspeed as deepspeed


def gas_and_loader(rank: int, world: int) -> None:
    cfg = {
        "train_batch_size": 8,
        "train_micro_batch_size_per_gpu": 2,
        "zero_optimization": {"offload_param": {"device": "cpu"}},
        "optimizer": {"type": "AdamW", "params": {"lr": 0.01}},
    }
    with deepspeed.zero.Init(config_dict_or_path=cfg):
        m = torch.nn.Linear(4, 3)
    data = TensorDataset(torch.arange(16.0).reshape(8, 2).repeat(1, 2))
    engine, _, loader, _ = deepspeed.initialize(model=m, config=cfg, training_data=data)
    with engine:
        assert engine.gradient_accumulation_steps() == 2, engine.gradient_accumulation_steps()
        assert isinstance(loader.sampler, DistributedSampler) and loader.batch_size == 2
        mine = torch.cat([b for (b,) in loader])
        assert mine.shape == (4, 4)
        everyone = [torch.empty_like(mine) for _ in range(world)]
        dist.all_gather(everyone, mine)
        assert sorted(torch.cat(everyone)[:, 0].tolist()) == [2.0 * i for i in range(8)]  # disjoint shares
        for (batch,) in loader:
            engine.backward(engine(batch).square().mean())
            engine.step()
        assert (engine.micro_steps, engine.global_steps) == (2, 1)


def overflow_on_one_rank(rank: int) -> None:
    cfg = {
        "zero_optimization": {"offload_param": {"device": "cpu"}},
        "fp16": {"enabled": True, "initial_scale_power": 8, "hysteresis": 1},
        "optimizer": {"type": "AdamW", "params": {"lr": 0.01}},
    }
    torch.manual_seed(0)
    with zswap.Init(cfg):
        m = torch.nn.Linear(4, 3)
    with zswap.initialize(m, cfg) as engine:
        for step in range(2):
            x = torch.ones(2, 4, dtype=torch.float16) * (6e4 if (step == 0 and rank == 1) else 1.0)
            engine.backward(engine(x).float().square().mean())
            engine.step()
            scale = torch.tensor([engine.loss_scale, float(engine.skipped_steps)])
            scales = [torch.empty_like(scale) for _ in range(2)]
            dist.all_gather(scales, scale)
            assert torch.equal(scales[0], scales[1]), scales
        assert engine.skipped_steps == 1 and engine.loss_scale == 128.0, (
            engine.skipped_steps,
            engine.loss_scale,
        )


def main() -> None:
    rank, world = int(sys.argv[1]), int(sys.argv[2])
    dist.init_process_group("gloo", init_method=f"file://{sys.argv[3]}", rank=rank, world_size=world)
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore", zswap.ZswapWarning)
            gas_and_loader(rank, world)
            overflow_on_one_rank(rank)
        dist.barrier()
    finally:
        dist.destroy_process_group()


if __name__ == "__main__":
    from _worker_exit import run_then_exit  # the script's folder, tests/, is on sys.path

    run_then_exit(main)
