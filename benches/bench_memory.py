"""Peak memory of `zswap demo` (build under Init, 3 inference passes, AdamW steps, params and optimizer
states on NVMe) at several model sizes, against the bound of issue 14 (not run in CI).

Each run is its own subprocess, so its ``ru_maxrss`` belongs to that run alone. Baselines measured in the
same invocation, each in a fresh subprocess too:

- ``import torch``: the process after ``import torch, zswap`` (what the issue calls the torch baseline);
- ``torch training``: that plus what any PyTorch training process pays once — a ``torch.optim.AdamW``
  (its first ``add_param_group`` imports ``torch._dynamo``, sympy and triton: ~150 MiB here) and one
  activation-checkpointed ``Linear`` forward + backward (torch's kernels paged in);
- ``plain``, per size: plain PyTorch training this same model on this same batch (`_child_plain`), its
  params and gradients taken out (zswap keeps those on NVMe): the model's own activations, measured.

Bound: peak RSS − baseline ≤ live-param budget + the optimizer's in-flight sub-groups (its ring of three
records) + 256 MiB, the same at every size (the demo caps its live budget at 128 MiB and its sub-groups at
8 Mi elements, so the bound itself does not grow with the model). The breakdown comes from the run's
``Engine.stats()`` ``mem_*`` lines (peaks over the training phase), and from a sampler thread's snapshot
of every account at the demo's highest RSS (`_sampler`, printed as ``at the peak``).

Usage: ``python benches/bench_memory.py [--path DIR] [--sizes 0.75GiB,3GiB,6GiB] [--steps 2]
[--output-pool]`` (the last: ``engine.reuse_backward_outputs = True``, `zswap.outputs`). The default
runs 0.75 GiB only (~1.5 min); 3 GiB needs ~15 GiB free on DIR's disk and 2–6 minutes on this VM (load
3 to 8), 6 GiB ~30 GiB (params + two Adam moments + gradients, plus copy-on-write slack) and 10–25 minutes.

``--malloc default,off,256KiB`` instead runs each size under each glibc setting (`MALLOC_MODES`; a size fixes
the mmap threshold there through ``MALLOC_MMAP_THRESHOLD_``), each in a fresh process, and prints peak RSS,
build, inference and step times, and a no-I/O compute loop (`_child_compute`), each against ``default``.
"""

from __future__ import annotations

import argparse
import itertools
import json
import os
import resource
import subprocess
import sys
import tempfile
import threading
import time
from typing import Any

MIB = 1 << 20
SLACK = 256 * MIB
CAPPED = ("mem_peak_optimizer_ring", "mem_peak_early_step_buffers", "mem_peak_early_step_tensors")
CAPPED += ("mem_peak_fetch_buffers",)


def _maxrss() -> int:
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024  # Linux reports KiB


def _child_import() -> dict[str, Any]:
    import torch  # noqa: F401

    import zswap  # noqa: F401

    return {"peak_rss": _maxrss()}


def _fixed_cost() -> None:
    """What any PyTorch training process pays once (the ``torch training`` baseline)."""
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


def _child_training() -> dict[str, Any]:
    _fixed_cost()
    return {"peak_rss": _maxrss()}


