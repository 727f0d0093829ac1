"""One rank of tests/test_step_hf.py's two-rank case: ``python _step_hf_dist_worker.py RANK WORLD INIT_FILE
SWAP_ROOT``.

Each rank trains tiny Hugging Face models (BERT's tied masked-LM head, ALBERT's one layer run in every
layer) on its own micro-batches with dropout on; the reference is plain PyTorch on DDP's averaged gradients
(each rank's micro-batch with that rank's seed). Without clipping params are bitwise equal; the norm is
summed from partition norms, so where clipping bites it agrees to rounding, and so do the params. In bf16
with clipping at 1.0 (the Trainer's default) the reference is the same run with the early step off.
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


LOW_PRECISION: dict[str, dict[str, Any]] = {
    "bf16-clip-1": {"tiers": ("nvme", "nvme"), "device": "cpu", "gas": 1, "clip": 1.0, "half": "bf16"},
    "bf16-stand-in-clip-1": {
        "tiers": ("nvme", "nvme"), "device": "standin", "gas": 1, "clip": 1.0, "half": "bf16"
    },
}  # fmt: skip
"""The Hugging Face Trainer's usual setup (bf16, ``max_grad_norm`` 1.0) over two ranks."""


def check_low(name: str, setup_name: str, rank: int, world: int, root: Path) -> None:
    """bf16 with fp32 masters: each rank's params, norms and losses bitwise its early-off twin's."""
    arch, setup = ARCHS[name], LOW_PRECISION[setup_name]
    mine = [(i + 1, 100 + i) for i in range(rank, STEPS * world, world)]
    runs = []
    for early in (True, False):
        d = root / f"{name}-{setup_name}-{early}-{rank}"
        d.mkdir()
        with warnings.catch_warnings():
            warnings.simplefilter("ignore", zswap.ZswapWarning)
            runs.append(through_zswap(arch, setup, d, early=early, batches=mine))
    (got, norms, losses, stats), (want, want_norms, want_losses, _) = runs
    assert (losses, norms) == (want_losses, want_norms), (name, setup_name)
    assert [n for n, w in want.items() if not torch.equal(got[n], w)] == [], (name, setup_name)
    assert stats["steps_ordinary"] == 1, (name, setup_name, stats["steps_ordinary_reason"])


def main() -> None:
    rank, world = int(sys.argv[1]), int(sys.argv[2])
    init_file, root = sys.argv[3], Path(sys.argv[4])
    dist.init_process_group("gloo", init_method=f"file://{init_file}", rank=rank, world_size=world)
    try:
        for name in ("bert-mlm", "albert-mlm", "gpt-oss"):  # gpt-oss: each rank routes its own tokens
            for setup_name in SETUPS:
                check(name, setup_name, rank, world, root)
        for name in ("qwen2", "bert-mlm"):
            for setup_name in LOW_PRECISION:
                check_low(name, setup_name, rank, world, root)
        dist.barrier()
    finally:
        dist.destroy_process_group()


if __name__ == "__main__":
    from _worker_exit import run_then_exit  # the script's folder, tests/, is on sys.path

    run_then_exit(main)
