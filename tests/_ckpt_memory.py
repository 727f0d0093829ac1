"""Peak-memory probe for tests/test_checkpoint_memory.py and benches/bench_checkpoint.py:
``python _ckpt_memory.py save|load ROOT PARAM_BYTES`` prints one JSON line.

``save``: builds a model of PARAM_BYTES of float32 params under ``Init(nvme)``, takes one training step
(AdamW states on NVMe), then saves a checkpoint to ROOT/ckpt. ``load``: builds the same model in this new
process and loads that checkpoint. Around the save or load the kernel's peak-RSS mark is reset
(``/proc/self/clear_refs`` ← 5) so the peak measured is the operation's own; also reported: seconds, bytes
of the checkpoint files, and ``ru_maxrss`` for the whole process.
"""

from __future__ import annotations

import json
import resource
import sys
import time
import warnings
from pathlib import Path

import torch
from torch import nn

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import zswap

WIDTH = 2048  # 16 MiB float32 per layer: many params, none large


def rss(field: str) -> int:
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith(field + ":"):
            return int(line.split()[1]) * 1024
    raise RuntimeError(field)


def reset_peak() -> None:
    Path("/proc/self/clear_refs").write_text("5")


def config(root: Path) -> dict:
    swap = root / "swap"
    swap.mkdir(parents=True, exist_ok=True)
    return {
        "zero_optimization": {
            "offload_param": {"device": "nvme", "nvme_path": str(swap)},
            "offload_optimizer": {"device": "nvme", "nvme_path": str(swap)},
            "sub_group_size": 4 << 20,
        },
        "optimizer": {"type": "AdamW", "params": {"lr": 1e-4}},
    }


def build(root: Path, param_bytes: int) -> tuple[nn.Module, zswap.Engine]:
    layers = max(1, param_bytes // (WIDTH * WIDTH * 4))
    cfg = config(root)
    torch.manual_seed(0)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", zswap.ZswapWarning)
        with zswap.Init(cfg):
            m = nn.Sequential(*(nn.Linear(WIDTH, WIDTH, bias=False) for _ in range(layers)))
        return m, zswap.initialize(m, cfg)


def main() -> None:
    op, root, param_bytes = sys.argv[1], Path(sys.argv[2]), int(sys.argv[3])
    m, engine = build(root, param_bytes)
    with engine:
        if op == "save":
            m(torch.randn(1, WIDTH)).square().mean().backward()
            engine.step()
        reset_peak()
        base = rss("VmRSS")
        t0 = time.perf_counter()
        if op == "save":
            folder = engine.save_checkpoint(root / "ckpt")
        else:
            engine.load_checkpoint(root / "ckpt")
            folder = root / "ckpt" / (root / "ckpt" / "latest").read_text().strip()
        seconds = time.perf_counter() - t0
        peak = rss("VmHWM")
    nbytes = sum(f.stat().st_size for f in Path(folder).iterdir())
    print(json.dumps({
        "op": op, "baseline_rss": base, "peak_rss": peak, "growth": peak - base, "seconds": seconds,
        "bytes": nbytes, "ru_maxrss": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024,
    }))  # fmt: skip


if __name__ == "__main__":
    main()
