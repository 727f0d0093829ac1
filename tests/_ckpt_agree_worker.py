"""One rank of the two-rank load agreements (tests/test_checkpoint_agree.py):
``python _ckpt_agree_worker.py RANK WORLD INIT_FILE TMP``."""

from __future__ import annotations

import os
import shutil
import sys
import warnings
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import zswap
import zswap.deepspeed as deepspeed
from zswap.checkpoint import CheckpointArgumentError, CheckpointNotFoundError


def engine(tmp: Path, rank: int) -> tuple[nn.Module, zswap.Engine]:
    swap = tmp / f"swap{rank}"
    swap.mkdir(exist_ok=True)
    cfg = {
        "train_micro_batch_size_per_gpu": 2,
        "zero_optimization": {"stage": 3, "offload_param": {"device": "nvme", "nvme_path": str(swap)}},
        "optimizer": {"type": "AdamW", "params": {"lr": 1e-2}},
    }
    torch.manual_seed(0)
    with deepspeed.zero.Init(config_dict_or_path=cfg):
        model = nn.Sequential(nn.Linear(8, 8), nn.Linear(8, 2))
    eng, *_ = deepspeed.initialize(model=model, config=cfg, model_parameters=model.parameters())
    return model, eng


def refused(kind: type[Exception], call: Any, *args: Any, **kwargs: Any) -> Exception:
    """The error of ``kind`` that ``call(*args, **kwargs)`` raises (it must raise one)."""
    try:
        call(*args, **kwargs)
    except kind as e:
        return e
    raise AssertionError(f"{call.__name__}{args} raised no {kind.__name__}")


def main() -> None:
    rank, world, init_file, tmp = int(sys.argv[1]), int(sys.argv[2]), sys.argv[3], Path(sys.argv[4])
    dist.init_process_group("gloo", init_method=f"file://{init_file}", rank=rank, world_size=world)
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore", zswap.ZswapWarning)
            model, eng = engine(tmp, rank)
            for tag in ("a", "b"):
                eng.backward(model(torch.randn(2, 8)).square().mean())
                eng.step()
                eng.save_checkpoint(str(tmp / "ckpt"), tag=tag)
            dist.barrier()
            # Each rank its own copy, whose 'latest' names another tag: one checkpoint or none.
            mine = tmp / f"copy{rank}"
            shutil.copytree(tmp / "ckpt", mine)
            (mine / "latest").write_text("ab"[rank])
            e = refused(CheckpointArgumentError, eng.load_checkpoint, str(mine))
            assert "the ranks resolved different checkpoints (rank 0: 'a', rank 1: 'b')" in str(e), e
            # 'latest' on rank 0's folder only: refused on both, not (None, None) on one rank alone.
            if rank == 1:
                (mine / "latest").unlink()
            else:
                (mine / "latest").write_text("a")
            e = refused(CheckpointArgumentError, eng.load_checkpoint, str(mine))
            assert "is there on rank(s) 0 but not on 1" in str(e), e
            # A file missing on rank 1: the same error class on both ranks (``except FileNotFoundError``).
            if rank == 1:
                (mine / "latest").write_text("a")
                os.remove(next((mine / "a").glob("rank00001-of-00002.*params*")))
            dist.barrier()
            e = refused(CheckpointNotFoundError, eng.load_checkpoint, str(mine), tag="a")
            assert isinstance(e, FileNotFoundError) and (rank == 1 or "failed on rank 1" in str(e)), e
    finally:
        dist.destroy_process_group()


if __name__ == "__main__":
    from _worker_exit import run_then_exit  # the script's folder, tests/, is on sys.path

    run_then_exit(main)
