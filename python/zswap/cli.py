"""The `zswap` command line: `demo` (a model larger than its memory budget, run and trained from a temp dir),
`bench` (engine next to the raw disk), `tune` (block size × queue depth sweep printing a ready `aio`
config block), `env` (what this machine allows, `zswap/envreport.py`) and `export` (checkpoint →
consolidated safetensors)."""

from __future__ import annotations

import argparse
import contextlib
import json
import sys
import tempfile
from collections.abc import Iterator, Sequence
from pathlib import Path

from pydantic_core import PydanticCustomError

from ._zswap import __version__
from .config._values import to_byte_size


def _size(text: str) -> int:
    try:
        return to_byte_size(text)
    except PydanticCustomError as e:
        raise argparse.ArgumentTypeError(f"{text!r} {e.message()}") from None


@contextlib.contextmanager
def _work_dir(path: Path | None) -> Iterator[Path]:
    """The given directory (which must exist), or a temp dir on the local disk, removed afterwards."""
    if path is not None:
        if not path.is_dir():
            raise SystemExit(f"zswap: --path {path} is not an existing directory")
        yield path
        return
    with tempfile.TemporaryDirectory(
        prefix="zswap-", dir="/var/tmp" if Path("/var/tmp").is_dir() else None
    ) as d:
        yield Path(d)


def _bench(args: argparse.Namespace) -> int:
    from . import bench

    with _work_dir(args.path) as d:
        res = bench.run(
            d, args.size, block_size=args.block_size, queue_depth=args.queue_depth,
            backend=args.backend, threads=args.threads, repeat=args.repeat,
        )  # fmt: skip
    if args.json:
        args.json.write_text(res.to_json())
    return 0


def _tune(args: argparse.Namespace) -> int:
    import torch

    from . import bench
    from .swap import SwapEngine

    best: tuple[float, int, int] = (0.0, 0, 0)
    with _work_dir(args.path) as d:
        print(f"zswap tune: {args.size / 2**20:.0f} MiB per pass in {d}")
        print(f"{'block':>10}{'depth':>8}{'write GB/s':>13}{'read GB/s':>12}")
        for bs in args.block_sizes:
            for qd in args.queue_depths:
                with SwapEngine(d, block_size=bs, queue_depth=qd) as e:
                    r = bench.engine_rate(
                        e, e.empty(args.size // 4, torch.float32), args.repeat, "tune", lambda _: None
                    )
                score = 2 / (1 / r.write + 1 / r.read)  # harmonic mean: swap-out and swap-in both matter
                print(f"{bs >> 10:>8}Ki{qd:>8}{r.write:>13.2f}{r.read:>12.2f}")
                best = max(best, (score, bs, qd))
    print("\nbest (harmonic mean of write and read); paste into your config:")
    print(json.dumps({"aio": {"block_size": best[1], "queue_depth": best[2]}}, indent=2))
    return 0


def _demo(args: argparse.Namespace) -> int:
    from . import demo

    with _work_dir(args.path) as d:
        demo.run(d, args.size, args.config, args.steps)
    return 0


def _env(args: argparse.Namespace) -> int:
    from . import envreport

    with _work_dir(args.path) as d:
        report = envreport.collect(d)
    sys.stdout.write(envreport.to_json(report) + "\n" if args.json else envreport.render(report))
    return 0


def _export(args: argparse.Namespace) -> int:
    # torch is needed for the tensor casts, torch.distributed is never started and no model is built.
    from .checkpoint import export
    from .errors import ZswapError

    dtype = None if args.dtype is None else getattr(__import__("torch"), args.dtype)
    try:
        out = export(
            args.ckpt_dir, args.out_dir, tag=args.tag, dtype=dtype, max_shard_size=args.max_shard_size
        )
    except (ZswapError, OSError, ValueError) as e:
        print(f"zswap export: {e}", file=sys.stderr)
        return 1
    print(f"zswap export: weights written to {out}")
    return 0


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="zswap", description="Run and train PyTorch models larger than memory.")
    p.add_argument("--version", action="version", version=f"zswap {__version__}")
    sub = p.add_subparsers(dest="command", required=True)

    d = sub.add_parser("demo", help="build, run and train a GPT-style model larger than its memory budget")
    d.add_argument("--path", type=Path, help="swap directory (default: a temp dir on the local disk)")
    d.add_argument("--size", type=_size, default=768 << 20, help="fp32 bytes of params (default 768MiB)")
    d.add_argument("--config", help="a config: path to a JSON file, or a JSON string (default: built in)")
    d.add_argument("--steps", type=int, default=5, help="training steps (default 5)")
    d.set_defaults(func=_demo)

    b = sub.add_parser("bench", help="engine throughput next to the raw disk (fio, or zswap's raw loop)")
    b.add_argument("--path", type=Path, help="directory on the drive to test (default: a temp dir)")
    b.add_argument("--size", type=_size, default=1 << 30, help="bytes per pass, e.g. 1GiB (default)")
    b.add_argument("--block-size", type=_size, default=1 << 20, help="default 1MiB")
    b.add_argument("--queue-depth", type=int, default=16, help="default 16")
    b.add_argument("--backend", choices=["auto", "io_uring", "psync"], default="auto")
    b.add_argument("--threads", type=int, default=None, help="engine worker threads (default: auto)")
    b.add_argument("--repeat", type=int, default=3, help="passes per figure; the best counts (default 3)")
    b.add_argument("--json", type=Path, help="also write the figures to this file")
    b.set_defaults(func=_bench)

    t = sub.add_parser("tune", help="sweep block size and queue depth; print the best aio block")
    t.add_argument("--path", type=Path)
    t.add_argument("--size", type=_size, default=256 << 20, help="bytes per pass (default 256MiB)")
    t.add_argument("--block-sizes", type=_size, nargs="+", default=[256 << 10, 1 << 20, 4 << 20])
    t.add_argument("--queue-depths", type=int, nargs="+", default=[4, 16, 64])
    t.add_argument("--repeat", type=int, default=2)
    t.set_defaults(func=_tune)

    v = sub.add_parser(
        "env", help="what this machine allows (io_uring, O_DIRECT, huge pages...) and what zswap does"
    )
    v.add_argument(
        "--path", type=Path, help="swap directory to probe (default: a temp dir on the local disk)"
    )
    v.add_argument("--json", action="store_true", help="machine-readable: every field, a reason for each no")
    v.set_defaults(func=_env)

    x = sub.add_parser("export", help="checkpoint folder -> consolidated Hugging Face safetensors weights")
    x.add_argument("ckpt_dir", type=Path, help="the folder given to engine.save_checkpoint")
    x.add_argument("out_dir", type=Path, help="where model.safetensors (or shards + index) are written")
    x.add_argument("--tag", help="checkpoint tag (default: the one CKPT_DIR/latest names)")
    x.add_argument("--dtype", choices=["float32", "bfloat16", "float16"], help="cast floating tensors")
    x.add_argument("--max-shard-size", default="5GB", help="largest shard, e.g. 5GB (default) or 500MB")
    x.set_defaults(func=_export)
    return p


def main(argv: Sequence[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    return int(args.func(args))


if __name__ == "__main__":
    sys.exit(main())
