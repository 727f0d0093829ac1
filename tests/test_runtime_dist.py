"""zswap.initialize across two torch.distributed (gloo) processes: see `_runtime_dist_worker.py`."""

from __future__ import annotations

from pathlib import Path

import pytest

from .conftest import run_ranks

WORKER = Path(__file__).with_name("_runtime_dist_worker.py")


@pytest.mark.dist
def test_two_ranks_match_the_plain_model(tmp_path):
    run_ranks(WORKER, tmp_path)
