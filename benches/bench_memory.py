"""Peak memory of `zswap demo` (build under Init, 3 inference passes, AdamW steps, params and optimizer
states on NVMe) at several model sizes, against the bound of issue 14 (not run in CI).

Each run is its own subprocess, so its ``ru_maxrss`` belongs to that run alone. Baselines measured in the
same invocation, each in a fresh subprocess too:

- ``import torch``: the process after ``import torch, zswap`` (what the issue calls the torch baseline);
- ``torch training``: that plus what any PyTorch training process pays once — a ``torch.optim.AdamW``
  (its first ``add_param_group`` imports ``torch._dynamo``, sympy and triton: ~150 MiB here) and one
  activation-checkpointed ``Linear`` forward + backward (torch's kernels paged in).

Bound: peak RSS − baseline ≤ live-param budget + the optimizer's in-flight sub-groups (its ring of three
records) + 256 MiB, the same at every size (the demo caps its live budget at 128 MiB and its sub-groups at
8 Mi elements, so the bound itself does not grow with the model). The breakdown comes from the run's
``Engine.stats()`` ``mem_*`` lines (peaks over the training phase).

Usage: ``python benches/bench_memory.py [--path DIR] [--sizes 0.75GiB,3GiB,6GiB] [--steps 2]``. The default
runs 0.75 GiB only; 3 GiB needs ~15 GiB free on DIR's disk and about 5 minutes on this VM, 6 GiB ~30 GiB
(params + two Adam moments + gradients, plus copy-on-write slack) and about 10 minutes.
"""

from __future__ import annotations

import argparse
import json
import resource
import subprocess
import sys
import tempfile
import time
from typing import Any

MIB = 1 << 20
SLACK = 256 * MIB


def _maxrss() -> int:
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024  # Linux reports KiB


def _child_import() -> dict[str, Any]:
    import torch  # noqa: F401

    import zswap  # noqa: F401

    return {"peak_rss": _maxrss()}


def _child_training() -> dict[str, Any]:
    import torch
    from torch.utils.checkpoint import checkpoint

    import zswap  # noqa: F401

    p = torch.nn.Parameter(torch.zeros(16))
    opt = torch.optim.AdamW([p])
    p.grad = torch.ones(16)
    opt.step()
    lin = torch.nn.Linear(1024, 1024)
    x = torch.randn(2, 64, 1024, requires_grad=True)
    checkpoint(lin, x, use_reentrant=False).sum().backward()
    return {"peak_rss": _maxrss()}


def _child_demo(path: str, size: int, steps: int) -> dict[str, Any]:
    import io
    from pathlib import Path

    from zswap import demo

    t0 = time.perf_counter()
    fig = demo.run(Path(path), size, None, steps, out=io.StringIO())
    t = fig["training"]
    return {
        "peak_rss": _maxrss(),
        "seconds": time.perf_counter() - t0,
        "model_bytes": fig["model_bytes"],
        "losses": fig["losses"],
        "step_seconds": t["wall_seconds"] / steps,
        "step_read": t["bytes_read"] / steps,
        "step_written": t["bytes_written"] / steps,
        "live_bytes": t["max_live_elements"] * 4,
        "inference_rss": fig["inference_rss"],
        **{k: v for k, v in t.items() if k.startswith("mem_")},
    }


def _run(args: list[str]) -> dict[str, Any]:
    out = subprocess.run(
        [sys.executable, __file__, "--child", *args], capture_output=True, text=True, check=False
    )
    if out.returncode != 0:
        raise SystemExit(f"child {args} failed:\n{out.stderr[-4000:]}")
    return json.loads(out.stdout.strip().splitlines()[-1])


def _size(text: str) -> int:
    units = {"GiB": 1 << 30, "MiB": 1 << 20}
    for unit, mul in units.items():
        if text.endswith(unit):
            return int(float(text[: -len(unit)]) * mul)
    return int(text)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--path", default=None, help="swap directory (default: a temp dir under /tmp)")
    ap.add_argument("--sizes", default="0.75GiB", help="comma-separated model sizes (default 0.75GiB)")
    ap.add_argument("--steps", type=int, default=2)
    ap.add_argument("--child", nargs="+", help=argparse.SUPPRESS)
    a = ap.parse_args()
    if a.child:
        kind, *rest = a.child
        if kind == "import":
            res = _child_import()
        elif kind == "training":
            res = _child_training()
        else:
            res = _child_demo(rest[0], int(rest[1]), int(rest[2]))
        print(json.dumps(res))
        return

    imp = _run(["import"])["peak_rss"]
    train = _run(["training"])["peak_rss"]
    print(f"baselines: import torch {imp / MIB:,.0f} MiB; torch training fixed cost {train / MIB:,.0f} MiB")
    hdr = (
        f"{'model':>9} {'peak RSS':>9} {'- import':>9} {'- train':>9} {'bound':>7} {'ratio':>11} "
        f"{'live':>6} {'ring':>6} {'fetch':>6} {'grads':>6} {'bounce':>6} {'queue':>6} {'s/step':>7} "
        f"{'GiB/step r+w':>13} loss"
    )
    print(hdr)
    for text in a.sizes.split(","):
        size = _size(text.strip())
        with tempfile.TemporaryDirectory(dir=a.path or "/tmp") as d:
            r = _run(["demo", d, str(size), str(a.steps)])
        bound = r["live_bytes"] + r["mem_peak_optimizer_ring"] + SLACK
        over_imp, over_train = r["peak_rss"] - imp, r["peak_rss"] - train
        losses = r["losses"]
        ratio = f"{over_imp / bound:.2f}/{over_train / bound:.2f}×"
        print(
            f"{r['model_bytes'] / MIB:>5,.0f} MiB {r['peak_rss'] / MIB:>5,.0f} MiB "
            f"{over_imp / MIB:>5,.0f} MiB "
            f"{over_train / MIB:>5,.0f} MiB {bound / MIB:>7,.0f} {ratio:>11} "
            f"{r['live_bytes'] / MIB:>6,.0f} {r['mem_peak_optimizer_ring'] / MIB:>6,.0f} "
            f"{r['mem_peak_fetch_buffers'] / MIB:>6,.0f} {r['mem_peak_grad_buffers'] / MIB:>6,.0f} "
            f"{r['mem_bounce'] / MIB:>6,.0f} {r['mem_write_queue_limit'] / MIB:>6,.0f} "
            f"{r['step_seconds']:>7.2f} {r['step_read'] / 2**30:>6.2f}+{r['step_written'] / 2**30:<6.2f} "
            f"{losses[0]:.3f}→{losses[-1]:.3f}"
        )
    print(
        "bound = live budget + optimizer ring + 256 MiB; ratio = (peak − import baseline)/bound and "
        "(peak − training baseline)/bound, target ≤ 1.00 at every size. Columns live…queue in MiB: the "
        "budget, and the training phase's peaks of engine buffers by purpose (Engine.stats() mem_peak_*), "
        "bounce buffers, write-queue limit."
    )


if __name__ == "__main__":
    main()
