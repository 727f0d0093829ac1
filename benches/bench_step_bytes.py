"""Bytes moved per training step and step time against its bounds: zswap next to DeepSpeed ZeRO-3.

    python benches/bench_step_bytes.py [--size 609MiB] [--steps 4] [--path DIR] [--no-deepspeed]
                                       [--rounds 1] [--no-variants] [--output-pool]

Model: `zswap.demo.GPT` of ``--size`` fp32 bytes (the default is the issue's 160 M-param, 609 MiB one),
batch 2 × 64 tokens, one fixed batch, AdamW (lr 1e-3, no weight decay), params and optimizer states on
NVMe in one directory — `zswap.demo.default_config`, the knobs the demo uses — and the same config dict
(stage 3, the same live budget, prefetch bucket, persistence threshold and ``sub_group_size``, aio block
1 MiB, queue depth 16) given to DeepSpeed on its CPU accelerator. Each contender runs in its own process:

- ``zswap``: as shipped (the optimizer update runs in backward where it may: `zswap.earlystep`; the
  gradients it applies are not stored; the next forward's first params kept from it: seeds);
- ``zswap, applied grads kept``: ``engine.keep_applied_grads = True`` (those gradients stored too —
  written, with the default ``grad_stash_bytes`` 0 — so that ``full_grad`` and every change between
  backward and step fall back to the ordinary step);
- ``zswap, ordinary step``: ``engine.early_step = False`` (the step after backward, as before);
- ``deepspeed``: ZeRO-3 with ``offload_param``/``offload_optimizer`` on NVMe, DeepSpeedCPUAdam; bytes are
  those of every read and write issued through its aio handles (counted by a proxy, `benches/_ds_step.py`);
  skipped with the reason where DeepSpeed or its ops cannot be loaded;
- ``plain PyTorch in RAM``: the same model, ``torch.optim.AdamW(fused=True)``: the compute time.

Per contender: seconds per step, GiB read and written per step (the median step after the first: the
first places the optimizer records), ratios to DeepSpeed. For zswap also I/O time (bytes read / write over
the `SwapEngine` read / write bandwidth measured in the same directory in the same run) and the ratio
step / max(I/O, compute). Target: zswap's bytes ≤ 0.85 × DeepSpeed's; step ≤ 1.15 × max(I/O, compute).

``--rounds N`` runs ``zswap`` and ``plain PyTorch in RAM`` N times each, alternating and back to back
(zswap, plain, zswap, plain, …), before the other contenders: this VM's speed drifts by up to 2 × within
half an hour, so a ratio is only like with like between runs minutes apart. Each round's ratio is printed;
the table gives both contenders' median over the rounds and, for ``zswap``, the median of the rounds'
ratios. ``--no-variants`` leaves out the two other zswap contenders. ``--output-pool`` runs every zswap
contender with ``engine.reuse_backward_outputs = True`` (`zswap.outputs`, off by default).
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
import warnings
from collections.abc import Callable
from pathlib import Path
from typing import Any, NamedTuple

import torch
import torch.nn.functional as F

HERE = Path(__file__).resolve().parent
GiB = float(1 << 30)


def say(line: str = "") -> None:
    print(line, flush=True)


def config(path: Path, size: int) -> dict[str, Any]:
    """zswap's demo config with DeepSpeed's stage and batch keys, so both read the same dict."""
    from zswap.demo import BATCH, Shape, default_config

    shape = Shape.for_bytes(size)
    cfg = default_config(path, shape)
    z = cfg["zero_optimization"]
    z["stage"] = 3
    z["sub_group_size"] = max(1 << 20, -(-shape.params // 32 // 1024) * 1024)  # zswap's own default
    z["offload_param"]["pin_memory"] = False
    z["offload_optimizer"]["pin_memory"] = False
    cfg["train_micro_batch_size_per_gpu"] = BATCH
    cfg["aio"] = {"block_size": 1 << 20, "queue_depth": 16, "single_submit": False, "overlap_events": True}
    return cfg


def peak_rss() -> int:
    """This process's peak RSS (VmHWM: ru_maxrss would include the parent's, kept across exec)."""
    with open("/proc/self/status") as f:
        return next(int(line.split()[1]) * 1024 for line in f if line.startswith("VmHWM:"))


def _step_loop(step: Any, steps: int, stats: Any) -> list[dict[str, float]]:
    out = []
    for _ in range(steps):
        stats(True)
        t0 = time.perf_counter()
        loss = step()
        wall = time.perf_counter() - t0
        out.append({"wall": wall, "loss": loss, **stats(False)})
    return out


class Setup(NamedTuple):
    """One contender, built: the model, its fixed batch and what applies a step's gradients."""

    shape: Any
    model: torch.nn.Module
    batch: torch.Tensor
    apply: Callable[[], None]
    """The optimizer step after backward: ``engine.step`` for zswap, AdamW's step + ``zero_grad`` in RAM."""
    engine: Any = None


