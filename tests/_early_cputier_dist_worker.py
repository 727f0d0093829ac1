"""One rank of tests/test_early_cputier.py's two-rank test: ``python _early_cputier_dist_worker.py RANK
WORLD INIT_FILE SWAP_ROOT``.

Twins over one model partitioned across both ranks — the early step on, and off — for each setup with
states, params or both in CPU memory, each rank on its own data. After every optimizer step this rank's
params (gathered: a collective) and optimizer records are bitwise the twin's, for clipping that does not
bite, that bites (redone) and the deferred step after it; the early one committed where it may. Again
with an early step's cap a part of the copies kept for the commit fits: that part updated in backward.
"""

from __future__ import annotations

import sys
import warnings
from pathlib import Path

import torch.distributed as dist

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import zswap
from tests._early_dist_worker import check

LIMITS = [1e6, 1e6, 1e-3, 1e-3, 1e6, 1e6]
"""Not biting, biting (redone), then deferred while it bites, then back in backward."""
WANT = [(0, 0, 0), (1, 0, 0), (0, 1, 0), (0, 0, 1), (0, 0, 1), (1, 0, 0)]
"""(in backward, redone, deferred) of each step."""
PART_CAP = 18_000
"""An early step's cap a part of each rank's copies kept for the commit fits in every setup, short of all:
the first records backward completes need 6432 bytes of them with states in CPU memory (the most) and room
for 8704 bytes of param copies and gradients held besides (`zswap.step.early_memory.plan_part`)."""


def main() -> None:
    rank, world = int(sys.argv[1]), int(sys.argv[2])
    dist.init_process_group("gloo", init_method=f"file://{sys.argv[3]}", rank=rank, world_size=world)
    root = Path(sys.argv[4])
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore", zswap.ZswapWarning)
            for tiers in (("nvme", "cpu"), ("cpu", "nvme"), ("cpu", "cpu")):
                seen = check(root / "-".join(tiers), rank, LIMITS, 1, [b for b, _, _ in WANT], tiers=tiers)
                assert seen == WANT, (rank, tiers, seen)
                # Copies kept for the commit past the cap: the part that fits is updated in backward.
                part = [b for b, _, _ in WANT]
                seen = check(
                    root / f"part-{tiers}", rank, LIMITS, 1, part, tiers=tiers, cap=PART_CAP, partly=part
                )
                assert seen == WANT, (rank, tiers, seen)
        dist.barrier()
    finally:
        dist.destroy_process_group()


if __name__ == "__main__":
    from _worker_exit import run_then_exit  # the script's folder, tests/, is on sys.path

    run_then_exit(main)
