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

import pytest
import torch
import torch.distributed as dist

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import zswap
from tests.test_leaf_modules import (
    ByRank,
    MoE,
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
    torch.manual_seed(0)
    cfg = config(tmp)
    cfg["zero_optimization"]["offload_param"]["max_in_cpu"] = 10**6
    with zswap.Init(cfg):
        model = MoE()
    utils.set_z3_leaf_modules(model, ["MoEBlock"])
    with zswap.initialize(model, cfg) as engine:
        compare(engine, model, MoE, rank, seed=50)


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


def compare(engine: zswap.Engine, model: torch.nn.Module, cls: type, rank: int, seed: int) -> None:
    torch.manual_seed(0)
    plain = cls()
    with zswap.GatheredParameters(list(model.parameters())):
        for p, q in zip(model.parameters(), plain.parameters(), strict=True):
            q.data.copy_(p.data)
    opt = torch.optim.AdamW(plain.parameters(), lr=1e-2, fused=True)
    for x, y in data(rank, seed, steps=4):
        engine.backward(engine(x, y))
        engine.step()
        train_plain_step(plain, opt, x, y)
    with zswap.GatheredParameters(list(model.parameters())):
        for p, q in zip(model.parameters(), plain.parameters(), strict=True):
            assert torch.equal(p.data.cpu(), q.data), (rank, cls.__name__)


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
