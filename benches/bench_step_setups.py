"""Bytes per optimizer step of each training setup (issue 29's table), the step in backward next to the
ordinary step of the same setup in the same run.

    python benches/bench_step_setups.py [--path DIR] [--steps 5]

Model: 4 × ``Linear(256, 256)`` (1 MiB of fp32 params; one setup with the middle two under reentrant
activation checkpoints), which fits the live budget: what the step moves is then the whole story (no param
is read again for forward or backward). Params and AdamW states on NVMe in a
fresh directory under ``--path`` (removed at the end), or in CPU memory where the setup says so. Each setup
runs twice in fresh engines: as shipped (the engine decides where the update runs: in backward, deferred to
the step, or the ordinary step) and with ``engine.early_step = False`` (the ordinary step, the baseline).
Printed: bytes read and written during the last optimizer step as multiples of the param bytes, for both,
and how the shipped one ran (``engine.stats()``'s ``steps_*``). Deterministic: no timing.
"""

from __future__ import annotations

import argparse
import os
import shutil
import sys
import tempfile
import warnings
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
import torch.multiprocessing as mp
from torch.utils.checkpoint import checkpoint

import zswap
from zswap.device import StandInDevice

SETUPS: dict[str, dict[str, Any]] = {
    "CPU": {},
    "CPU, clipping 1e6 (never bites)": {"gradient_clipping": 1e6},
    "CPU, clipping 1e-4 (always bites)": {"gradient_clipping": 1e-4},
    "CPU, GAS 2": {"gradient_accumulation_steps": 2},
    "CPU, GAS 2, a layer in the first micro-batch only": {
        "gradient_accumulation_steps": 2,
        "first_only": True,
    },
    "CPU, reentrant activation checkpointing": {"reentrant": True},
    "CPU, lr set between backward and step": {"lr_before_step": True},
    "CPU, lr set there at the last step only": {"lr_at_last": True},
    "CPU, max_in_cpu over the model": {"max_in_cpu": True},
    "CPU, max_in_cpu over the model, states in CPU memory": {"max_in_cpu": True, "states": "cpu"},
    "CPU, optimizer states in CPU memory": {"states": "cpu"},
    "CPU, params in CPU memory": {"params": "cpu"},
    "CPU, params and states in CPU memory": {"params": "cpu", "states": "cpu"},
    "CPU, torch AdamW as optimizer=, clipping 1.0": {"torch_adamw": True, "gradient_clipping": 1.0},
    "stand-in device": {"device": True},
    "stand-in device, clipping 1e-4": {"device": True, "gradient_clipping": 1e-4},
    "stand-in device, GAS 2": {"device": True, "gradient_accumulation_steps": 2},
    "stand-in device, bf16, GAS 2, clipping 1e-4": {
        "device": True,
        "bf16": True,
        "gradient_accumulation_steps": 2,
        "gradient_clipping": 1e-4,
    },
    "stand-in device, max_in_cpu over the model": {"device": True, "max_in_cpu": True},
    "stand-in device, max_in_cpu, states in CPU memory": {
        "device": True,
        "max_in_cpu": True,
        "states": "cpu",
    },
    "2 ranks, per rank": {"ranks": 2},
    "2 ranks, clipping 1e-4, per rank": {"ranks": 2, "gradient_clipping": 1e-4},
    "2 ranks, GAS 2, per rank": {"ranks": 2, "gradient_accumulation_steps": 2},
}


def run(root: Path, setup: dict[str, Any], early: bool, steps: int) -> tuple[float, float, str]:
    """Rank 0's figures of ``setup`` (with ``ranks`` 2, each rank a spawned gloo process on its own
    directory and data; bytes still as multiples of the whole model's)."""
    ranks = setup.get("ranks", 1)
    if ranks == 1:
        return _run(root, setup, early, steps)
    out = mp.get_context("spawn").Manager().dict()
    init = tempfile.mktemp(dir=root)
    mp.spawn(_rank, args=(ranks, init, root, setup, early, steps, out), nprocs=ranks)
    return out[0]


def _rank(
    rank: int, ranks: int, init: str, root: Path, setup: dict[str, Any], early: bool, steps: int, out: Any
) -> None:
    dist.init_process_group("gloo", init_method=f"file://{init}", rank=rank, world_size=ranks)
    try:
        out[rank] = _run(root, setup, early, steps, seed=rank)
    finally:
        dist.destroy_process_group()
    # torch 2.15's gloo sometimes aborts in C++ teardown after a rank's work is done (tests/_worker_exit.py);
    # the figures are in ``out`` already, and an exception above still reaches mp.spawn with its traceback
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)