def _child_plain(size: int) -> dict[str, Any]:
    """Plain PyTorch, the demo's model and batch: the fixed cost above, then one training forward +
    backward of `zswap.demo.GPT` at the shape of ``size`` (checkpointed blocks, the demo's batch of
    ``BATCH × (seq − 1)`` tokens, zswap's glibc setting), in memory, with no zswap. Its weights are one
    block's, shared by every layer (the same module at each depth), so that params and gradients are 2 ×
    one block + the embeddings instead of 2 × the model; every tensor the forward and backward make — the
    checkpointed block inputs, one block's recomputed activations, logits, each gradient as it is computed —
    has the size and lifetime it has in the real model. ``state`` = bytes of those params and their
    gradients, which zswap keeps on NVMe: ``peak_rss − state`` is what plain PyTorch needs in memory for
    this model and batch beside the model's state, measured."""
    import torch
    import torch.nn.functional as F

    from zswap import demo, memory

    _fixed_cost()
    memory.bound_heap()
    shape = demo.Shape.for_bytes(size)
    torch.manual_seed(0)
    model = demo.GPT(demo.Shape(shape.vocab, shape.width, 1, shape.heads, shape.seq), checkpoint_blocks=True)
    model.blocks = torch.nn.ModuleList([model.blocks[0]] * shape.layers)
    g = torch.Generator().manual_seed(0)
    batch = torch.randint(0, shape.vocab, (demo.BATCH, shape.seq), generator=g)
    model.train()
    logits = model(batch[:, :-1])
    F.cross_entropy(logits.reshape(-1, shape.vocab), batch[:, 1:].reshape(-1)).backward()
    params = list(model.parameters())  # unique: the tied head and the shared block once each
    state = sum(p.nbytes for p in params) + sum(p.grad.nbytes for p in params if p.grad is not None)
    return {"peak_rss": _maxrss(), "state": state, "layers": shape.layers}


def _child_compute(iters: int) -> dict[str, Any]:
    """No I/O: the demo's blocks (width 1024, batch 2 × 64, checkpointed) trained in plain torch with
    zswap's glibc setting in force and a trim after each step, as an Engine does: where a fresh mapping per
    tensor of the threshold's size or more costs most, against the same loop under the other settings."""
    import torch

    from zswap import demo, memory

    memory.bound_heap()
    torch.manual_seed(0)
    blocks = torch.nn.ModuleList(demo.Block(1024, 16) for _ in range(4))
    x = torch.randn(demo.BATCH, demo.SEQ, 1024)
    from torch.utils.checkpoint import checkpoint

    def one() -> None:
        h = x.requires_grad_(False)
        for b in blocks:
            h = checkpoint(b, h, use_reentrant=False)
        h.square().mean().backward()
        for p in blocks.parameters():
            p.grad = None  # freed as zswap frees them, once written
        memory.trim()

    one()  # warm-up
    t0 = time.perf_counter()
    for _ in range(iters):
        one()
    return {"seconds": (time.perf_counter() - t0) / iters, "peak_rss": _maxrss()}


def activations(size: int) -> int:
    """Bytes of the demo's checkpointed block inputs at the start of backward: one (batch × tokens ×
    width) fp32 tensor per layer, held through forward by `torch.utils.checkpoint` — the model's own
    activations, which any framework holds for this model, batch and checkpointing (see `main`)."""
    from zswap import demo

    shape = demo.Shape.for_bytes(size)
    return shape.layers * demo.BATCH * (shape.seq - 1) * shape.width * 4


def _sampler(found: dict[str, Any], stop: threading.Event) -> None:
    """At each new high of the process's RSS (by 1 MiB or more), a snapshot of every account zswap keeps:
    the ledger by purpose, the fetch buffers by holder (`zswap.buffers.fetch_lines`), the held tensors,
    glibc's heap — so the peak's line-by-line split is taken at the peak itself, not from peaks of
    separate lines at different moments."""
    from zswap import buffers, memory
    from zswap.parts.runners import RUNNERS

    high = 0
    while not stop.wait(0.003):
        rss = memory.rss()
        if rss < high + (1 << 20):
            continue
        high = rss
        for _ in range(3):  # the main thread changes what is read here: retry a torn read
            try:
                engines = list(RUNNERS)
                snap: dict[str, Any] = {"rss": rss, **memory.live(), **memory.heap()}
                snap["held"] = sum(memory.held().values())
                snap["stash"] = sum(getattr(gs, "stash_bytes", 0) for e in engines for gs in e._grad_stores)
                for e in engines:
                    lines = getattr(buffers, "fetch_lines", None)  # (absent before this bench's round)
                    snap.update(lines(e) if lines else {}, persistent=buffers.persistent(e))
                    pool = e._hooks.outputs.pool
                    snap["output_pool"], snap["output_pool_idle"] = pool.pooled, pool.idle()
                    early = e._early
                    snap["phase"] = (
                        "between passes"
                        if e._sched._recording is None
                        else "backward" if early is not None and not early.ended
                        else "a pass"
                    )  # fmt: skip
                    snap["phase"] += f", pass {e._sched.counters.iterations + 1} of the phase"
                    if early is not None:
                        snap["phase"] += f", {early.commits} early steps made live"
            except (RuntimeError, KeyError):
                continue
            except Exception as exc:  # a name this bench reads is gone: say so instead of a stale snapshot
                found.clear()
                found["error"] = f"{type(exc).__name__}: {exc}"
                return
            found.clear()
            found.update(snap)
            break


