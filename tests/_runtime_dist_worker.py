"""One rank of tests/test_runtime_dist.py: ``python _runtime_dist_worker.py RANK WORLD INIT_FILE SWAP_ROOT``.

Each rank trains on its own batch. Logits must be bitwise those of the plain model on that batch (every
rank gathers the same full weights). Gradients are the average over ranks, as DDP's: compared to the plain
model's (g0 + g1) / 2 with a tight tolerance, since the reduce-scatter may sum in another order than this
script does; and the gathered full gradients must be bitwise equal on every rank.
"""

from __future__ import annotations

import os
import sys
import warnings
from pathlib import Path

import torch
import torch.distributed as dist

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import zswap
from tests.test_runtime import MLP, TinyLM, ids, sq
from zswap import _hostcomm, full_grad, param_state


def config(tier: str, rank: int, swap_root: Path) -> dict:
    cfg: dict = {
        "offload_param": {"device": tier},
        "zero_optimization": {"stage3_param_persistence_threshold": 0},
    }
    if tier == "nvme":
        path = swap_root / f"rank{rank}"
        path.mkdir(exist_ok=True)
        cfg["offload_param"]["nvme_path"] = str(path)
    return cfg


def batches(kind: str, world: int, step: int) -> list[torch.Tensor]:
    if kind == "lm":
        return [ids(seed=100 * step + r) for r in range(world)]
    g = torch.Generator().manual_seed(step)
    return [torch.randn(4, 12, generator=g) for _ in range(world)]


def check(kind: str, tier: str, rank: int, world: int, swap_root: Path) -> None:
    make = (lambda: TinyLM(reentrant=False)) if kind == "lm" else MLP
    torch.manual_seed(0)
    ref = make()
    cfg = config(tier, rank, swap_root)
    torch.manual_seed(0)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", zswap.ZswapWarning)
        with zswap.Init(cfg):
            m = make()
        engine = zswap.initialize(m, cfg)
    assert all(param_state(p).world_size == world for p in m.parameters())
    with engine:
        for step in range(2):
            xs = batches(kind, world, step)
            out = m(xs[rank])
            assert torch.equal(out, ref(xs[rank])), (kind, tier, "logits differ from the plain model")
            sq(out).backward()
            for x in xs:  # the plain model sees every rank's batch; its sum is averaged below
                sq(ref(x)).backward()
        assert engine.stats()["prefetch_hits"] > 0, (kind, tier)
        for (name, p), q in zip(m.named_parameters(), ref.parameters(), strict=True):
            assert p.grad is None, name
            g = full_grad(p)
            want = q.grad / world
            torch.testing.assert_close(g, want, rtol=1e-6, atol=1e-7, msg=f"{kind} {tier} {name}")
            others = [torch.empty_like(g) for _ in range(world)]
            dist.all_gather(others, g.contiguous())
            assert all(torch.equal(o, g) for o in others), f"{kind} {tier} {name}: ranks differ"


def main() -> None:
    rank, world = int(sys.argv[1]), int(sys.argv[2])
    init_file, swap_root = sys.argv[3], Path(sys.argv[4])
    dist.init_process_group("gloo", init_method=f"file://{init_file}", rank=rank, world_size=world)
    try:
        for kind in ("mlp", "lm"):
            for tier in ("cpu", "nvme"):
                check(kind, tier, rank, world, swap_root)
        ran = [ch.rounds for _, ch in _hostcomm._CHANNELS.values() if ch is not None]
        assert bool(ran and all(ran)) == (os.environ["ZSWAP_HOST_COLLECTIVES"] == "1"), ran
        dist.barrier()
    finally:
        dist.destroy_process_group()


if __name__ == "__main__":
    from _worker_exit import run_then_exit  # the script's folder, tests/, is on sys.path

    run_then_exit(main)
