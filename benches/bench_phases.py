"""Where a training step's wall time goes: per step, forward / backward / optimizer seconds, this process's
CPU (user, sys), minor page faults and voluntary context switches, and per phase the machine's CPU split
(user, sys, idle, iowait, steal) and the swap disk's read / write rates and busy time.

    python benches/bench_phases.py [--size 2GiB] [--steps 4] [--path DIR] [--plain | --output-pool]
        [--clip NORM]

The model, batch and config are `benches/bench_step_bytes.py`'s (`zswap.demo.GPT` of ``--size`` fp32
bytes, params and AdamW states on NVMe); ``--plain`` runs the same model in RAM with
``torch.optim.AdamW(fused=True)`` instead, the compute baseline; ``--clip`` clips the global norm (the
engine's ``max_grad_norm``; in RAM ``clip_grad_norm_``) and prints how each zswap step ran (in backward,
deferred, redone, ordinary). The first step places the optimizer
records; read the steps after it. The machine figures come from ``/proc/stat`` and the disk holding
``--path`` from ``/proc/diskstats``, so they include everything else running: on a shared VM the steal
column says how much of the wall time the host took. It is a profile for finding the cause of a step time
(CPU-bound or disk-bound, faulting, stolen), not a figure for the README's tables: those come from
`bench_step_bytes.py`, each beside its baseline.
"""

from __future__ import annotations

import argparse
import os
import resource
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from bench_step_bytes import forward_loss, peak_rss, setup_ram, setup_zswap  # the same model and config

Sample = tuple[list[int], int, int, int]


def _disk_of(path: Path) -> str:
    """The /proc/diskstats name of the whole disk holding ``path`` (on tmpfs, say, a name no line has: the
    disk columns read 0)."""
    dev = os.stat(path).st_dev
    name = Path(f"/sys/dev/block/{os.major(dev)}:{os.minor(dev)}").resolve().name
    part = Path(f"/sys/class/block/{name}/partition")
    return Path(f"/sys/class/block/{name}").resolve().parent.name if part.exists() else name


def _sample(disk: str) -> Sample:
    with open("/proc/stat") as f:
        cpu = [int(x) for x in f.readline().split()[1:]]
    read = written = busy_ms = 0
    with open("/proc/diskstats") as f:
        for line in f:
            d = line.split()
            if d[2] == disk:  # sectors of 512 B read (5) and written (9), ms busy (12)
                read, written, busy_ms = int(d[5]) * 512, int(d[9]) * 512, int(d[12])
    return cpu, read, written, busy_ms


def _window(a: Sample, b: Sample, wall: float) -> str:
    d = [y - x for x, y in zip(a[0], b[0], strict=True)]
    total = sum(d[:8]) or 1
    user, nice, system, idle, iowait, irq, softirq, steal = d[:8]
    pct = lambda *xs: f"{100 * sum(xs) / total:3.0f}"  # noqa: E731
    return (
        f"us {pct(user, nice)} sy {pct(system, irq, softirq)} id {pct(idle)} wa {pct(iowait)} "
        f"st {pct(steal)} | disk r {(b[1] - a[1]) / wall / 1e9:.2f} w {(b[2] - a[2]) / wall / 1e9:.2f} "
        f"GB/s busy {min(100.0, (b[3] - a[3]) / 10 / wall):3.0f}%"
    )


def _clipped(apply: Any, params: list[torch.nn.Parameter], norm: float) -> Any:
    def clip_then_apply() -> None:
        torch.nn.utils.clip_grad_norm_(params, norm)
        apply()

    return clip_then_apply


def _how(engine: Any) -> str:
    """How the engine's step ran, from the counters' moves since the last call ("" in RAM)."""
    if engine is None:
        return ""
    s = engine.stats(reset=True)
    keys = ("steps_in_backward", "steps_deferred", "steps_redone", "steps_ordinary")
    return " " + "/".join(str(s[k]) for k in keys) + " b/d/r/o"


def main(argv: list[str] | None = None) -> int:
    from zswap.cli import _size

    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--size", default="2GiB", help="fp32 bytes of params (default 2GiB)")
    ap.add_argument("--steps", type=int, default=4)
    ap.add_argument("--path", type=Path, help="swap directory (default: a temp dir under /var/tmp)")
    ap.add_argument("--plain", action="store_true", help="plain PyTorch in RAM instead of zswap")
    ap.add_argument(
        "--output-pool",
        action="store_true",
        help="engine.reuse_backward_outputs = True (zswap.outputs; off by default)",
    )
    ap.add_argument("--clip", type=float, help="clip the gradients' global norm to this")
    args = ap.parse_args(argv)
    with tempfile.TemporaryDirectory(dir="/var/tmp", prefix="zswap-phases-") as tmp:
        path = args.path or Path(tmp)
        path.mkdir(parents=True, exist_ok=True)
        disk = _disk_of(path)
        size = _size(args.size)
        s = setup_ram(size) if args.plain else setup_zswap(size, path)
        if args.output_pool and s.engine is not None:
            s.engine.reuse_backward_outputs = True
        if args.clip is not None and s.engine is not None:
            s.engine.max_grad_norm = args.clip
        elif args.clip is not None:
            s = s._replace(apply=_clipped(s.apply, list(s.model.parameters()), args.clip))
        try:
            for i in range(args.steps):
                r0, s0, t0 = resource.getrusage(resource.RUSAGE_SELF), _sample(disk), time.perf_counter()
                loss = forward_loss(s)
                s1, t1 = _sample(disk), time.perf_counter()
                loss.backward()
                s2, t2 = _sample(disk), time.perf_counter()
                s.apply()
                t3, r1 = time.perf_counter(), resource.getrusage(resource.RUSAGE_SELF)
                print(
                    f"step {i}: {t3 - t0:.2f} s = forward {t1 - t0:.2f} + backward {t2 - t1:.2f} + step "
                    f"{t3 - t2:.2f} | CPU user {r1.ru_utime - r0.ru_utime:.2f} s, sys "
                    f"{r1.ru_stime - r0.ru_stime:.2f} s, {r1.ru_minflt - r0.ru_minflt} minor faults, "
                    f"{r1.ru_nvcsw - r0.ru_nvcsw} voluntary switches, loss {float(loss.detach()):.4f}",
                    flush=True,
                )
                print(f"    forward  [{_window(s0, s1, t1 - t0)}]", flush=True)
                print(f"    backward [{_window(s1, s2, t2 - t1)}]", flush=True)
                print(f"    step     [{_window(s2, _sample(disk), t3 - t2)}]{_how(s.engine)}", flush=True)
            if s.engine is not None:
                pool = s.engine._hooks.outputs.pool
                print(f"output pool: {pool.made} buffers made, {pool.reused} outputs reused", flush=True)
        finally:
            if s.engine is not None:
                s.engine.close()
    print(f"VmHWM: {peak_rss() // 1024} kB")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
