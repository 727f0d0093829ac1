"""One rank of tests/test_resident_step.py's two-rank test: ``python _resident_dist_worker.py RANK WORLD
INIT_FILE SWAP_ROOT``.

Each rank trains on its own batch twice, on the CPU and on the stand-in device: params resident
(``max_in_cpu`` over the model) and streamed (the ordinary path). Both runs reduce-scatter the same
gradients, so their params must be bitwise equal; a warm resident step loads no param partition from NVMe;
each rank's NVMe partition is its slice of the gathered copy, and the gathered copies agree across ranks
(the other slices refreshed after the step).
"""

from __future__ import annotations

import sys
import warnings
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import zswap
from tests.test_resident_step import Net, compute, inputs
from zswap import Status, param_state
from zswap.parts.params import NvmeStore


def run(
    rank: int, world: int, root: Path, max_in_cpu: int, clip: float | None, device: str
) -> list[torch.Tensor]:
    path = root / f"rank{rank}-{max_in_cpu}-{clip}-{device}"
    path.mkdir()
    cfg: dict[str, Any] = {
        "zero_optimization": {
            "offload_param": {"device": "nvme", "nvme_path": str(path), "max_in_cpu": max_in_cpu},
            "stage3_param_persistence_threshold": 0,
        },
        "optimizer": {"type": "AdamW", "params": {"lr": 1e-2, "weight_decay": 0.01}},
    }
    torch.manual_seed(0)
    loaded: list[str] = []
    load = NvmeStore.load

    def counting(self: NvmeStore, key: str, numel: int, dtype: torch.dtype) -> Any:
        loaded.append(key)
        return load(self, key, numel, dtype)

    with warnings.catch_warnings():
        warnings.simplefilter("ignore", zswap.ZswapWarning)
        with zswap.Init(cfg):
            m = Net()
        engine = zswap.initialize(m, cfg, max_grad_norm=clip, device=compute(device))
    params = list(m.parameters())
    assert all(param_state(p).world_size == world for p in params)
    with engine:
        xs = list(inputs(4 * world))
        for step in range(4):
            if step == 2 and max_in_cpu:
                NvmeStore.load = counting  # type: ignore[method-assign]
            try:
                engine.backward(engine(xs[step * world + rank]))
                engine.step()
            finally:
                NvmeStore.load = load  # type: ignore[method-assign]
        if max_in_cpu:
            assert loaded == [], loaded
            for p in params:
                st = param_state(p)
                assert st.status is Status.AVAILABLE
                flat = p.data.reshape(-1)
                buf, handle = st.store.load(st.key, st.partition_numel, st.dtype)
                if handle is not None:
                    handle.wait()
                n = st.partition_numel
                mine = flat[rank * n : (rank + 1) * n]
                assert torch.equal(buf[: mine.numel()], mine)  # padding past the param's end aside
                others = [torch.empty_like(flat) for _ in range(world)]
                dist.all_gather(others, flat.contiguous())
                assert all(torch.equal(o, flat) for o in others)
        with zswap.GatheredParameters(params):
            return [p.detach().clone() for p in params]


def main() -> None:
    rank, world = int(sys.argv[1]), int(sys.argv[2])
    init_file, root = sys.argv[3], Path(sys.argv[4])
    dist.init_process_group("gloo", init_method=f"file://{init_file}", rank=rank, world_size=world)
    try:
        for device in ("cpu", "stand-in"):
            for clip in (None, 0.5):
                resident = run(rank, world, root, 10**9, clip, device)
                streamed = run(rank, world, root, 0, clip, device)
                assert all(torch.equal(a, b) for a, b in zip(resident, streamed, strict=True)), (clip, device)
        dist.barrier()
    finally:
        dist.destroy_process_group()


if __name__ == "__main__":
    from _worker_exit import run_then_exit  # the script's folder, tests/, is on sys.path

    run_then_exit(main)
