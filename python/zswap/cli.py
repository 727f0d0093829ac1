"""The `zswap` command line: `demo` (a model larger than its memory budget, run and trained from a temp dir),
`bench` (engine next to the raw disk), `tune` (block size × queue depth sweep printing a ready `aio`
config block), `env` (what this machine allows, `zswap/envreport.py`), `export` (checkpoint →
consolidated safetensors) and `estimate` (memory and disk a model needs, `zswap/estimate.py`).

Every subcommand reports errors the same way, as one line on stderr, ``zswap CMD: error: ...``, naming the
value: a bad argument (checked while parsing by the ``type=`` functions below, or by a command before it
starts work, `UsageError`) exits with status 2, a failure while running with status 1, an interrupt with
130; ``--debug`` (before or after the subcommand) raises the error with its traceback instead."""

from __future__ import annotations

import argparse
import contextlib
import errno
import json
import os
import signal
import sys
import tempfile
import threading
from collections.abc import Iterator, Sequence
from pathlib import Path
from typing import Any, NoReturn

from pydantic_core import PydanticCustomError

from ._zswap import __version__
from .config._values import to_block_size, to_byte_size, to_int

EXIT_RUNTIME = 1
EXIT_USAGE = 2
EXIT_INTERRUPTED = 130


class UsageError(Exception):
    """An argument found wrong by a command before it starts work (it needed more than the argument's own
    text to tell): reported as argparse reports one, exit status 2."""


class _Parser(argparse.ArgumentParser):
    """argparse, with a bad argument reported as one line (``zswap bench: error: argument …``), not the
    usage block followed by the message."""

    def error(self, message: str) -> NoReturn:
        self.exit(EXIT_USAGE, f"{self.prog}: error: {message} (see {self.prog} --help)\n")


def _checked(check: Any, text: Any, **options: Any) -> Any:
    try:
        return check(text, **options)
    except PydanticCustomError as e:
        raise argparse.ArgumentTypeError(f"{text!r} {e.message()}") from None


def _size(text: str) -> int:
    return int(_checked(to_byte_size, text))


def _pass_size(text: str) -> int:
    """bench's and tune's bytes per pass: at least 1 MiB, below which no drive's rate is measured."""
    value = _size(text)
    if value < 1 << 20:
        raise argparse.ArgumentTypeError(f"{text!r} is below 1MiB, too small a pass to measure a drive")
    return value


def _block_size(text: str) -> int:
    # Checked here: the engine would refuse it only after a temp dir and a swap file were made.
    return int(_checked(lambda t: to_block_size(to_byte_size(t)), text))


def _int_between(minimum: int, maximum: int) -> Any:
    def parse(text: str) -> int:
        try:
            value = int(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"{text!r} is not an integer") from None
        return int(_checked(to_int, value, minimum=minimum, maximum=maximum))

    parse.__name__ = "integer"
    return parse


def _existing_directory(text: str) -> Path:
    path = Path(text)
    if not path.is_dir():
        raise argparse.ArgumentTypeError(
            f"{text!r} is not a directory" if path.exists() else f"{text!r} is not an existing directory"
        )
    return path


def _shard_size(text: str) -> int:
    # The rule export applies (decimal and binary units, positive), checked before any file is read.
    from .checkpoint._hf_layout import parse_size

    try:
        return int(parse_size(text.strip()))
    except (TypeError, ValueError):
        raise argparse.ArgumentTypeError(f"{text!r} is not a size such as 5GB, 500MB or 1GiB") from None


def _path(text: str) -> Path:
    """A path argument; an empty one is refused (``Path("")`` is the current directory, which the user
    did not name)."""
    if not text.strip():
        raise argparse.ArgumentTypeError("an empty path")
    return Path(text)


def _directory(text: str) -> Path:
    """An existing directory a file can be made in (what every command puts there), checked with a
    temporary file that is gone at once: ``/proc`` or a read-only mount fails here, naming the path."""
    path = _existing_directory(text)
    try:
        with tempfile.TemporaryFile(dir=path):
            pass
    except OSError as e:
        raise argparse.ArgumentTypeError(f"{text!r}: cannot create a file there ({e.strerror})") from None
    return path


def _output_file(text: str) -> Path:
    """A file to write: not a directory, in an existing directory a file can be made in (checked before
    the command runs, not after)."""
    path = _path(text)
    if path.is_dir():
        raise argparse.ArgumentTypeError(f"{text!r} is a directory")
    _directory(str(path.parent))
    return path


