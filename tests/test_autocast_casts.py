"""Autocast's copies of the weights (`zswap.fetch.casts`). Under autocast an op saves its weight cast to
the autocast dtype for backward (``linear`` saves ``weight.to(bfloat16).t()``); zswap saves the param's
layout instead and casts again in backward, so no copy of a weight outlives its module's forward (it used
to: half the float32 model in bfloat16, past the live budget), and training stays plain torch's under the
same autocast, trainable and frozen weights alike, autocast entered by the config or by the caller."""

from __future__ import annotations

import contextlib

import pytest
import torch
from torch import nn

import zswap

from .test_runtime import build, config, engine_for

D = 128  # a weight is D x D; activations are BATCH x D, so a saved D x D tensor can only be a weight
BATCH = 4


class Net(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.a = nn.Linear(D, D)
        self.frozen = nn.Linear(D, D).requires_grad_(False)
        self.b = nn.Linear(D, D)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.b(torch.relu(self.frozen(torch.relu(self.a(x)))))


def _autocast(by: str, who: str) -> contextlib.AbstractContextManager[object]:
    if by == who:
        return torch.autocast("cpu", dtype=torch.bfloat16)
    return contextlib.nullcontext()


@pytest.mark.parametrize("by", ["config", "caller"])
@pytest.mark.parametrize("tier", ["cpu", "nvme"])
def test_no_copy_of_a_weight_is_saved_and_training_is_plain_torchs(by, tier, tmp_path):
    cfg = config(tier, tmp_path, stage3_param_persistence_threshold=0)
    cfg["optimizer"] = {"type": "AdamW", "params": {"lr": 1e-2, "weight_decay": 0.01}}
    if by == "config":
        cfg["torch_autocast"] = {"enabled": True, "dtype": "bfloat16"}
    m, ref = build(Net, cfg)
    opt = torch.optim.AdamW(
        [p for p in ref.parameters() if p.requires_grad], lr=1e-2, weight_decay=0.01, fused=True
    )
    saved: list[tuple[tuple[int, ...], torch.dtype]] = []

    def pack(t: torch.Tensor) -> torch.Tensor:
        saved.append((tuple(t.shape), t.dtype))
        return t

    g = torch.Generator().manual_seed(3)
    with engine_for(m, cfg) as engine:
        for _ in range(3):
            x = torch.randn(BATCH, D, generator=g)
            saved.clear()
            with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t), _autocast(by, "caller"):
                loss = m(x).float().square().mean()
            assert saved and all(s[0] != (D, D) for s in saved), saved  # activations only
            engine.backward(loss)
            engine.step()
            with torch.autocast("cpu", dtype=torch.bfloat16):
                ref_loss = ref(x).float().square().mean()
            ref_loss.backward()
            opt.step()
            opt.zero_grad()
            assert torch.equal(loss.detach(), ref_loss.detach())
        params = list(m.parameters())
        with zswap.GatheredParameters(params):
            for (name, p), q in zip(m.named_parameters(), ref.parameters(), strict=True):
                assert torch.equal(p, q), name


def test_autocasts_cast_cache_is_as_the_caller_left_it_after_a_forward(tmp_path):
    cfg = config("nvme", tmp_path, stage3_param_persistence_threshold=0)
    m, _ = build(Net, cfg)
    with engine_for(m, cfg):
        with torch.autocast("cpu", dtype=torch.bfloat16):
            assert torch.is_autocast_cache_enabled()
            m(torch.randn(BATCH, D)).float().sum().backward()
            assert torch.is_autocast_cache_enabled()
        torch.set_autocast_cache_enabled(False)
        try:
            m(torch.randn(BATCH, D)).sum().backward()
            assert not torch.is_autocast_cache_enabled()
        finally:
            torch.set_autocast_cache_enabled(True)
