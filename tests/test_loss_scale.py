"""fp16 loss scaling with DeepSpeed's rules: the scale sequence on forced overflows (against the rules and
against DeepSpeed's own DynamicLossScaler where installed), the engine scaling the loss and unscaling in
the kernel (bitwise the unscaled run), skipped steps, static scales, the floor, state_dict."""

from __future__ import annotations

import warnings
from typing import Any

import pytest
import torch

import zswap
from zswap.config.models import FP16Config
from zswap.loss_scale import LossScaleError, LossScaler

# An overflow pattern that exercises hysteresis, the floor-free halving, the window and its restart.
PATTERN = [1, 0, 0, 0, 0, 1, 1, 1, 0, 0, 0, 0, 0, 0, 0, 1, 0, 1, 0, 0, 0, 0, 1, 1, 1, 1, 0, 0, 0, 0]


def _dynamic(**fp16: Any) -> LossScaler:
    return LossScaler.from_config(FP16Config(**fp16))


def test_dynamic_scale_starts_at_2_to_the_initial_power_and_static_never_moves():
    assert _dynamic().loss_scale == 2.0**16
    assert _dynamic(initial_scale_power=5).loss_scale == 32.0
    static = _dynamic(loss_scale=128)
    assert not static.dynamic
    for overflow in PATTERN:
        static.update(bool(overflow))
    assert static.loss_scale == 128.0


def test_hysteresis_then_halving_then_raising_after_the_window():
    s = _dynamic(initial_scale_power=4, loss_scale_window=3, hysteresis=2)
    seq = []
    for overflow in [1, 1, 1, 0, 0, 0, 0, 0, 0, 0]:
        s.update(bool(overflow))
        seq.append(s.loss_scale)
    # 1st overflow uses the hysteresis, the 2nd and 3rd halve; after 3 clean steps *past* the last overflow
    # step the scale doubles (DeepSpeed counts the step after the overflow as the window's first).
    assert seq == [16, 8, 4, 4, 4, 4, 8, 8, 8, 16]


def test_consecutive_hysteresis_refills_after_each_clean_step():
    plain = _dynamic(initial_scale_power=4, loss_scale_window=100, hysteresis=2)
    refilled = _dynamic(
        initial_scale_power=4, loss_scale_window=100, hysteresis=2, consecutive_hysteresis=True
    )
    for overflow in [1, 0, 1, 0, 1]:
        plain.update(bool(overflow))
        refilled.update(bool(overflow))
    assert plain.loss_scale == 4.0  # hysteresis spent once, then two halvings
    assert refilled.loss_scale == 16.0  # every overflow was forgiven by a refilled hysteresis


def test_overflow_at_the_floor_raises():
    s = _dynamic(initial_scale_power=1, hysteresis=1, min_loss_scale=1)
    s.update(True)
    assert s.loss_scale == 1.0
    with pytest.raises(LossScaleError, match=r"already at fp16\.min_loss_scale \(1\)") as ei:
        s.update(True)
    assert isinstance(ei.value, FloatingPointError) and isinstance(ei.value, zswap.ZswapError)
    floor = _dynamic(initial_scale_power=3, hysteresis=1, min_loss_scale=3)
    floor.update(True)
    assert floor.loss_scale == 4.0
    floor.update(True)
    assert floor.loss_scale == 3.0  # halving stops at the floor


def test_state_dict_continues_the_sequence():
    a = _dynamic(initial_scale_power=16, loss_scale_window=4)
    for overflow in PATTERN[:13]:
        a.update(bool(overflow))
    b = _dynamic(initial_scale_power=16, loss_scale_window=4)
    b.load_state_dict(a.state_dict())
    for overflow in PATTERN[13:]:
        a.update(bool(overflow))
        b.update(bool(overflow))
        assert a.loss_scale == b.loss_scale
    with pytest.raises(ValueError, match="the saved loss scaler is dynamic"):
        _dynamic(loss_scale=8).load_state_dict(a.state_dict())


