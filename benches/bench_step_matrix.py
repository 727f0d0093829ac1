"""Bytes and seconds per optimizer step in the setups people train in, next to their bounds and DeepSpeed.

    python benches/bench_step_matrix.py [--size 1GiB] [--steps 4] [--rows PATTERNS] [--path DIR]
                                        [--deepspeed-python PATH | --no-deepspeed] [--timeout S]
                                        [--malloc-tuning on|off] [--params nvme|cpu] [--states nvme|cpu]

The matrix of issue 29 (item 7): compute {``cpu``; ``standin``: `zswap.device.StandInDevice`, the suite's
model of CUDA, given to ``zswap.initialize(device=...)``} × ranks {1, 2: gloo, one spawned process each} ×
clipping {off, ``gradient_clipping`` 1.0} × dtype {fp32, bf16}. Rows are named like ``cpu/1r/clip-off/fp32``
and ``standin/2r/clip-1/bf16``; ``--rows`` keeps those matching any of its comma-separated shell patterns
(``--rows 'cpu/1r/*,*/2r/clip-1/bf16'``).

Model: `zswap.demo.GPT` of ``--size`` bytes of fp32 params (one shape in every row; a bf16 row builds it in
bf16 with fp32 master weights), batch 2 × 64 tokens per rank, AdamW (lr 1e-3, no weight decay); params and
AdamW states on NVMe (``--params cpu``, ``--states cpu``: in CPU memory, every contender alike), each rank
in its own directory under a fresh one in ``--path`` (default /var/tmp), removed at the end; the demo's
knobs (`bench_step_bytes.config`, which DeepSpeed reads too). Every row runs in fresh processes. Figures
are medians over the steps from the third on (the first places the optimizer records; the second is the
first an early step can speculate from a step before it):

- read ×, written ×: bytes per optimizer step through ``engine.stats()``, as multiples of the model's param
  bytes (all params × their dtype's size); with 2 ranks each rank's figure, ``rank 0/rank 1``;
- moved ×: read + written, all ranks together;
- s/step: forward + backward + ``engine.step()``; with 2 ranks the slower rank's;
- I/O s: all ranks' bytes read / the engine's read rate + bytes written / its write rate, both measured on
  the same directory at the start of the run (`zswap.bench.engine_rate`; the ranks share the disk);
- compute s: the same step on the same model held in RAM in plain PyTorch (``clip_grad_norm_`` where the row
  clips, ``torch.optim.AdamW(fused=True)``; bf16: fp32 master weights; 2 ranks: DistributedDataParallel over
  gloo), once per (ranks, clipping, dtype) right before that group's rows;
- × bound: s/step ÷ max(I/O s, compute s). Target ≤ 1.1 on the CPU rows;
- DeepSpeed: ZeRO-3 with params and optimizer states on NVMe, the same config dict (its
  ``gradient_clipping`` written out as 0.0 when off: DeepSpeed ≥ 0.19.3 clips at 1.0 without it), on its CPU
  accelerator (it has no stand-in device: its row of a (ranks, clipping, dtype) group serves both compute
  kinds), run by `_ds_step.py` under ``--deepspeed-python`` (default: this interpreter); bytes are those
  its aio handles moved. vs DS: zswap's moved ÷ DeepSpeed's (target ≤ 0.6) and the step times' ratio;
- peak RSS (each contender's line as it finishes, per rank): ``VmHWM`` of each worker process. With
  ``--malloc-tuning off`` zswap's workers run with ``ZSWAP_MALLOC_TUNING=0``: glibc keeps freed CPU tensors
  on its heap instead of returning those of 256 KiB and more to the kernel (`zswap.memory`), which is what
  the memory bound costs in step time (the baselines are unchanged: they never tune);
- steps b/d/r/o: of all the row's steps, rank 0's made live in backward / deferred to the step / redone
  because clipping bit / run the ordinary way (``engine.stats()``'s ``steps_*``); why the last ordinary
  one was is printed under the table.
"""

