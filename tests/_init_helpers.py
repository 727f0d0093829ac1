"""Shared by the Init / GatheredParameters tests: one way to open an Init on each tier, and a fake engine."""

from __future__ import annotations

import warnings
from pathlib import Path
from typing import Any

import pytest
import torch

import zswap

TIERS = ("cpu", "none", "nvme")


def engine_available() -> bool:
    try:
        from zswap.swap import SwapEngine  # noqa: F401
    except ImportError:
        return False
    return True


def make_init(tier: str, tmp_path: Path, **kwargs: Any) -> zswap.Init:
    """An Init on ``tier``; nvme goes to ``tmp_path`` through the real engine (skipped when not built)."""
    if tier != "nvme":
        return zswap.Init(remote_device=tier, **kwargs)
    if not engine_available():
        pytest.skip("the native swap engine (zswap._zswap) is not built")
    with warnings.catch_warnings():
        # io_uring / O_DIRECT fallbacks depend on the test machine, not on what is tested here.
        warnings.simplefilter("ignore", zswap.ZswapWarning)
        return zswap.Init({"offload_param": {"device": "nvme", "nvme_path": str(tmp_path)}}, **kwargs)


def gathered(params: Any) -> list[torch.Tensor]:
    """Copies of the full data of ``params`` (managed or not)."""
    params = list(params)
    with zswap.GatheredParameters(params):
        return [p.data.clone() for p in params]


class FakeHandle:
    def __init__(self, engine: FakeEngine, error: BaseException | None) -> None:
        self._engine, self._error, self._done = engine, error, False

    def done(self) -> bool:
        return self._done

    def wait(self) -> None:
        if not self._done:
            self._done = True
            self._engine.waits += 1
        if self._error is not None:
            raise self._error


class FakeEngine:
    """In-memory stand-in for `zswap.SwapEngine` that never completes a write before ``wait()``."""

    def __init__(self, fail_writes: bool = False) -> None:
        self.data: dict[str, torch.Tensor] = {}
        self.writes = self.waits = 0
        self.fail_writes = fail_writes

    def write(self, key: str, t: torch.Tensor) -> FakeHandle:
        self.writes += 1
        if self.fail_writes:
            return FakeHandle(self, zswap.SwapIOError(28, "No space left on device", key=key))
        self.data[key] = t.clone()
        return FakeHandle(self, None)

    def read(self, key: str, out: torch.Tensor) -> FakeHandle:
        src = self.data[key]
        if src.numel() * src.element_size() != out.numel() * out.element_size():
            raise ValueError("size mismatch")
        out.view(torch.uint8).copy_(src.view(torch.uint8))
        return FakeHandle(self, None)

    def empty(self, shape: Any, dtype: torch.dtype) -> torch.Tensor:
        return torch.empty(shape, dtype=dtype)

    def free(self, key: str) -> None:
        self.data.pop(key, None)

    def __contains__(self, key: object) -> bool:
        return key in self.data
