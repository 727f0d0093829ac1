"""One rank of tests/test_speculation.py's two-rank test: ``python _early_dist_worker.py RANK WORLD
INIT_FILE SWAP_ROOT``.

Twins over one model partitioned across both ranks — the early step on, and off — with params, gradients
and AdamW states on NVMe (one swap directory per rank and twin), each rank on its own data. After every
optimizer step this rank's params (gathered: a collective) and optimizer records are bitwise the twin's,
for clipping that does not bite, clipping that bites (redone, then deferred; also past the early step's
cap, in part), and gradient accumulation 2, on the CPU and the stand-in device; the early one committed
where it may; and the bytes a warm step moves on each rank.
"""

from __future__ import annotations

import sys
import warnings
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import zswap
from tests.test_faults import cfg_for, optim_state, params_of, same
from tests.test_runtime import TinyLM, ids, sq
from zswap.device import StandInDevice
from zswap.step import early_memory, earlystep


def twins(
    root: Path,
    rank: int,
    device: bool = False,
    tiers: tuple[str, str] = ("nvme", "nvme"),
    resident: bool = False,
    **extra: Any,
) -> list[tuple[Any, Any]]:
    """The early-step twin and its early-off twin, params and AdamW states on ``tiers`` (``resident``:
    about half the params kept gathered, ``max_in_cpu``; ``d``: TinyLM's width, odd for partitions
    padded past a param's end)."""
    d_model = extra.pop("d", 16)
    out = []
    for name, early in (("early", True), ("plain", False)):
        d = root / f"{name}-{rank}"
        d.mkdir(parents=True, exist_ok=True)
        cfg = cfg_for(d, *tiers, **extra)
        if resident:
            cfg["offload_param"]["max_in_cpu"] = 3000  # of 7280 elements
        torch.manual_seed(0)
        with zswap.Init(cfg):
            m = TinyLM(d=d_model)
        e = zswap.initialize(m, cfg, device=StandInDevice() if device else "cpu")
        e.early_step = early
        out.append((m, e))
    return out


def check(
    root: Path,
    rank: int,
    limits: list[float | None],
    gas: int,
    expect: list[int],
    device: bool = False,
    tiers: tuple[str, str] = ("nvme", "nvme"),
    partly: list[int] | None = None,
    resident: bool = False,
    cap: int | None = None,
    **extra: Any,
) -> list[tuple[int, int, int]]:
    """Steps the twins with each clip limit in turn, bitwise equal after every optimizer step; ``expect``:
    the early twin's steps made live in backward, step by step (``partly``: its deferred steps that left
    records past the cap to the ordinary step, or with ``cap`` — the early step's — its steps in backward
    that did; ``extra``: config keys, or TinyLM's ``d``). Returns (in backward, redone, deferred) of each
    step."""
    if gas > 1:
        extra["gradient_accumulation_steps"] = gas
    runs = twins(root, rank, device, tiers, resident, **extra)
    (m, e), (ref, ref_e) = runs
    if cap is not None:
        e._early.cap = cap
    seen, parts = [], []
    for step, limit in enumerate(limits):
        for mm, ee in runs:
            ee.max_grad_norm = limit
            ee.stats(reset=True)
            for micro in range(gas):
                ee.backward(sq(mm(ids(seed=100 * rank + 10 * step + micro))))
                ee.step()
        s = e.stats()
        seen.append((s["steps_in_backward"], s["steps_redone"], s["steps_deferred"]))
        parts.append(s["steps_deferred_partly"] if cap is None else s["steps_in_backward_partly"])
        assert same(params_of(m), params_of(ref)), (rank, step, root.name)
        assert same(optim_state(e.optimizer, m), optim_state(ref_e.optimizer, ref)), (rank, step)
        assert e.last_grad_norm == ref_e.last_grad_norm, (rank, step)
    assert [b for b, _, _ in seen] == expect, (rank, limits, gas, seen, e.stats()["steps_ordinary_reason"])
    assert parts == (partly or [0] * len(limits)), (rank, limits, gas, parts, seen)
    for _, ee in runs:
        ee.close()
    return seen