from __future__ import annotations

import argparse
import fnmatch
import itertools
import json
import os
import shutil
import socket
import statistics
import subprocess
import sys
import tempfile
import time
import warnings
from pathlib import Path
from typing import Any, NamedTuple

import torch
import torch.nn.functional as F

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))

from bench_step_bytes import config as demo_config  # noqa: E402 (the sibling bench's config, shared)

COMPUTES, RANKS, CLIPS, DTYPES = ("cpu", "standin"), (1, 2), (0.0, 1.0), ("fp32", "bf16")
MEASURED_FROM = 3
"""Steps before this one are not counted."""
TIERS = {"offload_param": "nvme", "offload_optimizer": "nvme"}
"""Where the params and the optimizer states are kept (``--params``, ``--states``), every row alike."""


class Row(NamedTuple):
    compute: str
    ranks: int
    clip: float
    dtype: str

    @property
    def name(self) -> str:
        clip = "clip-off" if not self.clip else f"clip-{self.clip:g}"
        return f"{self.compute}/{self.ranks}r/{clip}/{self.dtype}"

    @property
    def group(self) -> tuple[int, float, str]:
        """What the compute baseline and DeepSpeed share: everything but the compute kind."""
        return self.ranks, self.clip, self.dtype

    @classmethod
    def parse(cls, name: str) -> Row:
        compute, ranks, clip, dtype = name.split("/")
        return cls(compute, int(ranks[:-1]), 0.0 if clip == "clip-off" else float(clip[5:]), dtype)


ALL_ROWS = [Row(*r) for r in itertools.product(COMPUTES, RANKS, CLIPS, DTYPES)]


def say(line: str = "") -> None:
    print(line, flush=True)


def row_config(path: Path, size: int, clip: float, dtype: str) -> dict[str, Any]:
    cfg = demo_config(path, size)
    for key, tier in TIERS.items():
        if tier != "nvme":
            cfg["zero_optimization"][key] = {"device": tier}
    cfg["gradient_clipping"] = clip
    if dtype == "bf16":
        cfg["bf16"] = {"enabled": True}
    return cfg


def param_bytes(size: int, dtype: str) -> int:
    from zswap.demo import Shape

    return Shape.for_bytes(size).params * (2 if dtype == "bf16" else 4)


# -- the workers: one process per rank ---------------------------------------------------------------------


def _batch(shape: Any, rank: int) -> torch.Tensor:
    from zswap.demo import BATCH

    g = torch.Generator().manual_seed(rank)
    return torch.randint(0, shape.vocab, (BATCH, shape.seq), generator=g)


def _loss(model: torch.nn.Module, batch: torch.Tensor, vocab: int) -> torch.Tensor:
    logits = model(batch[:, :-1]).float()
    return F.cross_entropy(logits.reshape(-1, vocab), batch[:, 1:].reshape(-1))


STEP_KEYS = {
    "in backward": "steps_in_backward",
    "deferred": "steps_deferred",
    "redone": "steps_redone",
    "ordinary": "steps_ordinary",
}
"""How `engine.stats()` counts the optimizer steps (`zswap.step.stepping.Tally`), by column label."""


def early_counts(before: dict[str, Any], after: dict[str, Any]) -> dict[str, Any]:
    """How the steps between two ``engine.stats()`` answers ran (`STEP_KEYS`; a counter that went down
    was reset between them: its value then), and why the last ordinary one was (``reason``)."""
    out: dict[str, Any] = {}
    for label, key in STEP_KEYS.items():
        v = after.get(key)
        if isinstance(v, int) and not isinstance(v, bool):
            b = before.get(key, 0)
            out[label] = v - b if isinstance(b, int) and v >= b else v
    for label, key in (("reason", "steps_ordinary_reason"), ("part", "steps_partly_reason")):
        reason = after.get(key)
        if isinstance(reason, str) and reason:
            out[label] = reason
    return out


