"""Engine throughput next to the raw disk, measured in the same run on the same directory.

The baseline is fio (io_uring, O_DIRECT, same block size and queue depth), best of its ordinary and
huge-page buffers; without fio, the bare io_uring loop in the Rust crate (`baseline.rs`). Every figure is
the best of `repeat` passes, each an overwrite of space written once before (as fio's are after layout).
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import threading
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import TextIO

import torch

from . import _zswap
from .swap import Backend, SwapEngine


@dataclass(frozen=True)
class Rate:
    """Throughput in GB/s (10^9 bytes per second)."""

    write: float
    read: float
    source: str
    #: Why the figure could not be measured (then write and read are 0).
    unavailable: str | None = None


def fio_rate(path: Path, size: int, block_size: int, queue_depth: int, iomem: str, repeat: int) -> Rate:
    """fio's best of `repeat` write and read passes on a temp file in `path` (deleted afterwards)."""
    target = path / f".zswap-fio-{os.getpid()}"
    best = {"write": 0.0, "read": 0.0}
    try:
        for rw in ["write"] * (repeat + 1) + ["read"] * repeat:
            cmd = [
                "fio", "--name=zswap-baseline", f"--filename={target}", f"--size={size}",
                f"--bs={block_size}", f"--iodepth={queue_depth}", "--ioengine=io_uring", "--direct=1",
                f"--rw={rw}", f"--iomem={iomem}", "--output-format=json",
            ]  # fmt: skip
            r = subprocess.run(cmd, capture_output=True, text=True, timeout=600)
            if r.returncode != 0:
                raise RuntimeError(f"fio failed: {(r.stderr or r.stdout).strip()[-300:]}")
            job = json.loads(r.stdout[r.stdout.index("{") :])["jobs"][0]
            best[rw] = max(best[rw], job[rw]["bw_bytes"] / 1e9)
    finally:
        target.unlink(missing_ok=True)
    return Rate(best["write"], best["read"], f"fio io_uring O_DIRECT iomem={iomem}")


def baseline(path: Path, size: int, block_size: int, queue_depth: int, repeat: int) -> list[Rate]:
    """The raw-disk figures: fio with ordinary and huge-page buffers, or the crate's own loop."""
    if shutil.which("fio") is None:
        best = Rate(0.0, 0.0, "zswap raw io_uring loop (fio not installed)")
        for _ in range(repeat):
            w, r = _zswap.raw_io_uring_baseline(path, size, block_size, queue_depth)
            best = Rate(max(best.write, size / w / 1e9), max(best.read, size / r / 1e9), best.source)
        return [best]
    rates = [fio_rate(path, size, block_size, queue_depth, "malloc", repeat)]
    try:  # needs reserved hugetlb pages (/proc/sys/vm/nr_hugepages)
        rates.append(fio_rate(path, size, block_size, queue_depth, "shmhuge", repeat))
    except RuntimeError as e:
        rates.append(Rate(0.0, 0.0, "fio io_uring O_DIRECT iomem=shmhuge", unavailable=str(e)[:160]))
    return rates


def engine_rate(
    engine: SwapEngine, tensor: torch.Tensor, repeat: int, label: str, progress: Callable[[str], None]
) -> Rate:
    """The engine's best of `repeat` write and read passes of `tensor` through the Python API."""
    size = tensor.numel() * tensor.element_size()
    best = {"write": 0.0, "read": 0.0}
    engine.write("bench", tensor).wait()  # layout pass: later passes overwrite, like fio's
    for i in range(repeat):
        for op in ("write", "read"):
            with _Progress(engine, f"{label}: {op} {i + 1}/{repeat}", size, progress):
                t0 = time.perf_counter()
                getattr(engine, op)("bench", tensor).wait()
                dt = time.perf_counter() - t0
            best[op] = max(best[op], size / dt / 1e9)
    engine.free("bench")
    return Rate(best["write"], best["read"], label)