def bytes_per_step(root: Path, rank: int, gas: int, clip: float | None) -> None:
    """A model within the live budget: from the second optimizer step on, each rank reads only its records
    (the next forward's params are its updated partitions, kept: each rank all-gathers them from memory)
    and writes its partition and records — half the one-rank fast path's 2 R / 3 W of the whole model."""
    d = root / f"bytes-{gas}-{clip}-{rank}"
    d.mkdir(parents=True)
    cfg: dict[str, Any] = {
        "offload_param": {"device": "nvme", "nvme_path": str(d)},
        "offload_optimizer": {"device": "nvme", "nvme_path": str(d)},
        "optimizer": {"type": "AdamW", "params": {"lr": 1e-3}},
        "gradient_accumulation_steps": gas,
        **({"gradient_clipping": clip} if clip is not None else {}),
    }
    torch.manual_seed(0)
    with zswap.Init(cfg):
        m = torch.nn.Sequential(*[torch.nn.Linear(64, 64) for _ in range(3)])
    e = zswap.initialize(m, cfg)
    part = sum(zswap.param_state(p).partition_numel * 4 for p in m.parameters())
    g = torch.Generator().manual_seed(rank)
    for step in range(4):
        e.stats(reset=True)
        for _ in range(gas):
            e.backward(e(torch.randn(4, 64, generator=g)).square().mean())
            e.step()
        s = e.stats()
        if step > 0:
            assert (s["bytes_read"], s["bytes_written"]) == (2 * part, 3 * part), (rank, gas, clip, step, s)
            assert s["steps_in_backward"] + s["steps_deferred"] == 1, (rank, s)
    e.close()


def main() -> None:
    rank, world = int(sys.argv[1]), int(sys.argv[2])
    dist.init_process_group("gloo", init_method=f"file://{sys.argv[3]}", rank=rank, world_size=world)
    root = Path(sys.argv[4])
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore", zswap.ZswapWarning)
            check(root / "plain", rank, [None] * 3, 1, [0, 1, 1])
            check(root / "clip", rank, [1e6, 1e6, 1e-3, 1e-3, 1e6, 1e6], 1, [0, 1, 0, 0, 0, 1])
            check(root / "gas", rank, [1e6, 1e6, 1e6], 2, [0, 1, 1])
            # The stand-in device: partitions and gradients land on the host; seeds cross back per rank.
            check(
                root / "dev-clip", rank, [1e6, 1e6, 1e-3, 1e-3, 1e6, 1e6], 1, [0, 1, 0, 0, 0, 1], device=True
            )
            check(root / "dev-gas", rank, [1e6, 1e6, 1e6], 2, [0, 1, 1], device=True)
            # bf16 (float32 masters in the records): the update only writes a param, so its copy is a
            # buffer taken at the update — over each rank's partition, padded past an odd param's end
            # (width 15); every such buffer starts as NaN.
            alloc = early_memory.alloc
            early_memory.alloc = lambda st, like: alloc(st, like).fill_(float("nan"))
            for device in (False, True):
                limits, expect = [1e6, 1e6, 1e-3, 1e-3, 1e6, 1e6], [0, 1, 0, 0, 0, 1]
                bf16 = {"enabled": True}
                check(root / f"bf16-{device}", rank, limits, 1, expect, device, d=15, bf16=bf16)
            early_memory.alloc = alloc
            # Past the early step's cap (the live budget alone): a deferred step holds the copies and
            # gradients that fit, and the records past it take the ordinary step in the same commit.
            earlystep.CAP_EXTRA, extra = 0, earlystep.CAP_EXTRA
            for device, resident, gas in (
                (False, False, 1),
                (True, False, 1),
                (False, True, 1),
                (False, False, 2),
            ):
                seen = check(
                    root / f"cap-{device}-{resident}-{gas}",
                    rank,
                    [1e6, 1e-3, 1e-3, 1e-3],
                    gas,
                    [0, 0, 0, 0],
                    device,
                    partly=[0, 0, 1, 1],
                    resident=resident,
                )
                assert [d for _, _, d in seen] == [0, 0, 1, 1], (rank, seen)
            earlystep.CAP_EXTRA = extra
            for gas, clip in ((1, None), (1, 1.0), (1, 1e-4), (2, 1.0)):
                bytes_per_step(root, rank, gas, clip)
        dist.barrier()
    finally:
        dist.destroy_process_group()


if __name__ == "__main__":
    from _worker_exit import run_then_exit  # the script's folder, tests/, is on sys.path

    run_then_exit(main)
