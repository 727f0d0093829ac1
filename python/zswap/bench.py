"""Engine throughput next to the raw disk, like with like, measured in the same run on the same directory.

Four cases, each for engine buffers (`SwapEngine.empty`) and for ordinary torch tensors, each beside the
fio figure for the same case (io_uring, O_DIRECT, same block size and queue depth, best of its buffer
kinds) and the ratio:

- fresh write: the engine writes into a new swap file, fio onto a new file (both `fallocate`d, never
  written: the file system converts unwritten extents as it goes);
- rewrite: both write over space already written once (for the engine: the key's copy-on-write target
  is an extent written before);
- read into touched memory: into the tensor that was just written (fio reuses its buffers);
- read into untouched memory: into a tensor allocated just before the timed read (outside the timer),
  as every fetch into a new buffer does. fio has no such case; its read figure is the baseline.

Without fio the crate's bare io_uring loop (`baseline.rs`) is the baseline (one write and one read
figure for every row). Every figure is the best of `repeat` passes; fio and the engine alternate pass by
pass so a drifting disk moves both, in an order that turns by one each pass.

Unless given, the block size and queue depth are the engine's own picks for the drive (its request
limits in sysfs and the page size of engine memory), and fio runs with the same two; the table is
preceded by the settings in force and why each has its value.
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
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import TextIO

import torch

from . import _zswap
from .swap import Backend, SwapEngine

#: The four cases, in the order printed.
CASES = ("fresh write", "rewrite", "read, touched memory", "read, untouched memory")
#: Which fio figure each case is compared with.
_FIO_CASE = {
    "fresh write": "fresh write",
    "rewrite": "rewrite",
    "read, touched memory": "read",
    "read, untouched memory": "read",
}
#: ratio targets of issue 14 (engine buffers, ordinary tensors).
TARGETS = {"engine buffers": 0.95, "torch tensors": 0.90}
#: fio's buffer kinds: plain malloc, malloc on transparent huge pages (glibc's `hugetlb=1` tunable makes
#: malloc advise MADV_HUGEPAGE, as the engine does with its buffers), and reserved hugetlb pages.
_FIO_IOMEM = {
    "malloc": ("malloc", {}),
    "malloc+THP": ("malloc", {"GLIBC_TUNABLES": "glibc.malloc.hugetlb=1"}),
    "shmhuge": ("shmhuge", {}),
}


@dataclass(frozen=True)
class Rate:
    """Throughput in GB/s (10^9 bytes per second). `write` is over space written before, `fresh_write`
    onto a new file (0 where not measured)."""

    write: float
    read: float
    source: str
    #: Why the figure could not be measured (then write and read are 0).
    unavailable: str | None = None
    fresh_write: float = 0.0


#: A pass's figures: (GB/s, CPU seconds per GB moved — user + system, every thread of the process).
Pass = tuple[float, float]


def _fio_pass(target: Path, size: int, block_size: int, queue_depth: int, rw: str, iomem: str) -> Pass:
    mem, env = _FIO_IOMEM[iomem]
    cmd = [
        "fio", "--name=zswap-baseline", f"--filename={target}", f"--size={size}",
        f"--bs={block_size}", f"--iodepth={queue_depth}", "--ioengine=io_uring", "--direct=1",
        f"--rw={rw}", f"--iomem={mem}", "--output-format=json",
    ]  # fmt: skip
    r = subprocess.run(cmd, capture_output=True, text=True, timeout=600, env={**os.environ, **env})
    if r.returncode != 0:
        first = (r.stderr or r.stdout).strip().splitlines() or ["no output"]
        raise RuntimeError(f"fio failed: {first[0][:160]}")
    job = json.loads(r.stdout[r.stdout.index("{") :])["jobs"][0]
    gbps = float(job[rw]["bw_bytes"]) / 1e9
    cpu_s = (float(job["usr_cpu"]) + float(job["sys_cpu"])) / 100 * float(job["job_runtime"]) / 1e3
    return gbps, cpu_s / (size / 1e9)


def fio_cases(path: Path, size: int, block_size: int, queue_depth: int, iomem: str) -> dict[str, Pass]:
    """One fio pass of each case on a new temp file in `path` (deleted afterwards): write onto the new
    file, write over it again, read it."""
    target = path / f".zswap-fio-{os.getpid()}"
    target.unlink(missing_ok=True)
    try:
        return {
            "fresh write": _fio_pass(target, size, block_size, queue_depth, "write", iomem),
            "rewrite": _fio_pass(target, size, block_size, queue_depth, "write", iomem),
            "read": _fio_pass(target, size, block_size, queue_depth, "read", iomem),
        }
    finally:
        target.unlink(missing_ok=True)


def _best(into: dict[str, Pass], new: dict[str, Pass]) -> None:
    """Keeps each case's fastest pass (with that pass's CPU figure)."""
    for k, v in new.items():
        into[k] = max(into.get(k, (0.0, 0.0)), v)


def baseline(path: Path, size: int, block_size: int, queue_depth: int, repeat: int) -> list[Rate]:
    """The raw-disk figures: fio with each buffer kind (best of `repeat`), or the crate's own loop."""
    if shutil.which("fio") is None:
        return [_raw_loop(path, size, block_size, queue_depth, repeat)]
    rates = []
    for iomem in _FIO_IOMEM:
        best: dict[str, Pass] = {}
        try:
            for _ in range(repeat):
                _best(best, fio_cases(path, size, block_size, queue_depth, iomem))
        except RuntimeError as e:  # shmhuge needs reserved hugetlb pages (/proc/sys/vm/nr_hugepages)
            rates.append(Rate(0.0, 0.0, f"fio io_uring O_DIRECT iomem={iomem}", unavailable=str(e)[:160]))
            continue
        rates.append(_fio_rate(best, iomem))
    return rates


