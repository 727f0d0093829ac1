"""One rank of `tests/test_ds_fragments.py`'s two-rank scenario: ``python _fragments_dist_worker.py RANK
WORLD INIT_FILE TMP``. Each rank trains on its own batches; full reads are every rank's local reads put
together; the same writes on every rank (full on even steps, each rank's partition on odd ones) train the
params exactly as the same writes into one plain PyTorch model and its AdamW."""

from __future__ import annotations

import sys
import warnings
from pathlib import Path

import torch
import torch.distributed as dist

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import zswap
from tests.test_ds_fragments import batch, build, config, partition, plain_adamw, write_everything
from zswap.deepspeed import utils


def main() -> None:
    rank, world, init_file, tmp = int(sys.argv[1]), int(sys.argv[2]), sys.argv[3], Path(sys.argv[4])
    dist.init_process_group("gloo", init_method=f"file://{init_file}", rank=rank, world_size=world)
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore", zswap.ZswapWarning)
            (tmp / f"swap{rank}").mkdir()
            engine, plain = build(config(tmp / f"swap{rank}"))
            opt = plain_adamw(plain)
            with engine:
                for step in range(4):
                    x, y = batch(100 * rank + step)
                    engine.backward(engine(x, y))
                    plain(x, y).backward()
                    for p in engine.module.parameters():
                        for read in ("fp32_param", "grad"):
                            full = getattr(utils, f"safe_get_full_{read}")(p)
                            local = getattr(utils, f"safe_get_local_{read}")(p)
                            assert torch.equal(partition(p, full), local), (rank, step, read)
                    write_everything(engine, plain, opt, 10 * step, full=step % 2 == 0)
                    engine.step()
                    opt.step()
                    opt.zero_grad()
                    write_everything(engine, plain, opt, 10 * step + 1, full=step % 2 == 1)
                    with zswap.GatheredParameters(list(engine.module.parameters())):
                        for p, q in zip(engine.module.parameters(), plain.parameters(), strict=True):
                            assert torch.equal(p.data, q.data), (rank, step)
    finally:
        dist.destroy_process_group()


if __name__ == "__main__":
    from _worker_exit import run_then_exit  # the script's folder, tests/, is on sys.path

    run_then_exit(main)
