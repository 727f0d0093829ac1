"""The step pipeline under activation checkpointing, above all reentrant (``use_reentrant=True``, torch's
default when the argument is left out, and DeepSpeed's and Megatron's kind): each checkpoint's backward runs
as an autograd task inside the outer one (`zswap.step.nesting`). Against plain PyTorch in RAM with the same
checkpoints (fused AdamW after ``clip_grad_norm_``), bitwise, after every optimizer step; and how each step
ran.

Layouts: ``blocks`` — checkpointed blocks with plain layers and the head after them (the usual one: the
update runs in backward, the inner tasks' gradients counted as the outer backward's); ``shared`` — one
block checkpointed twice, so its params get their gradient in two parts, one per inner task (no update in
backward: every step is the ordinary one, from the summed parts); ``all-inside`` — the head inside the
checkpoint too, so backward's first gradient comes from an inner task (the ordinary step); and, without
reentrancy, ``frozen-shared`` — a frozen block checkpointed at two depths (its params are kept by the
checkpoint as they are, not as detached aliases, and compared with the first forward's right after the
re-run: they must still be gathered then).
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import torch
from torch import nn
from torch.utils.checkpoint import checkpoint

import zswap
from zswap.device import StandInDevice
from zswap.step import nesting

from ._ddp import ddp_grads
from .conftest import run_ranks
from .test_runtime import Block

VOCAB, WIDTH, STEPS = 13, 16, 4


class Checkpointed(nn.Module):
    def __init__(self, layout: str) -> None:
        super().__init__()
        self.layout = layout
        self.emb = nn.Embedding(VOCAB, WIDTH)
        self.blocks = nn.ModuleList(Block(WIDTH) for _ in range(3))
        if layout in ("shared", "frozen-shared"):
            self.blocks[2] = self.blocks[0]
        if layout == "frozen-shared":
            self.blocks[0].requires_grad_(False)
        self.post = nn.Sequential(nn.Linear(WIDTH, WIDTH), nn.Tanh(), nn.Linear(WIDTH, WIDTH))
        self.ln = nn.LayerNorm(WIDTH)
        self.head = nn.Linear(WIDTH, VOCAB, bias=False)

    def _rest(self, h: torch.Tensor) -> torch.Tensor:
        for b in self.blocks:
            h = b(h)
        return self.head(self.ln(self.post(h)))

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        h = self.emb(ids)
        if self.layout == "all-inside":
            logits = checkpoint(self._rest, h, use_reentrant=True)
        else:
            for b in self.blocks:
                h = checkpoint(b, h, use_reentrant=self.layout != "frozen-shared")
            logits = self.head(self.ln(self.post(h)))
        return nn.functional.cross_entropy(logits.flatten(0, 1), ids.roll(1, 1).flatten()) * 20


def batches(n: int) -> list[torch.Tensor]:
    g = torch.Generator().manual_seed(7)
    return [torch.randint(0, VOCAB, (3, 6), generator=g) for _ in range(n)]


def plain(layout: str, gas: int, clip: float | None, world: int = 1) -> list[list[torch.Tensor]]:
    """Params after each optimizer step in RAM. ``world`` > 1: DDP's gradients — rank r's micro-batch i is
    ``batches(...)[i * world + r]``, each micro-batch's gradients averaged over the ranks, then summed (one
    rank: autograd's own accumulation, each part of a gradient added in turn, as zswap's store adds them)."""
    torch.manual_seed(0)
    ref = Checkpointed(layout)
    params = list(ref.parameters())
    opt = torch.optim.AdamW(params, lr=1e-2, betas=(0.9, 0.99), weight_decay=0.01, fused=True)
    xs, after = batches(STEPS * gas * world), []
    for s in range(STEPS):
        if world == 1:
            for k in range(gas):
                (ref(xs[s * gas + k]) / gas).backward()
        else:

            def backward(k: int, r: int, s: int = s) -> None:
                (ref(xs[(s * gas + k) * world + r]) / gas).backward()

            ddp_grads(params, gas, world, backward)
        if clip:
            torch.nn.utils.clip_grad_norm_(ref.parameters(), clip)
        opt.step()
        opt.zero_grad()
        after.append([p.detach().clone() for p in ref.parameters()])
    return after


def through_zswap(
    tmp_path: Path,
    layout: str,
    gas: int,
    clip: float | None,
    device: bool,
    stash: int | None = None,
    mine: list[torch.Tensor] | None = None,
) -> tuple[list[list[torch.Tensor]], list[dict[str, Any]]]:
    """Params after each optimizer step and each step's stats; ``mine``: this rank's micro-batches."""
    cfg: dict[str, Any] = {
        "offload_param": {"device": "nvme", "nvme_path": str(tmp_path)},
        "offload_optimizer": {"device": "nvme", "nvme_path": str(tmp_path)},
        "optimizer": {"type": "AdamW", "params": {"lr": 1e-2, "betas": [0.9, 0.99], "weight_decay": 0.01}},
        "gradient_accumulation_steps": gas,
        **({"gradient_clipping": clip} if clip else {}),
    }
    torch.manual_seed(0)
    with zswap.Init(cfg):
        model = Checkpointed(layout)
    xs, after, stats = mine or batches(STEPS * gas), [], []
    with zswap.initialize(model, cfg, device=StandInDevice() if device else "cpu") as engine:
        if stash is not None:
            engine.grad_stash_bytes = stash
        for s in range(STEPS):
            engine.stats(reset=True)
            for k in range(gas):
                engine.backward(model(xs[s * gas + k].to(engine.device)))
                engine.step()
            stats.append(engine.stats())
            with zswap.GatheredParameters(list(model.parameters())):
                after.append([p.detach().clone() for p in model.parameters()])
    return after, stats


SETUPS = {
    "cpu": {"gas": 1, "clip": None, "device": False},
    "cpu-clip-bites-gas2": {"gas": 2, "clip": 1e-3, "device": False},
    "stand-in": {"gas": 1, "clip": None, "device": True},
    "stand-in-gas2-clip-idle": {"gas": 2, "clip": 1e6, "device": True},
}


@pytest.mark.parametrize("setup", list(SETUPS), ids=list(SETUPS))
@pytest.mark.parametrize("layout", ["blocks", "frozen-shared"])
def test_checkpointed_blocks_take_the_step_in_backward(layout, setup, tmp_path):
    """Gradients from the checkpoints' inner tasks are the outer backward's: every step after the first
    (which makes the optimizer's records) runs in backward, or deferred where clipping bites. A frozen
    block checkpointed twice without reentrancy trains too (its re-run failed torch's check before)."""
    s = SETUPS[setup]
    got, stats = through_zswap(tmp_path, layout, s["gas"], s["clip"], s["device"])
    for step, (mine, ref) in enumerate(zip(got, plain(layout, s["gas"], s["clip"]), strict=True)):
        assert all(torch.equal(a, b) for a, b in zip(mine, ref, strict=True)), step
    fast = "steps_deferred" if s["clip"] == 1e-3 else "steps_in_backward"
    why = [st["steps_ordinary_reason"] for st in stats]
    assert [st[fast] for st in stats] == [0] + [1] * (STEPS - 1), why


@pytest.mark.parametrize("stash", [None, 1 << 20], ids=["default-stash", "stash-holds-all"])
@pytest.mark.parametrize("layout", ["shared", "all-inside"])
@pytest.mark.parametrize("gas", [1, 2])
def test_layouts_the_step_in_backward_cannot_take_fall_back_exactly(layout, gas, stash, tmp_path):
    """A param whose gradient comes in two parts, or a backward whose first gradient comes from an inner
    task: the ordinary step every time, saying why, bitwise plain PyTorch's — with accumulation the
    parts are summed onto earlier micro-batches' gradients kept in memory (a second add in one backward
    once read the earlier micro-batch's sum from the stash, not this backward's own)."""
    got, stats = through_zswap(tmp_path, layout, gas, None, False, stash)
    for step, (mine, ref) in enumerate(zip(got, plain(layout, gas, None), strict=True)):
        assert all(torch.equal(a, b) for a, b in zip(mine, ref, strict=True)), step
    why = nesting.PARTS if layout == "shared" else nesting.INSIDE
    assert [st["steps_ordinary"] for st in stats] == [1] * STEPS
    assert [st["steps_ordinary_reason"] for st in stats[1:]] == [why] * (STEPS - 1)


def test_checkpointing_moves_the_bytes_of_the_same_model_without_it(tmp_path):
    """Within the live budget the checkpoints' re-run forward reads nothing and the step in backward
    moves what it moves without checkpointing: 2 × the param bytes read, 3 × written per step."""
    moved = []
    for name, reentrant in (("plain", None), ("reentrant", True)):
        d = tmp_path / name
        d.mkdir()
        cfg: dict[str, Any] = {
            "offload_param": {"device": "nvme", "nvme_path": str(d)},
            "offload_optimizer": {"device": "nvme", "nvme_path": str(d)},
            "optimizer": {"type": "AdamW", "params": {"lr": 1e-2}},
        }
        torch.manual_seed(0)
        with zswap.Init(cfg):
            model = Checkpointed("blocks")
        if reentrant is None:
            model.forward = _unchecked(model)  # type: ignore[method-assign]
        xs = batches(STEPS)
        with zswap.initialize(model, cfg) as engine:
            for s in range(STEPS):
                engine.stats(reset=True)
                engine.backward(model(xs[s]))
                engine.step()
            st = engine.stats()
        moved.append((st["bytes_read"], st["bytes_written"], st["steps_in_backward"]))
    nbytes = sum(p.numel() * 4 for p in Checkpointed("blocks").parameters())
    assert moved[1] == moved[0] == (2 * nbytes, 3 * nbytes, 1)


def _unchecked(model: Checkpointed) -> Any:
    def forward(ids: torch.Tensor) -> torch.Tensor:
        h = model.emb(ids)
        for b in model.blocks:
            h = b(h)
        logits = model.head(model.ln(model.post(h)))
        return nn.functional.cross_entropy(logits.flatten(0, 1), ids.roll(1, 1).flatten()) * 20

    return forward


def test_two_ranks_take_the_step_in_backward(tmp_path):
    """Each gloo rank updates its partitions in backward, inner tasks' gradients reduce-scattered as any
    others: bitwise DDP's in RAM (``_checkpointed_dist_worker.py``)."""
    run_ranks(Path(__file__).with_name("_checkpointed_dist_worker.py"), tmp_path)
