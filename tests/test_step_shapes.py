"""The step pipeline on model shapes that bend its bookkeeping, against plain PyTorch in RAM (fused AdamW or
Adam after ``clip_grad_norm_``): tied weights (one record, one gradient summed from two uses), frozen params
(no gradient, no record), a branch taken on every other step (a param whose gradient is missing on half
the steps: plain PyTorch leaves it and its moments alone then, and so must the update in backward), and a
branch taken in each step's first micro-batch only (an expert the boundary micro-batch does not route to:
its gradient, complete before the backward that runs the update, is updated with the rest). Params
after 5 optimizer steps and every step's gradient norm must be bitwise equal, and the steps after the first
must have taken the fast path (in backward, or deferred where clipping bites) wherever the setup allows it.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
import torch
from torch import nn

import zswap
from zswap.device import StandInDevice

from ._ddp import ddp_grads
from .conftest import run_ranks

VOCAB, STEPS = 11, 5


class Shaped(nn.Module):
    def __init__(self, kind: str, width: int = 16) -> None:
        super().__init__()
        self.kind = kind
        self.emb = nn.Embedding(VOCAB, width)
        self.a = nn.Linear(width, 2 * width)
        self.b = nn.Linear(2 * width, width)
        self.c = nn.Linear(
            width, width, bias=False
        )  # "branch": on even steps only; "first-micro": see forward
        self.ln = nn.LayerNorm(width)
        self.head = nn.Linear(width, VOCAB, bias=False)
        if kind == "tied":
            self.head.weight = self.emb.weight
        if kind == "frozen":
            self.a.requires_grad_(False)

    def forward(self, ids: torch.Tensor, step: int, micro: int = 0) -> torch.Tensor:
        h = self.emb(ids)
        h = h + self.b(torch.tanh(self.a(h)))
        if (self.kind == "branch" and step % 2 == 0) or (self.kind == "first-micro" and micro == 0):
            h = h + self.c(h)
        logits = self.head(self.ln(h)).flatten(0, 1)
        return nn.functional.cross_entropy(logits, ids.roll(1, 1).flatten()) * 30  # norms well above 1


def batches(n: int) -> list[torch.Tensor]:
    g = torch.Generator().manual_seed(3)
    return [torch.randint(0, VOCAB, (3, 5), generator=g) for _ in range(n)]


def cosine(step: int) -> float:
    """A learning rate per optimizer step, as training scripts set it between backward and step; the first
    is the optimizer's own (1e-2), so that first assignment changes no value."""
    return 1e-2 * (0.5 + 0.5 * math.cos(math.pi * step / STEPS))


def warmup_cosine(step: int) -> float:
    return min(1.0, (step + 1) / 2) * cosine(step)


SCHEDULES = {"warmup-cosine": warmup_cosine, "cosine": cosine}

Hypers = float | dict[str, float] | None
"""What a schedule sets at a step: an lr, several hyper-parameters, or nothing."""


def _hypers(value: Hypers) -> dict[str, float]:
    return {} if value is None else {"lr": value} if isinstance(value, float) else value


def milestone(adam: str) -> Callable[[int], Hypers]:
    """Nothing set until step 3, where the lr, eps and (AdamW's decoupled) weight decay change."""
    new = {"lr": 3e-3, "eps": 1e-6} | ({"weight_decay": 0.1} if adam == "AdamW" else {})
    return lambda step: new if step == 3 else None


def plain(
    kind: str,
    adam: str,
    gas: int,
    clip: float | None,
    world: int = 1,
    lr_at: Callable[[int], Hypers] | None = None,
) -> tuple[list[torch.Tensor], list[float]]:
    """Params after 5 optimizer steps in RAM and each step's norm. ``world`` > 1: DDP's gradients —
    rank r's micro-batch i is ``batches(...)[i * world + r]``, each micro-batch's gradients averaged over
    the ranks, then summed over the micro-batches (as zswap adds each averaged partition)."""
    torch.manual_seed(0)
    ref = Shaped(kind)
    trainable = [p for p in ref.parameters() if p.requires_grad]
    cls = torch.optim.AdamW if adam == "AdamW" else torch.optim.Adam
    opt = cls(trainable, lr=1e-2, betas=(0.9, 0.99), weight_decay=0.01, fused=True)
    xs, norms = batches(STEPS * gas * world), []
    for s in range(STEPS):

        def backward(k: int, r: int, s: int = s) -> None:
            (ref(xs[(s * gas + k) * world + r], s, k) / gas).backward()

        ddp_grads(trainable, gas, world, backward)
        if clip:
            norms.append(float(torch.nn.utils.clip_grad_norm_(trainable, clip)))
        if lr_at is not None:
            for g in opt.param_groups:
                g.update(_hypers(lr_at(s)))
        opt.step()
        opt.zero_grad()
    return [p.detach() for p in ref.parameters()], norms