def _config(text: str) -> str:
    """``--config``: a JSON file or a JSON object in the argument; loaded once here to report a typo, a
    missing file or bad JSON as a usage error (the command loads it again)."""
    from .config import from_argument, load_config

    try:
        load_config(from_argument(text))
    except FileNotFoundError:
        raise argparse.ArgumentTypeError(f"{text!r}: no such file") from None
    except (ValueError, TypeError, OSError) as e:
        raise argparse.ArgumentTypeError(str(e)) from None
    return text


@contextlib.contextmanager
def _work_dir(path: Path | None) -> Iterator[Path]:
    """The given directory (checked to exist by `_directory`), or a temp dir on the local disk, removed
    afterwards."""
    if path is not None:
        yield path
        return
    with tempfile.TemporaryDirectory(
        prefix="zswap-", dir="/var/tmp" if Path("/var/tmp").is_dir() else None
    ) as d:
        yield Path(d)


def _bench(args: argparse.Namespace) -> int:
    from . import bench

    with _work_dir(args.path) as d:
        try:
            res = bench.run(
                d, args.size, block_size=args.block_size, queue_depth=args.queue_depth,
                backend=args.backend, threads=args.threads, repeat=args.repeat, out=sys.stdout,
            )  # fmt: skip
        except bench.SizeBelowBlock as e:
            raise UsageError(str(e)) from None
    if args.json:
        args.json.write_text(res.to_json())
    return 0


def _tune(args: argparse.Namespace) -> int:
    import torch

    from . import bench
    from .swap import SwapEngine

    too_big = [b for b in args.block_sizes or () if b > args.size]
    if too_big:
        raise UsageError(
            f"--block-sizes {' '.join(f'{b >> 10}KiB' for b in too_big)} exceed --size "
            f"({args.size >> 10}KiB): a pass must hold at least one block"
        )
    best: tuple[float, int, int] = (0.0, 0, 0)
    with _work_dir(args.path) as d:
        print(f"zswap tune: {args.size / 2**20:.0f} MiB per pass in {d}")
        with SwapEngine(d) as e:
            pick = e.info
        print(f"zswap's pick here (no aio block): block {pick['block_size_reason']}")
        print(f"{'':24}queue depth {pick['queue_depth_reason']}")
        block_sizes = args.block_sizes or sorted(
            b for b in {256 << 10, 1 << 20, 4 << 20, pick["block_size"]} if b <= args.size
        )
        depths = args.queue_depths or sorted({4, 16, 64, pick["queue_depth"]})
        print(f"{'block':>10}{'depth':>8}{'write GB/s':>13}{'read GB/s':>12}")
        for bs in block_sizes:
            for qd in depths:
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

    try:
        demo.Shape.for_bytes(args.size, strict=True)
    except ValueError as e:  # before a temp dir is made: the demo would build no model
        raise UsageError(f"argument --size: {e}") from None
    if args.path and args.config:
        given = os.path.realpath(args.path)
        other = [p for p in demo.swap_dirs(demo.user_config(args.config, args.path)) if p != given]
        if other:
            raise UsageError(
                f"--path {args.path} and the config's nvme_path {', '.join(other)} disagree: name the swap "
                "directory in one of them"
            )
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
    from .checkpoint import CheckpointArgumentError, CheckpointNotFoundError, export
    from .checkpoint.manifest import LATEST

    # What the checkpoint folder holds is found out while running (status 1, as every checkpoint that
    # cannot be read), but said in the CLI's terms: a file is not a folder, --tag names a checkpoint.
    ckpt: Path = args.ckpt_dir
    if ckpt.exists() and not ckpt.is_dir():
        raise NotADirectoryError(
            errno.ENOTDIR,
            "the checkpoint is not a directory (give the folder save_checkpoint wrote)",
            str(ckpt),
        )
    if ckpt.is_dir() and args.tag is None and not (ckpt / LATEST).is_file():
        tags = sorted(e.name for e in ckpt.iterdir() if e.is_dir() and not e.name.startswith("."))
        raise CheckpointNotFoundError(
            errno.ENOENT,
            f"no {LATEST!r} file names the checkpoint to export; pass --tag to name one "
            f"(tags there: {', '.join(tags) or 'none'})",
            str(ckpt / LATEST),
        )
    dtype = None if args.dtype is None else getattr(__import__("torch"), args.dtype)
    try:
        out = export(
            args.ckpt_dir, args.out_dir, tag=args.tag, dtype=dtype, max_shard_size=args.max_shard_size
        )
    except CheckpointArgumentError as e:  # OUT_DIR inside the checkpoint, a --tag no folder can have
        raise UsageError(str(e).removeprefix("zswap export: ")) from e
    print(f"zswap export: weights written to {out}")
    return 0