class _Progress:
    """Prints a progress line from the engine's block counter while a transfer runs (another thread, so
    the timed call itself is not disturbed)."""

    def __init__(self, engine: SwapEngine, label: str, size: int, out: Callable[[str], None]) -> None:
        self.engine, self.label, self.size, self.out = engine, label, size, out
        self.stop = threading.Event()
        self.thread = threading.Thread(target=self._run, daemon=True)

    def __enter__(self) -> _Progress:
        self.start_blocks = self.engine.stats()["blocks"]
        self.thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self.stop.set()
        self.thread.join()

    def _run(self) -> None:
        bs = self.engine.info["block_size"]
        while not self.stop.wait(0.25):
            done = min(self.size, (self.engine.stats()["blocks"] - self.start_blocks) * bs)
            self.out(f"{self.label} {done / 2**20:,.0f}/{self.size / 2**20:,.0f} MiB")


@dataclass
class BenchResult:
    path: str
    size: int
    block_size: int
    queue_depth: int
    backend: str
    direct: bool
    baseline: list[Rate]
    engine_buffers: Rate
    torch_tensors: Rate

    def best_baseline(self) -> tuple[float, float]:
        return max(r.write for r in self.baseline), max(r.read for r in self.baseline)

    def to_json(self) -> str:
        w, r = self.best_baseline()
        d = asdict(self)
        d["ratios"] = {
            name: {"write": _ratio(rate.write, w), "read": _ratio(rate.read, r)}
            for name, rate in (("engine_buffers", self.engine_buffers), ("torch_tensors", self.torch_tensors))
        }
        return json.dumps(d, indent=2)


def _ratio(x: float, base: float) -> float | None:
    return round(x / base, 3) if base > 0 else None


def run(
    path: Path,
    size: int,
    *,
    block_size: int = 1 << 20,
    queue_depth: int = 16,
    backend: Backend = "auto",
    threads: int | None = None,
    repeat: int = 3,
    out: TextIO = sys.stdout,
) -> BenchResult:
    """Measures and prints the table; returns the figures."""
    tty = out.isatty()

    def progress(line: str) -> None:
        if tty:
            out.write(f"\r\033[K{line}")
            out.flush()

    def say(line: str) -> None:
        out.write(("\r\033[K" if tty else "") + line + "\n")
        out.flush()

    say(
        f"zswap bench: {size / 2**30:.2f} GiB in {path}, "
        f"block {block_size >> 10} KiB, queue depth {queue_depth}"
    )
    progress("raw disk baseline...")
    base = baseline(path, size, block_size, queue_depth, repeat)
    with SwapEngine(
        path, block_size=block_size, queue_depth=queue_depth, backend=backend, threads=threads
    ) as e:
        numel = size // 4
        eng = engine_rate(e, e.empty(numel, torch.float32).fill_(1.25), repeat, "engine buffers", progress)
        plain = engine_rate(e, torch.full((numel,), 1.25), repeat, "torch tensors", progress)
        info = e.info
    res = BenchResult(
        str(path), size, block_size, queue_depth, info["backend"], info["direct"], base, eng, plain
    )
    bw, br = res.best_baseline()
    say(f"backend {info['backend']}, direct I/O {info['direct']}, {info['threads']} thread(s)")
    say(f"{'':44}{'write GB/s':>18}{'read GB/s':>18}")
    for r in base:
        if r.unavailable:
            say(f"{'raw disk: ' + r.source:44}{'n/a':>18}{'n/a':>18}  ({r.unavailable})")
        else:
            say(f"{'raw disk: ' + r.source:44}{r.write:>18.2f}{r.read:>18.2f}")
    for r in (eng, plain):
        cells = [f"{v:.2f} ({_ratio(v, b) or 0:.2f}×)" for v, b in ((r.write, bw), (r.read, br))]
        say(f"{'zswap SwapEngine, ' + r.source:44}{cells[0]:>18}{cells[1]:>18}")
    say("ratios are against the best raw-disk figure above")
    return res
