"""The ordinary step of a param with a float32 master (bf16 params under `OffloadedAdamW`) does not read the
param: the kernel steps the master in its record and only writes the rounded param
(`OffloadedAdamW.overwrites`). Bitwise the step that reads it, fewer bytes read by exactly the params' own,
and a step the optimizer skips writes no param back."""

from __future__ import annotations

from typing import Any

import pytest
import torch
from torch import nn

import zswap
from zswap.step.optim import OffloadedAdamW

from .test_runtime import build, engine_for

WIDTH, STEPS = 64, 4


class Net(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.a = nn.Linear(WIDTH, WIDTH, bias=False)
        self.b = nn.Linear(WIDTH, WIDTH, bias=False)
        self.c = nn.Linear(WIDTH, WIDTH, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.c(torch.tanh(self.b(torch.tanh(self.a(x))))).float().square().mean()


def config(tmp_path: Any, clip: float | None) -> dict[str, Any]:
    nvme = {"device": "nvme", "nvme_path": str(tmp_path)}
    cfg: dict[str, Any] = {
        "zero_optimization": {"offload_param": dict(nvme), "offload_optimizer": dict(nvme)},
        "optimizer": {"type": "AdamW", "params": {"lr": 1e-2, "weight_decay": 0.01}},
        "bf16": {"enabled": True},
    }
    if clip is not None:
        cfg["gradient_clipping"] = clip
    return cfg


def train(tmp_path: Any, clip: float | None) -> tuple[list[list[torch.Tensor]], list[int]]:
    """Params after each of `STEPS` ordinary steps, and the bytes each ``engine.step()`` read."""
    tmp_path.mkdir()
    cfg = config(tmp_path, clip)
    m, _ = build(Net, cfg)
    g = torch.Generator().manual_seed(5)
    after, reads = [], []
    with engine_for(m, cfg) as engine:
        engine.early_step = False
        for _ in range(STEPS):
            engine.backward(engine(torch.randn(4, WIDTH, generator=g).to(torch.bfloat16)))
            before = engine.stats()["bytes_read"]
            engine.step()
            reads.append(engine.stats()["bytes_read"] - before)
            with zswap.GatheredParameters(list(m.parameters())):
                after.append([p.detach().clone() for p in m.parameters()])
    return after, reads


@pytest.mark.parametrize("clip", [None, 1e-3], ids=["no-clip", "clip-bites"])
def test_a_mastered_param_is_not_read_by_its_step(clip, tmp_path, monkeypatch):
    params, reads = train(tmp_path / "unread", clip)
    assert all(p.dtype == torch.bfloat16 for p in params[0])
    monkeypatch.setattr(OffloadedAdamW, "overwrites", lambda self, params: set())
    want, want_reads = train(tmp_path / "read", clip)
    for step, (got, ref) in enumerate(zip(params, want, strict=True)):
        assert all(torch.equal(a, b) for a, b in zip(got, ref, strict=True)), f"step {step}"
    param_bytes = 3 * WIDTH * WIDTH * 2
    # The first step makes the records (its params are read to seed the masters); each later one reads
    # the same but the params.
    assert reads[0] == want_reads[0]
    assert [w - r for r, w in zip(reads[1:], want_reads[1:], strict=True)] == [param_bytes] * (STEPS - 1)


def test_a_step_the_optimizer_skips_writes_no_unread_param(tmp_path, monkeypatch):
    """`OffloadedAdamW` skips a step of its own (its clipping or fp16 check found no finite norm): the
    buffers the unread params were given hold no value and must not be stored."""
    real = OffloadedAdamW._grad_scale
    skipped: set[int] = set()

    def skip_the_third(self: OffloadedAdamW, todo: list[int], extra: float) -> float | None:
        if self._steps[todo[0]] == 2 and not skipped.issuperset(todo):  # two steps taken: skip once
            skipped.update(todo)
            return None
        return real(self, todo, extra)

    monkeypatch.setattr(OffloadedAdamW, "_grad_scale", skip_the_third)
    params, _ = train(tmp_path / "run", None)
    assert all(torch.equal(a, b) for a, b in zip(params[2], params[1], strict=True))  # the skipped step
    assert not all(torch.equal(a, b) for a, b in zip(params[3], params[2], strict=True))  # the next one ran
