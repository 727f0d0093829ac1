"""Benchmark of ``engine.save_checkpoint`` / ``load_checkpoint``: params and AdamW states on NVMe, saved and
loaded as bytes per second, next to baselines measured in the same run on the same folder:

- fio (io_uring, O_DIRECT): a write to a *new* file (as a save writes new files) and a read of it, at the
  checkpoint's own concurrency (8 MiB blocks, 4 in flight) and at the disk's best (1 MiB, 16 in flight);
  without fio, the crate's raw io_uring loop.
- the copy bound: a save reads every byte from the offload tier and writes it to the checkpoint, a load reads
  it (twice: every block's CRC is verified before anything changes) and writes it to the tier, all on the
  same disk here, so ``bytes/read + bytes/write`` (``+ bytes/read`` for the load) at fio's rates is the
  least time either can take.
- memcpy (torch ``copy_`` of 8 MiB blocks): a save copies every byte once into its staging buffers and a
  load copies it out of them, so on a machine where copying is slower than the disk, memcpy is the bound.

    python benches/bench_checkpoint.py [--size 512MiB] [--path DIR]

``--size`` is the float32 params' size; the checkpoint is 3x that (params, exp_avg, exp_avg_sq). Target:
save and load >= 0.8x the disk. Not run in CI.
"""

from __future__ import annotations

import argparse
import json
import shutil
import subprocess
import sys
import tempfile
import time
import warnings
from pathlib import Path

import torch
from torch import nn

import zswap
from zswap import _zswap
from zswap.cli import _size

WIDTH = 2048


def fio(path: Path, size: int, bs: str, depth: int) -> tuple[float, float] | None:
    if shutil.which("fio") is None:
        return None
    target = path / "fio-baseline"
    rates = []
    try:
        for rw in ("write", "read"):
            cmd = [
                "fio", "--name=ckpt", f"--filename={target}", f"--size={size}", f"--bs={bs}",
                f"--iodepth={depth}", "--ioengine=io_uring", "--direct=1", f"--rw={rw}",
                "--output-format=json",
            ]  # fmt: skip
            r = subprocess.run(cmd, capture_output=True, text=True, timeout=600, check=True)
            job = json.loads(r.stdout[r.stdout.index("{") :])["jobs"][0]
            rates.append(job[rw]["bw_bytes"] / 1e9)
    finally:
        target.unlink(missing_ok=True)
    return rates[0], rates[1]


def memcpy_rate() -> float:
    src = torch.ones(64 << 20, dtype=torch.uint8)
    dst = torch.zeros(8 << 20, dtype=torch.uint8)
    best = 0.0
    for _ in range(3):
        t0 = time.perf_counter()
        for i in range(8):
            dst.copy_(src[i << 23 : (i + 1) << 23])
        best = max(best, (64 << 20) / (time.perf_counter() - t0) / 1e9)
    return best


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--size", type=_size, default=512 << 20)
    ap.add_argument("--path", type=Path)
    args = ap.parse_args()
    root = Path(tempfile.mkdtemp(prefix="zswap-bench-ckpt-", dir=args.path))
    try:
        swap = root / "swap"
        swap.mkdir()
        cfg = {
            "zero_optimization": {
                "offload_param": {"device": "nvme", "nvme_path": str(swap)},
                "offload_optimizer": {"device": "nvme", "nvme_path": str(swap)},
                "sub_group_size": 4 << 20,
            },
            "optimizer": {"type": "AdamW", "params": {"lr": 1e-4}},
        }
        with warnings.catch_warnings():
            warnings.simplefilter("ignore", zswap.ZswapWarning)
            with zswap.Init(cfg):
                m = nn.Sequential(
                    *(nn.Linear(WIDTH, WIDTH, bias=False) for _ in range(args.size // (WIDTH * WIDTH * 4)))
                )
            engine = zswap.initialize(m, cfg)
        with engine:
            m(torch.randn(1, WIDTH)).square().mean().backward()
            engine.step()
            t0 = time.perf_counter()
            folder = engine.save_checkpoint(root / "ckpt")
            save_s = time.perf_counter() - t0
            nbytes = sum(f.stat().st_size for f in folder.iterdir())
            t0 = time.perf_counter()
            engine.load_checkpoint(root / "ckpt")
            load_s = time.perf_counter() - t0
        shutil.rmtree(root / "ckpt")
        baselines = {}
        for label, bs, depth in (
            ("fio 8MiB x4 (same concurrency)", "8m", 4),
            ("fio 1MiB x16 (disk best)", "1m", 16),
        ):
            r = fio(root, nbytes, bs, depth)
            if r is not None:
                baselines[label] = r
        if not baselines:
            w, r = _zswap.raw_io_uring_baseline(root, nbytes, 1 << 20, 16)
            baselines["raw io_uring loop 1MiB x16 (fio not installed)"] = (nbytes / w / 1e9, nbytes / r / 1e9)
        copy = memcpy_rate()
    finally:
        shutil.rmtree(root, ignore_errors=True)
    save, load = nbytes / save_s / 1e9, nbytes / load_s / 1e9
    print(
        f"checkpoint: {nbytes / 1e9:.2f} GB (params {args.size / 2**20:.0f} MiB fp32 + exp_avg + exp_avg_sq),"
        f" save {save_s:.2f} s, load {load_s:.2f} s (load verifies every block's CRC first)"
    )
    print(f"{'':42}{'write/save GB/s':>17}{'read/load GB/s':>16}")
    print(f"{'zswap checkpoint':42}{save:>17.2f}{load:>16.2f}")
    for label, (w, r) in baselines.items():
        print(f"{label:42}{w:>17.2f}{r:>16.2f}   ratio save {save / w:.2f}x, load {load / r:.2f}x")
    w, r = max(baselines.values())
    save_bound = 1 / (1 / r + 1 / w)
    load_bound = 1 / (2 / r + 1 / w)
    print(f"{'copy bound (tier <-> checkpoint, same disk)':42}{save_bound:>17.2f}{load_bound:>16.2f}   "
          f"ratio save {save / save_bound:.2f}x, load {load / load_bound:.2f}x")  # fmt: skip
    print(
        f"{'memcpy (torch copy_, 8 MiB)':42}{copy:>17.2f}{copy:>16.2f}   "
        f"ratio save {save / copy:.2f}x, load {load / copy:.2f}x"
    )
    sys.stdout.flush()


if __name__ == "__main__":
    main()
