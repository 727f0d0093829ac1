"""One rank of tests/test_step_hf.py's two-rank case: ``python _step_hf_dist_worker.py RANK WORLD INIT_FILE
SWAP_ROOT``.

Each rank trains tiny Hugging Face models (BERT's tied masked-LM head, ALBERT's one layer run in every
layer) on its own micro-batches with dropout on; the reference is plain PyTorch on DDP's averaged gradients
(each rank's micro-batch with that rank's seed). Without clipping params are bitwise equal; the norm is
summed from partition norms, so where clipping bites it agrees to rounding, and so do the params.
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
from tests._hf_archs import ARCHS
from tests.test_step_hf import STEPS, plain, through_zswap

SETUPS: dict[str, dict[str, Any]] = {
    "nvme": {"tiers": ("nvme", "nvme"), "device": "cpu", "gas": 1, "clip": None},
    "stand-in-gas2": {"tiers": ("nvme", "cpu"), "device": "standin", "gas": 2, "clip": None},
    "clip-bites": {"tiers": ("nvme", "nvme"), "device": "cpu", "gas": 1, "clip": 1e-3},
}


def check(name: str, setup_name: str, rank: int, world: int, root: Path) -> None:
    arch, setup = ARCHS[name], SETUPS[setup_name]
    want, want_norms = plain(arch, setup, world)
    d = root / f"{name}-{setup_name}-{rank}"
    d.mkdir()
    mine = [(i + 1, 100 + i) for i in range(rank, STEPS * setup["gas"] * world, world)]
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", zswap.ZswapWarning)
        got, norms, _, stats = through_zswap(arch, setup, d, batches=mine)
    assert stats["steps_ordinary"] == 1, (name, setup_name, stats["steps_ordinary_reason"])
    assert stats["steps_in_backward"] + stats["steps_deferred"] == STEPS - 1, (name, setup_name, stats)
    if setup["clip"]:
        torch.testing.assert_close(torch.tensor(norms), torch.tensor(want_norms), rtol=1e-6, atol=0)
        for n, w in want.items():
            torch.testing.assert_close(got[n], w, rtol=1e-5, atol=1e-6, msg=f"{name} {setup_name} {n}")
    else:
        assert [n for n, w in want.items() if not torch.equal(got[n], w)] == [], (name, setup_name)


def main() -> None:
    rank, world = int(sys.argv[1]), int(sys.argv[2])
    init_file, root = sys.argv[3], Path(sys.argv[4])
    dist.init_process_group("gloo", init_method=f"file://{init_file}", rank=rank, world_size=world)
    try:
        for name in ("bert-mlm", "albert-mlm"):
            for setup_name in SETUPS:
                check(name, setup_name, rank, world, root)
        dist.barrier()
    finally:
        dist.destroy_process_group()


if __name__ == "__main__":
    from _worker_exit import run_then_exit  # the script's folder, tests/, is on sys.path

    run_then_exit(main)