def zswap_worker(row: Row, size: int, path: Path, steps: int, rank: int) -> dict[str, Any]:
    import zswap
    from zswap.demo import GPT, Shape
    from zswap.device import StandInDevice

    shape = Shape.for_bytes(size)
    mine = path / f"rank{rank}"
    mine.mkdir(parents=True, exist_ok=True)
    cfg = row_config(mine, size, row.clip, row.dtype)
    torch.manual_seed(0)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", zswap.ZswapWarning)
        with zswap.Init(cfg):
            model = GPT(shape)
        device = StandInDevice() if row.compute == "standin" else None
        engine = zswap.initialize(model, cfg, device=device)
    batch = _batch(shape, rank)
    out = []
    with engine:
        first = before = engine.stats()
        for _ in range(steps):
            t0 = time.perf_counter()
            loss = _loss(model, batch, shape.vocab)
            engine.backward(loss)
            engine.step()
            wall = time.perf_counter() - t0
            after = engine.stats()  # outside the timer: it waits for reads issued ahead for the next pass
            out.append(
                {
                    "wall": wall,
                    "loss": float(loss.detach()),
                    "bytes_read": after["bytes_read"] - before["bytes_read"],
                    "bytes_written": after["bytes_written"] - before["bytes_written"],
                }
            )
            before = after
        early = early_counts(first, after)
    return {"steps": out, "early": early}


def ram_worker(row: Row, size: int, steps: int, rank: int, world: int) -> dict[str, Any]:
    """The compute baseline: the same step on the model held in RAM."""
    from zswap.demo import GPT, Shape

    shape = Shape.for_bytes(size)
    torch.manual_seed(0)
    model = GPT(shape)
    master: list[torch.Tensor] = []
    if row.dtype == "bf16":  # bf16 params for compute, fp32 master weights stepped by AdamW (as zswap keeps)
        model = model.to(torch.bfloat16)
        master = [p.detach().float().requires_grad_() for p in model.parameters()]
    params = list(model.parameters())
    stepped = master or params
    opt = torch.optim.AdamW(stepped, lr=1e-3, weight_decay=0.0, fused=True)
    net: torch.nn.Module = model
    if world > 1:
        net = torch.nn.parallel.DistributedDataParallel(model)
    batch = _batch(shape, rank)
    out = []
    for _ in range(steps):
        t0 = time.perf_counter()
        loss = _loss(net, batch, shape.vocab)
        loss.backward()
        for m, p in zip(master, params, strict=False):
            assert p.grad is not None
            m.grad, p.grad = p.grad.float(), None
        if row.clip:
            torch.nn.utils.clip_grad_norm_(stepped, row.clip)
        opt.step()
        opt.zero_grad(set_to_none=True)
        with torch.no_grad():
            for m, p in zip(master, params, strict=False):
                p.copy_(m)
        wall = time.perf_counter() - t0
        out.append({"wall": wall, "loss": float(loss.detach()), "bytes_read": 0, "bytes_written": 0})
    return {"steps": out}


def worker(args: argparse.Namespace, size: int) -> None:
    row = Row.parse(args.row)
    if row.ranks > 1:
        import torch.distributed as dist

        init = f"file://{args.init}"
        dist.init_process_group("gloo", init_method=init, rank=args.rank, world_size=row.ranks)
        torch.set_num_threads(threads_per_rank(row.ranks))
    if args.worker == "ram":
        res = ram_worker(row, size, args.steps, args.rank, row.ranks)
    else:
        res = zswap_worker(row, size, args.path, args.steps, args.rank)
    res["peak_rss"] = peak_rss()
    print("RESULT " + json.dumps(res), flush=True)
    sys.stderr.flush()
    # torch 2.15's gloo sometimes aborts in C++ teardown after a rank's work is done (tests/_worker_exit.py)
    os._exit(0)