def _child_demo(path: str, size: int, steps: int, output_pool: bool = False) -> dict[str, Any]:
    import io
    from pathlib import Path

    from zswap import demo, outputs

    outputs.DEFAULT = output_pool  # the demo's engine: `Engine.reuse_backward_outputs`
    at_peak: dict[str, Any] = {}
    stop = threading.Event()
    sampler = threading.Thread(target=_sampler, args=(at_peak, stop), daemon=True)
    t0 = time.perf_counter()
    sampler.start()
    try:
        fig = demo.run(Path(path), size, None, steps, out=io.StringIO())
    finally:
        stop.set()
        sampler.join()
    t = fig["training"]
    return {
        "peak_rss": _maxrss(),
        "seconds": time.perf_counter() - t0,
        "model_bytes": fig["model_bytes"],
        "losses": fig["losses"],
        "step_seconds": t["wall_seconds"] / steps,
        "build_seconds": fig["build_seconds"],
        "inference_seconds": fig["inference"]["wall_seconds"] / 3,
        "step_read": t["bytes_read"] / steps,
        "step_written": t["bytes_written"] / steps,
        "live_bytes": t["max_live_elements"] * 4,
        "hit_rate": t["prefetch_hit_rate"],
        "inference_rss": fig["inference_rss"],
        "build_rss": fig["build_rss"],
        "layers": demo.Shape.for_bytes(size).layers,
        "acts": activations(size),
        "at_peak": at_peak,
        **{k: v for k, v in t.items() if k.startswith("mem_")},
    }


MALLOC_MODES = {
    "default": {},
    "off": {"ZSWAP_MALLOC_TUNING": "0"},
}
"""glibc settings `--malloc` compares (each a fresh process): zswap's (mmap threshold fixed at 1 MiB,
``malloc_trim`` after Init and each step), none (glibc's dynamic threshold, no trim); a size such as
``4MiB`` or ``32MiB`` fixes the threshold there through ``MALLOC_MMAP_THRESHOLD_`` (zswap then leaves the
threshold alone and still trims)."""


def _env(mode: str) -> dict[str, str]:
    base = {k: v for k, v in os.environ.items() if k not in ("ZSWAP_MALLOC_TUNING", "MALLOC_MMAP_THRESHOLD_")}
    if mode in MALLOC_MODES:
        return {**base, **MALLOC_MODES[mode]}
    return {**base, "MALLOC_MMAP_THRESHOLD_": str(_size(mode))}


def _run(args: list[str], mode: str = "default") -> dict[str, Any]:
    out = subprocess.run(
        [sys.executable, __file__, "--child", *args],
        capture_output=True,
        text=True,
        check=False,
        env=_env(mode),
    )
    if out.returncode != 0:
        raise SystemExit(f"child {args} failed:\n{out.stderr[-4000:]}")
    return json.loads(out.stdout.strip().splitlines()[-1])


