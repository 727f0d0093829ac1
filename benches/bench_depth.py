"""What grows with depth: the `zswap demo` GPT at a fixed live budget and sub-group size, at two depths, each
in a fresh process; what is resident at the start of the first backward (every checkpointed block input
alive) and at the process's peak, split by the ledger (`zswap.memory`), glibc's account and, with
``--trace``, Python's allocations (tracemalloc), per layer (not run in CI).

    python benches/bench_depth.py [--width 1024] [--layers 8,24] [--path DIR] [--trace] [--no-early-step]

Width 1024 is the demo's (each block's checkpointed input, 2 × 63 × 1024 fp32 = 504 KiB, is then mapped by
itself: ``heap_mapped``); a narrower model makes it a heap chunk. A sampler thread records the ledger at
each new RSS high, so the peak's phase (forward, backward, step of iteration 1 or 2) is known.
"""

from __future__ import annotations

import argparse
import json
import resource
import subprocess
import sys
import tempfile
import threading
import time
import tracemalloc
import warnings
from typing import Any

MIB = 1 << 20


def _maxrss() -> int:
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024


def child(layers: int, width: int, path: str, trace: bool, early: bool) -> dict[str, Any]:
    import torch
    import torch.nn.functional as F
    from torch.utils.checkpoint import checkpoint

    import zswap
    from zswap import demo, memory

    # What every torch training process pays once (benches/bench_memory.py's "training" baseline).
    p = torch.nn.Parameter(torch.zeros(16))
    opt = torch.optim.AdamW([p])
    p.grad = torch.ones(16)
    opt.step()
    checkpoint(
        torch.nn.Linear(width, width), torch.randn(2, 64, width, requires_grad=True), use_reentrant=False
    )
    base = _maxrss()
    shape = demo.Shape(vocab=8 * width, width=width, layers=layers, heads=max(1, width // 64), seq=demo.SEQ)
    largest = max(shape.vocab * width, 4 * width * width) + shape.seq * width
    live = 4 * largest  # fixed: the bound does not change with the depth
    cfg = {
        "zero_optimization": {
            "offload_param": {"device": "nvme", "nvme_path": path},
            "offload_optimizer": {"device": "nvme", "nvme_path": path},
            "stage3_max_live_parameters": live,
            "stage3_prefetch_bucket_size": live - largest,
            "stage3_param_persistence_threshold": 10 * width,
            "sub_group_size": 1 << 20,
        },
        "optimizer": {"type": "AdamW", "params": {"lr": 1e-3, "weight_decay": 0.0}},
    }
    torch.manual_seed(0)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", zswap.ZswapWarning)
        with zswap.Init(cfg):
            model = demo.GPT(shape, checkpoint_blocks=True)
        engine = zswap.initialize(model, cfg)
    engine.early_step = early
    if trace:
        tracemalloc.start()
    batch = torch.randint(0, shape.vocab, (demo.BATCH, shape.seq), generator=torch.Generator().manual_seed(0))
    model.eval()
    with torch.no_grad():
        model(batch)
    model.train()

    def account() -> dict[str, Any]:
        return {"rss": memory.rss(), **memory.live(), **{f"held_{k}": v for k, v in memory.held().items()},
                **memory.heap(), "python": tracemalloc.get_traced_memory()[0] if trace else 0}  # fmt: skip

    phase, peak, start = ["init"], {"rss": 0}, {}
    stop = threading.Event()

    def sample() -> None:
        while not stop.is_set():
            if memory.rss() > peak["rss"]:
                peak.update(account(), phase=phase[0])
            time.sleep(0.002)

    sampler = threading.Thread(target=sample, daemon=True)
    sampler.start()
    for step in range(2):
        phase[0] = f"forward {step + 1}"
        logits = model(batch[:, :-1])

        def at_backward(_: Any, step: int = step) -> None:
            phase[0] = f"backward {step + 1}"
            if step == 0:
                start.update(account())

        logits.register_hook(at_backward)
        F.cross_entropy(logits.reshape(-1, shape.vocab), batch[:, 1:].reshape(-1)).backward()
        phase[0] = f"step {step + 1}"
        engine.step()
    stop.set()
    sampler.join()
    s = engine.stats()
    engine.close()
    acts = layers * demo.BATCH * (demo.SEQ - 1) * width * 4  # the checkpointed block inputs
    over = _maxrss() - base
    persistent = s["mem_persistent_params"]
    return {
        "layers": layers,
        "over": over,
        "start": start,
        "peak": peak,
        "persistent": persistent,
        "acts": acts,
    }


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--width", type=int, default=1024)
    ap.add_argument("--layers", default="8,24")
    ap.add_argument("--path", default="/var/tmp")
    ap.add_argument("--trace", action="store_true", help="count Python's allocations too (slower)")
    ap.add_argument("--no-early-step", action="store_true", help="engine.early_step = False")
    ap.add_argument("--child", nargs=5, help=argparse.SUPPRESS)
    a = ap.parse_args()
    if a.child:
        layers, width, path, trace, early = a.child
        print(json.dumps(child(int(layers), int(width), path, trace == "1", early == "1")))
        return
    rows = []
    for n in (int(x) for x in a.layers.split(",")):
        with tempfile.TemporaryDirectory(dir=a.path) as d:
            flags = ["1" if a.trace else "0", "0" if a.no_early_step else "1"]
            cmd = [sys.executable, __file__, "--child", str(n), str(a.width), d, *flags]
            out = subprocess.run(cmd, capture_output=True, text=True, check=False)
        if out.returncode != 0:
            raise SystemExit(f"child {n} failed:\n{out.stderr[-4000:]}")
        rows.append(json.loads(out.stdout.strip().splitlines()[-1]))
        r = rows[-1]
        print(
            f"{n} layers: peak above the training baseline {r['over'] / MIB:,.1f} MiB, at "
            f"{r['peak']['phase']}"
        )
    lo, hi = rows[0], rows[-1]
    n = hi["layers"] - lo["layers"]
    for where in ("start", "peak"):
        a_, b_ = lo[where], hi[where]
        parts = {k: (b_[k] - a_[k]) / n / 1024 for k in a_ if isinstance(a_[k], int)}
        # Ledger (engine buffers by purpose) + glibc (heap in use, free, mapped by itself) cover disjoint
        # memory; the early step's held tensors and Python's allocations lie inside glibc's lines.
        subsets = ("python", *(k for k in parts if k.startswith("held_")))
        known = sum(v for k, v in parts.items() if k != "rss" and k not in subsets)
        print(
            f"per layer at the {'start of backward 1' if where == 'start' else 'peak'} (KiB): RSS "
            f"{parts['rss']:+.0f} = "
            + " + ".join(f"{k} {v:+.0f}" for k, v in parts.items() if k != "rss" and k not in subsets)
            + f" + not in these lines {parts['rss'] - known:+.0f}; within them: "
            + ", ".join(f"{k} {parts[k]:+.0f}" for k in subsets)
        )
    print(
        f"per layer: checkpointed input {(hi['acts'] - lo['acts']) / n / 1024:.0f} KiB, persistent params "
        f"{(hi['persistent'] - lo['persistent']) / n / 1024:.0f} KiB, process peak "
        f"{(hi['over'] - lo['over']) / n / 1024:+.0f} KiB"
    )


if __name__ == "__main__":
    main()