def _fio_rate(best: dict[str, Pass], iomem: str) -> Rate:
    source = f"fio io_uring O_DIRECT iomem={iomem}"
    return Rate(best["rewrite"][0], best["read"][0], source, None, best["fresh write"][0])


def _raw_loop(path: Path, size: int, block_size: int, queue_depth: int, repeat: int) -> Rate:
    w_best = r_best = 0.0
    for _ in range(repeat):
        w, r = _zswap.raw_io_uring_baseline(path, size, block_size, queue_depth)
        w_best, r_best = max(w_best, size / w / 1e9), max(r_best, size / r / 1e9)
    return Rate(w_best, r_best, "zswap raw io_uring loop (fio not installed)", None, w_best)


def engine_rate(
    engine: SwapEngine, tensor: torch.Tensor, repeat: int, label: str, progress: Callable[[str], None]
) -> Rate:
    """The engine's best of `repeat` overwrite and read (into `tensor`, touched) passes, after a layout
    pass: the steady-state figures `zswap tune` and other benches compare."""
    size = tensor.numel() * tensor.element_size()
    best = {"write": 0.0, "read": 0.0}
    engine.write("bench", tensor).wait()  # layout pass: later passes overwrite, like fio's
    for i in range(repeat):
        for op in ("write", "read"):
            move = getattr(engine, op)
            with _Progress(engine, f"{label}: {op} {i + 1}/{repeat}", size, progress):
                dt = _timed(lambda: move("bench", tensor).wait())  # noqa: B023 (called at once)
            best[op] = max(best[op], size / dt / 1e9)
    engine.free("bench")
    return Rate(best["write"], best["read"], label)


def _timed(fn: Callable[[], object]) -> float:
    t0 = time.perf_counter()
    fn()
    return time.perf_counter() - t0


#: How each kind of tensor is made: in an engine buffer, or by torch's own allocator.
_MAKERS: dict[str, Callable[[SwapEngine, int], torch.Tensor]] = {
    "engine buffers": lambda e, n: e.empty(n, torch.float32),
    "torch tensors": lambda _e, n: torch.empty(n, dtype=torch.float32),
}


