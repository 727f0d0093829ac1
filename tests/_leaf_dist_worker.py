"""One rank of `tests/test_leaf_modules.py`'s two-rank scenarios: ``python _leaf_dist_worker.py RANK WORLD
INIT_FILE TMP``. Ranks run different modules inside a model: without leaf modules the step raises
`RanksDivergedError` on every rank (before, the gathers paired partitions of different params and trained
on mixed weights, silently), and so does the end of a forward no backward follows; with the module marked
a leaf — after `initialize` too — training is bitwise DDP's (gradients averaged over the ranks, zeros where
a rank did not use a param)."""

from __future__ import annotations

import sys
import warnings
from pathlib import Path
from typing import Any

import pytest
import torch
import torch.distributed as dist
from torch import nn

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import zswap
from tests.test_leaf_modules import (
    ByRank,
    MoE,
    MoETwice,
    RankLess,
    Skipping,
    WithMixtral,
    config,
    data,
    train_hf_moe,
    train_plain_step,
)
from zswap.deepspeed import utils
from zswap.device import StandInDevice
from zswap.errors import RanksDivergedError


def by_rank_needs_a_leaf(rank: int, tmp: Path) -> None:
    torch.manual_seed(0)
    with zswap.Init(config(tmp)):
        model = ByRank()
    with zswap.initialize(model, config(tmp)) as engine:
        x, y = next(data(rank))
        engine.backward(engine(x, y))
        with pytest.raises(RanksDivergedError, match="did not gather the same params"):
            engine.step()
        engine.zero_grad()
        utils.set_z3_leaf_modules(model, [ByRank])  # on an open engine: from its next forward
        compare(engine, model, ByRank, rank, seed=10)


def by_rank_in_evaluation(rank: int, tmp: Path) -> None:
    """No step to check at: the forward itself raises (its outputs paired different params' partitions),
    on every rank; a forward inside `GatheredParameters` gathers nothing, so one rank runs it alone."""
    torch.manual_seed(0)
    with zswap.Init(config(tmp)):
        model = ByRank()
    with zswap.initialize(model, config(tmp)) as engine:
        x, y = next(data(rank))
        with torch.no_grad():
            with pytest.raises(RanksDivergedError, match="in this forward, which no backward follows"):
                engine(x, y)
            utils.set_z3_leaf_modules(model, [ByRank])
            expected = engine(x, y)  # as a leaf: every rank gathers both layers
            with zswap.GatheredParameters(list(model.parameters())):
                if rank == 0:
                    assert torch.equal(engine(x, y), expected)
        dist.barrier()


def moe_with_leaf_blocks(rank: int, tmp: Path, device: object = "cpu") -> None:
    torch.manual_seed(0)
    with zswap.Init(config(tmp)):
        model = MoE()
    assert len(utils.set_z3_leaf_modules(model, ["MoEBlock"])) == 2
    with zswap.initialize(model, config(tmp), device=device) as engine:
        compare(engine, model, MoE, rank, seed=20)


def moe_on_the_device_path(rank: int, tmp: Path) -> None:
    moe_with_leaf_blocks(rank, tmp, StandInDevice())


def a_leaf_one_rank_passes_through(rank: int, tmp: Path) -> None:
    """Rank 1's leaf returns its input: its backward still ends (and reduces) where rank 0's does, not at
    the end of the backward after the next module's collectives (every rank waited on the other)."""
    torch.manual_seed(0)
    cfg = config(tmp)
    cfg["zero_optimization"]["leaf_module"] = {"names": ["skip"]}
    with zswap.Init(cfg):
        model = Skipping()
    with zswap.initialize(model, cfg) as engine:
        compare(engine, model, Skipping, rank, seed=40)


def leaves_kept_gathered_by_max_in_cpu(rank: int, tmp: Path) -> None:
    """Leaves whose params all stay gathered (``max_in_cpu``) are reduced at their backward's end too
    (they had no backward hooks: their gradients waited for a reduction that never came, untrained)."""
    moe_leaves(rank, tmp, MoE, seed=50, max_in_cpu=10**6)


def a_leaf_run_twice_kept_gathered(rank: int, tmp: Path) -> None:
    """A leaf run twice per forward is reduced once per backward, after its last call's backward: each
    call's reduction sent a gradient one call gave against the other rank's zeros (where the other
    rank's came in the other call), which the early step took as a second gradient for the param."""
    moe_leaves(rank, tmp, MoETwice, seed=60, max_in_cpu=10**6)


def a_leaf_run_twice_over_windows(rank: int, tmp: Path) -> None:
    """The same over accumulation windows: bitwise DDP's sum of each micro-batch's averages (two
    half-reductions a backward rounded apart from it)."""
    moe_leaves(rank, tmp, MoETwice, seed=70, gas=2)