def _estimate(args: argparse.Namespace) -> int:
    from . import estimate

    if (args.params is None) == (args.model is None):
        raise UsageError("give exactly one of --params (e.g. 7B) and --model (a config.json or model folder)")
    if args.model is not None and args.largest_layer is not None:
        raise UsageError("--largest-layer goes with --params; with --model the layers are counted")
    if args.model is not None:
        try:
            shape = estimate.shape_from_config(args.model)
        except (OSError, ValueError) as e:
            raise UsageError(f"argument --model: {e}") from None
    else:
        if args.largest_layer is not None and args.largest_layer > args.params:
            raise UsageError(
                f"--largest-layer {args.largest_layer:,} is more than --params {args.params:,}: a layer is a "
                "part of the model"
            )
        shape = estimate.ModelShape(params=args.params, largest_layer=args.largest_layer)
    est = estimate.estimate(
        shape, dtype=args.dtype, world_size=args.world_size, offload_param=args.offload_param,
        offload_optimizer=args.offload_optimizer,
    )  # fmt: skip
    sys.stdout.write(estimate.render(est))
    return 0


def build_parser() -> argparse.ArgumentParser:
    p = _Parser(prog="zswap", description="Run and train PyTorch models larger than memory.")
    p.add_argument("--version", action="version", version=f"zswap {__version__}")
    p.add_argument("--debug", action="store_true", help="show the full traceback of an error")
    sub = p.add_subparsers(dest="command", required=True)
    # --debug after the subcommand too; SUPPRESS keeps a subparser from resetting the one given before it.
    common = _Parser(add_help=False)
    common.add_argument("--debug", action="store_true", default=argparse.SUPPRESS, help=argparse.SUPPRESS)
    positive = _int_between(1, 1 << 31)

    d = sub.add_parser(
        "demo", parents=[common], help="build, run and train a GPT-style model larger than its memory budget"
    )
    d.add_argument("--path", type=_directory, help="swap directory (default: a temp dir on the local disk)")
    d.add_argument("--size", type=_size, default=768 << 20, help="fp32 bytes of params (default 768MiB)")
    d.add_argument(
        "--config", type=_config, help="a config: path to a JSON file, or a JSON string (default: built in)"
    )
    d.add_argument("--steps", type=positive, default=5, help="training steps (default 5)")
    d.set_defaults(func=_demo)

    b = sub.add_parser(
        "bench", parents=[common], help="engine throughput next to the raw disk (fio, or zswap's raw loop)"
    )
    b.add_argument("--path", type=_directory, help="directory on the drive to test (default: a temp dir)")
    b.add_argument("--size", type=_pass_size, default=1 << 30, help="bytes per pass, e.g. 1GiB (default)")
    b.add_argument(
        "--block-size", type=_block_size, help="4KiB..64MiB, a power of two (default: the engine's pick)"
    )
    b.add_argument("--queue-depth", type=_int_between(1, 4096), help="1..4096 (default: the engine's pick)")
    b.add_argument("--backend", choices=["auto", "io_uring", "psync"], default="auto")
    b.add_argument(
        "--threads", type=_int_between(1, 256), default=None, help="engine worker threads (default: auto)"
    )
    b.add_argument(
        "--repeat", type=positive, default=3, help="passes per figure; the best counts (default 3)"
    )
    b.add_argument("--json", type=_output_file, help="also write the figures to this file")
    b.set_defaults(func=_bench)

    t = sub.add_parser(
        "tune", parents=[common], help="sweep block size and queue depth; print the best aio block"
    )
    t.add_argument("--path", type=_directory)
    t.add_argument("--size", type=_pass_size, default=256 << 20, help="bytes per pass (default 256MiB)")
    t.add_argument(
        "--block-sizes", type=_block_size, nargs="+", help="default: 256KiB 1MiB 4MiB and the engine's pick"
    )
    t.add_argument(
        "--queue-depths", type=_int_between(1, 4096), nargs="+", help="default: 4 16 64 and the engine's pick"
    )
    t.add_argument("--repeat", type=positive, default=2)
    t.set_defaults(func=_tune)

    v = sub.add_parser(
        "env",
        parents=[common],
        help="what this machine allows (io_uring, O_DIRECT, huge pages...) and what zswap does",
    )
    v.add_argument(
        "--path",
        type=_existing_directory,  # not _directory: whether files can be made there is what env reports
        help="swap directory to probe (default: a temp dir on the local disk)",
    )
    v.add_argument("--json", action="store_true", help="machine-readable: every field, a reason for each no")
    v.set_defaults(func=_env)

    x = sub.add_parser(
        "export", parents=[common], help="checkpoint folder -> consolidated Hugging Face safetensors weights"
    )
    x.add_argument("ckpt_dir", type=_path, help="the folder given to engine.save_checkpoint")
    x.add_argument("out_dir", type=_path, help="where model.safetensors (or shards + index) are written")
    x.add_argument("--tag", help="checkpoint tag (default: the one CKPT_DIR/latest names)")
    x.add_argument("--dtype", choices=["float32", "bfloat16", "float16"], help="cast floating tensors")
    x.add_argument(
        "--max-shard-size", type=_shard_size, default="5GB", help="largest shard, e.g. 5GB (default) or 500MB"
    )
    x.set_defaults(func=_export)

    e = sub.add_parser(
        "estimate", parents=[common], help="memory and disk a model needs per rank, by offload choice"
    )
    e.add_argument("--params", type=_param_count, help="parameter count, e.g. 7B, 350M or 1234567")
    e.add_argument(
        "--model", type=_path, help="a local config.json or model folder (built on meta; no download)"
    )
    e.add_argument(
        "--largest-layer", type=_param_count, help="params of the largest layer, with --params (optional)"
    )
    e.add_argument(
        "--dtype", choices=["bf16", "fp16", "fp32"], default="bf16", help="param dtype (default bf16)"
    )
    e.add_argument("--world-size", type=positive, default=1, help="ranks sharing the model (default 1)")
    tiers = ["none", "cpu", "nvme"]
    e.add_argument("--offload-param", choices=tiers, default="nvme", help="params' tier (default nvme)")
    e.add_argument(
        "--offload-optimizer", choices=tiers, default="nvme", help="optimizer's tier (default nvme)"
    )
    e.set_defaults(func=_estimate)
    return p


