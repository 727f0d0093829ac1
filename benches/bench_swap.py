"""Python-level benchmark: 1 GiB through `SwapEngine`, engine buffers and ordinary torch tensors — fresh
write, rewrite, read into touched and into untouched memory — each next to fio's figure for the same case
(or zswap's raw io_uring loop) on the same directory, same run, with the ratio.

    python benches/bench_swap.py [--path DIR] [--size 1GiB] [--json out.json]

Not run in CI (`make bench` runs it). Same figures as `zswap bench`, which it calls.
"""

from __future__ import annotations

import sys

from zswap.cli import main

if __name__ == "__main__":
    sys.exit(main(["bench", *sys.argv[1:]]))
