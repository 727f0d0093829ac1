"""DeepSpeed's dynamic loss-scale tests (``tests/unit/runtime/half_precision/test_dynamic_loss_scale.py``,
``test_fp16.py``'s overflow cases), adapted: fp16 steps through `zswap.deepspeed.initialize` whose gradients
are finite or not, and the scale, the skipped steps and the weights after each.

DeepSpeed's own tests run its stage-0 fp16 optimizer, which halves the scale at every overflow; its ZeRO
optimizers (zswap's counterpart) first use up ``hysteresis`` and raise at ``min_loss_scale``. Both are
checked here: ``hysteresis: 1`` gives the stage-0 sequence."""

from __future__ import annotations

import math
import warnings
from typing import Any

import pytest
import torch

import zswap
import zswap.deepspeed as deepspeed
from zswap.loss_scale import LossScaleError

from ._ds_common import TwoLayer, base_config


@pytest.fixture(autouse=True)
def _quiet() -> Any:
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", zswap.ZswapWarning)
        yield


def fp16_engine(**fp16: Any) -> Any:
    cfg = base_config(fp16={"enabled": True, "loss_scale": 0, **fp16})
    cfg["train_batch_size"] = 1
    torch.manual_seed(0)
    model = TwoLayer(hidden=4)
    engine, *_ = deepspeed.initialize(config=cfg, model=model, model_parameters=model.parameters())
    return engine


def weights(engine: Any) -> list[torch.Tensor]:
    params = list(engine.module.parameters())
    with zswap.GatheredParameters(params):
        return [p.detach().clone() for p in params]


def step(engine: Any, value: float, seed: int = 0) -> None:
    """One step whose gradients are all finite (``value`` finite) or all inf/nan."""
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(1, 4, generator=g).to(torch.float16)
    y = torch.randint(0, 4, (1,), generator=g)
    loss = engine(x, y)
    engine.backward(loss * value if not math.isfinite(value) else loss * abs(value))
    engine.step()


def test_no_overflow_doubles_the_scale_every_window():
    engine = fp16_engine(initial_scale_power=8, loss_scale_window=2)
    with engine:
        scaler = engine.loss_scaler
        assert scaler.dynamic and engine.optimizer.cur_scale == 2**8 and scaler.scale_window == 2
        expected = 2**8
        for i in range(10):
            before = weights(engine)
            step(engine, 0.05 + 0.01 * i, seed=i)
            assert engine.optimizer.cur_scale == expected and scaler.cur_iter == i + 1
            assert not all(torch.equal(a, b) for a, b in zip(before, weights(engine), strict=True))
            if scaler.cur_iter % 2 == 0:
                expected *= 2
        assert engine.skipped_steps == 0 and engine.global_steps == 10


def test_every_overflow_halves_the_scale_without_hysteresis_and_skips_the_step(caplog):
    """Each skipped step is logged at warning level, as DeepSpeed prints its "OVERFLOW! … Skipping step"."""
    engine = fp16_engine(initial_scale_power=4, loss_scale_window=2, hysteresis=1)
    with engine:
        start = weights(engine)
        expected = 2.0**4
        for i, value in enumerate([math.inf, -math.inf, math.nan, math.nan]):
            caplog.clear()
            step(engine, value, seed=i)
            said = f"fp16 gradients overflowed at loss scale {expected:g}: optimizer step {i + 1} skipped"
            expected = max(expected / 2, 1)
            assert engine.optimizer.cur_scale == expected and engine.loss_scaler.cur_iter == i + 1
            assert [r.getMessage() for r in caplog.records if r.levelname == "WARNING"] == [
                f"{said}, loss scale now {expected:g}"
            ]
        assert all(torch.equal(a, b) for a, b in zip(start, weights(engine), strict=True))
        assert (engine.skipped_steps, engine.global_steps) == (4, 4)
        # At the floor (min_loss_scale 1) another overflow cannot be absorbed: ZeRO's scaler raises too.
        with pytest.raises(LossScaleError, match=r"already at fp16\.min_loss_scale \(1\)"):
            step(engine, math.nan, seed=9)


def test_hysteresis_absorbs_overflows_before_the_scale_halves():
    engine = fp16_engine(initial_scale_power=4, loss_scale_window=100, hysteresis=3)
    with engine:
        scales = []
        for i in range(5):
            step(engine, math.inf, seed=i)
            scales.append(engine.optimizer.cur_scale)
        assert scales == [16, 16, 8, 4, 2]  # two overflows used up the hysteresis of 3