def _param_count(text: str) -> int:
    from .estimate import parse_count

    try:
        return parse_count(text)
    except ValueError as e:
        raise argparse.ArgumentTypeError(str(e)) from None


def main(argv: Sequence[str] | None = None) -> int:
    """Run the command; a bad argument exits with status 2 (argparse's exit, or `UsageError` returned as 2),
    an error while running returns 1 after one line on stderr (``--debug``: raised with its traceback)."""
    args = build_parser().parse_args(argv)
    try:
        with _terminable():
            return int(args.func(args))
    except KeyboardInterrupt:
        print(f"zswap {args.command}: interrupted", file=sys.stderr)
        return EXIT_INTERRUPTED
    except _Terminated as t:
        print(f"zswap {args.command}: terminated ({signal.Signals(t.signum).name})", file=sys.stderr)
        return 128 + t.signum
    except UsageError as exc:
        if getattr(args, "debug", False):
            raise
        print(f"zswap {args.command}: error: {exc} (see zswap {args.command} --help)", file=sys.stderr)
        return EXIT_USAGE
    except Exception as exc:
        if getattr(args, "debug", False):
            raise
        print(f"zswap {args.command}: error: {_one_line(exc)} (--debug shows the traceback)", file=sys.stderr)
        return EXIT_RUNTIME


class _Terminated(BaseException):
    """SIGTERM or SIGHUP while a command ran (a BaseException, as KeyboardInterrupt: no ``except
    Exception`` on the way takes it for a failure to handle)."""

    def __init__(self, signum: int) -> None:
        super().__init__(signum)
        self.signum = signum


@contextlib.contextmanager
def _terminable() -> Iterator[None]:
    """Within: SIGTERM and SIGHUP raise `_Terminated` in the main thread, so a command's cleanup (its temp
    dir, fio's file, the engine's swap files) runs as after Ctrl-C; their default action ended the process
    on the spot, leaving a file of ``--size`` bytes behind."""
    if threading.current_thread() is not threading.main_thread():
        yield
        return

    def stop(signum: int, frame: object) -> None:
        raise _Terminated(signum)

    old = {s: signal.signal(s, stop) for s in (signal.SIGTERM, signal.SIGHUP)}
    try:
        yield
    finally:
        for s, handler in old.items():
            signal.signal(s, handler)


def _one_line(exc: BaseException) -> str:
    """``exc`` as one line naming its type where the message alone would not say what failed."""
    text = " ".join(str(exc).split()) or type(exc).__name__
    if isinstance(exc, OSError | ValueError | TypeError | KeyError) and not text.startswith("["):
        return f"{type(exc).__name__}: {text}"
    return text


if __name__ == "__main__":
    sys.exit(main())
