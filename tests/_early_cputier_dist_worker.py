"""One rank of tests/test_early_cputier.py's two-rank test: ``python _early_cputier_dist_worker.py RANK
WORLD INIT_FILE SWAP_ROOT``.

Twins over one model partitioned across both ranks — the early step on, and off — for each setup with
states, params or both in CPU memory, each rank on its own data. After every optimizer step this rank's
params (gathered: a collective) and optimizer records are bitwise the twin's, for clipping that does not
bite, that bites (redone) and the deferred step after it; the early one committed where it may.
"""

from __future__ import annotations

import sys
import warnings
from pathlib import Path

import torch
import torch.distributed as dist

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import zswap
from tests.test_faults import cfg_for, optim_state, params_of, same
from tests.test_runtime import TinyLM, ids, sq


def check(root: Path, rank: int, params: str, states: str) -> None:
    runs = []
    for name, early in (("early", True), ("plain", False)):
        d = root / f"{params}-{states}-{name}-{rank}"
        d.mkdir(parents=True, exist_ok=True)
        cfg = cfg_for(d, params, states)
        torch.manual_seed(0)
        with zswap.Init(cfg):
            m = TinyLM()
        e = zswap.initialize(m, cfg)
        e.early_step = early
        runs.append((m, e))
    (m, e), (ref, ref_e) = runs
    limits = [1e6, 1e6, 1e-3, 1e-3, 1e6, 1e6]
    seen = []
    for step, limit in enumerate(limits):
        for mm, ee in runs:
            ee.max_grad_norm = limit
            ee.stats(reset=True)
            ee.backward(sq(mm(ids(seed=100 * rank + step))))
            ee.step()
        s = e.stats()
        seen.append((s["steps_in_backward"], s["steps_redone"], s["steps_deferred"]))
        assert same(params_of(m), params_of(ref)), (rank, step)
        assert same(optim_state(e.optimizer, m), optim_state(ref_e.optimizer, ref)), (rank, step)
        assert e.last_grad_norm == ref_e.last_grad_norm, (rank, step)
    want = [(0, 0, 0), (1, 0, 0), (0, 1, 0), (0, 0, 1), (0, 0, 1), (1, 0, 0)]
    assert seen == want, (rank, params, states, seen)
    for _, ee in runs:
        ee.close()


def main() -> None:
    rank, world = int(sys.argv[1]), int(sys.argv[2])
    dist.init_process_group("gloo", init_method=f"file://{sys.argv[3]}", rank=rank, world_size=world)
    root = Path(sys.argv[4])
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore", zswap.ZswapWarning)
            for params, states in (("nvme", "cpu"), ("cpu", "nvme"), ("cpu", "cpu")):
                check(root, rank, params, states)
        dist.barrier()
    finally:
        dist.destroy_process_group()


if __name__ == "__main__":
    from _worker_exit import run_then_exit  # the script's folder, tests/, is on sys.path

    run_then_exit(main)