def test_some_overflow_lowers_then_a_clean_window_raises_the_scale():
    engine = fp16_engine(initial_scale_power=8, loss_scale_window=2, hysteresis=1)
    with engine:
        expected, it = 2.0**8, 0
        for value in (math.inf, math.nan):
            step(engine, value, seed=it)
            it += 1
        expected /= 4
        assert engine.optimizer.cur_scale == expected and engine.loss_scaler.cur_iter == it
        for i in range(3):  # window + 1 clean steps raise it once
            step(engine, 0.05, seed=10 + i)
            it += 1
        expected *= 2
        assert engine.optimizer.cur_scale == expected and engine.loss_scaler.cur_iter == it
        step(engine, math.inf, seed=20)  # one more overflow lowers it again
        it += 1
        expected /= 2
        assert engine.optimizer.cur_scale == expected and engine.loss_scaler.cur_iter == it
        assert engine.skipped_steps == 3


def test_consecutive_hysteresis_refills_after_every_clean_step():
    engine = fp16_engine(
        initial_scale_power=6, loss_scale_window=100, hysteresis=2, consecutive_hysteresis=True
    )
    with engine:
        scales = []
        for i, value in enumerate([math.inf, 0.05, math.inf, 0.05, math.inf, math.inf]):
            step(engine, value, seed=i)
            scales.append(engine.optimizer.cur_scale)
        assert scales == [64, 64, 64, 64, 64, 32]


def test_a_static_loss_scale_never_moves_but_still_skips_overflows():
    engine = fp16_engine(loss_scale=138.0)
    with engine:
        assert engine.optimizer.cur_scale == 138.0 and not engine.loss_scaler.dynamic
        start = weights(engine)
        step(engine, math.inf)
        assert engine.optimizer.cur_scale == 138.0 and engine.skipped_steps == 1
        assert all(torch.equal(a, b) for a, b in zip(start, weights(engine), strict=True))
        step(engine, 0.05)
        assert engine.optimizer.cur_scale == 138.0 and engine.skipped_steps == 1


def test_the_scaler_state_round_trips_through_a_checkpoint(tmp_path):
    a = fp16_engine(initial_scale_power=5, loss_scale_window=3, hysteresis=2)
    for i, value in enumerate([math.inf, math.inf, 0.05]):
        step(a, value, seed=i)
    a.save_checkpoint(tmp_path)
    b = fp16_engine(initial_scale_power=5, loss_scale_window=3, hysteresis=2)
    b.load_checkpoint(tmp_path)
    assert b.loss_scaler.state_dict() == a.loss_scaler.state_dict()
    for i, value in enumerate([0.05, math.inf, 0.05, 0.05, 0.05, 0.05]):
        step(a, value, seed=30 + i)
        step(b, value, seed=30 + i)
        assert a.optimizer.cur_scale == b.optimizer.cur_scale
    assert all(torch.equal(x, y) for x, y in zip(weights(a), weights(b), strict=True))
    a.close()
    b.close()


def test_was_step_applied_says_whether_the_last_step_changed_the_weights():
    engine = fp16_engine(loss_scale=138.0)
    with engine:
        assert not engine.was_step_applied()  # no step yet
        step(engine, 0.05)
        assert engine.was_step_applied()
        step(engine, math.inf)
        assert not engine.was_step_applied()
        step(engine, 0.05, seed=1)
        assert engine.was_step_applied()


def test_was_step_applied_is_false_after_each_micro_step_between_boundaries():
    """DeepSpeed resets it at every ``step()``: with 4 accumulation steps it is true after the 4th and 8th
    calls only (zswap kept the last boundary's answer through the micro-steps after it)."""
    cfg = base_config(gradient_accumulation_steps=4)
    cfg["train_batch_size"] = 4
    torch.manual_seed(0)
    model = TwoLayer(hidden=4)
    engine, *_ = deepspeed.initialize(config=cfg, model=model, model_parameters=model.parameters())
    applied = []
    with engine:
        for i in range(8):
            g = torch.Generator().manual_seed(i)
            engine.backward(engine(torch.randn(1, 4, generator=g), torch.randint(0, 4, (1,), generator=g)))
            engine.step()
            applied.append(engine.was_step_applied())
    assert applied == [False, False, False, True] * 2


def test_deepspeed_loss_scale_names():
    """DeepSpeed's names for the scale: ``engine.loss_scale()`` is the config's static ``fp16.loss_scale``
    (0: dynamic); the scale in use is the optimizer's ``cur_scale`` / ``loss_scale``; ``optimizer.overflow``
    says whether the last step was skipped (Megatron-DeepSpeed logs them; Accelerate reads ``overflow``)."""
    engine = fp16_engine(initial_scale_power=8, hysteresis=1)
    with engine:
        opt = engine.optimizer
        assert engine.loss_scale() == 0.0 and opt.cur_scale == opt.loss_scale == 2**8 and not opt.overflow
        step(engine, math.inf)
        assert opt.overflow and opt.cur_scale == 2**7 and engine.loss_scale() == 0.0
        step(engine, 1.0)
        assert not opt.overflow and opt.cur_scale == 2**7
    static = fp16_engine(loss_scale=64.0)
    with static:
        assert static.loss_scale() == 64.0 == static.optimizer.cur_scale
