"""The GPU path's two figures, each next to baselines measured in the same run on the same machine.

    python benches/bench_gpu.py [--path DIR] [--fetch-size 4GiB] [--size 2GiB] [--iters 2] [--out DIR]

1. **Fetch**: params streamed NVMe → registered engine buffer → GPU by `zswap.initialize(device="cuda")`'s
   fetch path (a model of large params whose forward does next to no compute, run under ``no_grad`` after a
   recording pass), in GB/s of bytes gathered per second of wall time, next to
   - the disk: fio read (io_uring, O_DIRECT) on the same folder, or the engine's raw io_uring loop
     without fio (`zswap.bench.baseline`);
   - torch's own pinned host → GPU copy (``copy_(non_blocking=True)`` from ``pin_memory`` memory);
   target ≥ 0.9 × min(disk, H2D).
2. **Training**: forward + backward + `Engine.step` (AdamW, states on NVMe) of a GPT-style model at least
   8 × its GPU live budget, wall time per iteration next to max(I/O, H2D, compute), where I/O = bytes the
   iteration read and wrote / the disk's rates above, H2D = bytes gathered / torch's H2D rate, compute =
   the same model's forward + backward resident on the GPU + the CPU Adam step over its state in memory;
   target ≤ 1.2 ×.

Figures go to stdout and, with ``--out``, to ``DIR/bench_gpu.json``. ``--device standin`` runs the same code
on the CPU through `zswap.device.StandInDevice` with tiny sizes: a smoke test of the script, no figures.
"""

from __future__ import annotations

import argparse
import json
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
from zswap.bench import baseline
from zswap.cli import _size
from zswap.demo import GPT, Shape, default_config
from zswap.device import StandInDevice
from zswap.optim import OffloadedAdamW

TARGET_FETCH = 0.9
TARGET_TRAIN = 1.2


def say(line: str) -> None:
    print(line, flush=True)


class Env:
    def __init__(self, device: str) -> None:
        self.standin = device == "standin"
        self.torch_device = torch.device("cpu") if self.standin else torch.device("cuda")

    def engine_device(self) -> Any:
        return StandInDevice() if self.standin else "cuda"

    def sync(self) -> None:
        if not self.standin:
            torch.cuda.synchronize()


# -- baselines ---------------------------------------------------------------------------------------------