def _size(text: str) -> int:
    units = {"GiB": 1 << 30, "MiB": 1 << 20, "KiB": 1 << 10}
    for unit, mul in units.items():
        if text.endswith(unit):
            return int(float(text[: -len(unit)]) * mul)
    return int(text)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--path", default=None, help="swap directory (default: a temp dir under /tmp)")
    ap.add_argument("--sizes", default="0.75GiB", help="comma-separated model sizes (default 0.75GiB)")
    ap.add_argument("--steps", type=int, default=2)
    ap.add_argument(
        "--output-pool",
        action="store_true",
        help="the demo with engine.reuse_backward_outputs = True (zswap.outputs; off by default)",
    )
    ap.add_argument("--compute-iters", type=int, default=20, help=argparse.SUPPRESS)
    ap.add_argument(
        "--malloc",
        default=None,
        help="compare glibc settings instead, same sizes, e.g. default,off,32MiB (see MALLOC_MODES)",
    )
    ap.add_argument("--child", nargs="+", help=argparse.SUPPRESS)
    a = ap.parse_args()
    if a.child:
        kind, *rest = a.child
        if kind == "import":
            res = _child_import()
        elif kind == "training":
            res = _child_training()
        elif kind == "compute":
            res = _child_compute(int(rest[0]))
        elif kind == "plain":
            res = _child_plain(int(rest[0]))
        else:
            res = _child_demo(rest[0], int(rest[1]), int(rest[2]), rest[3:] == ["pool"])
        print(json.dumps(res))
        return

    if a.malloc:
        _compare_malloc(a)
        return
    imp = _run(["import"])["peak_rss"]
    train = _run(["training"])["peak_rss"]
    print(f"baselines: import torch {imp / MIB:,.0f} MiB; torch training fixed cost {train / MIB:,.0f} MiB")
    hdr = (
        f"{'model':>9} {'layers':>6} {'peak RSS':>9} {'- import':>9} {'- train':>9} {'plain':>6} "
        f"{'bound':>6} "
        f"{'ratio imp/train/plain':>22} {'acts':>5} {'build':>6} {'infer':>6} {'live':>6} {'ring':>6} "
        f"{'fetch':>6} {'grads':>6} "
        f"{'early':>6} {'bounce':>6} {'queue':>6} {'heap':>6} {'wall s':>7} {'s/step':>7} "
        f"{'GiB/step r+w':>13} {'hits':>5} loss"
    )
    print(hdr)
    done: list[dict[str, Any]] = []
    for text in a.sizes.split(","):
        size = _size(text.strip())
        plain = _run(["plain", str(size)])
        with tempfile.TemporaryDirectory(dir=a.path or "/tmp") as d:
            r = _run(["demo", d, str(size), str(a.steps), *(["pool"] if a.output_pool else [])])
        bound = r["live_bytes"] + r["mem_peak_optimizer_ring"] + SLACK
        over_imp, over_train = r["peak_rss"] - imp, r["peak_rss"] - train
        # plain PyTorch's own memory for this model and batch beyond the fixed cost and the model's state
        r["plain"] = plain["peak_rss"] - plain["state"] - train
        over_plain = over_train - r["plain"]
        losses = r["losses"]
        ratio = f"{over_imp / bound:.2f}/{over_train / bound:.2f}/{over_plain / bound:.2f}×"
        r["over_train"], r["bound"] = over_train, bound
        done.append(r)
        early = r["mem_peak_early_step_buffers"] + r["mem_peak_early_step_tensors"]
        heap = r["mem_heap_in_use"] + r["mem_heap_free"]
        mib = [r[k] / MIB for k in ("build_rss", "inference_rss", "live_bytes", "mem_peak_optimizer_ring")]
        mib += [r[k] / MIB for k in ("mem_peak_fetch_buffers", "mem_peak_grad_buffers")]
        mib += [early / MIB, r["mem_bounce"] / MIB, r["mem_write_queue_limit"] / MIB, heap / MIB]
        print(
            f"{r['model_bytes'] / MIB:>5,.0f} MiB {r['layers']:>6} {r['peak_rss'] / MIB:>5,.0f} MiB "
            f"{over_imp / MIB:>5,.0f} MiB {over_train / MIB:>5,.0f} MiB {r['plain'] / MIB:>6,.0f} "
            f"{bound / MIB:>6,.0f} {ratio:>22} {r['acts'] / MIB:>5,.0f} "
            + " ".join(f"{v:>6,.0f}" for v in mib)
            + f" {r['seconds']:>7.0f} {r['step_seconds']:>7.2f} "
            f"{r['step_read'] / 2**30:>6.2f}+{r['step_written'] / 2**30:<6.2f} {r['hit_rate']:>5.0%} "
            f"{losses[0]:.3f}→{losses[-1]:.3f}",
            flush=True,
        )
    for r in done:
        print(_at_peak(r, train))
    for lo, hi in itertools.pairwise(done):
        n = hi["layers"] - lo["layers"]
        if n:
            # The lines with a cap (the ring, the early step's records, the fetch pool) reach it at different
            # sizes: their growth is not per layer. What is left beside them and the activations is.
            per = {k: (hi[k] - lo[k]) / n / MIB for k in ("over_train", "plain", "acts", *CAPPED)}
            rest = per["over_train"] - sum(v for k, v in per.items() if k not in ("over_train", "plain"))
            print(
                f"per layer, {lo['layers']} → {hi['layers']} layers: peak above the training baseline "
                f"+{per['over_train']:.3f} MiB = checkpointed inputs {per['acts']:.3f} + "
                + " + ".join(f"{k[9:]} {per[k]:.3f}" for k in CAPPED)
                + f" + the rest {rest:.3f} MiB; plain PyTorch, same model and batch: +{per['plain']:.3f} MiB"
            )
    print(
        "bound = live budget + optimizer ring + 256 MiB. ratio = peak RSS above a baseline / bound, target "
        "≤ 1.00 at every size, against three baselines, each measured in this run in a fresh process: imp = "
        "import torch, zswap; train = that + the fixed cost of any torch training process (an AdamW step: "
        "torch._dynamo, sympy; a checkpointed Linear forward + backward); plain = train + `plain` MiB, what "
        "plain PyTorch itself holds in memory to train this same model on this same batch beside its params "
        "and gradients (the demo GPT at this shape, checkpointed, one forward + backward; its layers share "
        "one block's weights, whose bytes and gradients are subtracted exactly: `_child_plain`) — the "
        "checkpointed block inputs, one block's recomputed activations, logits, gradients as they are made. "
        "acts = the checkpointed inputs alone, computed from the shape (MiB), for comparison. Columns "
        "build…heap in MiB: peak RSS after the build under Init and after inference; the live budget; the "
        "training phase's peaks of engine buffers by purpose (Engine.stats() mem_peak_*; early = the early "
        "step's copies + gradients held in backward); bounce buffers; write-queue limit; glibc heap (in use "
        "+ free) after training. wall s: the whole demo run (build, raw-disk baseline, 3 inference passes, "
        "the steps); hits: the training prefetch hit rate. `at the peak`: a sampler's snapshot of every "
        "account at the demo's highest RSS (MiB)."
    )


