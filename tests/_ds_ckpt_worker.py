"""One rank of tests/test_ds_checkpoint.py's two-rank scenario (DeepSpeed's ``test_tag_validation.py``):
``python _ds_ckpt_worker.py RANK WORLD INIT_FILE TMP``. Ranks passing different tags get an error on every
rank and nothing is saved; so do ranks passing different folders, or one folder not on a file system both
see (a node's local disk: rank 1 made not to see rank 0's temp folder); the same tag saves one checkpoint
both ranks load."""

from __future__ import annotations

import sys
import warnings
from pathlib import Path

import torch
import torch.distributed as dist

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import zswap
import zswap.deepspeed as deepspeed
from tests._ds_common import TwoLayer, base_config, batches
from zswap.checkpoint import CheckpointArgumentError


def main() -> None:
    rank, world, init_file, tmp = int(sys.argv[1]), int(sys.argv[2]), sys.argv[3], Path(sys.argv[4])
    dist.init_process_group("gloo", init_method=f"file://{init_file}", rank=rank, world_size=world)
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore", zswap.ZswapWarning)
            cfg = base_config(checkpoint={"tag_validation": "Warn"}, zero_optimization={"stage": 3})
            model = TwoLayer()
            engine, *_ = deepspeed.initialize(config=cfg, model=model, model_parameters=model.parameters())
            for x, y in batches(2, seed=rank):
                engine.backward(engine(x, y))
                engine.step()
            folder = tmp / "ck"
            try:
                engine.save_checkpoint(folder, tag=f"tag-{rank}")
            except CheckpointArgumentError as e:
                assert "rank 0: 'tag-0', rank 1: 'tag-1'" in str(e), e
            else:
                raise AssertionError("different tags on two ranks were accepted")
            dist.barrier()
            assert not (folder / "latest").exists() and not (folder / "tag-0").exists()
            try:
                engine.save_checkpoint(tmp / f"ck{rank}", tag="same")
            except CheckpointArgumentError as e:
                assert "every rank must pass the same save_dir, got rank 0: " in str(e), e
            else:
                raise AssertionError("different folders on two ranks were accepted")
            _not_shared(rank, engine, folder)
            engine.save_checkpoint(folder, tag="same")
            try:
                engine.load_checkpoint(folder, tag=f"same{rank or ''}")
            except CheckpointArgumentError as e:
                assert "every rank must pass the same tag" in str(e), e
            else:
                raise AssertionError("different tags on two ranks were accepted by load_checkpoint")
            params = list(model.parameters())
            with zswap.GatheredParameters(params):
                want = [p.detach().clone() for p in params]
            with torch.no_grad(), zswap.GatheredParameters(params, modifier_rank=0):
                for p in params:
                    p.zero_()
            path, _ = engine.load_checkpoint(folder)
            assert path == str(folder / "same")
            with zswap.GatheredParameters(params):
                assert all(torch.equal(p, q) for p, q in zip(params, want, strict=True))
            engine.close()
    finally:
        dist.destroy_process_group()


def _not_shared(rank: int, engine: object, folder: Path) -> None:
    """On rank 1 the temp folder rank 0 creates is not there, as on a node's own disk."""
    is_dir = Path.is_dir
    if rank == 1:
        Path.is_dir = lambda p: False if p.name.startswith(".tmp-") else is_dir(p)  # type: ignore[method-assign]
    try:
        engine.save_checkpoint(folder, tag="same")  # type: ignore[attr-defined]
    except zswap.ZswapError as e:
        assert "save_dir must be on a file system every rank shares" in str(e), e
    else:
        raise AssertionError("a temp folder one rank could not see was accepted")
    finally:
        Path.is_dir = is_dir  # type: ignore[method-assign]
    dist.barrier()
    assert not (folder / "same").exists()


if __name__ == "__main__":
    from _worker_exit import run_then_exit  # the script's folder, tests/, is on sys.path

    run_then_exit(main)
