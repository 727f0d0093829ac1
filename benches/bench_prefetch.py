"""Prefetch hit rates on the first and later iterations, and the read bandwidth of an I/O-bound inference
pass next to fio's on the same directory, in the same run.

    python benches/bench_prefetch.py [--size 512MiB] [--passes 4] [--repeat 1] [--path DIR] [--skip-gpt]

1. I/O-bound inference: ``nn.Sequential`` of ``Linear(2048, 2048)`` (16 MiB of fp32 each) up to ``--size``,
   params on NVMe, a batch of one row (compute is a matrix-vector product per layer, far below the I/O).
   For pass 1 (the static guess; `initialize` faulted its read buffers in and read the first ones
   ahead), passes 2.. (the recorded trace) and the first pass of a second kind (train mode under
   no_grad: the static guess again, into buffers already used): prefetch hit rate, bytes read / wall
   time, and that next to the disk's best raw read in the same directory (``fio --rw=read``, io_uring,
   O_DIRECT, 1 MiB blocks, the engine's queue depth, with malloc'd and huge-page buffers, and the crate's
   bare io_uring loop, also run right after each setting's passes), with the ratio (target >= 0.85),
   and pass 1's rate next to the later passes' of the same engines. Twice, in the same run: with the
   reads ahead across passes (`Engine.prefetch_across_passes`, the default) and without (the first step
   of every pass read on demand). The passes run back to back, pass 1 right after `initialize` (whose
   last act is to issue its reads ahead, as a pass's end issues the next one's); bytes are the engine's
   completed reads in each pass's wall time (not `Engine.stats()`, which waits for reads ahead in
   flight). ``--repeat R``: R new models and engines per setting, one after the other, their rows
   summed (R passes 1: one pass is a fraction of a second on a shared disk). Before any of it, a plain
   PyTorch model of the same shapes runs its first and second forward (printed): the process's one-time
   warm-up is paid there, not in zswap's pass 1.
2. The `zswap demo` model (GPT-style, live budget 1/6 of the model, at ``--size``) for inference and
   training (forward + backward + `Engine.step`): hit rate of iteration 1 and of iterations 2.. (target
   >= 0.95 from the second on).

The swap dir is a temp dir under /var/tmp unless --path. Results are never compared here (the tests do).
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
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

import zswap
from zswap.cli import _size
from zswap.demo import BATCH, GPT, Shape, default_config

WIDTH = 2048


def say(line: str) -> None:
    print(line, flush=True)


def fio_read(path: Path, size: int, queue_depth: int, iomem: str, repeat: int = 2) -> float:
    """fio's best sequential O_DIRECT read, GB/s, over a file of ``size`` in ``path``."""
    target = path / ".bench-prefetch-fio"
    best = 0.0
    try:
        for _ in range(repeat):  # fio lays the file out before its first read pass
            cmd = [
                "fio", "--name=prefetch-baseline", f"--filename={target}", f"--size={size}", "--bs=1M",
                f"--iodepth={queue_depth}", "--ioengine=io_uring", "--direct=1", "--rw=read",
                f"--iomem={iomem}", "--output-format=json",
            ]  # fmt: skip
            r = subprocess.run(cmd, capture_output=True, text=True, timeout=600)
            if r.returncode != 0:
                raise RuntimeError((r.stderr or r.stdout).strip()[-200:])
            job = json.loads(r.stdout[r.stdout.index("{") :])["jobs"][0]
            best = max(best, job["read"]["bw_bytes"] / 1e9)
    finally:
        target.unlink(missing_ok=True)
    return best


def bare_read(path: Path, size: int, queue_depth: int) -> float:
    """The crate's bare io_uring read loop on huge pages over ``size`` in ``path``, GB/s."""
    _, seconds = zswap._zswap.raw_io_uring_baseline(path, size, 1 << 20, queue_depth)
    return float(size / seconds / 1e9)


def disk_read(path: Path, size: int, queue_depth: int, earlier: list[float]) -> float:
    """The best raw read rate of the disk, GB/s: fio with malloc'd and (where hugetlb pages are reserved)
    huge-page buffers, and the crate's bare io_uring loop on huge pages, now and right after each setting's
    passes (``earlier``: the disk is shared, so its rate drifts within a run; the best is the baseline);
    each printed."""
    rates: dict[str, float] = {}
    for i, rate in enumerate(earlier, 1):
        rates[f"bare io_uring loop (huge pages), after setting {i}'s passes"] = rate
    if shutil.which("fio") is not None:
        for iomem in ("malloc", "shmhuge"):
            try:
                rates[f"fio --iomem={iomem}"] = fio_read(path, size, queue_depth, iomem)
            except RuntimeError as e:
                say(f"  fio --iomem={iomem}: not run ({str(e).splitlines()[0]})")
    else:
        say("  fio not installed")
    rates["bare io_uring loop (huge pages), at the end"] = bare_read(path, size, queue_depth)
    for name, rate in rates.items():
        say(
            f"  raw disk read, same dir, {mib(size)}, 1 MiB blocks, qd {queue_depth}, {name}: {rate:.2f} GB/s"
        )
    return max(rates.values())