def moe_leaves(rank: int, tmp: Path, cls: type, seed: int, max_in_cpu: int = 0, gas: int = 1) -> None:
    """``cls`` (an `MoE`) with its blocks marked leaves trains as DDP."""
    torch.manual_seed(0)
    cfg = {**config(tmp), "gradient_accumulation_steps": gas}
    cfg["zero_optimization"]["offload_param"]["max_in_cpu"] = max_in_cpu
    with zswap.Init(cfg):
        model = cls()
    utils.set_z3_leaf_modules(model, ["MoEBlock"])
    with zswap.initialize(model, cfg) as engine:
        compare(engine, model, cls, rank, seed=seed, gas=gas)


def a_leaf_no_gradient_reaches_on_one_rank(rank: int, tmp: Path) -> None:
    """Rank 1's leaf output is zeros, or unused by its loss: rank 1 reduces the leaf where its input's
    gradient is complete, as rank 0 does (both ranks hung, rank 0 reducing there and rank 1 at the end)."""
    for i, how in enumerate(("zeros", "unused")):
        torch.manual_seed(0)
        cfg = config(tmp / how)
        (tmp / how).mkdir()
        cfg["zero_optimization"]["leaf_module"] = {"names": ["leaf"]}
        with zswap.Init(cfg):
            model = RankLess(how)
        with zswap.initialize(model, cfg) as engine:
            compare(engine, model, lambda how=how: RankLess(how), rank, seed=80 + i)


def mixtral_blocks_are_leaves_by_default(rank: int, tmp: Path) -> None:
    with zswap.Init(config(tmp)):
        model = WithMixtral()
    with zswap.initialize(model, config(tmp)) as engine:
        assert utils.get_z3_leaf_modules(model) == list(model.blocks)  # DeepSpeed's default classes
        for x, y in data(rank, 30, steps=2):
            engine.backward(engine(x, y))
            engine.step()


def hf_mixtral(rank: int, tmp: Path) -> None:
    train_hf_moe("mixtral", tmp, rank)  # its sparse blocks are leaves by default


def compare(engine: zswap.Engine, model: nn.Module, make: Any, rank: int, seed: int, gas: int = 1) -> None:
    torch.manual_seed(0)
    plain = make()
    with zswap.GatheredParameters(list(model.parameters())):
        for p, q in zip(model.parameters(), plain.parameters(), strict=True):
            q.data.copy_(p.data)
    opt = torch.optim.AdamW(plain.parameters(), lr=1e-2, fused=True)
    batches = list(data(rank, seed, steps=4 * gas))
    for w in range(4):
        window = batches[w * gas : (w + 1) * gas]
        for x, y in window:
            engine.backward(engine(x, y))
            engine.step()
        if gas == 1:
            train_plain_step(plain, opt, *window[0])
        else:
            train_plain_window(plain, opt, window)
    with zswap.GatheredParameters(list(model.parameters())):
        for p, q in zip(model.parameters(), plain.parameters(), strict=True):
            assert torch.equal(p.data.cpu(), q.data), (rank, type(plain).__name__)


def train_plain_window(plain: torch.nn.Module, opt: torch.optim.Optimizer, window: list[Any]) -> None:
    """DDP over an accumulation window: each micro-batch's loss divided by the window's length, its
    gradients averaged over the ranks (zeros where a rank gave none), the averages summed."""
    world, params = dist.get_world_size(), list(plain.parameters())
    total: list[torch.Tensor | None] = [None] * len(params)
    for x, y in window:
        for p in params:
            p.grad = None
        (plain(x, y) / len(window)).backward()
        for i, p in enumerate(params):
            used = torch.tensor([p.grad is not None], dtype=torch.uint8)
            dist.all_reduce(used, op=dist.ReduceOp.MAX)
            if used.item():
                g = p.grad if p.grad is not None else torch.zeros_like(p)
                dist.all_reduce(g)
                total[i] = g / world if total[i] is None else total[i] + g / world
    for p, g in zip(params, total, strict=True):
        p.grad = g
    opt.step()
    opt.zero_grad()


def main() -> None:
    rank, world, init_file, tmp = int(sys.argv[1]), int(sys.argv[2]), sys.argv[3], Path(sys.argv[4])
    dist.init_process_group("gloo", init_method=f"file://{init_file}", rank=rank, world_size=world)
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore", zswap.ZswapWarning)
            scenarios = (
                by_rank_needs_a_leaf,
                by_rank_in_evaluation,
                moe_with_leaf_blocks,
                moe_on_the_device_path,
                a_leaf_one_rank_passes_through,
                leaves_kept_gathered_by_max_in_cpu,
                a_leaf_run_twice_kept_gathered,
                a_leaf_run_twice_over_windows,
                a_leaf_no_gradient_reaches_on_one_rank,
                mixtral_blocks_are_leaves_by_default,
                hf_mixtral,
            )
            for i, scenario in enumerate(scenarios):
                swap = tmp / f"swap{rank}-{i}"
                swap.mkdir()
                scenario(rank, swap)
    finally:
        dist.destroy_process_group()


if __name__ == "__main__":
    from _worker_exit import run_then_exit  # the script's folder, tests/, is on sys.path

    run_then_exit(main)
