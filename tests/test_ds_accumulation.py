"""DeepSpeed's gradient-accumulation semantics as its tests use them (``test_zero_cpu_offload_grad_accum``,
``TestZeroAdamOptimizerStepCount``, the engine's ``is_gradient_accumulation_boundary``), adapted: the
boundary sequence, the counters, the loss ``backward`` returns, the schedule stepping only at boundaries,
and the weights against torch with the summed, divided gradients."""

from __future__ import annotations

import warnings
from typing import Any

import pytest
import torch

import zswap
import zswap.deepspeed as deepspeed

from ._ds_common import TwoLayer, base_config, batches


@pytest.fixture(autouse=True)
def _quiet() -> Any:
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", zswap.ZswapWarning)
        yield


@pytest.mark.parametrize("tier", ["none", "cpu"])
def test_a_gas_3_loop_as_deepspeed_runs_it(tier):
    cfg = base_config(
        train_micro_batch_size_per_gpu=2,
        gradient_accumulation_steps=3,
        scheduler={"type": "WarmupLR", "params": {"warmup_num_steps": 10, "warmup_max_lr": 0.01}},
        zero_optimization={"stage": 3, "offload_optimizer": {"device": tier}, "sub_group_size": 4},
    )
    del cfg["train_batch_size"]
    torch.manual_seed(0)
    ref = TwoLayer()
    torch.manual_seed(0)
    model = TwoLayer()
    engine, _, _, sched = deepspeed.initialize(config=cfg, model=model, model_parameters=model.parameters())
    ref_opt = torch.optim.AdamW(ref.parameters(), lr=0.0, weight_decay=0.0, fused=True)
    boundaries, lrs = [], []
    with engine:
        assert engine.global_steps == 0 and engine.gradient_accumulation_steps() == 3
        assert engine.train_batch_size() == 6 and engine.train_micro_batch_size_per_gpu() == 2
        for i, (x, y) in enumerate(batches(9)):
            loss = engine(x, y)
            returned = engine.backward(loss)
            assert torch.equal(returned, loss / 3)  # DeepSpeed returns the loss divided by GAS
            (ref(x, y) / 3).backward()
            boundaries.append(engine.is_gradient_accumulation_boundary())
            used = engine.get_lr()[0]  # the rate this step applies, if it is a boundary
            engine.step()
            lrs.append(sched.get_lr()[0])
            if i % 3 == 2:
                for g in ref_opt.param_groups:
                    g["lr"] = used
                ref_opt.step()
                ref_opt.zero_grad()
        assert boundaries == [False, False, True] * 3
        assert (engine.global_steps, engine.micro_steps, sched.last_batch_iteration) == (3, 9, 2)
        # The schedule moves only at boundaries: log warmup from 0 over 10 steps, at its steps 0, 1, 2.
        assert lrs == [0.0] * 5 + [lrs[5]] * 3 + [lrs[8]] and 0.0 < lrs[5] < lrs[8]
        params = list(model.parameters())
        with zswap.GatheredParameters(params):
            for p, q in zip(params, ref.parameters(), strict=True):
                assert torch.equal(p, q)


def test_backward_without_gas_scaling_accumulates_the_sum():
    cfg = base_config(train_micro_batch_size_per_gpu=2, gradient_accumulation_steps=2)
    del cfg["train_batch_size"]
    torch.manual_seed(0)
    ref = TwoLayer()
    torch.manual_seed(0)
    model = TwoLayer()
    engine, *_ = deepspeed.initialize(config=cfg, model=model, model_parameters=model.parameters())
    with engine:
        for x, y in batches(2):
            engine.backward(engine(x, y), scale_wrt_gas=False)
            ref(x, y).backward()
        for p, q in zip(model.parameters(), ref.parameters(), strict=True):
            assert torch.equal(zswap.full_grad(p), q.grad)
