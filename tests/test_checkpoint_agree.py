"""Two ranks agree on what a load is: the same checkpoint resolved by every rank (each reads its own
``latest``), a ``latest`` seen by some ranks only refused on all, and an error of one rank raised as the
same class on every rank, so ``except FileNotFoundError`` takes one branch everywhere
(`_ckpt_agree_worker.py`)."""

from __future__ import annotations

from pathlib import Path

from .conftest import run_ranks

WORKER = Path(__file__).with_name("_ckpt_agree_worker.py")


def test_ranks_agree_on_what_they_load(tmp_path: Path) -> None:
    run_ranks(WORKER, tmp_path, timeout=240)