class _Checkpointed(torch.nn.Module):
    """The same four layers, the middle two each under a reentrant activation checkpoint (whose backward runs
    inside the outer one)."""

    def __init__(self) -> None:
        super().__init__()
        self.layers = torch.nn.ModuleList(torch.nn.Linear(256, 256) for _ in range(4))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = self.layers[0](x)
        for layer in self.layers[1:3]:
            x = checkpoint(layer, x, use_reentrant=True)
        return self.layers[3](x)


class _FirstOnly(torch.nn.Module):
    """The same four layers, the third run in each step's first micro-batch only (an expert the window's
    last micro-batch does not route to)."""

    def __init__(self) -> None:
        super().__init__()
        self.layers = torch.nn.ModuleList(torch.nn.Linear(256, 256) for _ in range(4))
        self.first = True

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = self.layers[1](self.layers[0](x))
        x = self.layers[2](x) if self.first else x
        return self.layers[3](x)


def _run(
    root: Path, setup: dict[str, Any], early: bool, steps: int, seed: int = 0
) -> tuple[float, float, str]:
    d = Path(tempfile.mkdtemp(dir=root))
    cfg: dict[str, Any] = {
        "offload_param": {"device": setup.get("params", "nvme"), "nvme_path": str(d)},
        "offload_optimizer": {"device": setup.get("states", "nvme"), "nvme_path": str(d)},
        "optimizer": {"type": "AdamW", "params": {"lr": 1e-3}},
    }
    gas = setup.get("gradient_accumulation_steps", 1)
    for key in ("gradient_clipping", "gradient_accumulation_steps"):
        if key in setup:
            cfg[key] = setup[key]
    if setup.get("max_in_cpu"):
        cfg["offload_param"]["max_in_cpu"] = 10**9
    dtype = torch.bfloat16 if setup.get("bf16") else torch.float32
    if setup.get("bf16"):
        cfg["bf16"] = {"enabled": True}
    torch.manual_seed(0)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", zswap.ZswapWarning)
        with zswap.Init(cfg):
            if setup.get("reentrant"):
                model: torch.nn.Module = _Checkpointed()
            elif setup.get("first_only"):
                model = _FirstOnly()
            else:
                model = torch.nn.Sequential(*[torch.nn.Linear(256, 256) for _ in range(4)])
        given = None
        if setup.get("torch_adamw"):  # the plain-PyTorch way: zswap rebuilds it as its offloaded AdamW
            del cfg["optimizer"]
            given = torch.optim.AdamW(model.parameters(), lr=1e-3, weight_decay=0.0)
        device = StandInDevice() if setup.get("device") else "cpu"
        engine = zswap.initialize(model, cfg, optimizer=given, device=device)
    engine.early_step = early
    nbytes = sum(zswap.param_state(p).numel * dtype.itemsize for p in model.parameters())  # whole model's
    g = torch.Generator().manual_seed(seed)
    with engine:
        for step in range(steps):
            engine.stats(reset=True)
            for k in range(gas):
                model.first = k == 0  # (read by `_FirstOnly` alone)
                engine.backward(engine(torch.randn(8, 256, generator=g).to(dtype)).float().square().mean())
                if setup.get("lr_before_step"):  # a schedule applied right before the step
                    for group in engine.optimizer.param_groups:
                        group["lr"] = 1e-3 / (1 + step)
                if setup.get("lr_at_last") and step == steps - 1:  # a milestone: redone at the step
                    for group in engine.optimizer.param_groups:
                        group["lr"] = 1e-4
                engine.step()
            s = engine.stats()
    shutil.rmtree(d, ignore_errors=True)
    how = f"{s['steps_in_backward']}/{s['steps_deferred']}/{s['steps_ordinary']}"
    return s["bytes_read"] / nbytes, s["bytes_written"] / nbytes, how


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--path", default="/var/tmp", help="where the swap directories go (default /var/tmp)")
    ap.add_argument("--steps", type=int, default=5, help="optimizer steps; the last is reported (≥ 3)")
    args = ap.parse_args(argv)
    root = Path(tempfile.mkdtemp(prefix="zswap-setups-", dir=args.path))
    print("| setup | read × | written × | ordinary step: read × | written × | last step b/d/o |")
    print("|---|---|---|---|---|---|")
    try:
        for name, setup in SETUPS.items():
            r, w, how = run(root, setup, True, max(3, args.steps))
            br, bw, _ = run(root, setup, False, max(3, args.steps))
            print(f"| {name} | {r:.2f} | {w:.2f} | {br:.2f} | {bw:.2f} | {how} |")
    finally:
        shutil.rmtree(root, ignore_errors=True)
    print(
        "× = multiples of the param bytes (2 ranks: rank 0's bytes, of the whole model's); b/d/o: the last "
        "step ran in backward / deferred / ordinary"
    )
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
