"""Leaf modules (`zswap.deepspeed.utils.set_z3_leaf_modules` and its kin, DeepSpeed's
``tests/unit/runtime/zero/test_zero_leaf_module.py`` adapted): which modules are marked, and models
whose inside changes from step to step — or from rank to rank — training as plain PyTorch (DDP over two
ranks) with their params gathered together."""

from __future__ import annotations

import warnings
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import torch
import torch.distributed as dist
from torch import nn

import zswap
from zswap.deepspeed import utils

from .conftest import run_ranks

HIDDEN = 8


class ByRank(nn.Module):
    """DeepSpeed's ChooseModuleByRankModel: each rank runs one of two layers."""

    def __init__(self) -> None:
        super().__init__()
        self.linears = nn.ModuleList([nn.Linear(HIDDEN, HIDDEN, bias=False) for _ in range(2)])

    def forward(self, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        rank = dist.get_rank() if dist.is_initialized() else 0
        return nn.functional.cross_entropy(torch.relu(self.linears[rank % 2](x)), y)


class ByCounter(nn.Module):
    """DeepSpeed's ChooseModuleByCounter: each forward runs the other layer."""

    def __init__(self) -> None:
        super().__init__()
        self.linears = nn.ModuleList([nn.Linear(HIDDEN, HIDDEN, bias=False) for _ in range(2)])
        self.counter = 0

    def forward(self, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        layer = self.linears[self.counter % 2]
        self.counter += 1
        return nn.functional.cross_entropy(torch.relu(layer(x)), y)


class MoEBlock(nn.Module):
    """A mixture of experts: each sample goes to the expert its gate picks; experts no sample picked
    do not run (the rank's and the batch's data decide which)."""

    def __init__(self, experts: int = 4) -> None:
        super().__init__()
        self.gate = nn.Linear(HIDDEN, experts, bias=False)
        self.experts = nn.ModuleList([nn.Linear(HIDDEN, HIDDEN) for _ in range(experts)])

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        logits = self.gate(x)
        pick = logits.argmax(-1)
        out = torch.zeros_like(x)
        for i, expert in enumerate(self.experts):
            rows = (pick == i).nonzero().flatten()
            if len(rows):
                out = out.index_add(0, rows, expert(x[rows]) * logits.softmax(-1)[rows, i : i + 1])
        return x + out


class MoE(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.inp = nn.Linear(HIDDEN, HIDDEN)
        self.blocks = nn.ModuleList([MoEBlock(), MoEBlock()])
        self.out = nn.Linear(HIDDEN, HIDDEN)

    def forward(self, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        x = self.inp(x)
        for block in self.blocks:
            x = block(x)
        return nn.functional.cross_entropy(self.out(x), y)


class RankSkip(nn.Module):
    """A branch on the rank: rank 0 adds a layer's output, the others return their input as it is."""

    def __init__(self) -> None:
        super().__init__()
        self.inner = nn.Linear(HIDDEN, HIDDEN)

    def forward(self, h: torch.Tensor) -> torch.Tensor:
        rank = dist.get_rank() if dist.is_initialized() else 0
        return h + self.inner(h) if rank == 0 else h


class Skipping(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.inp = nn.Linear(HIDDEN, HIDDEN)
        self.skip = RankSkip()
        self.out = nn.Linear(HIDDEN, HIDDEN)

    def forward(self, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        return nn.functional.cross_entropy(self.out(self.skip(self.inp(x))), y)


class MoETwice(MoE):
    """Each leaf block run twice per forward (weights shared between depths): an expert one call picks
    and the other does not gets its gradient in one of the two calls' backwards."""

    def forward(self, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        x = self.inp(x)
        for block in self.blocks:
            x = block(block(x))
        return nn.functional.cross_entropy(self.out(x), y)


def _rank_one() -> bool:
    return dist.is_initialized() and dist.get_rank() == 1


class ZerosOnOne(nn.Module):
    """A layer whose output is zeros on rank 1 (a branch on the rank, inside the leaf)."""

    def __init__(self) -> None:
        super().__init__()
        self.lin = nn.Linear(HIDDEN, HIDDEN)

    def forward(self, h: torch.Tensor) -> torch.Tensor:
        return torch.zeros_like(h) if _rank_one() else self.lin(h)


class RankLess(nn.Module):
    """A leaf no gradient reaches on rank 1: its output is zeros there (``"zeros"``), or rank 1's loss does
    not use it (``"unused"``); rank 0 trains it."""

    def __init__(self, how: str) -> None:
        super().__init__()
        self.how = how
        self.inp = nn.Linear(HIDDEN, HIDDEN)
        self.leaf = ZerosOnOne() if how == "zeros" else nn.Linear(HIDDEN, HIDDEN)
        self.out = nn.Linear(HIDDEN, HIDDEN)

    def forward(self, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        h = self.inp(x)
        side = self.leaf(h)
        if self.how == "zeros":
            return nn.functional.cross_entropy(self.out(h + side), y)
        return nn.functional.cross_entropy(self.out(h if _rank_one() else side), y)


def config(path: Path) -> dict[str, Any]:
    return {
        "train_micro_batch_size_per_gpu": 3,
        "optimizer": {"type": "AdamW", "params": {"lr": 1e-2, "weight_decay": 0.01}},
        "zero_optimization": {
            "stage3_param_persistence_threshold": 0,
            "offload_optimizer": {"device": "nvme", "nvme_path": str(path)},
            "offload_param": {"device": "nvme", "nvme_path": str(path)},
        },
    }


def data(rank: int, seed: int = 0, steps: int = 1) -> Iterator[tuple[torch.Tensor, torch.Tensor]]:
    g = torch.Generator().manual_seed(seed * 10 + rank)
    for _ in range(steps):
        yield torch.randn(3, HIDDEN, generator=g), torch.randint(0, HIDDEN, (3,), generator=g)


def train_plain_step(plain: nn.Module, opt: torch.optim.Optimizer, x: torch.Tensor, y: torch.Tensor) -> None:
    """One step of ``plain`` as DDP takes it (one rank: as it is): each rank's gradients averaged over
    the ranks, zeros where a rank gave a param none, no gradient where none did."""
    plain(x, y).backward()
    world = dist.get_world_size() if dist.is_initialized() else 1
    for p in plain.parameters():
        if world > 1:
            used = torch.tensor([p.grad is not None], dtype=torch.uint8)
            dist.all_reduce(used, op=dist.ReduceOp.MAX)
            if used.item():
                g = p.grad if p.grad is not None else torch.zeros_like(p)
                dist.all_reduce(g)
                p.grad = g / world
    opt.step()
    opt.zero_grad()


@pytest.fixture(autouse=True)
def _quiet() -> Any:
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", zswap.ZswapWarning)
        yield


def test_marking_by_class_name_or_suffix_as_deepspeed_does():
    model = MoE()
    assert not utils.z3_leaf_module(model) and utils.get_z3_leaf_modules(model) == []
    assert utils.set_z3_leaf_modules(model, [MoEBlock]) == list(model.blocks)
    assert utils.get_z3_leaf_modules(model) == list(model.blocks)
    assert utils.unset_z3_leaf_modules(model, [f"{__name__}.MoEBlock"]) == list(model.blocks)
    assert utils.get_z3_leaf_modules(model) == []
    assert utils.set_z3_leaf_modules_by_name(model, ["blocks.1", "nope"], raise_if_not_found=False) == (
        [model.blocks[1]],
        ["nope"],
    )
    assert utils.set_z3_leaf_modules_by_suffix(model, ["experts"])[0] == [b.experts for b in model.blocks]
    utils.set_z3_leaf_module(model, True)
    assert utils.z3_leaf_module(model)
    with pytest.raises(ValueError, match="no module of \\['Missing'\\] in the model"):
        utils.set_z3_leaf_modules(model, ["Missing"])
    with pytest.raises(ValueError, match="no module named \\['nope'\\] in the model"):
        utils.set_z3_leaf_modules_by_name(model, ["nope"])
    assert utils.set_z3_leaf_modules(model, ["Missing"], raise_if_not_found=False) == []


@pytest.mark.parametrize("leaf", ["before", "after"], ids=["marked-before-initialize", "marked-after"])
@pytest.mark.parametrize("cls", [ByCounter, MoE])
def test_a_leaf_module_whose_inside_changes_trains_as_plain_torch(tmp_path, cls, leaf):
    torch.manual_seed(0)
    plain = cls()
    torch.manual_seed(0)
    with zswap.Init(config(tmp_path)):
        model = cls()
    target = [MoEBlock] if cls is MoE else [cls]
    if leaf == "before":
        utils.set_z3_leaf_modules(model, target)
    opt = torch.optim.AdamW(plain.parameters(), lr=1e-2, weight_decay=0.01, fused=True)
    with zswap.initialize(model, config(tmp_path)) as engine:
        for step, (x, y) in enumerate(data(0, steps=6)):
            if step == 2 and leaf == "after":
                utils.set_z3_leaf_modules(model, target)  # the engine is wired again over the marks
            engine.backward(engine(x, y))
            engine.step()
            train_plain_step(plain, opt, x, y)
        with zswap.GatheredParameters(list(model.parameters())):
            for p, q in zip(model.parameters(), plain.parameters(), strict=True):
                assert torch.equal(p.data, q.data)


def hf_moe(kind: str) -> nn.Module:
    """A tiny Hugging Face mixture-of-experts causal LM (Mixtral, Qwen2-MoE): 4 experts, 2 per token."""
    import transformers

    shape = {"vocab_size": 128, "hidden_size": 32, "intermediate_size": 48, "num_hidden_layers": 2,
             "num_attention_heads": 4, "num_key_value_heads": 2, "num_experts_per_tok": 2,
             "max_position_embeddings": 64}  # fmt: skip
    if kind == "mixtral":
        return transformers.MixtralForCausalLM(transformers.MixtralConfig(**shape, num_local_experts=4))
    return transformers.Qwen2MoeForCausalLM(
        transformers.Qwen2MoeConfig(
            **shape, num_experts=4, moe_intermediate_size=24, shared_expert_intermediate_size=32
        )
    )


def train_hf_moe(kind: str, path: Path, rank: int = 0, steps: int = 4) -> None:
    """`hf_moe` trained through zswap and in plain PyTorch (DDP's gradients over several ranks) on the
    rank's own batches: bitwise equal, the update run in backward after the first step."""
    cfg = config(path)
    torch.manual_seed(0)
    plain = hf_moe(kind)
    torch.manual_seed(0)
    with zswap.Init(cfg):
        model = hf_moe(kind)
    opt = torch.optim.AdamW(plain.parameters(), lr=1e-2, weight_decay=0.01, fused=True)
    g = torch.Generator().manual_seed(rank)
    with zswap.initialize(model, cfg) as engine:
        for _ in range(steps):
            ids = torch.randint(3, 128, (2, 8), generator=g)
            engine.backward(engine(input_ids=ids, labels=ids).loss)
            engine.step()
            train_plain_step(_Loss(plain), opt, ids, ids)
        assert engine.stats()["steps_in_backward"] == steps - 1
        with zswap.GatheredParameters(list(model.parameters())):
            for p, q in zip(model.parameters(), plain.parameters(), strict=True):
                assert torch.equal(p.data, q.data)


class _Loss(nn.Module):
    """``forward(ids, labels)`` → a causal LM's loss (what `train_plain_step` calls)."""

    def __init__(self, lm: nn.Module) -> None:
        super().__init__()
        self.lm = lm

    def forward(self, ids: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
        return self.lm(input_ids=ids, labels=labels).loss


@pytest.mark.parametrize("kind", ["mixtral", "qwen2-moe"])
def test_hugging_face_moe_models_train_as_plain_torch(tmp_path, kind, quiet_transformers):
    train_hf_moe(kind, tmp_path)


class MixtralLike(MoEBlock):
    """Stands for transformers' Mixtral block: DeepSpeed's default leaf classes name it."""


MixtralLike.__module__, MixtralLike.__qualname__ = (
    "transformers.models.mixtral.modeling_mixtral",
    "MixtralSparseMoeBlock",
)


class WithMixtral(MoE):
    def __init__(self) -> None:
        super().__init__()
        self.blocks = nn.ModuleList([MixtralLike(), MixtralLike()])


def test_the_configs_leaf_module_marks_modules_as_the_engine_is_built(tmp_path):
    cfg = config(tmp_path)
    cfg["zero_optimization"]["leaf_module"] = {
        "classes": "MoEBlock",
        "name_suffixes": ["out"],
        "names": ["x.y"],
    }
    with zswap.Init(cfg):
        model = MoE()
    with pytest.warns(zswap.ZswapWarning, match=r"leaf_module: \['x.y'\] match no module"):
        engine = zswap.initialize(model, cfg)
    with engine:
        assert utils.get_z3_leaf_modules(model) == [*model.blocks, model.out]
        assert utils.z3_leaf_parameter(model.blocks[0].experts[1].weight)
        assert not utils.z3_leaf_parameter(model.inp.weight)
        utils.unset_z3_leaf_modules(model, [MoEBlock])  # kept unset (the config applies once)
        engine.backward(engine(*next(data(0))))
        engine.step()
        assert utils.get_z3_leaf_modules(model) == [model.out]
    with zswap.Init(config(tmp_path)):
        model = WithMixtral()
    with zswap.initialize(model, config(tmp_path)):
        assert utils.get_z3_leaf_modules(model) == []  # DeepSpeed's default classes: over several ranks only
    cfg["zero_optimization"]["leaf_module"] = {"classes": [3]}
    with pytest.raises(zswap.ConfigError, match=r"leaf_module\.classes must be a name or a list of names"):
        zswap.load_config(cfg)
    cfg["zero_optimization"]["leaf_module"] = {"class": ["MoEBlock"]}
    with pytest.raises(zswap.ConfigError, match=r"unknown key 'class' in zero_optimization\.leaf_module"):
        zswap.load_config(cfg)


@pytest.mark.dist
def test_two_ranks_running_different_modules_need_a_leaf_and_then_train_as_ddp(tmp_path):
    run_ranks(Path(__file__).with_name("_leaf_dist_worker.py"), tmp_path)
