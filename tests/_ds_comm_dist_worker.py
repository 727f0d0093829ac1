"""One rank of a training script written against DeepSpeed's ``deepspeed.comm`` and ``get_accelerator()``,
ported by changing its imports only (tests/test_deepspeed_comm.py): ``python _ds_comm_dist_worker.py RANK
WORLD INIT_FILE TMP``. Every collective's result is checked, then two optimizer steps of a model built
under ``zero.Init``; the loss each rank logs (all-reduced through ``dist``) and the weights agree across
ranks."""

from __future__ import annotations

import os
import sys
import warnings
from pathlib import Path

import torch
from torch import nn

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import zswap
import zswap.deepspeed as deepspeed
import zswap.deepspeed.comm as dist
from zswap.deepspeed.accelerator import get_accelerator


def collectives(rank: int, world: int) -> None:
    acc = get_accelerator()
    dev = acc.device_name()
    assert (dist.is_initialized(), dist.get_rank(), dist.get_world_size()) == (True, rank, world)
    assert dist.get_local_rank() == rank and dist.get_world_group() is torch.distributed.group.WORLD
    t = acc.FloatTensor([rank + 1.0])
    dist.all_reduce(t, op=dist.ReduceOp.SUM, log_name="sum", debug="here")
    assert t.item() == world * (world + 1) / 2, t
    b = torch.full((3,), float(rank), device=dev)
    dist.broadcast(b, src=world - 1)
    assert torch.equal(b, torch.full((3,), world - 1.0))
    parts = [torch.empty(2) for _ in range(world)]
    dist.all_gather(parts, torch.full((2,), float(rank)))
    assert [p.tolist() for p in parts] == [[float(r)] * 2 for r in range(world)]
    flat = torch.empty(2 * world)
    dist.allgather_fn(flat, torch.full((2,), float(rank)))
    assert flat.tolist() == [float(r) for r in range(world) for _ in range(2)]
    mine = torch.empty(2)
    dist.reduce_scatter_fn(mine, torch.arange(2.0 * world) + rank)
    want = [world * (2 * rank + i) + world * (world - 1) / 2 for i in range(2)]
    assert mine.tolist() == want, (mine, want)
    group = dist.new_group(list(range(world)))
    assert dist.get_all_ranks_from_group(group) == list(range(world))
    assert dist.get_global_rank(group, world - 1) == world - 1
    dist.barrier()


def training(rank: int, world: int, tmp: str) -> None:
    cfg = {
        "train_micro_batch_size_per_gpu": 2,
        "gradient_accumulation_steps": 1,
        "optimizer": {"type": "AdamW", "params": {"lr": 1e-2}},
        "zero_optimization": {"stage": 3, "offload_param": {"device": "nvme", "nvme_path": tmp}},
    }
    torch.manual_seed(0)
    with deepspeed.zero.Init(config_dict_or_path=cfg):
        model = nn.Sequential(nn.Linear(6, 8), nn.Tanh(), nn.Linear(8, 1))
    engine, *_ = deepspeed.initialize(model=model, model_parameters=model.parameters(), config=cfg)
    dev = get_accelerator().current_device_name()
    g = torch.Generator().manual_seed(rank)
    logged = []
    with engine:
        for _ in range(2):
            x = torch.randn(2, 6, generator=g).to(dev)
            loss = engine(x).square().mean()
            engine.backward(loss)
            engine.step()
            reported = loss.detach().clone()
            dist.all_reduce(reported)
            logged.append(reported.item() / dist.get_world_size())
        with zswap.GatheredParameters(list(model.parameters())):
            weights = torch.cat([p.detach().reshape(-1) for p in model.parameters()])
    every = [torch.empty_like(weights) for _ in range(world)]
    dist.all_gather(every, weights)
    assert all(torch.equal(w, weights) for w in every)
    losses = [None] * world
    dist.all_gather_object(losses, logged)
    assert all(x == logged for x in losses), losses


def main() -> None:
    rank, world, init_file = int(sys.argv[1]), int(sys.argv[2]), sys.argv[3]
    os.environ["LOCAL_RANK"] = str(rank)
    backend = get_accelerator().communication_backend_name()
    dist.init_distributed(backend, init_method=f"file://{init_file}", rank=rank, world_size=world)
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore", zswap.ZswapWarning)
            collectives(rank, world)
            training(rank, world, sys.argv[4])
    finally:
        dist.destroy_process_group()


if __name__ == "__main__":
    from _worker_exit import run_then_exit  # the script's folder, tests/, is on sys.path

    run_then_exit(main)
