"""zswap.Init and GatheredParameters across two torch.distributed (gloo) processes."""

from __future__ import annotations

from pathlib import Path

import pytest

from .conftest import run_ranks

WORKER = Path(__file__).with_name("_dist_worker.py")


@pytest.mark.dist
def test_two_ranks_each_hold_half_and_gather_the_whole(tmp_path):
    run_ranks(WORKER, tmp_path)
