"""One rank of tests/test_step_shapes.py's two-rank case: ``python _step_shapes_dist_worker.py RANK WORLD
INIT_FILE SWAP_ROOT``.

Each rank trains `Shaped` (tied weights, a branch taken on every other step or in each step's first
micro-batch only) on its own micro-batches; the
reference is plain PyTorch on DDP's averaged gradients. Without clipping, or with clipping that does not
bite, params are bitwise equal. The global norm is built from each rank's partition norms (DDP's
``clip_grad_norm_`` takes each whole gradient's norm), so it agrees to rounding, and where clipping bites
so do the params. An lr set between backward and step on every step defers every step after the first,
bitwise too; hyper-parameters first set there at a milestone are redone at that step, bitwise too.
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
from tests.test_step_shapes import STEPS, batches, milestone, plain, through_zswap, warmup_cosine

SETUPS: dict[str, dict[str, Any]] = {
    "nvme": {"tiers": ("nvme", "nvme"), "device": "cpu", "gas": 1, "clip": None},
    "some-resident-clip-idle-gas2": {
        "tiers": ("nvme", "cpu"), "device": "cpu", "gas": 2, "clip": 1e6, "max_in_cpu": 300
    },
    "stand-in-clip-bites": {"tiers": ("nvme", "nvme"), "device": "standin", "gas": 1, "clip": 1.0},
    "torch-adamw-given": {"tiers": ("nvme", "nvme"), "device": "cpu", "gas": 1, "clip": None, "given": True},
}  # fmt: skip


def check(kind: str, name: str, rank: int, world: int, root: Path, scheduled: str = "") -> None:
    """``scheduled`` "every": the lr set between backward and step on every step (`warmup_cosine`): every
    step after the first is deferred; "milestone": lr, eps and weight decay set there at step 3 only
    (`milestone`): that step is redone at the step."""
    setup = SETUPS[name]
    gas, clip = setup["gas"], setup["clip"]
    lr_at = {"": None, "every": warmup_cosine, "milestone": milestone("AdamW")}[scheduled]
    want, want_norms = plain(kind, "AdamW", gas, clip, world, lr_at=lr_at)
    mine = batches(STEPS * gas * world)[rank::world]
    d = root / f"{kind}-{name}-{rank}-{scheduled}"
    d.mkdir()
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", zswap.ZswapWarning)
        got, norms, stats = through_zswap(d, kind, setup, mine, lr_at=lr_at)
    assert stats["steps_ordinary"] == 1, (kind, name, stats["steps_ordinary_reason"])
    torch.testing.assert_close(torch.tensor(norms), torch.tensor(want_norms), rtol=1e-6, atol=0)
    if scheduled and clip != 1.0:
        if scheduled == "every":
            assert stats["steps_deferred"] == STEPS - 1, (kind, name, stats)
        else:  # the milestone's step redone at the step, the one after it deferred
            assert (stats["steps_hypers_redone"], stats["steps_deferred"]) == (1, 1), (kind, name, stats)
        differ = [i for i, (g, w) in enumerate(zip(got, want, strict=True)) if not torch.equal(g, w)]
        assert differ == [], (kind, name, "scheduled")
    elif clip == 1.0:  # bites on every step
        assert stats["steps_deferred"] == STEPS - 1, (kind, name, stats)
        for i, (g, w) in enumerate(zip(got, want, strict=True)):
            torch.testing.assert_close(g, w, rtol=1e-5, atol=1e-6, msg=f"{kind} {name} param {i}")
    else:
        assert stats["steps_in_backward"] == STEPS - 1, (kind, name, stats)
        differ = [i for i, (g, w) in enumerate(zip(got, want, strict=True)) if not torch.equal(g, w)]
        assert differ == [], (kind, name)


def main() -> None:
    rank, world = int(sys.argv[1]), int(sys.argv[2])
    init_file, root = sys.argv[3], Path(sys.argv[4])
    dist.init_process_group("gloo", init_method=f"file://{init_file}", rank=rank, world_size=world)
    try:
        for kind in ("tied", "branch", "first-micro"):
            for name in SETUPS:
                check(kind, name, rank, world, root)
        check("tied", "nvme", rank, world, root, scheduled="every")
        check("tied", "nvme", rank, world, root, scheduled="milestone")
        dist.barrier()
    finally:
        dist.destroy_process_group()


if __name__ == "__main__":
    from _worker_exit import run_then_exit  # the script's folder, tests/, is on sys.path

    run_then_exit(main)