def _batch(shape: Any) -> torch.Tensor:
    from zswap.demo import BATCH

    return torch.randint(0, shape.vocab, (BATCH, shape.seq), generator=torch.Generator().manual_seed(0))


def setup_zswap(size: int, path: Path) -> Setup:
    """The model built under ``zswap.Init`` with `config`'s dict and handed to ``zswap.initialize``."""
    import zswap
    from zswap.demo import GPT, Shape

    shape = Shape.for_bytes(size)
    cfg = config(path, size)
    torch.manual_seed(0)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", zswap.ZswapWarning)
        with zswap.Init(cfg):
            model = GPT(shape)
        engine = zswap.initialize(model, cfg)
    return Setup(shape, model, _batch(shape), engine.step, engine)


def setup_ram(size: int) -> Setup:
    """The same model in RAM with ``torch.optim.AdamW(fused=True)``: the compute baseline."""
    from zswap.demo import GPT, Shape

    shape = Shape.for_bytes(size)
    torch.manual_seed(0)
    model = GPT(shape)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3, weight_decay=0.0, fused=True)

    def apply() -> None:
        opt.step()
        opt.zero_grad(set_to_none=True)

    return Setup(shape, model, _batch(shape), apply)


def forward_loss(s: Setup) -> torch.Tensor:
    """Forward of the batch's tokens and the next-token cross-entropy."""
    logits = s.model(s.batch[:, :-1])
    return F.cross_entropy(logits.reshape(-1, s.shape.vocab), s.batch[:, 1:].reshape(-1))


def _train_step(s: Setup) -> float:
    loss = forward_loss(s)
    loss.backward()
    s.apply()
    return float(loss.detach())


def run_zswap(
    size: int, path: Path, steps: int, early: bool, keep: bool = False, pool: bool = False
) -> dict[str, Any]:
    s = setup_zswap(size, path)
    engine = s.engine
    engine.early_step = early
    engine.keep_applied_grads = keep
    engine.reuse_backward_outputs = pool

    def stats(reset: bool) -> dict[str, float]:
        st = engine.stats(reset=reset)
        return {"bytes_read": st["bytes_read"], "bytes_written": st["bytes_written"]}

    with engine:
        out = _step_loop(lambda: _train_step(s), steps, stats)
        early_commits = 0 if engine._early is None else engine._early.commits
    return {"steps": out, "early_commits": early_commits}


def run_ram(size: int, steps: int) -> dict[str, Any]:
    s = setup_ram(size)
    return {
        "steps": _step_loop(lambda: _train_step(s), steps, lambda _: {"bytes_read": 0, "bytes_written": 0})
    }


def bandwidth(path: Path) -> tuple[float, float]:
    """(write, read) GB/s of a SwapEngine in ``path``: 512 MiB from an engine buffer, best of 3."""
    import zswap
    from zswap.bench import engine_rate

    with warnings.catch_warnings():
        warnings.simplefilter("ignore", zswap.ZswapWarning)
        with zswap.SwapEngine(path) as e:
            r = engine_rate(e, e.empty(1 << 27, torch.float32).fill_(1.0), 3, "bench", lambda _: None)
    return r.write, r.read


def worker(kind: str, size: int, path: Path, steps: int, pool: bool) -> int:
    if kind == "ram":
        res = run_ram(size, steps)
    else:
        early, keep = kind != "zswap-ordinary", kind == "zswap-keep"
        res = run_zswap(size, path, steps, early=early, keep=keep, pool=pool)
    res["peak_rss"] = peak_rss()
    print("RESULT " + json.dumps(res), flush=True)
    return 0