def engine_cases(
    path: Path, size: int, kind: str, engine_kwargs: dict[str, object], progress: Callable[[str], None]
) -> tuple[dict[str, Pass], dict[str, object]]:
    """One pass of each case through a new engine (so the first write lands on a new swap file);
    returns GB/s by case and the engine's `info`. Raises `AssertionError` if a read returns other bytes
    than were written (a benchmark of wrong results would mean nothing)."""
    make = _MAKERS[kind]
    numel = size // 4
    out: dict[str, Pass] = {}
    with SwapEngine(path, **engine_kwargs) as e:  # type: ignore[arg-type]

        def timed(case: str, fn: Callable[[], object]) -> None:
            with _Progress(e, f"{kind}: {case}", size, progress):
                cpu0 = time.process_time()
                dt = _timed(fn)
                out[case] = (size / dt / 1e9, (time.process_time() - cpu0) / (size / 1e9))

        src = make(e, numel)
        torch.arange(numel, out=src, dtype=torch.float32)  # a pattern a misplaced block would break
        sample = src[:: 1 << 16].clone()
        timed("fresh write", lambda: e.write("bench", src).wait())
        e.write("bench", src).wait()  # the copy-on-write target of the next write is now laid out too
        timed("rewrite", lambda: e.write("bench", src).wait())
        timed("read, touched memory", lambda: e.read("bench", src).wait())
        fresh = make(e, numel)  # allocated outside the timer, never touched
        timed("read, untouched memory", lambda: e.read("bench", fresh).wait())
        if not torch.equal(fresh, src) or not torch.equal(src[:: 1 << 16], sample):
            raise AssertionError(f"zswap bench: {kind}: the bytes read back differ from those written")
        info = dict(e.info)
    return out, info


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


@dataclass(frozen=True)
class Row:
    case: str
    zswap: float
    #: The same-run baseline figure (GB/s) and what it is.
    baseline: float
    baseline_case: str
    ratio: float | None
    #: CPU seconds per GB moved, zswap's (all threads of this process) and the baseline's.
    cpu_per_gb: float = 0.0
    baseline_cpu_per_gb: float = 0.0


@dataclass
class BenchResult:
    path: str
    size: int
    block_size: int
    queue_depth: int
    backend: str
    direct: bool
    #: The raw-disk figures, one per fio buffer kind (or the crate's loop).
    baseline: list[Rate]
    #: "engine buffers" / "torch tensors" -> the four cases.
    rows: dict[str, list[Row]] = field(default_factory=dict)
    #: Each setting in force -> (value, why), as printed above the table.
    settings: dict[str, tuple[str, str]] = field(default_factory=dict)

    def to_json(self) -> str:
        return json.dumps(asdict(self), indent=2)


_PAGES = {
    "hugetlb": "reserved 2 MiB hugetlb pages: a block is one or two physically contiguous runs",
    "thp": "2 MiB transparent huge pages (THP policy allows): a block is one or two contiguous runs",
    "small": "base pages (THP off, no hugetlb pages reserved): a request carries max_segments pages",
}


def settings(info: dict[str, object], threads_given: bool) -> dict[str, tuple[str, str]]:
    """The settings an engine runs with (its `info`) and why each has its value, in print order."""

    def split(reason: object) -> tuple[str, str]:
        value, _, why = str(reason).partition(": ")
        return value, why

    limits = info.get("queue_limits")
    if isinstance(limits, dict):
        drive = f"{limits['max_sectors_kb']} KiB × {limits['max_segments']}"
        drive_why = (
            f"max_sectors_kb × max_segments (sysfs queue/; nr_requests {limits['nr_requests']}): "
            "a request's limits, which the block size follows"
        )
    else:
        drive, drive_why = "none", "no block device under the path (tmpfs, overlayfs, network)"
    threads = str(info["threads"])
    return {
        "block size": split(info["block_size_reason"]),
        "queue depth": split(info["queue_depth_reason"]),
        "worker rings": (
            threads,
            "given" if threads_given else "the engine's default: 2, at least one per path, at most the depth",
        ),
        "engine buffers": (
            str(info["buffer_pages"]),
            _PAGES.get(str(info["buffer_pages"]), "?") + _measured_huge(info.get("buffer_huge_share")),
        ),
        "bounce buffers": (
            f"{info['bounce_pages']}, {int(str(info['bounce_bytes'])) >> 20} MiB",
            (
                "registered with the ring (READ_FIXED / WRITE_FIXED)"
                if info["fixed_buffers"]
                else "not registered (the kernel refused): plain READ / WRITE"
            )
            + _spare_why(int(str(info.get("bounce_spare", 0)))),
        ),
        "engine buffer reads": (
            "zero-copy" if info["zero_copy_reads"] else "bounced",
            str(info["zero_copy_reads_reason"]),
        ),
        "fresh read destinations": (
            "huge pages" if info["huge_destinations"] else "base pages",
            str(info["huge_destinations_reason"]),
        ),
        "drive": (drive, drive_why),
    }


