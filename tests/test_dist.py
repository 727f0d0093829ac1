"""zswap.Init and GatheredParameters across two torch.distributed (gloo) processes."""

from __future__ import annotations

from pathlib import Path

import pytest

from .conftest import run_ranks

WORKER = Path(__file__).with_name("_dist_worker.py")


@pytest.mark.dist
def test_two_ranks_each_hold_half_and_gather_the_whole(tmp_path):
    run_ranks(WORKER, tmp_path)


@pytest.mark.dist
@pytest.mark.parametrize("world", [2, 3])
def test_gloo_reduce_scatter_and_all_gather_keep_rank_order_bitwise(world, tmp_path):
    """See `_reduce_dist_worker.py`."""
    run_ranks(Path(__file__).with_name("_reduce_dist_worker.py"), tmp_path, world=world)


@pytest.mark.dist
def test_params_partitioned_before_the_ranks_came_up_are_refused_unless_a_one_rank_group_says_so(tmp_path):
    """See `_prepartitioned_dist_worker.py`."""
    run_ranks(Path(__file__).with_name("_prepartitioned_dist_worker.py"), tmp_path)
