"""One rank of tests/test_dist.py: ``python _dist_worker.py RANK WORLD INIT_FILE SWAP_ROOT``.

Exits 0 when every check passed; an assertion error (with its traceback on stderr) otherwise.
"""

from __future__ import annotations

import math
import sys
import warnings
from pathlib import Path

import torch
import torch.distributed as dist
from torch import nn

import zswap
from zswap import GatheredParameters, Init, param_state


class Net(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.a = nn.Linear(5, 3)  # 15 weights: odd, so the second rank's partition is padded
        self.b = nn.Linear(3, 2)
        self.s = nn.Parameter(torch.randn(1))  # fewer elements than ranks
        nn.init.normal_(self.a.weight)  # written after `a` was partitioned: a gather across ranks
        self.b.bias.data.fill_(0.25)


def make_init(tier: str, rank: int, swap_root: Path, group: object = None) -> Init:
    if tier != "nvme":
        return Init(remote_device=tier, process_group=group)
    path = swap_root / f"rank{rank}"
    path.mkdir(exist_ok=True)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", zswap.ZswapWarning)
        return Init({"offload_param": {"device": "nvme", "nvme_path": str(path)}}, process_group=group)


def check(tier: str, rank: int, world: int, swap_root: Path, group: object = None) -> None:
    torch.manual_seed(0)
    ref = Net()
    init = make_init(tier, rank, swap_root, group)
    torch.manual_seed(0)
    with init:
        m = Net()
    for p, r in zip(m.parameters(), ref.parameters(), strict=True):
        st = param_state(p)
        assert st is not None and p.numel() == 0 and st.shape == r.shape, (tier, st)
        assert (st.world_size, st.partition_numel) == (world, math.ceil(r.numel() / world)), (tier, st)
        local, handle = st.store.load(st.key, st.partition_numel, st.dtype)
        if handle is not None:
            handle.wait()
        flat = torch.cat([r.detach().reshape(-1), r.new_zeros(st.partition_numel * world - r.numel())])
        mine = flat[rank * st.partition_numel : (rank + 1) * st.partition_numel]
        assert torch.equal(local.cpu(), mine), (tier, "local partition is not this rank's slice")
    with GatheredParameters(m.parameters()):
        for p, r in zip(m.parameters(), ref.parameters(), strict=True):
            assert torch.equal(p.data, r.data), (tier, "gathered data differs from a plain build")
    with GatheredParameters([m.a.weight, m.s], modifier_rank=0):
        m.a.weight.data.fill_(float(rank + 1))  # only rank 0's values survive
        m.s.data.fill_(float(10 * (rank + 1)))
    with GatheredParameters(m.b.weight):
        m.b.weight.data.zero_()  # no modifier_rank: dropped everywhere
    with GatheredParameters(m.parameters()):
        assert torch.all(m.a.weight.data == 1.0), (tier, rank, m.a.weight.data)
        assert torch.all(m.s.data == 10.0), (tier, rank, m.s.data)
        assert torch.equal(m.b.weight.data, ref.b.weight.data), tier


def main() -> None:
    rank, world = int(sys.argv[1]), int(sys.argv[2])
    init_file, swap_root = sys.argv[3], Path(sys.argv[4])
    dist.init_process_group("gloo", init_method=f"file://{init_file}", rank=rank, world_size=world)
    try:
        for tier in ("cpu", "none", "nvme"):
            check(tier, rank, world, swap_root)
        check("cpu", rank, world, swap_root, group=dist.new_group(list(range(world))))
        dist.barrier()
    finally:
        dist.destroy_process_group()


if __name__ == "__main__":
    from _worker_exit import run_then_exit  # the script's folder, tests/, is on sys.path

    run_then_exit(main)