def _at_peak(r: dict[str, Any], train: int) -> str:
    """The demo's RSS at its peak, line by line, from the sampler's snapshot there (`_sampler`)."""
    p = r["at_peak"]
    if not p or "error" in p:
        return f"{r['model_bytes'] / MIB:,.0f} MiB: no snapshot at the peak ({p.get('error', 'none taken')})"
    fetch = ("fetch_live", "early_step_copies", "early_step_writing", "fetch_seeds", "fetch_pool_idle")
    vals = {k: p.get(f"mem_{k}", 0) for k in (*fetch, "fetch_elsewhere")}
    vals["persistent"] = p.get("persistent", 0)
    engine = sum(p[k] for k in ("fetch", "grads", "optimizer", "early_step", "other"))
    heap = p["heap_in_use"] + p["heap_free"] + p["heap_mapped"]
    rest = p["rss"] - engine - heap
    m = {k: v / MIB for k, v in vals.items()}
    return (
        f"{r['model_bytes'] / MIB:,.0f} MiB at the peak ({p.get('phase', '?')}): RSS {p['rss'] / MIB:,.0f} "
        f"({(p['rss'] - train) / MIB:,.0f} over the training baseline) = engine buffers {engine / MIB:,.0f} "
        f"[fetch {p['fetch'] / MIB:,.0f} = live {m['fetch_live']:.0f} + persistent {m['persistent']:.0f} + "
        f"early-step copies {m['early_step_copies']:.0f} + being written {m['early_step_writing']:.0f} + "
        f"seeds {m['fetch_seeds']:.0f} + idle in the pool {m['fetch_pool_idle']:.0f} + elsewhere "
        f"{m['fetch_elsewhere']:.0f}; grads {p['grads'] / MIB:,.0f}; ring {p['optimizer'] / MIB:,.0f}; other "
        f"{(p['early_step'] + p['other']) / MIB:,.0f}] + glibc {heap / MIB:,.0f} [in use "
        f"{p['heap_in_use'] / MIB:,.0f} (early-step tensors {p['held'] / MIB:,.0f}, gradient stash "
        f"{p['stash'] / MIB:,.0f}), free {p['heap_free'] / MIB:,.0f}, mapped by itself "
        f"{p['heap_mapped'] / MIB:,.0f} (backward's output pool {p.get('output_pool', 0) / MIB:,.0f}, idle "
        f"{p.get('output_pool_idle', 0) / MIB:,.0f})] + the rest {rest / MIB:,.0f} (code, Python's arenas, "
        "stacks)"
    )


