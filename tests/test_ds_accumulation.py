"""DeepSpeed's gradient-accumulation semantics as its tests use them (``test_zero_cpu_offload_grad_accum``,
``TestZeroAdamOptimizerStepCount``, the engine's ``is_gradient_accumulation_boundary``), adapted: the
boundary sequence, the counters, the loss ``backward`` returns, the schedule stepping only at boundaries,
and the weights against torch with the summed, divided gradients."""

from __future__ import annotations

import contextlib
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
        assert engine.global_samples == 18 and engine.get_mom() == [(0.9, 0.999)]
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


def with_reference(cfg: dict[str, Any]) -> tuple[Any, Any, TwoLayer, torch.optim.Optimizer]:
    """(model, its engine under ``cfg``, the same model in plain torch, fused torch Adam over it at the
    config's rate)."""
    torch.manual_seed(0)
    ref = TwoLayer()
    torch.manual_seed(0)
    model = TwoLayer()
    engine, *_ = deepspeed.initialize(config=cfg, model=model, model_parameters=model.parameters())
    return model, engine, ref, torch.optim.Adam(ref.parameters(), lr=0.00015, fused=True)


@pytest.mark.parametrize("tier", ["cpu", "nvme"])
@pytest.mark.parametrize(("chunks", "steps"), [(1, 1), (4, 1), (3, 3)])
def test_the_boundary_set_by_hand_sums_several_backwards_into_one_step(tmp_path, tier, chunks, steps):
    """DeepSpeed's TestZeroOffloadMultiBackward: ``gradient_accumulation_steps`` 1, several backwards per
    optimizer step, the last one's boundary set with ``set_gradient_accumulation_boundary(True)`` and one
    ``step()`` after them: the gradients are summed (not divided) and applied once, as in torch. A
    ``step()`` after a backward set as no boundary ends a micro-batch (nothing applied)."""
    zero: dict[str, Any] = {"stage": 3}
    for key in ("offload_param", "offload_optimizer"):
        zero[key] = {"device": tier, "nvme_path": str(tmp_path)}
    cfg = base_config(train_batch_size=1, zero_optimization=zero, gradient_clipping=0.0)
    model, engine, ref, ref_opt = with_reference(cfg)
    data = list(batches(chunks * steps, batch=1))
    with engine:
        for s in range(steps):
            for i, (x, y) in enumerate(data[s * chunks : (s + 1) * chunks]):
                engine.set_gradient_accumulation_boundary(i == chunks - 1)
                assert engine.is_gradient_accumulation_boundary() is (i == chunks - 1)
                engine.backward(engine(x, y))
                ref(x, y).backward()
            engine.step()
            ref_opt.step()
            ref_opt.zero_grad()
        assert (engine.global_steps, engine.micro_steps) == (steps, steps)
        params = list(model.parameters())
        with zswap.GatheredParameters(params):
            assert all(torch.equal(p, q) for p, q in zip(params, ref.parameters(), strict=True))
        x, y = data[0]
        engine.set_gradient_accumulation_boundary(False)
        engine.backward(engine(x, y))
        ref(x, y).backward()
        engine.step()  # a micro-batch's end: the gradient stays for the window's boundary
        assert (engine.global_steps, engine.micro_steps) == (steps, steps + 1)
        with zswap.GatheredParameters(params):
            assert all(torch.equal(p, q) for p, q in zip(params, ref.parameters(), strict=True))
        engine.set_gradient_accumulation_boundary(None)  # counting again: with GAS 1 each one ends
        assert engine.is_gradient_accumulation_boundary()
        ref(x, y).backward()  # summed with the micro-batch's before
        engine.backward(engine(x, y))
        engine.step()
        ref_opt.step()
        with zswap.GatheredParameters(params):
            assert all(torch.equal(p, q) for p, q in zip(params, ref.parameters(), strict=True))


@pytest.mark.parametrize("backwards", [[1, 1, 1], [2, 3, 1]])
def test_unmanaged_accumulation_makes_every_step_a_boundary(backwards):
    """``managed_gradient_accumulation: false`` (DeepSpeed 0.19): the caller owns the boundary, so each
    ``step()`` applies the optimizer to the backwards since the last one, each loss still divided by
    ``gradient_accumulation_steps``; as torch with those summed gradients."""
    cfg = base_config(
        train_micro_batch_size_per_gpu=2,
        gradient_accumulation_steps=2,
        managed_gradient_accumulation=False,
        gradient_clipping=0.0,
        zero_optimization={"stage": 3, "offload_optimizer": {"device": "cpu"}},
    )
    del cfg["train_batch_size"]
    model, engine, ref, ref_opt = with_reference(cfg)
    data = iter(batches(sum(backwards)))
    with engine:
        for n in backwards:
            for _ in range(n):
                x, y = next(data)
                assert engine.is_gradient_accumulation_boundary()
                engine.backward(engine(x, y))
                (ref(x, y) / 2).backward()
            engine.step()
            ref_opt.step()
            ref_opt.zero_grad()
        assert (engine.global_steps, engine.micro_steps) == (3, 3)
        assert engine.global_samples == 2 * sum(backwards)  # the micro-batches each step applied
        assert not engine.managed_gradient_accumulation()
        # DeepSpeed's TestUnmanagedGradientAccumulation*: what sets the boundary is refused (step() owns it).
        with pytest.raises(AssertionError, match="set_gradient_accumulation_boundary"):
            engine.set_gradient_accumulation_boundary(True)
        with pytest.raises(AssertionError, match="coalesce_grad_reduction"), engine.coalesce_grad_reduction():
            pass
        assert engine.is_gradient_accumulation_boundary()
        params = list(model.parameters())
        with zswap.GatheredParameters(params):
            assert all(torch.equal(p, q) for p, q in zip(params, ref.parameters(), strict=True))


