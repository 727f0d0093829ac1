"""Seeded random setups through `zswap.initialize`, each against plain PyTorch, bitwise.

Each seed draws a small model (an embedding, residual blocks, a head; weights tied or not, frozen norms,
blocks under reentrant or non-reentrant activation checkpointing, a weight also used outside its module,
a module never used, a param of no elements, dropout, a block run twice) and a setup (param and optimizer
tiers, the device stand-in, accumulation, clipping that bites or not, persistence, live and prefetch
budgets, ``max_in_cpu``, the config's AdamW or a torch AdamW / Adam / SGD / Adagrad over two param groups),
then a loop (a forward of two passes summed, ``loss.backward()`` or ``engine.backward``, an eval forward
between steps, an lr change between backward and step, a checkpoint saved and loaded, ``zero_grad`` after a
step).
float32 runs are compared with plain torch (``clip_grad_norm_``, ``AdamW(fused=True)``): every loss and
every param after the steps; bf16 and fp16 runs with the same setup's ordinary step (``engine.early_step =
False``). The setup is in the failure message; ``SEEDS`` can be widened locally to search further.
"""

from __future__ import annotations

import random
import shutil
import warnings
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any, cast

import pytest
import torch
from torch import nn
from torch.utils.checkpoint import checkpoint

import zswap
from zswap.device import StandInDevice

SEEDS = range(40)
VOCAB = 32


class Block(nn.Module):
    def __init__(self, width: int, frozen: bool, ckpt: str | None) -> None:
        super().__init__()
        self.a, self.b, self.n = nn.Linear(width, 2 * width), nn.Linear(2 * width, width), nn.LayerNorm(width)
        self.n.requires_grad_(not frozen)
        self.drop = nn.Dropout(0.1)
        self.register_buffer("scale", torch.full((width,), 0.5))
        self.ckpt = ckpt

    def _f(self, x: torch.Tensor) -> torch.Tensor:
        return x + self.drop(self.b(torch.tanh(self.a(self.n(x))))) * self.scale

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.ckpt and self.training and torch.is_grad_enabled():
            return checkpoint(self._f, x, use_reentrant=self.ckpt == "reentrant")
        return self._f(x)