def spawn(args: list[str], timeout: float) -> tuple[dict[str, Any] | None, str]:
    """Run one contender in a fresh process; (its RESULT/DSRESULT JSON, or None; the tail of its output)."""
    env = {
        **os.environ,
        "PYTHONPATH": os.pathsep.join([str(HERE.parent / "python"), os.environ.get("PYTHONPATH", "")]),
    }
    try:
        p = subprocess.run(
            [sys.executable, *args], capture_output=True, text=True, timeout=timeout, env=env, check=False
        )
    except subprocess.TimeoutExpired:
        return None, f"timed out after {timeout:.0f} s"
    for line in p.stdout.splitlines():
        if line.startswith(("RESULT ", "DSRESULT ")):
            return json.loads(line.split(" ", 1)[1]), ""
    tail = (p.stdout + p.stderr).strip().splitlines()
    return None, tail[-1] if tail else f"exit status {p.returncode}"


def summary(res: dict[str, Any]) -> dict[str, float]:
    later = res["steps"][1:] or res["steps"]  # the first step places the optimizer records
    med = {k: statistics.median(s[k] for s in later) for k in ("wall", "bytes_read", "bytes_written")}
    med["peak_rss"] = res["peak_rss"]
    return med


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--size", default="609MiB", help="fp32 bytes of params (default 609MiB)")
    ap.add_argument("--steps", type=int, default=4, help="steps per contender; the first is not counted")
    ap.add_argument("--path", type=Path, help="swap directory (default: a temp dir under /var/tmp)")
    ap.add_argument("--no-deepspeed", action="store_true", help="skip the DeepSpeed contender")
    ap.add_argument(
        "--rounds", type=int, default=1, help="zswap and plain PyTorch alternately, this many times each"
    )
    ap.add_argument(
        "--output-pool",
        action="store_true",
        help="zswap with engine.reuse_backward_outputs = True (zswap.outputs; off by default)",
    )
    ap.add_argument("--no-variants", action="store_true", help="skip the applied-kept and ordinary-step runs")
    ap.add_argument(
        "--timeout", type=float, default=1800, help="seconds per contender (DeepSpeed JIT-builds ops)"
    )
    ap.add_argument(
        "--worker", choices=["zswap", "zswap-keep", "zswap-ordinary", "ram"], help=argparse.SUPPRESS
    )
    args = ap.parse_args(argv)
    if args.rounds < 1:
        ap.error(f"--rounds must be at least 1, got {args.rounds}")
    from zswap.cli import _size
    from zswap.demo import Shape

    size = _size(args.size)
    root = Path("/var/tmp") if Path("/var/tmp").is_dir() else None
    with tempfile.TemporaryDirectory(prefix="zswap-bytes-", dir=root) as tmp:
        path = args.path or Path(tmp)
        if args.worker:
            return worker(args.worker, size, path, args.steps, args.output_pool)
        shape = Shape.for_bytes(size)
        say(f"bench_step_bytes: GPT {shape.layers} layers × {shape.width}, {shape.params / 1e6:.1f}M params "
            f"({shape.params * 4 / 2**20:,.0f} MiB fp32), batch 2 × {shape.seq}, {args.steps} steps, "
            f"dir {path}")  # fmt: skip
        wbw, rbw = bandwidth(path)
        say(f"  SwapEngine in {path}: write {wbw:.2f} GB/s, read {rbw:.2f} GB/s (512 MiB, best of 3)")
        me = [str(Path(__file__).resolve()), "--size", str(size), "--steps", str(args.steps)]
        me += ["--output-pool"] if args.output_pool else []
        results: dict[str, dict[str, float] | str] = {}

        def contend(name: str, kind: str) -> dict[str, Any]:
            sub = (args.path or Path(tmp)) / kind
            sub.mkdir(parents=True, exist_ok=True)
            res, why = spawn([*me, "--path", str(sub), "--worker", kind], args.timeout)
            say(f"  {name}: done" if res else f"  {name}: failed: {why}")
            return summary(res) if res else {"failed": why}

        rounds = [
            (contend("zswap", "zswap"), contend("plain PyTorch in RAM", "ram")) for _ in range(args.rounds)
        ]
        for name, i in (("zswap", 0), ("plain PyTorch in RAM", 1)):
            runs = [r[i] for r in rounds]
            bad = next((r["failed"] for r in runs if "failed" in r), None)
            results[name] = bad or {k: statistics.median(r[k] for r in runs) for k in runs[0]}
        variants = () if args.no_variants else (("zswap, applied kept", "zswap-keep"),
                                                ("zswap, ordinary step", "zswap-ordinary"))  # fmt: skip
        for name, kind in variants:
            res = contend(name, kind)
            results[name] = res.get("failed", res)
        if args.no_deepspeed:
            results["deepspeed"] = "skipped (--no-deepspeed)"
        else:
            try:
                import deepspeed  # noqa: F401

                sub = (args.path or Path(tmp)) / "deepspeed"
                sub.mkdir(parents=True, exist_ok=True)
                cfg = json.dumps(config(sub, size))
                res, why = spawn(
                    [str(HERE / "_ds_step.py"), str(size), str(sub), str(args.steps), cfg], args.timeout
                )
                results["deepspeed"] = summary(res) if res else f"could not run: {why}"
            except ImportError as exc:
                results["deepspeed"] = f"skipped: DeepSpeed cannot be imported ({exc})"
    report(results, wbw, rbw, rounds)
    return 0