@pytest.mark.parametrize(("chunks", "steps", "clip"), [(4, 1, 0.0), (1, 1, 0.0), (3, 3, 0.0), (4, 1, 0.5)])
def test_coalesced_backwards_train_as_the_same_backwards_without_the_block(tmp_path, chunks, steps, clip):
    """DeepSpeed's TestCoalesceCombinations: ``coalesce_grad_reduction()`` around one step's backwards
    (each boundary set by hand) gives the params the loop without it gives, bitwise, clipping included;
    ``step()`` inside the block and a nested block raise DeepSpeed's assertion, and the engine goes on."""
    zero = {"stage": 3, "offload_param": {"device": "nvme", "nvme_path": str(tmp_path)}}
    cfg = base_config(train_batch_size=1, zero_optimization=zero, gradient_clipping=clip)
    data = list(batches(chunks * steps, batch=1))
    finals = []
    for coalesce in (False, True):
        model, engine, *_ = with_reference(cfg)
        with engine:
            assert engine.managed_gradient_accumulation()
            for s in range(steps):
                with engine.coalesce_grad_reduction() if coalesce else contextlib.nullcontext():
                    for i, (x, y) in enumerate(data[s * chunks : (s + 1) * chunks]):
                        engine.set_gradient_accumulation_boundary(i == chunks - 1)
                        engine.backward(engine(x, y))
                    if coalesce and s == 0:
                        with pytest.raises(AssertionError, match=r"step\(\) inside coalesce_grad_reduction"):
                            engine.step()
                        with (
                            pytest.raises(AssertionError, match="cannot be nested"),
                            engine.coalesce_grad_reduction(),
                        ):
                            pass
                engine.step()
            assert engine.global_steps == steps
            params = list(model.parameters())
            with zswap.GatheredParameters(params):
                finals.append([p.detach().clone() for p in params])
    assert all(torch.equal(a, b) for a, b in zip(*finals, strict=True))


def test_accelerates_loop_steps_only_at_the_boundary_and_moves_what_deepspeeds_does(tmp_path):
    """Accelerate's DeepSpeedEngineWrapper: ``set_gradient_accumulation_boundary(is_boundary=sync)``,
    ``backward``, and ``step()`` only where ``sync``. The result is torch's with the divided, summed
    gradients, and the bytes moved are those of DeepSpeed's own loop (a ``step()`` after every backward):
    the micro-batch a skipped ``step()`` did not end is ended at the next forward."""

    def run(accelerate: bool, folder: str) -> tuple[list[torch.Tensor], int]:
        (tmp_path / folder).mkdir()
        zero: dict[str, Any] = {"stage": 3, "stage3_param_persistence_threshold": 0}
        for key in ("offload_param", "offload_optimizer"):
            zero[key] = {"device": "nvme", "nvme_path": str(tmp_path / folder)}
        cfg = base_config(gradient_accumulation_steps=2, gradient_clipping=0.0, zero_optimization=zero)
        cfg["train_batch_size"] = 4
        torch.manual_seed(0)
        model = TwoLayer()
        engine, *_ = deepspeed.initialize(config=cfg, model=model, model_parameters=model.parameters())
        with engine:
            for i, (x, y) in enumerate(batches(8)):
                sync = i % 2 == 1
                if accelerate:
                    engine.set_gradient_accumulation_boundary(is_boundary=sync)
                engine.backward(engine(x, y))
                if sync or not accelerate:
                    engine.step()
                if i == 3:
                    start = engine.stats()["bytes_read"]
            read = engine.stats()["bytes_read"] - start
            params = list(model.parameters())
            with zswap.GatheredParameters(params):
                return [p.detach().clone() for p in params], read

    torch.manual_seed(0)
    ref = TwoLayer()
    opt = torch.optim.Adam(ref.parameters(), lr=0.00015, fused=True)
    for i, (x, y) in enumerate(batches(8)):
        (ref(x, y) / 2).backward()
        if i % 2 == 1:
            opt.step()
            opt.zero_grad()
    counted, counted_read = run(False, "counted")
    accelerated, accelerated_read = run(True, "accelerated")
    assert all(torch.equal(p, q) for p, q in zip(accelerated, ref.parameters(), strict=True))
    assert all(torch.equal(p, q) for p, q in zip(counted, accelerated, strict=True))
    assert accelerated_read == counted_read > 0
