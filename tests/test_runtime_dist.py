"""zswap.initialize across two torch.distributed (gloo) processes: see `_runtime_dist_worker.py`."""

from __future__ import annotations

from pathlib import Path

import pytest

from .conftest import run_ranks

WORKER = Path(__file__).with_name("_runtime_dist_worker.py")


@pytest.mark.dist
@pytest.mark.parametrize("transport", ["shared memory", "gloo"])
def test_two_ranks_match_the_plain_model(transport, tmp_path, monkeypatch):
    """Through shared memory (ranks on one host, `zswap._hostcomm`) and through gloo's all-to-alls alike."""
    monkeypatch.setenv("ZSWAP_HOST_COLLECTIVES", "1" if transport == "shared memory" else "0")
    run_ranks(WORKER, tmp_path)