def through_zswap(
    tmp_path: Path,
    kind: str,
    setup: dict[str, Any],
    mine: list[torch.Tensor] | None = None,
    lr_at: Callable[[int], Hypers] | None = None,
) -> tuple[list[torch.Tensor], list[float | None], dict[str, Any]]:
    """Params after 5 optimizer steps, each step's norm where clipping, and the stats; ``mine``: this
    rank's micro-batches (default `batches`); ``lr_at``: the lr each optimizer step takes, set on the
    optimizer's param groups between the boundary backward and its step."""
    gas, clip, adam = setup["gas"], setup["clip"], setup.get("adam", "AdamW")
    params: dict[str, Any] = {"device": setup["tiers"][0], "nvme_path": str(tmp_path)}
    if setup.get("max_in_cpu"):
        params["max_in_cpu"] = setup["max_in_cpu"]
    cfg: dict[str, Any] = {
        "offload_param": params,
        "offload_optimizer": {"device": setup["tiers"][1], "nvme_path": str(tmp_path)},
        "optimizer": {
            "type": adam,
            # DeepSpeed's "Adam" decouples weight decay unless adam_w_mode is false; torch.optim.Adam does not
            "params": {"lr": 1e-2, "betas": [0.9, 0.99], "weight_decay": 0.01}
            | ({"adam_w_mode": False} if adam == "Adam" else {}),
        },
        "gradient_accumulation_steps": gas,
        **({"gradient_clipping": clip} if clip else {}),
    }
    torch.manual_seed(0)
    with zswap.Init(cfg):
        model = Shaped(kind)
    device = StandInDevice() if setup["device"] == "standin" else "cpu"
    xs = mine or batches(STEPS * gas)
    norms: list[float | None] = []
    given = None
    if setup.get("given"):  # the plain-PyTorch way: a torch optimizer, which zswap rebuilds as its own
        del cfg["optimizer"]
        cls = torch.optim.AdamW if adam == "AdamW" else torch.optim.Adam
        trainable = [p for p in model.parameters() if p.requires_grad]
        given = cls(trainable, lr=1e-2, betas=(0.9, 0.99), weight_decay=0.01)
    with zswap.initialize(model, cfg, optimizer=given, device=device) as engine:
        for s in range(STEPS):
            for k in range(gas):
                engine.backward(model(xs[s * gas + k], s, k))
                if lr_at is not None and k == gas - 1:
                    for g in engine.optimizer.param_groups:
                        for key, value in _hypers(lr_at(s)).items():
                            g[key] = value
                engine.step()
            if clip:
                norms.append(engine.last_grad_norm)
        stats = engine.stats()
        with zswap.GatheredParameters(list(model.parameters())):
            got = [p.detach().clone() for p in model.parameters()]
    return got, norms, stats


# "adam": the optimizer type (default "AdamW"); "given": a torch one passed to initialize, not the config's
SETUPS: dict[str, dict[str, Any]] = {
    "nvme": {"tiers": ("nvme", "nvme"), "device": "cpu", "gas": 1, "clip": None},
    "nvme-clip-bites-gas2": {"tiers": ("nvme", "nvme"), "device": "cpu", "gas": 2, "clip": 1.0},
    "stand-in-clip-idle": {
        "tiers": ("nvme", "nvme"),
        "device": "standin",
        "gas": 1,
        "clip": 1e6,
        "adam": "Adam",
    },
    "stand-in-clip-bites": {
        "tiers": ("nvme", "cpu"),
        "device": "standin",
        "gas": 1,
        "clip": 1.0,
        "adam": "Adam",
    },
    "some-resident-gas3": {
        "tiers": ("nvme", "cpu"),
        "device": "cpu",
        "gas": 3,
        "clip": None,
        "max_in_cpu": 300,
    },
    "all-in-memory-clip": {"tiers": ("cpu", "cpu"), "device": "cpu", "gas": 1, "clip": 5.0},
    "torch-adam-given-gas2": {
        "tiers": ("nvme", "nvme"),
        "device": "cpu",
        "gas": 2,
        "clip": None,
        "adam": "Adam",
        "given": True,
    },
    "stand-in-gas2": {"tiers": ("nvme", "nvme"), "device": "standin", "gas": 2, "clip": None},
}


