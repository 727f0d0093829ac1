"""The effect of each offload key DeepSpeed configs carry: offload_param.buffer_count / buffer_size /
max_in_cpu / pin_memory and offload_optimizer.buffer_count / pin_memory."""

from __future__ import annotations

import warnings
from pathlib import Path
from typing import Any

import pytest
import torch

import zswap
from zswap import ConfigError, Status, param_state

from .test_runtime import STREAM, TinyLM, build, engine_for, ids, sq


def nvme(tmp_path: Path, **offload: Any) -> dict[str, Any]:
    return {
        "offload_param": {"device": "nvme", "nvme_path": str(tmp_path), **offload},
        "zero_optimization": dict(STREAM),
    }


def _store(m: torch.nn.Module) -> Any:
    return param_state(next(iter(m.parameters()))).store


def _largest_partition(m: torch.nn.Module) -> int:
    return max(param_state(p).partition_numel for p in m.parameters())


def test_buffer_count_and_size_set_the_fetch_pool(tmp_path):
    cfg = nvme(tmp_path, buffer_count=3, buffer_size=1024)
    m, ref = build(TinyLM, cfg)
    with engine_for(m, cfg) as engine:
        assert _store(m).pool_bytes == 3 * 1024 * 4
        for step in range(2):  # and it still runs as the plain model
            out = engine(ids(seed=step))
            assert torch.equal(out, ref(ids(seed=step)))
            sq(out).backward()
        assert 0 < _store(m)._pooled <= 3 * 1024 * 4
    assert _store(m).pool_bytes == 0  # given back at close


def test_buffer_count_alone_counts_buffers_of_the_largest_partition(tmp_path):
    cfg = nvme(tmp_path, buffer_count=2)
    m, _ = build(TinyLM, cfg)
    with engine_for(m, cfg):
        assert _store(m).pool_bytes == 2 * _largest_partition(m) * 4


def test_without_buffer_keys_the_pool_is_the_live_budget(tmp_path):
    cfg = nvme(tmp_path)
    m, _ = build(TinyLM, cfg)
    with engine_for(m, cfg) as engine:
        s = engine.stats()
        assert _store(m).pool_bytes == (s["max_live_elements"] + s["persistent_elements"]) * 4


def test_a_buffer_size_below_a_partition_is_a_config_error_naming_it(tmp_path):
    m, _ = build(TinyLM, nvme(tmp_path))
    largest = _largest_partition(m)
    with pytest.raises(ConfigError) as ei:
        engine_for(m, nvme(tmp_path, buffer_size=largest - 1))
    assert str(ei.value) == (
        f"zero_optimization.offload_param.buffer_size={largest - 1} elements is smaller than the partition "
        f"of 'blocks.0.fc1.weight' ({largest} elements); raise it to at least {largest} or leave it out"
    )
    with engine_for(m, nvme(tmp_path, buffer_size=largest)):
        pass


def test_buffer_keys_mean_nothing_off_nvme_as_in_deepspeed(tmp_path):
    cfg = {"offload_param": {"device": "cpu", "buffer_count": 1, "buffer_size": 1}}
    m, ref = build(TinyLM, cfg)
    with engine_for(m, cfg) as engine:
        assert torch.equal(engine(ids()), ref(ids()))


def test_max_in_cpu_keeps_params_gathered_and_saves_their_reads(tmp_path):
    def second_pass_reads(max_in_cpu: int) -> tuple[int, list[str]]:
        cfg = nvme(tmp_path, max_in_cpu=max_in_cpu)
        m, ref = build(TinyLM, cfg)
        with engine_for(m, cfg) as engine:
            for step in range(2):
                out = engine(ids(seed=step))
                assert torch.equal(out, ref(ids(seed=step)))
                sq(out).backward()
                if step == 0:
                    engine.stats(reset=True)
            kept = [n for n, p in m.named_parameters() if param_state(p).status is Status.AVAILABLE]
            return engine.stats()["bytes_read"], kept

    base, kept0 = second_pass_reads(0)
    with_cpu, kept = second_pass_reads(8 * 16 + 40 * 16)  # the first two params, pos and wte.weight
    assert kept0 == [] and kept == ["pos", "wte.weight"]
    assert with_cpu < base


def test_max_in_cpu_is_counted_in_elements_in_parameters_order(tmp_path):
    # model.parameters() order: pos (128), wte.weight (640), then 16-element norms and biases
    cfg = nvme(tmp_path, max_in_cpu=8 * 16 + 40 * 16 + 5)
    m, _ = build(TinyLM, cfg)
    with engine_for(m, cfg) as engine:
        s = engine.stats()
        assert s["persistent_elements"] == 40 * 16 + 8 * 16  # wte and pos fit, nothing after them does
        assert engine.sizing.resident == {id(m.wte.weight), id(m.pos)}


@pytest.mark.parametrize(("count", "ring"), [(1, 1), (2, 2), (3, 3), (4, 3), (None, 3)])
def test_optimizer_buffer_count_bounds_the_nvme_walk(count, ring, tmp_path):
    off: dict[str, Any] = {"device": "nvme", "nvme_path": str(tmp_path)}
    if count is not None:
        off["buffer_count"] = count
    cfg = {"offload_optimizer": off, "optimizer": {"type": "AdamW", "params": {"lr": 0.1}}}
    p = torch.nn.Parameter(torch.randn(64))
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", zswap.ZswapWarning)
        opt = zswap.optim.OffloadedAdamW.from_config([p], cfg, lr=0.1)
    try:
        assert opt._store.ring_size == ring
        assert opt._store.read_ahead == (ring >= 2)
        p.grad = torch.ones(64)
        opt.step()  # still steps
        assert len(opt._store._ring) == ring
    finally:
        opt.close()


def _fake_pinning(monkeypatch: pytest.MonkeyPatch) -> list[int]:
    """A CUDA machine's pinning, on this one: ``pin_memory()`` returns a marked copy."""
    pinned: list[int] = []

    def pin_memory(self: torch.Tensor, *a: Any, **k: Any) -> torch.Tensor:
        out = self.clone()
        pinned.append(out.numel())
        return out

    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.Tensor, "pin_memory", pin_memory)
    return pinned


@pytest.mark.parametrize("pin", [True, False])
def test_optimizer_pin_memory_pins_the_cpu_records(pin, monkeypatch):
    pinned = _fake_pinning(monkeypatch)
    cfg = {"offload_optimizer": {"device": "cpu", "pin_memory": pin}, "optimizer": {"type": "AdamW"}}
    p = torch.nn.Parameter(torch.randn(10, dtype=torch.bfloat16))
    opt = zswap.optim.OffloadedAdamW.from_config([p], cfg, lr=0.1)
    p.grad = torch.ones(10, dtype=torch.bfloat16)
    opt.step()
    assert pinned == ([30] if pin else [])  # one record: exp_avg | exp_avg_sq | fp32 master


@pytest.mark.parametrize("pin", [True, False])
def test_param_pin_memory_pins_the_cpu_partitions(pin, monkeypatch):
    pinned = _fake_pinning(monkeypatch)
    with zswap.Init({"offload_param": {"device": "cpu", "pin_memory": pin}}):
        torch.nn.Linear(4, 3)
    assert sorted(pinned) == ([3, 12] if pin else [])