def huge_share(addr: int, nbytes: int) -> float | None:
    """Share of the resident memory of the mappings holding ``[addr, addr + nbytes)`` that the kernel
    backs with huge pages (``/proc/self/smaps``: AnonHugePages and hugetlb over all), or None where
    smaps is not there. What the THP policy allows is not what a mapping gets: an unaligned mapping, a
    fragmented or ballooned host, or ``defrag`` settings can leave it on base pages."""
    try:
        text = Path("/proc/self/smaps").read_text()
    except OSError:
        return None
    rss = huge = 0
    inside = False
    for line in text.splitlines():
        head = line.split(maxsplit=1)[0] if line else ""
        if "-" in head and not head.endswith(":"):
            lo, hi = (int(x, 16) for x in head.split("-"))
            inside = lo < addr + nbytes and addr < hi
        elif inside and head == "Rss:":
            rss += int(line.split()[1])
        elif inside and head == "AnonHugePages:":
            huge += int(line.split()[1])
        elif inside and head in ("Private_Hugetlb:", "Shared_Hugetlb:"):  # hugetlb is not in Rss
            rss += int(line.split()[1])
            huge += int(line.split()[1])
    return huge / rss if rss else None


def _measured_huge(share: object) -> str:
    if not isinstance(share, float):
        return ""
    return f"; measured: {share:.0%} of a fresh engine buffer in huge pages (smaps)"


def _spare_why(spare: int) -> str:
    if spare == 0:
        return "; one per slot: a block's copy waits for a free slot"
    return (
        f"; one per slot and {spare} spare per ring: the next block is copied while every slot is in flight"
    )


def _ratio(x: float, base: float) -> float | None:
    return round(x / base, 3) if base > 0 else None


class SizeBelowBlock(ValueError):
    """`run`'s ``size`` is below one block (a usage error: the command line says so before any pass)."""