@pytest.mark.filterwarnings("ignore")
@pytest.mark.parametrize(
    "fp16",
    [
        {"initial_scale_power": 8, "loss_scale_window": 3, "hysteresis": 2},
        {"initial_scale_power": 8, "loss_scale_window": 2, "hysteresis": 1},
        {"initial_scale_power": 10, "loss_scale_window": 4, "hysteresis": 3, "consecutive_hysteresis": True},
        {"initial_scale_power": 5, "loss_scale_window": 5, "hysteresis": 1, "min_loss_scale": 2},
    ],
)
def test_the_sequence_equals_deepspeeds_dynamic_loss_scaler(fp16, monkeypatch):
    mod = pytest.importorskip("deepspeed.runtime.fp16.loss_scaler", reason="deepspeed is not installed")
    monkeypatch.setattr(mod.dist, "get_rank", lambda *a, **k: 0)  # it only logs on rank 0
    cfg = FP16Config(**fp16)
    theirs = mod.DynamicLossScaler(
        init_scale=2**cfg.initial_scale_power,
        scale_window=cfg.loss_scale_window,
        min_scale=cfg.min_loss_scale,
        delayed_shift=cfg.hysteresis,
        consecutive_hysteresis=cfg.consecutive_hysteresis,
    )
    ours = LossScaler.from_config(cfg)
    for i, overflow in enumerate(PATTERN):
        try:
            theirs.update_scale(bool(overflow))
        except Exception:
            with pytest.raises(LossScaleError):
                ours.update(bool(overflow))
            return
        ours.update(bool(overflow))
        assert ours.loss_scale == theirs.cur_scale, f"update {i}"
        assert ours.cur_hysteresis == theirs.cur_hysteresis, f"update {i}"


# -- through the engine ------------------------------------------------------------------------------


def _fp16_model(cfg: dict[str, Any], seed: int = 0) -> torch.nn.Module:
    torch.manual_seed(seed)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", zswap.ZswapWarning)
        with zswap.Init(cfg):
            return torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.ReLU(), torch.nn.Linear(16, 4))


def _weights(m: torch.nn.Module) -> list[torch.Tensor]:
    with zswap.GatheredParameters(list(m.parameters())):
        return [p.data.clone() for p in m.parameters()]


def _x(seed: int) -> torch.Tensor:
    return torch.randn(4, 8, generator=torch.Generator().manual_seed(seed)).half()


def test_engine_backward_scales_the_loss_and_the_step_unscales_in_the_kernel_bitwise():
    # The reference: the same fp16 model unmanaged, (loss * scale).backward(), and the kernel given
    # grad_scale = 1 / scale — what DeepSpeed's fp16 optimizer does by hand.
    cfg: dict[str, Any] = {
        "offload_param": {"device": "cpu"},
        "fp16": {"enabled": True, "initial_scale_power": 10},
    }
    m = _fp16_model(cfg)
    ref = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.ReLU(), torch.nn.Linear(16, 4)).half()
    with torch.no_grad():
        for q, w in zip(ref.parameters(), _weights(m), strict=True):
            q.copy_(w)
    ref_opt = zswap.optim.OffloadedAdamW(ref.parameters(), lr=1e-2)
    with zswap.initialize(m, cfg, optimizer=zswap.optim.OffloadedAdamW(m.parameters(), lr=1e-2)) as engine:
        assert engine.loss_scale == 1024.0 and isinstance(engine.loss_scaler, LossScaler)
        for step in range(3):
            engine.backward(engine(_x(step)).float().square().mean())
            (ref(_x(step)).float().square().mean() * 1024).backward()
            for p, q in zip(m.parameters(), ref.parameters(), strict=True):
                assert torch.equal(zswap.full_grad(p), q.grad)  # the loss was scaled before autograd
            norm = torch.linalg.vector_norm(
                torch.stack([torch.linalg.vector_norm(q.grad, dtype=torch.float32) for q in ref.parameters()])
            )
            engine.step()
            ref_opt.step(grad_scale=1 / 1024)
            ref_opt.zero_grad()
            assert engine.last_grad_norm == float(norm / 1024)  # reported unscaled
        assert engine.skipped_steps == 0 and engine.global_steps == 3
    for a, b in zip(_weights(m), ref.parameters(), strict=True):
        assert torch.equal(a, b.data)


def test_forced_overflows_skip_steps_lower_the_scale_and_hold_the_schedule():
    cfg: dict[str, Any] = {
        "offload_param": {"device": "cpu"},
        "fp16": {"enabled": True, "initial_scale_power": 12, "hysteresis": 1, "loss_scale_window": 2},
        "optimizer": {"type": "AdamW", "params": {"lr": 0.1}},
        "scheduler": {
            "type": "LRRangeTest",
            "params": {"lr_range_test_min_lr": 0.1, "lr_range_test_step_size": 1},
        },
    }
    m = _fp16_model(cfg)
    pattern = [True, False, False, False, True, False]
    with zswap.initialize(m, cfg) as engine:
        before = _weights(m)
        scales, lrs = [], []
        for step, overflow in enumerate(pattern):
            x = _x(step) * (6e4 if overflow else 1)  # 6e4 × scale overflows fp16 in backward
            engine.backward(engine(x).float().square().mean())
            engine.step()
            scales.append(engine.loss_scale)
            lrs.append(engine.get_lr()[0])
            if step == 0:
                assert all(torch.equal(a, b) for a, b in zip(_weights(m), before, strict=True))
        assert engine.skipped_steps == 2 and engine.global_steps == 6
        assert scales == [2048, 2048, 2048, 4096, 2048, 2048]
        # the schedule moved only on the 4 applied steps: 0.1 × (1 + applied)
        assert lrs == [0.1, 0.2, pytest.approx(0.3), 0.4, 0.4, 0.5]


