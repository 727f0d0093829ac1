"""One rank of tests/test_hostcomm.py's diverging-ranks test: ``python _diverged_dist_worker.py RANK WORLD
INIT_FILE SWAP_ROOT``. Rank 1 detaches one Linear's output, so that Linear's params get a gradient on rank 0
only: rank 0 runs one gradient reduction more than rank 1, which goes on to ``engine.step()``'s check of
the ranks. Rank 0 must raise `RanksDivergedError` at once (it waited for the process group's 30-minute
timeout); rank 1, left in the check's collective, fails once rank 0 is gone.
"""

from __future__ import annotations

import sys
import time
import warnings
from pathlib import Path

import torch
import torch.distributed as dist
from torch import nn

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import zswap
from zswap.errors import RanksDivergedError


class Branch(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.a, self.b, self.c = nn.Linear(8, 8), nn.Linear(8, 8), nn.Linear(8, 8)

    def forward(self, x: torch.Tensor, through_b: bool) -> torch.Tensor:
        h = self.a(x)
        hb = self.b(h)
        return self.c(h + (hb if through_b else hb.detach())).square().mean()


def main() -> None:
    rank, world = int(sys.argv[1]), int(sys.argv[2])
    dist.init_process_group("gloo", init_method=f"file://{sys.argv[3]}", rank=rank, world_size=world)
    cfg = {"zero_optimization": {"offload_param": {"device": "cpu"}, "stage3_param_persistence_threshold": 0}}
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", zswap.ZswapWarning)
        with zswap.Init(cfg):
            model = Branch()
        engine = zswap.initialize(model, {**cfg, "optimizer": {"type": "AdamW", "params": {"lr": 1e-2}}})
    start = time.monotonic()
    try:
        engine.backward(model(torch.randn(2, 8), through_b=rank == 0))
        engine.step()
    except RanksDivergedError as e:
        assert rank == 0 and "rank 1 went on to the ranks' check (at engine.step()" in str(e), e
        assert time.monotonic() - start < 60
        print("rank 0: diverged", flush=True)
        return
    except RuntimeError as e:  # gloo: the peer closed its connection
        assert rank == 1, e
        print("rank 1: peer gone", flush=True)
        return
    raise AssertionError(f"rank {rank}: no error")


if __name__ == "__main__":
    from _worker_exit import run_then_exit  # the script's folder, tests/, is on sys.path

    run_then_exit(main)