def peak_rss() -> int:
    """This process's peak resident set (``VmHWM``), bytes; 0 where /proc does not say."""
    try:
        with open("/proc/self/status") as f:
            for line in f:
                if line.startswith("VmHWM:"):
                    return int(line.split()[1]) * 1024
    except OSError:
        pass
    return 0


# -- the parent: spawning, summing up, printing ------------------------------------------------------------


def threads_per_rank(ranks: int) -> int:
    """Each rank's share of the cores (every contender alike): ranks that each spin up every core's worth
    of OpenMP threads fight over them."""
    return max(1, (os.cpu_count() or 1) // ranks)


def _env(extra: dict[str, str] | None = None) -> dict[str, str]:
    pp = os.pathsep.join(p for p in (str(HERE.parent / "python"), os.environ.get("PYTHONPATH", "")) if p)
    return {**os.environ, "PYTHONPATH": pp, **(extra or {})}


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def spawn_ranks(
    cmds: list[list[str]], envs: list[dict[str, str]], logs: Path, timeout: float
) -> list[dict[str, Any]] | str:
    """Run one process per rank at once; every rank's RESULT/DSRESULT JSON, or why there is none. A rank
    that fails ends the others (they would wait in a collective until the timeout)."""
    logs.mkdir(parents=True, exist_ok=True)
    files = [open(logs / f"rank{r}.log", "w+") for r in range(len(cmds))]  # noqa: SIM115 (closed below)
    try:
        procs = [
            subprocess.Popen(c, stdout=f, stderr=subprocess.STDOUT, text=True, env=e, cwd=HERE.parent)
            for c, e, f in zip(cmds, envs, files, strict=True)
        ]
        deadline, why = time.monotonic() + timeout, ""
        while any(p.poll() is None for p in procs):
            if time.monotonic() > deadline:
                why = f"timed out after {timeout:.0f} s"
            elif not any(p.returncode for p in procs):
                time.sleep(0.2)
                continue
            for p in procs:
                if p.poll() is None:
                    p.kill()
                p.wait()
        results = []
        for rank, f in enumerate(files):
            f.seek(0)
            text = f.read()
            found = [
                ln.split(" ", 1)[1] for ln in text.splitlines() if ln.startswith(("RESULT ", "DSRESULT "))
            ]
            if not found:
                tail = [ln for ln in text.strip().splitlines() if ln.strip()]
                code = procs[rank].returncode
                return why or f"rank {rank}: " + (tail[-1] if tail else f"exit status {code}")
            results.append(json.loads(found[-1]))
        return results
    finally:
        for f in files:
            f.close()


def run_ranks(
    kind: str, row: Row, size: int, path: Path, steps: int, timeout: float, env: dict[str, str] | None = None
) -> list[dict[str, Any]] | str:
    me = [sys.executable, str(Path(__file__).resolve()), "--size", str(size), "--steps", str(steps)]
    me += ["--path", str(path), "--row", row.name, "--worker", kind, "--init", str(path / "init")]
    me += ["--params", TIERS["offload_param"], "--states", TIERS["offload_optimizer"]]
    path.mkdir(parents=True, exist_ok=True)
    cmds = [[*me, "--rank", str(r)] for r in range(row.ranks)]
    return spawn_ranks(cmds, [_env(env)] * row.ranks, path / "logs", timeout)


def run_deepspeed(
    python: str, row: Row, size: int, path: Path, steps: int, timeout: float
) -> list[dict[str, Any]] | str:
    path.mkdir(parents=True, exist_ok=True)
    cfg = json.dumps(row_config(path, size, row.clip, row.dtype))
    cmd = [python, str(HERE / "_ds_step.py"), str(size), str(path), str(steps), cfg]
    port = str(_free_port())
    envs = [
        _env(
            {
                "RANK": str(r),
                "LOCAL_RANK": str(r),
                "WORLD_SIZE": str(row.ranks),
                "MASTER_PORT": port,
                "OMP_NUM_THREADS": str(threads_per_rank(row.ranks)),
            }
        )
        for r in range(row.ranks)
    ]
    return spawn_ranks([cmd] * row.ranks, envs, path / "logs", timeout)


def deepspeed_version(python: str) -> str | None:
    try:
        p = subprocess.run(
            [python, "-c", "import deepspeed; print(deepspeed.__version__)"],
            capture_output=True, text=True, timeout=300, env=_env({"DS_ACCELERATOR": "cpu"}), check=False,
        )  # fmt: skip
    except (OSError, subprocess.TimeoutExpired):
        return None
    lines = p.stdout.strip().splitlines()
    return lines[-1] if p.returncode == 0 and lines else None


class Summary(NamedTuple):
    """One contender's figures per rank (medians of the measured steps) and the slowest rank's step."""

    read: list[float]
    written: list[float]
    wall: float
    early: dict[str, Any]
    rss: list[int]
    """Each rank's peak resident set, bytes (0: not reported)."""


def summarize(ranks: list[dict[str, Any]]) -> Summary:
    def med(res: dict[str, Any], key: str) -> float:
        counted = res["steps"][MEASURED_FROM - 1 :] or res["steps"][-1:]
        return float(statistics.median(s[key] for s in counted))

    n = min(len(r["steps"]) for r in ranks)
    first = min(MEASURED_FROM - 1, n - 1)
    walls = [max(r["steps"][i]["wall"] for r in ranks) for i in range(first, n)]
    return Summary(
        [med(r, "bytes_read") for r in ranks],
        [med(r, "bytes_written") for r in ranks],
        float(statistics.median(walls)),
        ranks[0].get("early", {}),
        [int(r.get("peak_rss", 0)) for r in ranks],
    )


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--size", default="1GiB", help="bytes of fp32 params (default 1GiB)")
    ap.add_argument("--steps", type=int, default=4, help=f"steps per row, counted from step {MEASURED_FROM}")
    ap.add_argument("--rows", default="*", help="comma-separated shell patterns of row names (default: all)")
    ap.add_argument("--path", type=Path, default=Path("/var/tmp"), help="where the swap directory is made")
    ap.add_argument("--deepspeed-python", default=sys.executable, help="an interpreter with DeepSpeed")
    ap.add_argument("--no-deepspeed", action="store_true", help="leave DeepSpeed out")
    ap.add_argument("--timeout", type=float, default=1800, help="seconds per contender and row")
    ap.add_argument(
        "--malloc-tuning",
        choices=["on", "off"],
        default="on",
        help="off: zswap's workers run with ZSWAP_MALLOC_TUNING=0 (glibc's own mmap threshold, no trim)",
    )
    ap.add_argument("--params", choices=["nvme", "cpu"], default="nvme", help="where params are kept")
    ap.add_argument("--states", choices=["nvme", "cpu"], default="nvme", help="where AdamW states are kept")
    ap.add_argument("--worker", choices=["zswap", "ram"], help=argparse.SUPPRESS)
    ap.add_argument("--row", help=argparse.SUPPRESS)
    ap.add_argument("--rank", type=int, default=0, help=argparse.SUPPRESS)
    ap.add_argument("--init", help=argparse.SUPPRESS)
    args = ap.parse_args(argv)
    if args.steps < MEASURED_FROM:
        ap.error(f"--steps must be at least {MEASURED_FROM} (steps are counted from step {MEASURED_FROM})")
    from zswap.cli import _size

    size = _size(args.size)
    TIERS.update(offload_param=args.params, offload_optimizer=args.states)
    if args.worker:
        worker(args, size)
    patterns = [p.strip() for p in args.rows.split(",") if p.strip()]
    rows = [r for r in ALL_ROWS if any(fnmatch.fnmatchcase(r.name, p) for p in patterns)]
    if not rows:
        ap.error(f"--rows {args.rows!r} matches none of: {', '.join(r.name for r in ALL_ROWS)}")
    args.path.mkdir(parents=True, exist_ok=True)
    root = Path(tempfile.mkdtemp(prefix="zswap-matrix-", dir=args.path))
    try:
        return measure(args, size, rows, root)
    finally:
        shutil.rmtree(root, ignore_errors=True)


def measure(args: argparse.Namespace, size: int, rows: list[Row], root: Path) -> int:
    from zswap.demo import Shape

    shape = Shape.for_bytes(size)
    say(f"bench_step_matrix: GPT {shape.layers} layers × {shape.width}, {shape.params / 1e6:.1f}M params "
        f"(fp32 {param_bytes(size, 'fp32') / 2**20:,.0f} MiB, bf16 {param_bytes(size, 'bf16') / 2**20:,.0f} "
        f"MiB), batch 2 × {shape.seq} per rank, {args.steps} steps (counted from step {MEASURED_FROM}), "
        f"dir {root}; params: {args.params}, AdamW states: {args.states}")  # fmt: skip
    wbw, rbw = bandwidth(root, size)
    say(f"  SwapEngine in {root}: write {wbw:.2f} GB/s, read {rbw:.2f} GB/s (best of 3)")
    ds_version = None if args.no_deepspeed else deepspeed_version(args.deepspeed_python)
    ds_note = "not run (--no-deepspeed)" if args.no_deepspeed else "not installed"
    say(f"  DeepSpeed: {ds_version or ds_note}" + (f" ({args.deepspeed_python})" if ds_version else ""))
    if args.malloc_tuning == "off":
        say("  zswap's workers: ZSWAP_MALLOC_TUNING=0 (glibc's dynamic mmap threshold, no trim)")
    groups: dict[tuple[int, float, str], list[Row]] = {}
    for r in rows:
        groups.setdefault(r.group, []).append(r)
    results: dict[str, Summary | str] = {}
    compute: dict[tuple[int, float, str], Summary | str] = {}
    deepspeed: dict[tuple[int, float, str], Summary | str] = {}
    for group, members in groups.items():
        base = Row("ram", *group)
        compute[group] = contend(args, "ram", base, size, root)
        for r in members:
            results[r.name] = contend(args, "zswap", r, size, root)
        if ds_version:
            deepspeed[group] = contend(args, "deepspeed", base, size, root)
    report(rows, results, compute, deepspeed, ds_version or ds_note, size, wbw, rbw)
    return 0


NAMES = {"ram": "plain PyTorch in RAM, ", "deepspeed": "DeepSpeed, ", "zswap": ""}


def contend(args: argparse.Namespace, kind: str, row: Row, size: int, root: Path) -> Summary | str:
    """One contender's run of a row, in its own directory (removed after); its summary, or why none."""
    name = NAMES[kind] + (row.name if kind == "zswap" else row.name.split("/", 1)[1])
    d = root / f"{kind}-{row.name.replace('/', '_')}"
    t0 = time.perf_counter()
    if kind == "deepspeed":
        res = run_deepspeed(args.deepspeed_python, row, size, d, args.steps, args.timeout)
    else:
        tuning = {"ZSWAP_MALLOC_TUNING": "0"} if kind == "zswap" and args.malloc_tuning == "off" else {}
        res = run_ranks(kind, row, size, d, args.steps, args.timeout, tuning)
    shutil.rmtree(d, ignore_errors=True)
    if isinstance(res, str):
        say(f"  {name}: failed: {res}")
        return res
    got = summarize(res)
    read, written = ("/".join(f"{b / 1e9:.3f}" for b in bs) for bs in (got.read, got.written))
    rss = "/".join(f"{b / 2**20:,.0f}" for b in got.rss)
    say(
        f"  {name}: done ({time.perf_counter() - t0:.0f} s): {got.wall:.2f} s/step, "
        f"GB read {read}, written {written}, peak RSS {rss} MiB"
    )
    return got


def bandwidth(root: Path, size: int) -> tuple[float, float]:
    """(write, read) GB/s of a SwapEngine in ``root``: the model's fp32 bytes up to 512 MiB, at least 16 MiB,
    from an engine buffer, best of 3 (`zswap.bench.engine_rate`)."""
    import zswap
    from zswap.bench import engine_rate

    n = min(512 << 20, max(16 << 20, size)) // 4
    d = root / "rate"
    d.mkdir()
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", zswap.ZswapWarning)
        with zswap.SwapEngine(d) as e:
            r = engine_rate(e, e.empty(n, torch.float32).fill_(1.0), 3, "bench", lambda _: None)
    shutil.rmtree(d, ignore_errors=True)
    return r.write, r.read


COLUMNS = ["row", "read ×", "written ×", "moved ×", "s/step", "I/O s", "compute s", "× bound", "DS moved ×",
           "vs DS", "DS s/step", "vs DS s", "steps b/d/r/o"]  # fmt: skip


def _x(v: float) -> str:
    return f"{v:.2f}"


def report(
    rows: list[Row],
    results: dict[str, Summary | str],
    compute: dict[tuple[int, float, str], Summary | str],
    deepspeed: dict[tuple[int, float, str], Summary | str],
    ds_note: str,
    size: int,
    wbw: float,
    rbw: float,
) -> None:
    say("")
    say("| " + " | ".join(COLUMNS) + " |")
    say("|" + "---|" * len(COLUMNS))
    notes = []
    for r in rows:
        res, base, ds = results[r.name], compute[r.group], deepspeed.get(r.group, ds_note)
        if isinstance(res, str):
            say(f"| {r.name} | failed: {res} |" + " |" * (len(COLUMNS) - 2))
            continue
        pb = param_bytes(size, r.dtype)
        moved = sum(res.read) + sum(res.written)
        io = sum(res.read) / 1e9 / rbw + sum(res.written) / 1e9 / wbw
        cells = [r.name, "/".join(_x(b / pb) for b in res.read), "/".join(_x(b / pb) for b in res.written)]
        cells += [_x(moved / pb), _x(res.wall), _x(io)]
        cells += (
            [_x(base.wall), _x(res.wall / max(io, base.wall))]
            if isinstance(base, Summary)
            else ["failed", "-"]
        )
        if isinstance(ds, Summary):
            ds_moved = sum(ds.read) + sum(ds.written)
            cells += [
                _x(ds_moved / pb),
                _x(moved / ds_moved) if ds_moved else "-",
                _x(ds.wall),
                _x(res.wall / ds.wall),
            ]
        else:
            cells += [f"DeepSpeed: {ds}", "-", "-", "-"]
        e = res.early
        cells.append("/".join(str(e[k]) if k in e else "-" for k in STEP_KEYS))
        if "reason" in e:
            notes.append(f"  {r.name}: the last ordinary step's reason: {e['reason']}")
        if "part" in e:
            notes.append(f"  {r.name}: the last step made live in part: {e['part']}")
        say("| " + " | ".join(cells) + " |")
    pbs = ", ".join(f"{d} {param_bytes(size, d) / 2**20:,.0f} MiB" for d in DTYPES)
    say("")
    say(
        f"I/O s at SwapEngine write {wbw:.2f} / read {rbw:.2f} GB/s; × = multiples of the model's param "
        f"bytes ({pbs}); 2-rank rows: read/written per rank, moved and I/O s of all ranks, s/step the "
        "slower rank's"
    )
    say(
        "steps b/d/r/o: rank 0's optimizer steps made live in backward / deferred to the step / redone "
        "(clipping bit) / ordinary (engine.stats() steps_*)"
    )
    for line in notes:
        say(line)
    say("targets: moved ≤ 0.6 × DeepSpeed's in every row; s/step ≤ 1.1 × max(I/O, compute) on the CPU rows")


if __name__ == "__main__":
    sys.exit(main())
