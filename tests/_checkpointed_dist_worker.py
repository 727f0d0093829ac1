"""One rank of tests/test_checkpointed_step.py's two-rank case: ``python _checkpointed_dist_worker.py RANK
WORLD INIT_FILE SWAP_ROOT``. Each rank trains the checkpointed blocks on its own micro-batches, without
clipping and with clipping that does not bite; the reference is plain PyTorch on DDP's averaged gradients,
bitwise.
"""

from __future__ import annotations

import sys
import warnings
from pathlib import Path

import torch
import torch.distributed as dist

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import zswap
from tests.test_checkpointed_step import STEPS, batches, plain, through_zswap


def main() -> None:
    rank, world = int(sys.argv[1]), int(sys.argv[2])
    init_file, root = sys.argv[3], Path(sys.argv[4])
    dist.init_process_group("gloo", init_method=f"file://{init_file}", rank=rank, world_size=world)
    try:
        for gas, clip in ((1, None), (2, 1e6)):
            d = root / f"{gas}-{rank}"
            d.mkdir()
            mine = batches(STEPS * gas * world)[rank::world]
            with warnings.catch_warnings():
                warnings.simplefilter("ignore", zswap.ZswapWarning)
                got, stats = through_zswap(d, "blocks", gas, clip, False, mine=mine)
            want = plain("blocks", gas, clip, world)
            for step, (g, w) in enumerate(zip(got, want, strict=True)):
                assert all(torch.equal(a, b) for a, b in zip(g, w, strict=True)), (gas, step)
            assert [st["steps_in_backward"] for st in stats] == [0] + [1] * (STEPS - 1), (gas, stats)
        dist.barrier()
    finally:
        dist.destroy_process_group()


if __name__ == "__main__":
    from _worker_exit import run_then_exit  # the script's folder, tests/, is on sys.path

    run_then_exit(main)
