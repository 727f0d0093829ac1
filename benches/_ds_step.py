"""DeepSpeed ZeRO-3 side of `bench_step_bytes.py`, run in its own process (DeepSpeed sets up
torch.distributed, its own threads and page-locked pools; none of that may leak into the zswap run it is
compared with).

    python benches/_ds_step.py SIZE PATH STEPS CONFIG_JSON

Trains `zswap.demo.GPT` (same shape, seed and batch as the zswap run) with params and AdamW states on NVMe
and prints one JSON line: per step seconds and the bytes DeepSpeed's own aio handles moved (every
``*pread``/``*pwrite`` call's tensor, counted by a proxy in front of the handle), plus /proc/self/io's
``read_bytes``/``write_bytes`` (block-device bytes, page-cache hits not included) and peak RSS.
"""

from __future__ import annotations

import json
import os
import sys
import time
from typing import Any

os.environ.setdefault("MASTER_ADDR", "127.0.0.1")
os.environ.setdefault("MASTER_PORT", str(29500 + os.getpid() % 1000))
os.environ.setdefault("RANK", "0")
os.environ.setdefault("LOCAL_RANK", "0")
os.environ.setdefault("WORLD_SIZE", "1")
os.environ.setdefault("DS_ACCELERATOR", "cpu")
# DeepSpeed JIT-builds its ops with ninja: the one pip installs sits next to this interpreter.
os.environ["PATH"] = os.path.dirname(sys.executable) + os.pathsep + os.environ.get("PATH", "")

import torch
import torch.nn.functional as F

COUNTS = {"read": 0, "written": 0}


def _nbytes(args: tuple[Any, ...]) -> int:
    t = next((a for a in args if isinstance(a, torch.Tensor)), None)
    return 0 if t is None else t.numel() * t.element_size()


class _Handle:
    """Counts the bytes of every read and write issued through one DeepSpeed aio handle."""

    def __init__(self, inner: Any) -> None:
        self._inner = inner

    def __getattr__(self, name: str) -> Any:
        attr = getattr(self._inner, name)
        kind = "read" if "pread" in name else "written" if "pwrite" in name else None
        if kind is None or not callable(attr):
            return attr

        def counted(*args: Any, **kwargs: Any) -> Any:
            COUNTS[kind] += _nbytes(args)
            return attr(*args, **kwargs)

        return counted


class _Module:
    def __init__(self, inner: Any) -> None:
        self._inner = inner

    def __getattr__(self, name: str) -> Any:
        attr = getattr(self._inner, name)
        if name == "aio_handle":
            return lambda *a, **k: _Handle(attr(*a, **k))
        return attr


def _count_aio() -> None:
    from deepspeed.ops.op_builder import AsyncIOBuilder

    load = AsyncIOBuilder.load

    def counted_load(self: Any, *a: Any, **k: Any) -> Any:
        return _Module(load(self, *a, **k))

    AsyncIOBuilder.load = counted_load  # type: ignore[method-assign]


def peak_rss() -> int:
    """This process's peak RSS (VmHWM: ru_maxrss would include the parent's, kept across exec)."""
    with open("/proc/self/status") as f:
        return next(int(line.split()[1]) * 1024 for line in f if line.startswith("VmHWM:"))


def _proc_io() -> tuple[int, int]:
    with open("/proc/self/io") as f:
        kv = dict(line.split(": ") for line in f.read().splitlines())
    return int(kv["read_bytes"]), int(kv["write_bytes"])


def main() -> int:
    size, steps, cfg_text = int(sys.argv[1]), int(sys.argv[3]), sys.argv[4]  # argv[2]: the dir, in cfg
    import deepspeed

    from zswap.demo import BATCH, GPT, Shape

    _count_aio()
    shape = Shape.for_bytes(size)
    cfg = json.loads(cfg_text)
    deepspeed.init_distributed(dist_backend="gloo")
    torch.manual_seed(0)
    with deepspeed.zero.Init(config_dict_or_path=cfg):
        model = GPT(shape)
    engine, *_ = deepspeed.initialize(model=model, config=cfg, model_parameters=model.parameters())
    g = torch.Generator().manual_seed(0)
    batch = torch.randint(0, shape.vocab, (BATCH, shape.seq), generator=g)
    out: list[dict[str, float]] = []
    for _ in range(steps):
        r0, w0, io0 = COUNTS["read"], COUNTS["written"], _proc_io()
        t0 = time.perf_counter()
        logits = engine(batch[:, :-1])
        loss = F.cross_entropy(logits.reshape(-1, shape.vocab), batch[:, 1:].reshape(-1))
        engine.backward(loss)
        engine.step()
        wall = time.perf_counter() - t0
        io = _proc_io()
        out.append(
            {
                "wall": wall,
                "loss": float(loss.detach()),
                "bytes_read": COUNTS["read"] - r0,
                "bytes_written": COUNTS["written"] - w0,
                "disk_read": io[0] - io0[0],
                "disk_written": io[1] - io0[1],
            }
        )
    rss = peak_rss()
    print("DSRESULT " + json.dumps({"steps": out, "peak_rss": rss, "version": deepspeed.__version__}))
    return 0


if __name__ == "__main__":
    sys.exit(main())