def test_static_loss_scale_scales_skips_and_stays():
    cfg: dict[str, Any] = {"offload_param": {"device": "cpu"}, "fp16": {"enabled": True, "loss_scale": 256}}
    m = _fp16_model(cfg)
    with zswap.initialize(m, cfg, optimizer=torch.optim.SGD(m.parameters(), lr=0.1)) as engine:
        assert engine.loss_scale == 256.0 and not engine.loss_scaler.dynamic
        engine.backward(engine(_x(0) * 6e4).float().square().mean())
        engine.step()
        assert (engine.skipped_steps, engine.loss_scale) == (1, 256.0)


def test_auto_cast_casts_the_inputs_to_fp16():
    cfg: dict[str, Any] = {"offload_param": {"device": "cpu"}, "fp16": {"enabled": True, "auto_cast": True}}
    m = _fp16_model(cfg)
    with zswap.initialize(m, cfg) as engine:
        assert engine(_x(0).float()).dtype == torch.float16  # a float32 input would fail in an fp16 Linear
    off = {"offload_param": {"device": "cpu"}, "fp16": {"enabled": True}}
    m2 = _fp16_model(off)
    with zswap.initialize(m2, off) as engine, pytest.raises(RuntimeError):
        engine(_x(0).float())


def test_without_fp16_there_is_no_scaler():
    cfg: dict[str, Any] = {"offload_param": {"device": "cpu"}, "fp16": {"loss_scale": 64}}
    torch.manual_seed(0)
    with zswap.Init(cfg):
        m = torch.nn.Linear(3, 3)
    with zswap.initialize(m, cfg) as engine:
        assert engine.loss_scaler is None and engine.loss_scale == 1.0


def test_fp16_master_weights_switch_is_refused():
    with pytest.raises(zswap.ConfigError, match=r"fp16\.fp16_master_weights_and_grads must be false"):
        zswap.load_config({"fp16": {"fp16_master_weights_and_grads": True}})


class _PartitionAware:
    """An optimizer that steps the partitions itself (``steps_partitions``) and records its factor."""

    steps_partitions = True

    def __init__(self) -> None:
        self.param_groups = [{"lr": 0.1}]
        self.factors: list[float | None] = []

    def step(self, grad_scale: float | None = None) -> None:
        self.factors.append(grad_scale)


def test_a_partition_aware_optimizer_gets_the_unscale_factor():
    cfg: dict[str, Any] = {
        "offload_param": {"device": "cpu"},
        "fp16": {"enabled": True, "initial_scale_power": 4},
    }
    m = _fp16_model(cfg)
    opt = _PartitionAware()
    with zswap.initialize(m, cfg, optimizer=opt) as engine:
        engine.backward(engine(_x(0)).float().square().mean())
        engine.step()
        engine(_x(1)).float().square().mean().backward()  # a plain backward: nothing to unscale
        engine.step()
    assert opt.factors == [1 / 16, None]


def test_the_autocast_scaler_moves_as_torchs_grad_scaler():
    """`LossScaler.for_autocast` (an fp16 ``torch_autocast`` run's) against `torch.amp.GradScaler` over an
    overflow and two growth windows: the same scale after every step."""
    ours, theirs = LossScaler.for_autocast(), torch.amp.GradScaler("cpu")
    p = torch.nn.Parameter(torch.zeros(1))
    opt = torch.optim.SGD([p], lr=0.0)
    for i, overflow in enumerate([False] * 1999 + [True] + [False] * 4001 + [True, True]):
        ours.update(overflow)
        theirs.scale(torch.ones(1))
        p.grad = torch.full((1,), float("inf") if overflow else 0.0)
        theirs.step(opt)
        theirs.update()
        assert ours.loss_scale == theirs.get_scale(), i
    assert ours.loss_scale == 2.0**15


def test_fp16_params_under_a_config_without_fp16_on_need_a_readable_dynamic_scale(tmp_path):
    """``fp16.enabled: "auto"`` keeps the window unread at load; fp16 params then take the dynamic scale, so
    the engine refuses a window it could not run, naming the key."""
    cfg = {
        "fp16": {"enabled": "auto", "loss_scale_window": 0},
        "optimizer": {"type": "AdamW", "params": {"lr": 1e-3}},
    }
    with zswap.Init(cfg):
        model = torch.nn.Linear(4, 4).half()
    with pytest.raises(
        zswap.ConfigError, match=r"^fp16\.loss_scale_window must be a positive integer, got 0$"
    ):
        zswap.initialize(model, cfg)
