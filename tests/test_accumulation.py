"""Gradient accumulation with DeepSpeed's semantics: `Engine.backward` divides by GAS, `Engine.step` applies
the optimizer only at accumulation boundaries; the batch keys' consistency; the Engine's DeepSpeed-shaped
methods (train/eval, __call__, get_lr, counters, device)."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import torch

import zswap
from zswap import ConfigError
from zswap.device import UnsupportedDeviceError

from .conftest import run_ranks
from .test_runtime import TIERS, TinyLM, build, config, engine_for, ids, sq


def _same_weights(m: torch.nn.Module, ref: torch.nn.Module) -> None:
    with zswap.GatheredParameters(list(m.parameters())):
        for (name, p), q in zip(m.named_parameters(), ref.parameters(), strict=True):
            assert torch.equal(p.data, q.data), name


@pytest.mark.parametrize("kind", ["zswap", "torch"])
@pytest.mark.parametrize("tier", TIERS)
def test_gas4_through_engine_backward_is_bitwise_torch_with_loss_over_4(tier, kind, tmp_path):
    cfg = config(tier, tmp_path, stage3_param_persistence_threshold=20)
    cfg["gradient_accumulation_steps"] = 4
    m, ref = build(TinyLM, cfg)
    hyper: dict[str, Any] = {"lr": 1e-2, "betas": (0.8, 0.95), "weight_decay": 0.1}
    ref_opt = torch.optim.AdamW(ref.parameters(), **hyper, fused=True)
    if kind == "zswap":
        opt: Any = zswap.optim.OffloadedAdamW(m.parameters(), **hyper)
    else:
        opt = torch.optim.AdamW(m.parameters(), **hyper, fused=True)
    with engine_for(m, cfg, optimizer=opt) as engine:
        assert engine.gradient_accumulation_steps() == 4
        for step in range(3):
            for micro in range(4):
                batch = ids(seed=10 * step + micro)
                assert engine.is_gradient_accumulation_boundary() == (micro == 3)
                out, want = engine(batch), ref(batch)
                assert torch.equal(out, want)  # the same weights so far
                returned = engine.backward(sq(out))
                assert torch.equal(returned, sq(want) / 4)
                (sq(want) / 4).backward()
                engine.step()
                assert engine.micro_steps == 4 * step + micro + 1
                assert engine.global_steps == step + (micro == 3)
            ref_opt.step()
            ref_opt.zero_grad()
            assert all(zswap.full_grad(p) is None for p in m.parameters())  # cleared at the boundary
    _same_weights(m, ref)


def test_between_boundaries_step_changes_nothing_and_keeps_the_gradients(tmp_path):
    cfg = config("cpu", tmp_path)
    cfg["gradient_accumulation_steps"] = 3
    m, _ = build(TinyLM, cfg)
    with engine_for(m, cfg, optimizer=torch.optim.SGD(m.parameters(), lr=0.1)) as engine:
        with zswap.GatheredParameters(list(m.parameters())):
            before = [p.data.clone() for p in m.parameters()]
        engine.backward(sq(engine(ids())))
        grads = [zswap.full_grad(p) for p in m.parameters()]
        engine.step()
        assert (engine.micro_steps, engine.global_steps) == (1, 0)
        for p, g in zip(m.parameters(), grads, strict=True):
            assert torch.equal(zswap.full_grad(p), g)
        with zswap.GatheredParameters(list(m.parameters())):
            assert all(torch.equal(p.data, b) for p, b in zip(m.parameters(), before, strict=True))


def test_plain_backward_with_gas_accumulates_the_sum_as_deepspeed(tmp_path):
    # DeepSpeed divides by GAS in engine.backward (and, since 0.18, in a backward through what engine(...)
    # returned: zswap.deepspeed's engine too, `test_ds_user_backward.py`); the module's own outputs' loss
    # is the caller's own.
    cfg = config("cpu", tmp_path)
    cfg["gradient_accumulation_steps"] = 2
    m, ref = build(TinyLM, cfg)
    ref_opt = torch.optim.SGD(ref.parameters(), lr=0.1)
    with engine_for(m, cfg, optimizer=torch.optim.SGD(m.parameters(), lr=0.1)) as engine:
        for micro in range(2):
            sq(m(ids(seed=micro))).backward()
            sq(ref(ids(seed=micro))).backward()
            engine.step()
        ref_opt.step()
    _same_weights(m, ref)


def test_plain_loop_without_gas_steps_every_call(tmp_path):
    cfg = config("cpu", tmp_path)
    m, ref = build(TinyLM, cfg)
    ref_opt = torch.optim.SGD(ref.parameters(), lr=0.1)
    with engine_for(m, cfg, optimizer=torch.optim.SGD(m.parameters(), lr=0.1)) as engine:
        for step in range(3):
            assert engine.is_gradient_accumulation_boundary()
            sq(m(ids(seed=step))).backward()
            sq(ref(ids(seed=step))).backward()
            engine.step()
            ref_opt.step()
            ref_opt.zero_grad()
        assert (engine.micro_steps, engine.global_steps) == (3, 3)
    _same_weights(m, ref)


@pytest.mark.parametrize(
    ("keys", "gas"),
    [
        ({"train_batch_size": 16, "train_micro_batch_size_per_gpu": 4}, 4),
        ({"train_batch_size": 16, "train_micro_batch_size_per_gpu": 4, "gradient_accumulation_steps": 4}, 4),
        ({"train_batch_size": 8, "gradient_accumulation_steps": 2}, 2),
        ({"train_batch_size": 8}, 1),
        ({"train_micro_batch_size_per_gpu": 8}, 1),
        (
            {
                "train_batch_size": "auto",
                "train_micro_batch_size_per_gpu": 4,
                "gradient_accumulation_steps": 3,
            },
            3,
        ),
        ({"train_batch_size": "auto", "gradient_accumulation_steps": "auto"}, 1),
    ],
)
def test_gas_is_derived_from_the_batch_keys_as_deepspeed(keys, gas, tmp_path):
    cfg = {**config("cpu", tmp_path), **keys}
    m, _ = build(TinyLM, cfg)
    with engine_for(m, cfg) as engine:
        assert engine.gradient_accumulation_steps() == gas


@pytest.mark.parametrize(
    ("keys", "world", "want"),
    [
        ({"train_batch_size": 32, "train_micro_batch_size_per_gpu": 4}, 2, (32, 4, 4)),
        ({"train_batch_size": 32, "gradient_accumulation_steps": 2}, 4, (32, 4, 2)),
        ({"train_batch_size": 32}, 8, (32, 4, 1)),
        ({"train_micro_batch_size_per_gpu": 3, "gradient_accumulation_steps": 2}, 4, (24, 3, 2)),
        ({"gradient_accumulation_steps": 5}, 3, (None, None, 5)),
        ({}, 2, (None, None, 1)),
    ],
)
def test_batch_keys_resolve_with_the_world_size_as_deepspeed(keys, world, want):
    assert zswap.load_config(keys).batch.resolve(world) == want


def test_inconsistent_batch_keys_at_a_world_size():
    batch = zswap.load_config(
        {"train_batch_size": 16, "train_micro_batch_size_per_gpu": 4, "gradient_accumulation_steps": 4}
    ).batch
    assert batch.resolve(1) == (16, 4, 4)
    with pytest.raises(ConfigError, match=r"× world size \(2\) = 32; fix one of the three"):
        batch.resolve(2)


def test_inconsistent_batch_keys_are_a_config_error_naming_the_three(tmp_path):
    cfg = {
        **config("cpu", tmp_path),
        "train_batch_size": 16,
        "train_micro_batch_size_per_gpu": 4,
        "gradient_accumulation_steps": 2,
    }
    m, _ = build(TinyLM, config("cpu", tmp_path))
    with pytest.raises(ConfigError) as ei:
        engine_for(m, cfg)
    assert str(ei.value) == (
        "train_batch_size (16) must equal train_micro_batch_size_per_gpu (4) × gradient_accumulation_steps "
        '(2) × world size (1) = 8; fix one of the three (or set it to "auto")'
    )
    with pytest.raises(ConfigError, match="gradient_accumulation_steps must be a positive integer, got 0"):
        zswap.load_config({"gradient_accumulation_steps": 0})
    # A key not given: what the others lack (it said "(None)", then values derived from a floor division).
    with pytest.raises(ConfigError) as ei:
        zswap.load_config({"train_batch_size": 10, "train_micro_batch_size_per_gpu": 4}).batch.resolve(1)
    assert str(ei.value) == (
        "train_batch_size (10) is not a multiple of train_micro_batch_size_per_gpu (4) × world size (1) = 4, "
        "from which the batch keys not given are derived"
    )
    steps = r"^train_batch_size \(5\) is not a multiple of gradient_accumulation_steps \(1\) × world size"
    with pytest.raises(ConfigError, match=steps):
        zswap.load_config({"train_batch_size": 5}).batch.resolve(2)
    # the engine was not left half-built: a correct config initializes the same model
    with engine_for(m, config("cpu", tmp_path)):
        pass


def test_engine_is_called_like_the_module_and_switches_modes(tmp_path):
    cfg = config("cpu", tmp_path)
    m, ref = build(TinyLM, cfg)
    with engine_for(m, cfg, optimizer=torch.optim.SGD(m.parameters(), lr=0.25)) as engine:
        assert engine.module is m
        assert torch.equal(engine(ids()), ref(ids()))
        assert engine.eval() is engine and not m.training
        assert engine.train() is engine and m.training
        engine.train(False)
        assert not m.training
        assert engine.get_lr() == [0.25]
        assert engine.loss_scale == 1.0 and engine.loss_scaler is None and engine.lr_scheduler is None


def test_backward_needs_a_tensor_and_get_lr_an_optimizer(tmp_path):
    cfg = config("cpu", tmp_path)
    m, _ = build(TinyLM, cfg)
    with engine_for(m, cfg) as engine:
        with pytest.raises(TypeError, match="backward takes the loss tensor, not float"):
            engine.backward(1.0)  # type: ignore[arg-type]
        with pytest.raises(zswap.ZswapError, match="no optimizer"):
            engine.get_lr()


def test_backward_without_gas_scaling(tmp_path):
    cfg = {**config("cpu", tmp_path), "gradient_accumulation_steps": 2}
    m, ref = build(TinyLM, cfg)
    with engine_for(m, cfg) as engine:
        engine.backward(sq(engine(ids())), scale_wrt_gas=False)
        assert engine.is_gradient_accumulation_boundary() is False
        sq(ref(ids())).backward()
        for p, q in zip(m.parameters(), ref.parameters(), strict=True):
            assert torch.equal(zswap.full_grad(p), q.grad)


@pytest.mark.parametrize("device", [None, "cpu", torch.device("cpu")])
def test_cpu_devices_are_accepted(device, tmp_path):
    cfg = config("cpu", tmp_path)
    m, _ = build(TinyLM, cfg)
    with engine_for(m, cfg, device=device):
        pass


@pytest.mark.parametrize(
    "device, match",
    [
        ("meta", "zswap computes on 'cpu' or 'cuda', not 'meta'"),
        *(
            []
            if torch.cuda.is_available()
            else [
                (d, "CUDA is not available on this machine")
                for d in ("cuda", "cuda:1", torch.device("cuda", 0))
            ]
        ),
    ],
)
def test_devices_zswap_cannot_compute_on_here_are_refused(device, match, tmp_path):
    cfg = config("cpu", tmp_path)
    m, _ = build(TinyLM, cfg)
    with pytest.raises(UnsupportedDeviceError, match=match) as ei:
        engine_for(m, cfg, device=device)
    assert isinstance(ei.value, NotImplementedError) and isinstance(ei.value, zswap.ZswapError)
    with pytest.raises(TypeError, match=r"device must be None, a str, a torch\.device or a zswap Device"):
        engine_for(m, cfg, device=0)


@pytest.mark.dist
def test_two_ranks_resolve_gas_share_the_data_and_skip_overflows_together(tmp_path):
    run_ranks(Path(__file__).with_name("_stepping_dist_worker.py"), tmp_path)
