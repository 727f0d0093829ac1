"""Python-level benchmark: swap 1 GiB out and in through `SwapEngine`, from engine buffers and from
ordinary torch tensors, next to fio (or zswap's raw io_uring loop) on the same directory, same run.

    python benches/bench_swap.py [--path DIR] [--size 1GiB] [--json out.json]

Not run in CI (`make bench` runs it). Same figures as `zswap bench`, which it calls.
"""

from __future__ import annotations

import sys

from zswap.cli import main

if __name__ == "__main__":
    sys.exit(main(["bench", *sys.argv[1:]]))