@pytest.mark.parametrize("setup", list(SETUPS), ids=list(SETUPS))
@pytest.mark.parametrize("kind", ["tied", "frozen", "branch", "first-micro"])
def test_model_shapes_train_bitwise_plain_pytorch(kind, setup, tmp_path):
    chosen = SETUPS[setup]
    want, want_norms = plain(kind, chosen.get("adam", "AdamW"), chosen["gas"], chosen["clip"])
    got, norms, stats = through_zswap(tmp_path, kind, chosen)
    assert norms == want_norms
    differ = [i for i, (g, w) in enumerate(zip(got, want, strict=True)) if not torch.equal(g, w)]
    assert differ == [], (kind, setup)
    # the first step makes the optimizer's records; every later one takes the fast path
    assert stats["steps_ordinary"] == 1, stats["steps_ordinary_reason"]
    assert stats["steps_in_backward"] + stats["steps_deferred"] == STEPS - 1


@pytest.mark.parametrize("schedule", list(SCHEDULES))
@pytest.mark.parametrize("setup", list(SETUPS), ids=list(SETUPS))
def test_an_lr_set_between_backward_and_step_on_every_step_is_the_one_applied(setup, schedule, tmp_path):
    """A schedule applied by hand between backward and step (``g["lr"] = lr_at(step)`` right before
    ``optimizer.step()``, as many training scripts do): the first step sees the lr assigned since its
    backward began (to its own value, for "cosine"), so every later one defers its update to the step,
    where it takes the lr just set — bitwise plain PyTorch, no error, and none of them the ordinary step."""
    chosen, lr_at = SETUPS[setup], SCHEDULES[schedule]
    adam = chosen.get("adam", "AdamW")
    want, want_norms = plain("tied", adam, chosen["gas"], chosen["clip"], lr_at=lr_at)
    got, norms, stats = through_zswap(tmp_path, "tied", chosen, lr_at=lr_at)
    assert norms == want_norms
    differ = [i for i, (g, w) in enumerate(zip(got, want, strict=True)) if not torch.equal(g, w)]
    assert differ == [], setup
    assert stats["steps_ordinary"] == 1, stats["steps_ordinary_reason"]
    assert stats["steps_deferred"] == STEPS - 1, stats


@pytest.mark.parametrize("setup", list(SETUPS), ids=list(SETUPS))
def test_hypers_first_set_between_backward_and_step_after_steps_without_are_applied(setup, tmp_path):
    """The lr, eps and decoupled weight decay set right before ``step()`` at step 3 only (a decay from a
    milestone on): that step's update already ran in backward with the old values and let its gradients
    go; the step recomputes its params from the moments it staged — bitwise plain PyTorch, no error.
    Where clipping bites, the step was deferred anyway (the update waited for the step)."""
    chosen = SETUPS[setup]
    adam = chosen.get("adam", "AdamW")
    want, want_norms = plain("tied", adam, chosen["gas"], chosen["clip"], lr_at=milestone(adam))
    got, norms, stats = through_zswap(tmp_path, "tied", chosen, lr_at=milestone(adam))
    assert norms == want_norms
    differ = [i for i, (g, w) in enumerate(zip(got, want, strict=True)) if not torch.equal(g, w)]
    assert differ == [], setup
    assert stats["steps_ordinary"] == 1, stats["steps_ordinary_reason"]
    bites = chosen["clip"] is not None and chosen["clip"] < 10
    assert stats["steps_hypers_redone"] == (0 if bites else 1), stats


@pytest.mark.dist
def test_model_shapes_over_two_ranks_match_ddp(tmp_path):
    """See `_step_shapes_dist_worker.py`: DDP's averaged gradients as the reference, bitwise where clipping
    does not bite."""
    run_ranks(Path(__file__).with_name("_step_shapes_dist_worker.py"), tmp_path)
