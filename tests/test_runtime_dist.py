"""zswap.initialize across two torch.distributed (gloo) processes: see `_runtime_dist_worker.py`."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

WORKER = Path(__file__).with_name("_runtime_dist_worker.py")


@pytest.mark.dist
def test_two_ranks_match_the_plain_model(tmp_path):
    world = 2
    env = {**os.environ, "WORLD_SIZE": str(world), "PYTHONDONTWRITEBYTECODE": "1"}
    procs = [
        subprocess.Popen(
            [sys.executable, str(WORKER), str(rank), str(world), str(tmp_path / "rendezvous"), str(tmp_path)],
            cwd=tmp_path,
            env={**env, "RANK": str(rank)},
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
            text=True,
        )
        for rank in range(world)
    ]
    outputs = []
    try:
        for p in procs:
            outputs.append(p.communicate(timeout=120)[0])
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
                p.wait()
    for rank, (p, out) in enumerate(zip(procs, outputs, strict=True)):
        assert p.returncode == 0, f"rank {rank} failed:\n{out}"
