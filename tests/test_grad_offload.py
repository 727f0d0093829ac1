"""Partition gradients on NVMe (``offload_optimizer.device == "nvme"``): no CPU partition gradient is held
after backward, yet full_grad, gradient accumulation, clipping and training give bitwise the plain model's
results; a failed gradient write surfaces as `zswap.SwapIOError`."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import torch

import zswap
from zswap import SwapIOError, full_grad, param_state
from zswap.gradstore import NvmeGrads

from .test_runtime import (
    STREAM,
    GivenAdamW,
    TinyLM,
    assert_same_grads,
    build,
    engine_for,
    ids,
    sq,
    train_pass,
)

PARAM_TIERS = ("nvme", "cpu")  # params on NVMe (the grads share their engine) or in memory (own engine)


def config(param_tier: str, tmp_path: Path, **zero: Any) -> dict[str, Any]:
    cfg: dict[str, Any] = {
        "offload_param": {"device": param_tier},
        "offload_optimizer": {"device": "nvme", "nvme_path": str(tmp_path)},
        "zero_optimization": zero,
    }
    if param_tier == "nvme":
        cfg["offload_param"]["nvme_path"] = str(tmp_path)
    return cfg


def assert_grads_on_nvme(m: torch.nn.Module) -> None:
    for p in m.parameters():
        st = param_state(p)
        assert st is not None and st.grad is None  # no partition gradient in memory
        assert isinstance(st.grad_store, NvmeGrads) and st.grad_store.has(st)
        assert st.grad_store.physical(st) in st.grad_store.engine


def grad_engine(m: torch.nn.Module) -> Any:
    """The SwapEngine holding ``m``'s gradients."""
    store = param_state(next(m.parameters())).grad_store
    assert isinstance(store, NvmeGrads)
    return store.engine


@pytest.mark.parametrize("param_tier", PARAM_TIERS)
def test_backward_leaves_the_partition_gradients_on_nvme_only(param_tier, tmp_path):
    cfg = config(param_tier, tmp_path, **STREAM)
    m, ref = build(TinyLM, cfg)
    with engine_for(m, cfg) as engine:
        engine.grad_stash_bytes = 0  # every gradient written (kept ones: tests/test_gradstash.py)
        if param_tier == "nvme":  # the params' own engine
            assert grad_engine(m) is param_state(next(m.parameters())).store.engine
        train_pass(m, ref, ids(), sq)
        assert_grads_on_nvme(m)
        assert_same_grads(m, ref)
        engine.zero_grad()
        assert all(full_grad(p) is None for p in m.parameters())
        assert not [k for k in list(grad_engine(m).keys()) if k.startswith("g/")]  # freed
    assert all(param_state(p).grad_store is None for p in m.parameters())  # detached on close


@pytest.mark.parametrize("param_tier", PARAM_TIERS)
def test_gradient_accumulation_is_bitwise_the_plain_models(param_tier, tmp_path):
    cfg = config(param_tier, tmp_path, **STREAM)
    m, ref = build(TinyLM, cfg)
    with engine_for(m, cfg) as engine:
        engine.grad_stash_bytes = 0  # every gradient written
        for seed in (1, 2):
            train_pass(m, ref, ids(seed=seed), sq)
        assert_grads_on_nvme(m)
        assert_same_grads(m, ref)


def _adamw(kind: str) -> Any:
    if kind == "torch":
        return lambda params: GivenAdamW(params, lr=1e-2)
    return lambda params: zswap.optim.OffloadedAdamW(params, lr=1e-2, weight_decay=0.01)


@pytest.mark.parametrize("kind", ["torch", "config"])
@pytest.mark.parametrize("param_tier", PARAM_TIERS)
def test_training_matches_the_plain_model_bitwise(param_tier, kind, tmp_path):
    # A budget below the model: the step loads param and gradient partitions in several chunks.
    cfg = config(param_tier, tmp_path, stage3_param_persistence_threshold=20, stage3_max_live_parameters=2500)
    if kind == "config":  # OffloadedAdamW with its states on NVMe, built from the config
        cfg["optimizer"] = {"type": "AdamW", "params": {"lr": 1e-2, "weight_decay": 0.01}}
    m, ref = build(TinyLM, cfg)
    ref_opt = _adamw("zswap" if kind == "config" else "torch")(ref.parameters())
    given = _adamw("torch")(m.parameters()) if kind == "torch" else None
    with engine_for(m, cfg, optimizer=given) as engine:
        engine.grad_stash_bytes = 0  # every gradient written
        engine.keep_applied_grads = True  # accumulated over two backwards, read between backward and step
        if kind == "config":
            assert isinstance(engine.optimizer, zswap.optim.OffloadedAdamW)
        for step in range(3):
            for micro in range(2):  # gradient accumulation too
                train_pass(m, ref, ids(seed=10 * step + micro), sq)  # equal logits: equal updates
            assert_grads_on_nvme(m)
            engine.step()
            ref_opt.step()
            ref_opt.zero_grad()
        assert all(full_grad(p) is None for p in m.parameters())
    with zswap.GatheredParameters(m.parameters()):
        for p, q in zip(m.parameters(), ref.parameters(), strict=True):
            assert torch.equal(p.data, q.data)