def _compare_malloc(a: argparse.Namespace) -> None:
    """Each size under each glibc setting, interleaved, one fresh process each: the demo's peak RSS above
    the import baseline of that setting, its build, inference and step times, each against ``default``'s
    of the same size in the same invocation."""
    modes = [m.strip() for m in a.malloc.split(",")]
    print(f"{'model':>9} {'glibc':>8} {'peak RSS':>9} {'- import':>9} {'bound':>6} {'ratio':>6} "
          f"{'build s':>8} {'infer s':>8} {'s/step':>7} {'step ×':>7} {'compute':>8} {'×':>6} {'wall s':>7} "
          "loss")  # fmt: skip
    for text in a.sizes.split(","):
        size = _size(text.strip())
        rows: dict[str, dict[str, Any]] = {}
        for mode in modes:
            imp = _run(["import"], mode)["peak_rss"]
            with tempfile.TemporaryDirectory(dir=a.path or "/tmp") as d:
                r = _run(["demo", d, str(size), str(a.steps)], mode)
            r["compute"] = _run(["compute", str(a.compute_iters)], mode)["seconds"]
            rows[mode] = r
            bound = r["live_bytes"] + r["mem_peak_optimizer_ring"] + SLACK
            ref = rows.get("default", r)
            print(
                f"{r['model_bytes'] / MIB:>5,.0f} MiB {mode:>8} {r['peak_rss'] / MIB:>5,.0f} MiB "
                f"{(r['peak_rss'] - imp) / MIB:>5,.0f} MiB {bound / MIB:>6,.0f} "
                f"{(r['peak_rss'] - imp) / bound:>5.2f}× {r['build_seconds']:>8.1f} "
                f"{r['inference_seconds']:>8.2f} {r['step_seconds']:>7.2f} "
                f"{r['step_seconds'] / ref['step_seconds']:>6.2f}× {r['compute']:>8.3f} "
                f"{r['compute'] / ref['compute']:>5.2f}× {r['seconds']:>7.0f} "
                f"{r['losses'][0]:.3f}→{r['losses'][-1]:.3f}",
                flush=True,
            )
    print(
        "glibc: default = zswap's tuning (mmap threshold 1 MiB, malloc_trim after Init and each step); off = "
        "ZSWAP_MALLOC_TUNING=0; a size = MALLOC_MMAP_THRESHOLD_ fixed there (trims kept). ratio = (peak − "
        "that setting's import baseline) / bound; step × = s/step against default's of the same size. "
        "build s: the build under Init and initialize; infer s: seconds per inference pass; compute: s per "
        "forward + backward of 4 demo blocks in plain torch (no I/O, a trim after each), × against default."
    )


if __name__ == "__main__":
    main()