def h2d_rate(env: Env, nbytes: int, repeat: int = 5) -> float:
    """torch's pinned host → device copy, GB/s, best of ``repeat``."""
    if env.standin:
        src = torch.ones(nbytes // 4)
        dst = torch.empty_like(src)
    else:
        src = torch.ones(nbytes // 4, pin_memory=True)
        dst = torch.empty(src.shape, device=env.torch_device)
    best = 0.0
    for _ in range(repeat):
        env.sync()
        t0 = time.perf_counter()
        dst.copy_(src, non_blocking=True)
        env.sync()
        best = max(best, nbytes / (time.perf_counter() - t0) / 1e9)
    return best


# -- 1. fetch --------------------------------------------------------------------------------------------


class Slab(nn.Module):
    """One large param and almost no compute: the forward is a fetch."""

    def __init__(self, numel: int) -> None:
        super().__init__()
        self.w = nn.Parameter(torch.zeros(numel))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + self.w[:1]


def fetch_rate(env: Env, path: Path, total: int, per_param: int) -> dict[str, Any]:
    n = max(2, total // per_param)
    numel = per_param // 4
    cfg = {
        "zero_optimization": {
            "offload_param": {"device": "nvme", "nvme_path": str(path)},
            "stage3_param_persistence_threshold": 0,
            "stage3_prefetch_bucket_size": 4 * numel,  # four reads in flight ahead of use
            "stage3_max_live_parameters": 6 * numel,
            "stage3_max_reuse_distance": 0,
        }
    }
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", zswap.ZswapWarning)
        with zswap.Init(cfg):
            model = nn.Sequential(*(Slab(numel) for _ in range(n)))
        engine = zswap.initialize(model, cfg, device=env.engine_device())
    x = torch.zeros(1, device=env.torch_device)
    best: dict[str, Any] = {"gbs": 0.0}
    with engine, torch.no_grad():
        model(x)  # records the trace
        for _ in range(2):
            engine.stats(reset=True)
            env.sync()
            t0 = time.perf_counter()
            model(x)
            env.sync()
            wall = time.perf_counter() - t0
            s = engine.stats()
            gbs = s["bytes_fetched"] / wall / 1e9
            if gbs > best["gbs"]:
                best = {"gbs": gbs, "wall": wall, **s}
    return best


# -- 2. training -----------------------------------------------------------------------------------------


def loss_of(model: nn.Module, batch: torch.Tensor, vocab: int) -> torch.Tensor:
    logits = model(batch[:, :-1])
    return F.cross_entropy(logits.reshape(-1, vocab), batch[:, 1:].reshape(-1))


def compute_baseline(env: Env, shape: Shape, batch: torch.Tensor, iters: int) -> tuple[float, float]:
    """(forward + backward of the model resident on the device, CPU Adam step over its state in RAM)."""
    torch.manual_seed(0)
    model = GPT(shape).to(env.torch_device)
    fb = float("inf")
    for i in range(iters + 1):
        env.sync()
        t0 = time.perf_counter()
        loss_of(model, batch, shape.vocab).backward()
        env.sync()
        if i:  # the first pass warms the allocator and kernels
            fb = min(fb, time.perf_counter() - t0)
        model.zero_grad(set_to_none=True)
    model.to("cpu")
    params = [p for p in model.parameters()]
    for p in params:
        p.grad = torch.ones_like(p) * 1e-3
    opt = OffloadedAdamW(params, lr=1e-4, weight_decay=0.0)
    adam = float("inf")
    for i in range(iters + 1):
        t0 = time.perf_counter()
        opt.step()
        if i:
            adam = min(adam, time.perf_counter() - t0)
    del model, params, opt
    if not env.standin:
        torch.cuda.empty_cache()
    return fb, adam


def train(env: Env, path: Path, shape: Shape, batch: torch.Tensor, iters: int, frac: int) -> dict[str, Any]:
    cfg = default_config(path, shape, live_fraction=frac, lr=1e-4)
    torch.manual_seed(0)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", zswap.ZswapWarning)
        with zswap.Init(cfg):
            model = GPT(shape)
        engine = zswap.initialize(model, cfg, device=env.engine_device())
    best: dict[str, Any] = {"wall": float("inf")}
    losses = []
    with engine:
        for i in range(iters + 1):  # the first records the trace
            engine.stats(reset=True)
            env.sync()
            t0 = time.perf_counter()
            loss = loss_of(model, batch, shape.vocab)
            loss.backward()
            engine.step()
            env.sync()
            wall = time.perf_counter() - t0
            losses.append(float(loss.detach()))
            s = engine.stats()
            if i and wall < best["wall"]:
                best = {**s, "wall": wall}
    best["losses"] = losses
    return best


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--path", type=Path, help="swap directory (default: a temp dir under /var/tmp)")
    ap.add_argument("--fetch-size", type=_size, default=4 << 30, help="bytes fetched per pass (4GiB)")
    ap.add_argument("--param-size", type=_size, default=256 << 20, help="bytes per param in the fetch test")
    ap.add_argument("--size", type=_size, default=2 << 30, help="fp32 bytes of the trained model (2GiB)")
    ap.add_argument("--live-fraction", type=int, default=10, help="model / GPU live budget (>= 8)")
    ap.add_argument("--batch", type=int, default=8)
    ap.add_argument("--iters", type=int, default=2, help="timed iterations; the best counts")
    ap.add_argument("--device", choices=["cuda", "standin"], default="cuda")
    ap.add_argument("--out", type=Path, help="write bench_gpu.json into this folder")
    args = ap.parse_args(argv)
    env = Env(args.device)
    if not env.standin and not torch.cuda.is_available():
        say("bench_gpu: no CUDA device here; nothing measured (use --device standin for a CPU smoke run)")
        return 2
    root = Path("/var/tmp") if Path("/var/tmp").is_dir() else None
    with tempfile.TemporaryDirectory(prefix="zswap-gpu-bench-", dir=root) as tmp:
        path = args.path or Path(tmp)
        name = "stand-in (CPU)" if env.standin else torch.cuda.get_device_name()
        say(f"bench_gpu: {name}, torch {torch.__version__}, swap dir {path}")
        size = min(args.fetch_size, 2 << 30)
        rates = [r for r in baseline(path, size, 1 << 20, 16, 2) if not r.unavailable]
        disk = max(rates, key=lambda r: r.read)
        h2d = h2d_rate(env, args.param_size)
        say(f"  disk ({disk.source}): read {disk.read:.2f} GB/s, write {disk.write:.2f} GB/s")
        say(f"  torch pinned H2D copy ({args.param_size >> 20} MiB): {h2d:.2f} GB/s")

        f = fetch_rate(env, path, args.fetch_size, args.param_size)
        bound = min(disk.read, h2d)
        say(
            f"fetch NVMe → GPU: {f['gbs']:.2f} GB/s over {f['bytes_fetched'] / 2**30:.2f} GiB = "
            f"{f['gbs'] / bound:.2f} × min(disk, H2D) = {bound:.2f} GB/s (target ≥ {TARGET_FETCH}); "
            f"prefetch hit rate {f['prefetch_hit_rate']:.0%}"
        )

        shape = Shape.for_bytes(args.size)
        g = torch.Generator().manual_seed(0)
        batch = torch.randint(0, shape.vocab, (args.batch, shape.seq + 1), generator=g).to(env.torch_device)
        fb, adam = compute_baseline(env, shape, batch, args.iters)
        t = train(env, path, shape, batch, args.iters, args.live_fraction)
        live_bytes = t["max_live_elements"] * 4
        io = t["bytes_read"] / 1e9 / disk.read + t["bytes_written"] / 1e9 / disk.write
        copy = t["bytes_fetched"] / 1e9 / h2d
        compute = fb + adam
        lower = max(io, copy, compute)
        say(
            f"train {shape.params / 1e6:.0f}M params ({shape.params * 4 / 2**30:.2f} GiB fp32) = "
            f"{shape.params * 4 / live_bytes:.1f} × its GPU live budget ({live_bytes / 2**20:.0f} MiB), "
            f"batch {args.batch} × {shape.seq}: {t['wall']:.2f} s per forward+backward+step"
        )
        say(
            f"  I/O {io:.2f} s (read {t['bytes_read'] / 2**30:.2f} GiB, written "
            f"{t['bytes_written'] / 2**30:.2f} GiB), H2D {copy:.2f} s, compute {compute:.2f} s "
            f"(GPU fwd+bwd {fb:.2f} + CPU Adam {adam:.2f}): wall / max = {t['wall'] / lower:.2f} × "
            f"(target ≤ {TARGET_TRAIN}); losses {', '.join(f'{x:.4f}' for x in t['losses'])}"
        )
        if "gpu_max_memory_allocated" in t:
            say(
                f"  peak GPU memory {t['gpu_max_memory_allocated'] / 2**20:.0f} MiB (live budget "
                f"{t['gpu_live_budget_bytes'] / 2**20:.0f} MiB + bucket "
                f"{t['gpu_prefetch_bucket_bytes'] / 2**20:.0f} MiB + activations)"
            )
    if env.standin:
        say("(stand-in run: a smoke test of this script on the CPU; these are not GPU figures)")
    figures = {
        "device": name,
        "torch": torch.__version__,
        "disk": {"source": disk.source, "read_gbs": disk.read, "write_gbs": disk.write},
        "h2d_gbs": h2d,
        "fetch": {"gbs": f["gbs"], "ratio": f["gbs"] / bound, "target": TARGET_FETCH, "stats": f},
        "train": {
            "wall": t["wall"],
            "io": io,
            "h2d": copy,
            "compute": compute,
            "gpu_fwd_bwd": fb,
            "cpu_adam": adam,
            "ratio": t["wall"] / lower,
            "target": TARGET_TRAIN,
            "model_over_live_budget": shape.params * 4 / live_bytes,
            "stats": t,
        },
        "standin": env.standin,
    }
    if args.out is not None:
        args.out.mkdir(parents=True, exist_ok=True)
        (args.out / "bench_gpu.json").write_text(json.dumps(figures, indent=2, default=str))
    return 0


if __name__ == "__main__":
    sys.exit(main())
