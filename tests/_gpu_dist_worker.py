"""One rank of tests/test_gpu.py's NCCL test: ``python _gpu_dist_worker.py RANK WORLD INIT_FILE SWAP_ROOT``.

Each rank computes on ``cuda:RANK``: fetches all-gather on the GPU (NCCL), gradients are reduce-scattered on
the GPU and come back through the copy stream. Logits must be bitwise those of the plain CUDA model on the
rank's batch; gradients the average over ranks (tight tolerance: the reduce-scatter sums in its own order)
and bitwise equal on every rank; one clipped AdamW step (the norm's all-reduce runs over NCCL) keeps the
ranks' params equal.
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
from tests.test_runtime import TinyLM, ids, sq
from zswap import full_grad, param_state


def main() -> None:
    rank, world = int(sys.argv[1]), int(sys.argv[2])
    init_file, swap_root = sys.argv[3], Path(sys.argv[4])
    os.environ.setdefault("CUBLAS_WORKSPACE_CONFIG", ":4096:8")
    torch.use_deterministic_algorithms(True)
    torch.cuda.set_device(rank)
    dev = torch.device("cuda", rank)
    dist.init_process_group("nccl", init_method=f"file://{init_file}", rank=rank, world_size=world)
    try:
        path = swap_root / f"rank{rank}"
        path.mkdir(exist_ok=True)
        cfg = {
            "offload_param": {"device": "nvme", "nvme_path": str(path)},
            "offload_optimizer": {"device": "nvme", "nvme_path": str(path)},
            "zero_optimization": {"stage3_param_persistence_threshold": 0},
            "optimizer": {"type": "AdamW", "params": {"lr": 1e-2, "weight_decay": 0.0}},
            "gradient_clipping": 0.5,
        }
        torch.manual_seed(0)
        ref = TinyLM(reentrant=False).to(dev)
        torch.manual_seed(0)
        with warnings.catch_warnings():
            warnings.simplefilter("ignore", zswap.ZswapWarning)
            with zswap.Init(cfg):
                m = TinyLM(reentrant=False)
            engine = zswap.initialize(m, cfg)  # device=None: cuda:RANK, the current device
        assert engine.device == dev
        assert all(param_state(p).world_size == world for p in m.parameters())
        with engine:
            for step in range(2):
                xs = [ids(seed=100 * step + r).to(dev) for r in range(world)]
                out = m(xs[rank])
                assert torch.equal(out, ref(xs[rank])), "logits differ from the plain CUDA model"
                sq(out).backward()
                for x in xs:
                    sq(ref(x)).backward()
            for (name, p), q in zip(m.named_parameters(), ref.parameters(), strict=True):
                g = full_grad(p)
                assert g is not None and g.device == dev, name
                torch.testing.assert_close(g, q.grad / world, rtol=1e-6, atol=1e-7, msg=name)
                others = [torch.empty_like(g) for _ in range(world)]
                dist.all_gather(others, g.contiguous())
                assert all(torch.equal(o, g) for o in others), f"{name}: ranks differ"
            engine.step()
            assert engine.last_grad_norm is not None
            # Inside the engine (nothing prefetched after a step): gathered on the GPU, over NCCL.
            with zswap.GatheredParameters(list(m.parameters())):
                for name, p in m.named_parameters():
                    full = p.detach().contiguous()
                    assert full.device == dev, name
                    others = [torch.empty_like(full) for _ in range(world)]
                    dist.all_gather(others, full)
                    assert all(torch.equal(o, full) for o in others), f"{name}: ranks' params differ"
        dist.barrier()
    finally:
        dist.destroy_process_group()


if __name__ == "__main__":
    from _worker_exit import run_then_exit  # the script's folder, tests/, is on sys.path

    run_then_exit(main)