class Net(nn.Module):
    def __init__(self, rng: random.Random, width: int, depth: int, empty: bool | None = None) -> None:
        super().__init__()
        self.emb = nn.Embedding(VOCAB, width)
        self.blocks = nn.ModuleList(
            Block(width, rng.random() < 0.3, rng.choice([None, None, "reentrant", "non-reentrant"]))
            for _ in range(depth)
        )
        self.head = nn.Linear(width, VOCAB, bias=rng.random() < 0.5)
        if rng.random() < 0.4:
            self.head.weight = self.emb.weight
        self.shared_use = rng.random() < 0.3  # a block's weight read outside its module too
        self.again = rng.random() < 0.3  # the last block run twice in one forward
        self.unused = nn.Linear(width, width) if rng.random() < 0.3 else None
        drawn = rng.random() < 0.2
        self.empty = nn.Parameter(torch.zeros(0)) if (drawn if empty is None else empty) else None

    def forward(self, ids: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
        h = self.emb(ids)
        for block in self.blocks:
            h = block(h)
        if self.again:
            h = self.blocks[-1](h)
        if self.shared_use:
            first = cast(Block, self.blocks[0])
            h = h + 0.1 * nn.functional.linear(h, first.b.weight[:, : h.shape[-1]])
        loss = nn.functional.cross_entropy(self.head(h).flatten(0, 1), targets.flatten())
        return loss if self.empty is None else loss + self.empty.sum()


@dataclass
class Setup:
    seed: int
    width: int
    depth: int
    steps: int
    gas: int
    clip: float | None
    zero: dict[str, Any]
    lr: float
    weight_decay: float
    standin: bool
    twice: bool
    direct: bool
    evals: bool
    lr_change: bool
    ckpt_after_first: bool
    zero_grad_after_first: bool
    optimizer: str = "config"
    """``"config"`` (the config's AdamW), or a torch ``"AdamW"`` / ``"Adam"`` / ``"SGD"`` / ``"Adagrad"``
    given to `zswap.initialize` over two groups: matrices with the weight decay, the rest without it at twice
    the lr."""
    half: str | None = None
    empty: bool | None = None
    """A param of no elements (a placeholder) in the model: drawn (``None``), or not."""

    def config(self, path: Path) -> dict[str, Any]:
        where = {"nvme_path": str(path)}
        zero = {k: {**v, **where} if k.startswith("offload") else v for k, v in self.zero.items()}
        cfg: dict[str, Any] = {"zero_optimization": zero, "gradient_accumulation_steps": self.gas}
        if self.optimizer == "config":
            cfg["optimizer"] = {"type": "AdamW", "params": {"lr": self.lr, "weight_decay": self.weight_decay}}
        if self.clip:
            cfg["gradient_clipping"] = self.clip
        if self.half:
            cfg[self.half] = {"enabled": True, **({"initial_scale_power": 8} if self.half == "fp16" else {})}
        return cfg

    def dtype(self) -> torch.dtype:
        return {None: torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16}[self.half]

    def model(self) -> Net:
        torch.manual_seed(self.seed)
        return Net(random.Random(self.seed + 1), self.width, self.depth, self.empty)

    def torch_optimizer(self, model: nn.Module, **fused: bool) -> torch.optim.Optimizer:
        """The optimizer of the plain run (``fused``), or the one given to `zswap.initialize`. Groups are
        chosen by name: on a partitioned model ``p.dim()`` outside forward is 1."""
        if self.optimizer == "config":
            return torch.optim.AdamW(model.parameters(), lr=self.lr, weight_decay=self.weight_decay, **fused)
        matrices = {n for n, p in self.model().named_parameters() if p.dim() >= 2}
        named = list(model.named_parameters())
        groups = [{"params": [p for n, p in named if n in matrices], "weight_decay": self.weight_decay}]
        rest = [p for n, p in named if n not in matrices]
        if rest:
            groups.append({"params": rest, "weight_decay": 0.0, "lr": 2 * self.lr})
        if self.optimizer in ("AdamW", "Adam"):  # rebuilt as zswap's AdamW: fused=True's bits
            return getattr(torch.optim, self.optimizer)(groups, lr=self.lr, **fused)
        extra = {"momentum": 0.9} if self.optimizer == "SGD" else {}  # stepped as given, as plain torch
        return getattr(torch.optim, self.optimizer)(groups, lr=self.lr, **extra)

    def batches(self) -> tuple[list[tuple[torch.Tensor, torch.Tensor]], tuple[torch.Tensor, torch.Tensor]]:
        g = torch.Generator().manual_seed(self.seed)
        pairs = [
            (torch.randint(0, VOCAB, (2, 5), generator=g), torch.randint(0, VOCAB, (2, 5), generator=g))
            for _ in range(self.steps * self.gas + 1)
        ]
        return pairs[:-1], pairs[-1]


def draw(seed: int, half: str | None = None) -> Setup:
    rng = random.Random(seed)
    params = rng.choice(["none", "cpu", "nvme", "nvme"])
    states = rng.choice(["none", "cpu", "nvme"] if params == "none" else ["cpu", "nvme", "nvme"])
    zero: dict[str, Any] = {
        "stage3_param_persistence_threshold": rng.choice([0, 0, 64, 10_000]),
        "offload_param": {"device": params},
        "offload_optimizer": {"device": states},
    }
    if rng.random() < 0.4:
        zero["stage3_max_live_parameters"] = rng.choice([100, 2000, 10**9])
    if rng.random() < 0.4:
        zero["stage3_prefetch_bucket_size"] = rng.choice([0, 500, 10**7])
    if rng.random() < 0.3:
        zero["stage3_max_reuse_distance"] = rng.choice([0, 10**9])
    if params == "nvme" and rng.random() < 0.3:
        zero["offload_param"]["max_in_cpu"] = rng.choice([500, 10**6])
    return Setup(
        seed=seed,
        width=rng.choice([8, 16, 32]),
        depth=rng.choice([1, 2, 3, 4]),
        steps=rng.choice([2, 3, 5]),
        gas=rng.choice([1, 1, 2, 3]),
        clip=rng.choice([None, None, 1e-3, 1.0, 100.0]),
        zero=zero,
        lr=rng.choice([1e-3, 1e-2]),
        weight_decay=rng.choice([0.0, 0.1]),
        standin=rng.random() < 0.3,
        twice=rng.random() < 0.25,
        direct=rng.random() < 0.3,
        evals=rng.random() < 0.4,
        lr_change=rng.random() < 0.3,
        ckpt_after_first=rng.random() < 0.25,
        zero_grad_after_first=rng.random() < 0.2,
        # (in bf16 / fp16 an optimizer stepped as given steps the params' own dtype, no float32 master:
        # the early step is zswap's AdamW's, so those draws keep to it)
        optimizer=rng.choice(["config", "AdamW", "Adam", "SGD", "Adagrad"][: 3 if half else 5]),
        half=half,
    )


def micro_batch(s: Setup, model: nn.Module, step: int, k: int, losses: list[float]) -> torch.Tensor:
    """Micro-batch ``k`` of ``step``'s loss (two passes summed where drawn), after an eval forward where
    drawn; each loss noted in ``losses``."""
    data, probe = s.batches()
    if s.evals and k == 0:
        with torch.no_grad():
            losses.append(float(model.eval()(*probe)))
        model.train()
    x, y = data[step * s.gas + k]
    torch.manual_seed(1000 * step + k)  # dropout's masks: the same in both runs
    loss = model(x, y) + model(y, x) if s.twice else model(x, y)
    losses.append(float(loss.detach()))
    return loss


def through_zswap(s: Setup, path: Path, early: bool = True) -> tuple[dict[str, torch.Tensor], list[float]]:
    """The params after the loop and every micro-batch's loss."""
    cfg = s.config(path)
    with zswap.Init(cfg):
        model = s.model()
    losses: list[float] = []
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", zswap.ZswapWarning)
        given = None if s.optimizer == "config" else s.torch_optimizer(model)
        engine = zswap.initialize(model, cfg, device=StandInDevice() if s.standin else None, optimizer=given)
    with engine:
        engine.early_step = early
        for step in range(s.steps):
            for k in range(s.gas):
                loss = micro_batch(s, model, step, k, losses)
                if s.direct:
                    (loss / s.gas).backward()  # zswap.initialize's engine: PyTorch's own backward
                else:
                    engine.backward(loss)
                if s.lr_change and step == 1 and k == s.gas - 1:
                    for group in engine.optimizer.param_groups:
                        group["lr"] /= 2
                engine.step()
            if step == 0 and s.ckpt_after_first:
                engine.save_checkpoint(path / "ckpt")
                engine.load_checkpoint(path / "ckpt")
                shutil.rmtree(path / "ckpt")
            if step == 0 and s.zero_grad_after_first:
                engine.zero_grad()
        named = dict(model.named_parameters())
        with zswap.GatheredParameters(list(named.values())):
            return {n: p.detach().clone() for n, p in named.items()}, losses


def plain(s: Setup) -> tuple[dict[str, torch.Tensor], list[float]]:
    model = s.model()
    params = list(model.parameters())
    opt = s.torch_optimizer(model, fused=True)
    losses: list[float] = []
    for step in range(s.steps):
        for k in range(s.gas):
            (micro_batch(s, model, step, k, losses) / s.gas).backward()
        if s.lr_change and step == 1:
            for group in opt.param_groups:
                group["lr"] /= 2
        if s.clip:
            torch.nn.utils.clip_grad_norm_(params, s.clip)
        opt.step()
        opt.zero_grad()
    return {n: p.detach() for n, p in model.named_parameters()}, losses


@pytest.mark.parametrize("seed", SEEDS)
def test_a_random_setup_trains_bitwise_as_plain_pytorch(seed, tmp_path):
    s = draw(seed)
    got, losses = through_zswap(s, tmp_path)
    want, want_losses = plain(s)
    assert losses == want_losses, s
    assert [n for n, w in want.items() if not torch.equal(got[n], w)] == [], s


@pytest.mark.parametrize("half", ["bf16", "fp16"])
@pytest.mark.parametrize("seed", SEEDS[:15])
def test_a_random_low_precision_setup_steps_in_backward_as_its_ordinary_step(seed, half, tmp_path):
    s = draw(1000 + seed, half)
    (tmp_path / "early").mkdir()
    (tmp_path / "ordinary").mkdir()
    got, losses = through_zswap(s, tmp_path / "early")
    want, want_losses = through_zswap(s, tmp_path / "ordinary", early=False)
    assert losses == want_losses, s
    assert [n for n, w in want.items() if not torch.equal(got[n], w)] == [], s


@pytest.mark.parametrize("standin", [False, True], ids=["cpu", "standin"])
@pytest.mark.parametrize("half", ["bf16", "fp16"])
@pytest.mark.parametrize("params", ["cpu", "nvme"])
def test_a_param_of_no_elements_is_cast_with_the_model(params, half, standin, tmp_path):
    """Its partition has no address: a memory store took the cast one for the float32 one written in place,
    and the ordinary step then assigned it a float32 gradient (torch's ``grad_dtype`` error)."""
    s = replace(draw(7, half), empty=True, standin=standin, gas=2, zero={"offload_param": {"device": params}})
    for early in (True, False):
        (tmp_path / str(early)).mkdir()
        got, _ = through_zswap(s, tmp_path / str(early), early=early)
        assert got["empty"].dtype == got["emb.weight"].dtype == s.dtype() and got["empty"].numel() == 0
