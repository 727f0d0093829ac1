"""What `checksum: crc32c` costs: swap-out and swap-in throughput through `SwapEngine` with checksums on
and off, same directory, same run, interleaved (best of `--repeat` rounds of each), from engine buffers
(zero-copy: the checksum is the only CPU work per byte) and from ordinary torch tensors (bounced).

    python benches/bench_checksum.py [--path DIR] [--size 256MiB] [--repeat 5] [--direct auto]

Prints GB/s for each and the ratio on/off. `aio.checksum` defaults to "off" because that ratio was
measured below 0.97 here (README, "Checksums"). Not run in CI.
"""

from __future__ import annotations

import argparse
import tempfile
import time

import torch

from zswap import SwapEngine


def _size(s: str) -> int:
    units = {"KiB": 1 << 10, "MiB": 1 << 20, "GiB": 1 << 30}
    for u, m in units.items():
        if s.endswith(u):
            return int(float(s[: -len(u)]) * m)
    return int(s)


def _round(e: SwapEngine, src: torch.Tensor, out: torch.Tensor) -> tuple[float, float]:
    t0 = time.perf_counter()
    e.write("k", src).wait()
    t1 = time.perf_counter()
    e.read("k", out).wait()
    t2 = time.perf_counter()
    return t1 - t0, t2 - t1


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--path", default=None)
    ap.add_argument("--size", default="256MiB")
    ap.add_argument("--repeat", type=int, default=5)
    ap.add_argument("--direct", default="auto", choices=["auto", "true", "false"])
    a = ap.parse_args()
    n = _size(a.size)
    direct: bool | str = {"auto": "auto", "true": True, "false": False}[a.direct]
    with tempfile.TemporaryDirectory(dir=a.path or "/var/tmp") as d:
        engines = {c: SwapEngine(d, checksum=c, direct=direct) for c in ("off", "crc32c")}  # type: ignore[arg-type]
        info = engines["off"].info
        print(
            f"bench_checksum: {n / 2**20:.0f} MiB in {d}, backend {info['backend']}, "
            f"direct {info['direct']}, block {info['block_size'] >> 10} KiB, "
            f"queue depth {info['queue_depth']}, best of {a.repeat}"
        )
        best: dict[tuple[str, str], list[float]] = {}
        for mem in ("engine buffers", "torch tensors"):
            bufs = {}
            for c, e in engines.items():
                if mem == "engine buffers":
                    src, out = e.empty(n, torch.uint8), e.empty(n, torch.uint8)
                    src.copy_(torch.randint(0, 256, (n,), dtype=torch.uint8))
                else:
                    src = torch.randint(0, 256, (n,), dtype=torch.uint8)
                    out = torch.empty_like(src)
                bufs[c] = (src, out)
                _round(e, src, out)  # warm-up: the file grows once
            for _ in range(a.repeat):
                for c, e in engines.items():  # interleaved, so drift hits both alike
                    w, r = _round(e, *bufs[c])
                    cur = best.setdefault((mem, c), [float("inf"), float("inf")])
                    cur[0], cur[1] = min(cur[0], w), min(cur[1], r)
        print(f"{'':34}{'write GB/s':>12}{'read GB/s':>12}")
        for mem in ("engine buffers", "torch tensors"):
            gb = {c: [n / t / 1e9 for t in best[(mem, c)]] for c in ("off", "crc32c")}
            print(f"{mem + ', checksum off':34}{gb['off'][0]:12.2f}{gb['off'][1]:12.2f}")
            print(f"{mem + ', checksum crc32c':34}{gb['crc32c'][0]:12.2f}{gb['crc32c'][1]:12.2f}")
            ratio = [gb["crc32c"][i] / gb["off"][i] for i in (0, 1)]
            print(f"{'  ratio crc32c / off':34}{ratio[0]:11.3f}×{ratio[1]:11.3f}×")
        for e in engines.values():
            e.close()


if __name__ == "__main__":
    main()
