"""One rank of the two-rank scenarios adapted from DeepSpeed's tests (tests/test_ds_zero_context.py):
``python _ds_dist_worker.py RANK WORLD INIT_FILE TMP``."""

from __future__ import annotations

import sys
import warnings
from pathlib import Path

import torch
import torch.distributed as dist
from torch import nn

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import zswap
import zswap.deepspeed as deepspeed
from zswap import Status, param_state


def scatter_gather(rank: int, world: int) -> None:
    with deepspeed.zero.Init():
        layer = nn.Linear(6, 3)
    st = param_state(layer.weight)
    assert st.status is Status.NOT_AVAILABLE and layer.weight.numel() == 0
    assert st.world_size == world and st.partition_numel == 9  # 18 elements over 2 ranks
    plain = nn.Linear(6, 3)
    assert param_state(plain.weight) is None and plain.weight.numel() == 18
    with deepspeed.zero.GatheredParameters(layer.weight):
        assert param_state(layer.weight).status is Status.AVAILABLE and layer.weight.numel() == 18


def gather_update(rank: int, world: int) -> None:
    with deepspeed.zero.Init():
        layer = nn.Linear(4, 2)
    with deepspeed.zero.GatheredParameters(layer.weight, modifier_rank=1):
        assert param_state(layer.weight).status is Status.AVAILABLE
        if rank == 1:
            with torch.no_grad():
                layer.weight.zero_()
    assert param_state(layer.weight).status is Status.NOT_AVAILABLE
    with deepspeed.zero.GatheredParameters(layer.weight):
        assert torch.equal(layer.weight, torch.zeros(2, 4)), layer.weight


def main() -> None:
    rank, world, init_file = int(sys.argv[1]), int(sys.argv[2]), sys.argv[3]
    dist.init_process_group("gloo", init_method=f"file://{init_file}", rank=rank, world_size=world)
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore", zswap.ZswapWarning)
            scatter_gather(rank, world)
            gather_update(rank, world)
    finally:
        dist.destroy_process_group()


if __name__ == "__main__":
    main()