def run(
    path: Path,
    size: int,
    *,
    block_size: int | None = None,
    queue_depth: int | None = None,
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

    size = max(4096, size // 4096 * 4096)
    # What the engine picks for this drive (where not given); fio then runs with the same values.
    with SwapEngine(
        path, block_size=block_size, queue_depth=queue_depth, backend=backend, threads=threads
    ) as e:
        picked = dict(e.info)
        probe = e.empty(max(int(picked["block_size"]), 4 << 20) // 4, torch.float32)
        picked["buffer_huge_share"] = huge_share(probe.data_ptr(), probe.numel() * 4)
        del probe
    given = block_size is not None
    block_size, queue_depth = int(picked["block_size"]), int(picked["queue_depth"])
    have_fio = shutil.which("fio") is not None
    if have_fio and size < block_size:
        # fio, the baseline, cannot run a job smaller than one block.
        whose = "--block-size" if given else "this drive's block"
        raise SizeBelowBlock(
            f"--size {size} bytes is below {whose} ({block_size >> 10} KiB), which fio, the baseline, needs "
            f"in one job: give at least {block_size >> 20 or 1} MiB"
        )
    say(
        f"zswap bench: {size / 2**30:.2f} GiB in {path}, "
        f"block {block_size >> 10} KiB, queue depth {queue_depth}, best of {repeat}"
    )
    chosen = settings(picked, threads is not None)
    say("settings (fio runs with the same block size and queue depth):")
    for name, (value, why) in chosen.items():
        say(f"  {name:24}{value:>12}  {why}")
    kwargs: dict[str, object] = {
        "block_size": block_size, "queue_depth": queue_depth, "backend": backend, "threads": threads,
    }  # fmt: skip
    fio_best: dict[str, dict[str, Pass]] = {k: {} for k in _FIO_IOMEM}
    fio_errors: dict[str, str] = {}
    eng_best: dict[str, dict[str, Pass]] = {k: {} for k in _MAKERS}
    load = os.getloadavg()[0]
    info: dict[str, object] = {}
    contenders = [("fio", k) for k in (_FIO_IOMEM if have_fio else ())] + [("zswap", k) for k in _MAKERS]
    for i in range(repeat):
        # fio and the engine alternate pass by pass, so a drifting disk moves both; the order turns by one
        # each pass, so no contender always runs first or last (a disk's rate drifts within a pass too).
        shift = i % len(contenders)
        for who, k in contenders[shift:] + contenders[:shift]:
            if who == "zswap":
                got, info = engine_cases(path, size, k, kwargs, progress)
                _best(eng_best[k], got)
                continue
            if k in fio_errors:
                continue
            progress(f"fio iomem={k} {i + 1}/{repeat}...")
            try:
                _best(fio_best[k], fio_cases(path, size, block_size, queue_depth, k))
            except RuntimeError as e:  # shmhuge needs reserved hugetlb pages
                fio_errors[k] = str(e)[:160]
    if have_fio:
        base = [
            Rate(0.0, 0.0, f"fio io_uring O_DIRECT iomem={k}", unavailable=fio_errors[k])
            if k in fio_errors
            else _fio_rate(fio_best[k], k)
            for k in _FIO_IOMEM
        ]
    else:
        base = [_raw_loop(path, size, block_size, queue_depth, repeat)]
    # Per fio case, the fastest buffer kind's pass (or the raw loop's figure, CPU not measured).
    fio: dict[str, Pass] = {}
    for k, cases in fio_best.items():
        if k not in fio_errors:
            _best(fio, cases)
    if not have_fio:
        (raw,) = base
        fio = {"fresh write": (raw.fresh_write, 0.0), "rewrite": (raw.write, 0.0), "read": (raw.read, 0.0)}
    res = BenchResult(
        str(path), size, block_size, queue_depth, str(info["backend"]), bool(info["direct"]), base,
        settings=chosen,
    )  # fmt: skip
    for kind, figures in eng_best.items():
        rows = []
        for c in CASES:
            (z, z_cpu), (b, b_cpu) = figures[c], fio[_FIO_CASE[c]]
            rows.append(Row(c, z, b, _FIO_CASE[c], _ratio(z, b), round(z_cpu, 3), round(b_cpu, 3)))
        res.rows[kind] = rows
    say(f"backend {info['backend']}, direct I/O {info['direct']}, {info['threads']} thread(s)")
    say(f"{'raw disk, GB/s':48}{'fresh write':>12}{'rewrite':>10}{'read':>8}")
    for r in base:
        if r.unavailable:
            say(f"  {r.source:46}{'n/a':>12}  ({r.unavailable})")
        else:
            say(f"  {r.source:46}{r.fresh_write:>12.2f}{r.write:>10.2f}{r.read:>8.2f}")
    say(
        f"{'zswap SwapEngine, GB/s':34}{'zswap':>8}{'baseline':>10}{'ratio':>8}{'target':>8}"
        f"{'CPU s/GB zswap / baseline':>28}"
    )
    for kind, rows in res.rows.items():
        say(f"  {kind}")
        for row in rows:
            ok = row.ratio is not None and row.ratio >= TARGETS[kind]
            say(
                f"    {row.case:30}{row.zswap:>8.2f}{row.baseline:>10.2f}"
                f"{(row.ratio or 0):>7.2f}×{f'≥ {TARGETS[kind]:.2f}':>8}"
                f"{f'{row.cpu_per_gb:.2f} / {row.baseline_cpu_per_gb:.2f}':>28}{'' if ok else '  (below)'}"
            )
    say("baseline: the best raw-disk figure above for the same case (both reads: fio's read)")
    end = os.getloadavg()[0]
    say(f"load average (1 min): {load:.1f} at the start, {end:.1f} at the end; {os.cpu_count()} CPUs")
    return res