def test_an_ordinary_step_reads_its_later_chunks_gradients_into_buffers_it_mapped_before(
    tmp_path, monkeypatch
):
    """`NvmeGrads.step_loads`: the step's chunks share their gradient buffers (of a size let go by an
    earlier chunk: reused; else mapped), unmapped once the step ends; the run stays bitwise PyTorch's."""
    cfg = config("nvme", tmp_path, stage3_param_persistence_threshold=0, stage3_max_live_parameters=2500)
    cfg["optimizer"] = {"type": "AdamW", "params": {"lr": 1e-2, "weight_decay": 0.01}}
    m, ref = build(TinyLM, cfg)
    ref_opt = _adamw("zswap")(ref.parameters())
    mapped, loads = [], []
    alloc, load = NvmeGrads._alloc, NvmeGrads.load
    monkeypatch.setattr(NvmeGrads, "_alloc", lambda self, n, dtype: mapped.append(n) or alloc(self, n, dtype))
    monkeypatch.setattr(NvmeGrads, "load", lambda self, st: loads.append(st) or load(self, st))
    with engine_for(m, cfg) as engine:
        engine.grad_stash_bytes = 0  # every gradient written, and read by the step
        engine.early_step = False  # the ordinary step reads them
        for step in range(2):
            train_pass(m, ref, ids(seed=step), sq)
            engine.step()
            ref_opt.step()
            ref_opt.zero_grad()
            assert engine.stats()["mem_grad_buffers"] == 0  # nothing kept past the step
        assert len(loads) == 2 * len(list(m.parameters()))
        assert 0 < len(mapped) < len(loads)  # later chunks reuse earlier ones' buffers (one map each before)
    with zswap.GatheredParameters(m.parameters()):
        for p, q in zip(m.parameters(), ref.parameters(), strict=True):
            assert torch.equal(p.data, q.data)


@pytest.mark.parametrize("param_tier", PARAM_TIERS)
def test_clipping_matches_clip_grad_norm(param_tier, tmp_path):
    cfg = config(param_tier, tmp_path, stage3_param_persistence_threshold=0, stage3_max_live_parameters=2500)
    m, ref = build(TinyLM, cfg)
    ref_opt = torch.optim.SGD(ref.parameters(), lr=0.1)
    with engine_for(m, cfg, optimizer=torch.optim.SGD(m.parameters(), lr=0.1), max_grad_norm=0.05) as engine:
        for step in range(2):
            train_pass(m, ref, ids(seed=step), sq)
            norm = torch.nn.utils.clip_grad_norm_(ref.parameters(), 0.05)
            assert norm > 0.05  # really clips
            engine.step()
            ref_opt.step()
            ref_opt.zero_grad()
            assert engine.last_grad_norm == float(norm)
    with zswap.GatheredParameters(m.parameters()):
        for p, q in zip(m.parameters(), ref.parameters(), strict=True):
            assert torch.equal(p.data, q.data)


@pytest.mark.parametrize("param_tier", PARAM_TIERS)
def test_a_failed_gradient_write_surfaces(param_tier, tmp_path):
    cfg = config(param_tier, tmp_path, **STREAM)
    m, ref = build(TinyLM, cfg)
    with engine_for(m, cfg, optimizer=torch.optim.SGD(m.parameters(), lr=0.1)) as engine:
        engine.grad_stash_bytes = 0  # every gradient written
        with zswap.GatheredParameters(m.parameters()):
            before = [p.data.clone() for p in m.parameters()]
        # The backward whose write fails raises at its end, and none of its gradients count.
        out = m(ids())
        grad_engine(m)._engine.inject_fault("write", "errno", 5)
        with pytest.raises(SwapIOError) as ei:
            sq(out).backward()
        assert ei.value.errno == 5 and ei.value.key.startswith("g/")
        assert all(full_grad(p) is None for p in m.parameters())
        engine.step()  # no gradient: nothing changes
        with zswap.GatheredParameters(m.parameters()):
            assert all(torch.equal(p.data, b) for p, b in zip(m.parameters(), before, strict=True))

        # A failure of gradients written outside a backward is kept until it is raised: by the step, by
        # full_grad, and by zero_grad if nothing raised it yet.
        p0 = next(m.parameters())
        grad_engine(m)._engine.inject_fault("write", "errno", 5)
        zswap.grads.accumulate(param_state(p0), torch.ones(param_state(p0).shape))
        with pytest.raises(SwapIOError):
            engine.step()
        with pytest.raises(SwapIOError):  # and again until the gradients are dropped
            full_grad(p0)
        engine.zero_grad()  # reported already: clears quietly
        grad_engine(m)._engine.inject_fault("write", "errno", 5)
        zswap.grads.accumulate(param_state(p0), torch.ones(param_state(p0).shape))
        with pytest.raises(SwapIOError):
            engine.zero_grad()
        assert all(full_grad(p) is None for p in m.parameters())

        # The engine trains on afterwards.
        ref.zero_grad()
        train_pass(m, ref, ids(seed=5), sq)
        assert_same_grads(m, ref)
        engine.step()