def io_seconds(r: dict[str, float], wbw: float, rbw: float) -> float:
    """A contender's step bytes over the SwapEngine bandwidths of the same run."""
    return r["bytes_read"] / 1e9 / rbw + r["bytes_written"] / 1e9 / wbw


def report(
    results: dict[str, Any], wbw: float, rbw: float, rounds: list[tuple[dict[str, Any], dict[str, Any]]]
) -> None:
    say("")
    ds = results.get("deepspeed")
    ram = results.get("plain PyTorch in RAM")
    compute = ram["wall"] if isinstance(ram, dict) else None
    # zswap's bound ratio, round by round: each against the plain run right after it
    paired: list[float] = []
    for i, (z, p) in enumerate(rounds, 1):
        if "failed" in z or "failed" in p:
            continue
        paired.append(z["wall"] / max(io_seconds(z, wbw, rbw), p["wall"]))
        if len(rounds) > 1:
            say(f"round {i}: zswap {z['wall']:.2f} s/step, plain {p['wall']:.2f} s/step, "
                f"step/max(I/O, compute) {paired[-1]:.2f}×")  # fmt: skip
    say(f"{'':<22} {'s/step':>7} {'read GiB':>9} {'write GiB':>10} {'moved GiB':>10} {'vs DS':>6} "
        f"{'I/O s':>6} {'step/max(I/O,compute)':>22} {'peak RSS GiB':>13}")  # fmt: skip
    for name, r in results.items():
        if not isinstance(r, dict):
            say(f"{name:<22} {r}")
            continue
        moved = r["bytes_read"] + r["bytes_written"]
        vs = f"{moved / (ds['bytes_read'] + ds['bytes_written']):.2f}×" if isinstance(ds, dict) else "-"
        io = io_seconds(r, wbw, rbw)
        bound = f"{r['wall'] / max(io, compute):.2f}×" if compute and name.startswith("zswap") else "-"
        if name == "zswap" and len(paired) > 1:
            bound = f"{statistics.median(paired):.2f}× (median)"
        say(f"{name:<22} {r['wall']:>7.2f} {r['bytes_read'] / GiB:>9.2f} {r['bytes_written'] / GiB:>10.2f} "
            f"{moved / GiB:>10.2f} {vs:>6} {io if moved else 0:>6.2f} {bound:>22} "
            f"{r['peak_rss'] / GiB:>13.2f}")  # fmt: skip
    say(f"compute = the plain PyTorch step in RAM ({compute:.2f} s"
        + (f", median of {len(rounds)} rounds)" if len(rounds) > 1 else ")")
        if compute else "compute: not measured")  # fmt: skip
    say("targets: zswap moved ≤ 0.85 × DeepSpeed's; zswap step ≤ 1.15 × max(I/O, compute)")


if __name__ == "__main__":
    sys.exit(main())