def mib(n: float) -> str:
    return f"{n / 2**20:.0f} MiB"


def hit_rate(s: dict[str, Any]) -> str:
    return f"{s['prefetch_hit_rate']:6.1%} ({s['prefetch_hits']}/{s['fetches']})"


def summed(stats: list[dict[str, Any]]) -> dict[str, Any]:
    out = {k: sum(s[k] for s in stats) for k in ("prefetch_hits", "fetches", "bytes_read")}
    out["prefetch_hit_rate"] = out["prefetch_hits"] / out["fetches"] if out["fetches"] else 0.0
    return out


def io_bound(path: Path, size: int, passes: int, across: bool) -> tuple[int, int, list[tuple[str, Any]]]:
    """The I/O-bound passes with reads ahead across passes on or off: (model bytes, queue depth, rows)."""
    layers = max(2, size // (WIDTH * WIDTH * 4))
    cfg = {"zero_optimization": {"offload_param": {"device": "nvme", "nvme_path": str(path)}}}
    torch.manual_seed(0)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", zswap.ZswapWarning)
        with zswap.Init(cfg):
            model = nn.Sequential(*(nn.Linear(WIDTH, WIDTH) for _ in range(layers)))
        engine = zswap.initialize(model, cfg)
    # Pass 1 starts right after `initialize` (nothing read or waited for in between: no `Engine.stats()`),
    # as each later pass starts right after the one before: each with the reads ahead just issued.
    engine.prefetch_across_passes = across
    swap = zswap.param_state(model[0].weight).store.engine  # type: ignore[union-attr]
    x = torch.randn(1, WIDTH)

    def snap() -> tuple[int, int, int, float]:
        # Counters read without `Engine.stats()` (which waits for reads ahead): the passes run back to
        # back, and the engine's bytes are those completed in each pass's own wall time.
        c = engine._sched.counters
        return c.prefetch_hits, c.demand_fetches, int(swap.stats()["bytes_read"]), time.perf_counter()

    deltas = []
    model.eval()
    with torch.no_grad():
        before = snap()
        for i in range(passes + 1):
            if i == passes:  # a new kind (train mode, no grad): a guessed pass into buffers used before
                model.train()
            model(x)
            after = snap()
            deltas.append([b - a for a, b in zip(before, after, strict=True)])
            before = after
    s = engine.stats()
    engine.close()
    depth = int(swap.info.get("queue_depth", 16))  # in all: the engine's rings share it
    model_bytes = sum(zswap.param_state(p).numel for p in model.parameters()) * 4  # type: ignore[union-attr]
    say(
        f"I/O-bound inference, reads ahead across passes {'on' if across else 'off'}: {layers} x "
        f"Linear({WIDTH}, {WIDTH}), {mib(model_bytes)} fp32 on NVMe; live budget "
        f"{mib(s['max_live_elements'] * 4)}, bucket {mib(s['prefetch_bucket_elements'] * 4)}"
    )
    parts = (
        ("pass 1 (guess)", deltas[:1]),
        (f"passes 2-{passes} (recorded)", deltas[1:passes]),
        ("new kind's pass 1 (guess)", deltas[passes:]),
    )
    rows = []
    for label, part in parts:
        if part:
            hits, demand, nbytes, wall = (sum(d[k] for d in part) for k in range(4))
            rows.append((label, {"prefetch_hits": hits, "fetches": hits + demand, "bytes_read": nbytes,
                                 "wall": wall, "passes": len(part)}))  # fmt: skip
    return model_bytes, depth, rows


def plain_warm_up(size: int) -> None:
    """A plain PyTorch model of the I/O-bound one's shapes (at most 16 layers, in RAM): its first and
    second forward, timed and printed. The difference is the process's one-time warm-up (kernels, thread
    pool, allocator), which any model pays once; paid here, before any zswap pass, so that zswap's pass 1
    is measured without it."""
    layers = min(16, max(2, size // (WIDTH * WIDTH * 4)))
    torch.manual_seed(0)
    plain = nn.Sequential(*(nn.Linear(WIDTH, WIDTH) for _ in range(layers))).eval()
    x = torch.randn(1, WIDTH)
    ms = []
    with torch.no_grad():
        for _ in range(2):
            t0 = time.perf_counter()
            plain(x)
            ms.append((time.perf_counter() - t0) * 1e3)
    say(
        f"plain PyTorch, {layers} x Linear({WIDTH}, {WIDTH}) in RAM, batch of one row, before any zswap "
        f"pass: forward 1 {ms[0]:.1f} ms, forward 2 {ms[1]:.1f} ms = {ms[0] / ms[1]:.2f} x (one-time warm-up "
        f"{ms[0] - ms[1]:+.1f} ms)"
    )


def report(rows: list[tuple[str, Any]], disk: float, across: bool) -> None:
    rate = {label: st["bytes_read"] / st["wall"] / 1e9 for label, st in rows}
    for label, st in rows:
        st["prefetch_hit_rate"] = st["prefetch_hits"] / st["fetches"] if st["fetches"] else 0.0
        gbs, ms = rate[label], st["wall"] * 1e3 / st["passes"]
        say(
            f"  across {'on ' if across else 'off'} {label:28s} hit rate {hit_rate(st)}, "
            f"{mib(st['bytes_read'])} in {ms:.0f} ms a pass, {gbs:.2f} GB/s = {gbs / disk:.2f} x the best "
            "raw read"
        )
    if len(rows) > 2:  # the same engine, passes back to back: the ratio the disk's drift disturbs least
        (first, _), (later, _) = rows[0], rows[1]
        on = "on " if across else "off"
        say(f"  across {on} {first} at {rate[first] / rate[later]:.2f} x {later}'s rate, same engines")


def gpt(path: Path, size: int, passes: int) -> None:
    shape = Shape.for_bytes(size)
    cfg = zswap.load_config(default_config(path, shape))
    torch.manual_seed(0)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", zswap.ZswapWarning)
        with zswap.Init(cfg):
            model = GPT(shape)
        engine = zswap.initialize(model, cfg)
    say(f"demo GPT: {shape.layers} layers x {shape.width}, {mib(shape.params * 4)} fp32, live budget 1/6")
    batch = torch.randint(0, shape.vocab, (BATCH, shape.seq), generator=torch.Generator().manual_seed(0))
    inference, training = [], []
    model.eval()
    engine.stats(reset=True)
    with torch.no_grad():
        for _ in range(passes):
            model(batch)
            inference.append(engine.stats(reset=True))
    model.train()
    for _ in range(passes):
        logits = model(batch[:, :-1])
        F.cross_entropy(logits.reshape(-1, shape.vocab), batch[:, 1:].reshape(-1)).backward()
        training.append(engine.stats(reset=True))  # before step: its reads are not fetches
        engine.step()
        engine.stats(reset=True)
    engine.close()
    for label, runs in (("inference", inference), ("training", training)):
        later = f", iterations 2-{passes} {hit_rate(summed(runs[1:]))}" if passes > 1 else ""
        say(f"  {label:10s} iteration 1 (static guess) {hit_rate(runs[0])}{later}")


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--size", type=_size, default=512 << 20)
    ap.add_argument("--passes", type=int, default=4)
    ap.add_argument("--path", type=Path)
    ap.add_argument("--skip-gpt", action="store_true")
    ap.add_argument(
        "--repeat", type=int, default=1, help="I/O-bound engines per setting, summed (a pass 1 each)"
    )
    args = ap.parse_args(argv)
    plain_warm_up(args.size)
    with tempfile.TemporaryDirectory(dir=args.path or "/var/tmp", prefix="zswap-bench-prefetch-") as d:
        runs, bare = [], []
        for across in (True, False):
            totals: dict[str, dict[str, Any]] = {}
            for _ in range(args.repeat):  # each a new model and engine: its own pass 1
                model_bytes, depth, got = io_bound(Path(d), args.size, args.passes, across)
                for label, st in got:
                    into = totals.setdefault(label, dict.fromkeys(st, 0))
                    for k, v in st.items():
                        into[k] += v
            runs.append((across, (model_bytes, depth, list(totals.items()))))
            bare.append(bare_read(Path(d), model_bytes, depth))
        model_bytes, depth, _ = runs[0][1]
        disk = disk_read(Path(d), model_bytes, depth, bare)
        for across, (_, _, rows) in runs:
            report(rows, disk, across)
        if not args.skip_gpt:
            gpt(Path(d), args.size, args.passes)


if __name__ == "__main__":
    sys.exit(main())
