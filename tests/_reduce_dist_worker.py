"""One rank of tests/test_dist.py's gradient reduce-scatter case: ``python _reduce_dist_worker.py RANK WORLD
INIT_FILE TMP``.

Every rank makes the same-seeded gradients of every rank, so each knows what the others send. The partition
`zswap.gradients.grads.local_part` gives this rank (gloo: one all-to-all, the slices summed in rank order)
must be bitwise ``((g0 + g1) + g2 + ...) / world`` of its slice, for sizes the world divides and sizes it pads
(zeros past the end), float32 and bfloat16 (float16: each divided first, ``(g0 / world + g1 / world) + ...``,
so that a sum past its range whose average is within it does not overflow); and, in float32, agree with
gloo's own reduce-scatter to rounding; bf16 reduced in float32 (``communication_data_type``) is the float32
average, rounded or kept. A param's all-gather with a scratch buffer (gloo: one all-to-all of the partition
repeated per rank) must be every rank's partition in rank order, bitwise.
"""

from __future__ import annotations

import sys
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import torch
import torch.distributed as dist

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from zswap import _dist
from zswap.gradients.grads import local_part


def grad_of(rank: int, numel: int, dtype: torch.dtype) -> torch.Tensor:
    g = torch.Generator().manual_seed(1000 * rank + numel)
    return torch.randn(numel, generator=g).to(dtype)


def state(rank: int, world: int, numel: int) -> Any:
    return SimpleNamespace(
        world_size=world, rank=rank, partition_numel=-(-numel // world), group=None, key="p0", store=None,
        device=torch.device("cpu"),
    )  # fmt: skip


def average(rank: int, world: int, numel: int, dtype: torch.dtype, wide: bool = False) -> list[torch.Tensor]:
    """[every rank's padded gradient (widened to float32 where ``wide``)…, this rank's slice of
    ``((g0 + g1) + g2 + ...) / world``]."""
    part_numel = -(-numel // world)
    padded = [torch.cat([grad_of(r, numel, dtype), torch.zeros(part_numel * world - numel, dtype=dtype)])
              for r in range(world)]  # fmt: skip
    padded = [p.float() for p in padded] if wide else padded
    mine = [p[rank * part_numel : (rank + 1) * part_numel] for p in padded]
    want = mine[0] + mine[1]
    for s in mine[2:]:
        want = want + s
    return [*padded, want / world]


def check(rank: int, world: int, numel: int, dtype: torch.dtype) -> None:
    st = state(rank, world, numel)
    got = local_part(st, grad_of(rank, numel, dtype))
    *padded, want = average(rank, world, numel, dtype)
    if dtype == torch.float16:  # each rank's divided first, as DeepSpeed's ZeRO-3
        mine = [p[rank * st.partition_numel : (rank + 1) * st.partition_numel] / world for p in padded]
        want = mine[0] + mine[1]
        for s in mine[2:]:
            want = want + s
    assert got.dtype == dtype and torch.equal(got, want), (rank, numel, dtype)
    if dtype == torch.float32:  # bfloat16 sums in another order round apart by a whole bfloat16 ulp
        theirs = torch.empty(st.partition_numel, dtype=dtype)
        dist.reduce_scatter_tensor(theirs, padded[rank], op=dist.ReduceOp.SUM)
        torch.testing.assert_close(got, theirs / world)


def check_half_sum_past_its_range(rank: int, world: int) -> None:
    """Every rank's float16 gradient 40000 (fp16's largest is 65504): the sum overflows, the average
    does not, and is what each rank gets (DeepSpeed's ZeRO-3 divides first, so its loss scaler sees no
    overflow there either)."""
    st = state(rank, world, 2 * world)
    got = local_part(st, torch.full((2 * world,), 40000.0, dtype=torch.float16))
    assert torch.equal(got, torch.full((2,), 40000.0, dtype=torch.float16)), got


def check_gather(rank: int, world: int, numel: int, dtype: torch.dtype) -> None:
    out = torch.full((numel * world,), 7, dtype=dtype)
    _dist.all_gather_flat(out, grad_of(rank, numel, dtype), None, lambda n, d: torch.empty(n, dtype=d))
    assert torch.equal(out, torch.cat([grad_of(r, numel, dtype) for r in range(world)])), (rank, numel)


def check_reduce_in(rank: int, world: int, numel: int) -> None:
    """``reduce_in`` (``communication_data_type``): each rank's bf16 gradient widened to float32, summed and
    divided there, the average rounded back to bf16 — or kept in float32 (``keep``)."""
    st, g = state(rank, world, numel), grad_of(rank, numel, torch.bfloat16)
    want = average(rank, world, numel, torch.bfloat16, wide=True)[-1]
    kept = local_part(st, g, torch.float32, keep=True)
    assert kept.dtype == torch.float32 and torch.equal(kept, want), (rank, numel)
    rounded = local_part(st, g, torch.float32)
    assert rounded.dtype == torch.bfloat16 and torch.equal(rounded, want.bfloat16()), (rank, numel)


def main() -> None:
    rank, world = int(sys.argv[1]), int(sys.argv[2])
    dist.init_process_group("gloo", init_method=f"file://{sys.argv[3]}", rank=rank, world_size=world)
    try:
        for dtype in (torch.float32, torch.bfloat16, torch.float16):
            for numel in (world * 1000, world * 1000 + 1, 7, 1):
                check(rank, world, numel, dtype)
                check_gather(rank, world, numel, dtype)
        check_half_sum_past_its_range(rank, world)
        for numel in (world * 1000 + 1, 7):
            check_reduce_in(rank, world, numel)
        dist.barrier()
    finally:
        dist.destroy_process_group()


if __name__ == "__main__":
    from _worker_exit import run_then_exit  # the script's folder, tests/, is on sys.path

    run_then_exit(main)
