"""DeepSpeed's backward without `engine.backward` (its tests/unit/v1/zero/test_zero_user_backward.py), through
`zswap.deepspeed.initialize`'s engine:

- ``loss.backward()`` and ``out.backward(grad)`` on what ``engine(...)`` returned divide the gradient by
  ``gradient_accumulation_steps``, as DeepSpeed ≥ 0.18 does (bitwise a plain model whose output gradient
  is divided so); ``engine.backward(loss, scale_wrt_gas=False)`` does not divide;
- under fp16 such a backward must be scaled by ``engine.scale(loss)`` (else `LossScalingRequiredError`, a
  RuntimeError with DeepSpeed's message), and then trains as ``engine.backward(loss)``;
- ``engine.forward(x)`` is ``engine(x)`` (the module's hooks run).
"""

from __future__ import annotations

from typing import Any

import pytest
import torch
from torch import nn

import zswap
import zswap.deepspeed as deepspeed
from zswap.deepspeed import LossScalingRequiredError
from zswap.deepspeed.utils import safe_get_full_grad

GAS = 4


def config(tmp_path: Any, **extra: Any) -> dict[str, Any]:
    return {
        "train_micro_batch_size_per_gpu": 2,
        "gradient_accumulation_steps": GAS,
        "optimizer": {"type": "Adam", "params": {"lr": 1e-3}},
        "zero_optimization": {"stage": 3, "offload_param": {"device": "nvme", "nvme_path": str(tmp_path)}},
        **extra,
    }


def build() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(4, 8), nn.ReLU(), nn.Linear(8, 2))


def batch(i: int) -> torch.Tensor:
    return torch.randn(2, 4, generator=torch.Generator().manual_seed(i))


def engine_for(tmp_path: Any, **extra: Any) -> Any:
    model = build()
    cfg = config(tmp_path, **extra)
    engine, *_ = deepspeed.initialize(model=model, config=cfg, model_parameters=model.parameters())
    engine.keep_applied_grads = True  # the boundary's gradients are read before the step
    return engine


@pytest.mark.parametrize("how", ["loss", "non-scalar", "scale", "no-gas-scaling"])
def test_a_backward_of_the_engines_outputs_is_deepspeeds(how, tmp_path):
    ref = build()
    engine = engine_for(tmp_path)
    with engine:
        for i in range(GAS):
            x = batch(i)
            out = ref(x)
            if how != "no-gas-scaling":
                out.register_hook(lambda g: g / GAS)  # DeepSpeed's hook on the engine's outputs
            got = engine(x)
            grad = torch.linspace(-1, 1, 4).reshape(2, 2)
            if how == "non-scalar":
                out.backward(grad)
                got.backward(grad)
            elif how == "scale":
                out.pow(2).mean().backward()
                engine.scale(got.pow(2).mean()).backward()
            elif how == "no-gas-scaling":
                out.pow(2).mean().backward()
                engine.backward(got.pow(2).mean(), scale_wrt_gas=False)
            else:
                out.pow(2).mean().backward()
                got.pow(2).mean().backward()
        for p, q in zip(engine.module.parameters(), ref.parameters(), strict=True):
            assert torch.equal(safe_get_full_grad(p), q.grad)
        engine.step()


def test_fp16_needs_the_loss_scaled_and_engine_scale_trains_as_engine_backward(tmp_path):
    runs = []
    for manual in (True, False):
        path = tmp_path / str(manual)
        path.mkdir()
        fp16 = {"enabled": True, "initial_scale_power": 8}
        engine = engine_for(path, gradient_accumulation_steps=1, fp16=fp16)
        with engine:
            for i in range(3):
                x = batch(i).half()
                if manual:
                    with pytest.raises(LossScalingRequiredError, match=r"^Loss scaling is required .*scale"):
                        engine(x).float().pow(2).mean().backward()
                    assert isinstance(LossScalingRequiredError(), RuntimeError)
                    engine.zero_grad()  # (that backward counted for nothing)
                    engine.scale(engine(x).float().pow(2).mean()).backward()
                else:
                    engine.backward(engine(x).float().pow(2).mean())
                engine.step()
            with zswap.GatheredParameters(list(engine.module.parameters())):
                runs.append([p.detach().clone() for p in engine.module.parameters()])
    assert all(torch.equal(a, b) for a, b in zip(*runs, strict=True))


def test_scale_refuses_what_deepspeeds_refuses(tmp_path):
    model = build()
    cfg = {k: v for k, v in config(tmp_path).items() if k != "optimizer"}
    engine, *_ = deepspeed.initialize(model=model, config=cfg)
    with engine, pytest.raises(zswap.ZswapError, match="needs an optimizer"):
        engine.scale(engine(batch(0)).sum())
    (tmp_path / "with").mkdir()
    engine = engine_for(tmp_path / "with")
    with engine, pytest.raises(ValueError, match="loss must be a scalar tensor with grad_fn") as info:
        engine.scale(engine(batch(0)))
    assert isinstance(info.value, AssertionError)  # what DeepSpeed's TestZeroUserBackwardWithScale expects


def test_forward_is_the_engines_call(tmp_path):
    model = nn.Linear(4, 4)  # the root module holds the params: its own hooks must run
    cfg = config(tmp_path)
    engine, *_ = deepspeed.initialize(model=model, config=cfg, model_parameters=model.parameters())
    with engine, torch.no_grad():
        assert torch.equal(engine.forward(batch(0)), engine(batch(0)))
    with zswap.initialize(model, cfg) as plain, torch.no_grad():  # zswap's own engine too
        assert torch.equal(plain.forward(batch(0)), plain(batch(0)))


class TwoOutputs(nn.Module):
    """Returns its loss and the logits it computed the loss from (as a Hugging Face model given labels)."""

    def __init__(self, kind: str) -> None:
        super().__init__()
        self.lin = nn.Linear(4, 2)
        self.kind = kind

    def forward(self, x: torch.Tensor) -> Any:
        logits = self.lin(x)
        loss = logits.pow(2).mean()
        if self.kind == "model-output":
            from transformers.modeling_outputs import CausalLMOutput

            return CausalLMOutput(loss=loss, logits=logits)
        return {"loss": loss, "logits": logits} if self.kind == "dict" else (loss, logits)


@pytest.mark.parametrize("kind", ["dict", "model-output", "tuple"])
@pytest.mark.parametrize("used", ["loss", "logits", "both"])
def test_a_gradient_is_divided_once_where_it_enters_the_engines_outputs(kind, used, tmp_path):
    """DeepSpeed hooks each output tensor, so the loss's gradient reaching the logits it was computed from
    is divided again; zswap divides the caller's gradient once, where it enters an output (also when the
    caller uses both, and after an in-place change of an output)."""
    if kind == "model-output":
        pytest.importorskip("transformers")
    torch.manual_seed(0)
    ref = TwoOutputs(kind)
    model = TwoOutputs(kind)
    model.load_state_dict(ref.state_dict())
    cfg = config(tmp_path)
    engine, *_ = deepspeed.initialize(model=model, config=cfg, model_parameters=model.parameters())
    engine.keep_applied_grads = True
    with engine:
        for i in range(GAS):
            x = batch(i)
            want, got = ref(x), engine(x)
            pick = (lambda o: (o[0], o[1])) if kind == "tuple" else (lambda o: (o["loss"], o["logits"]))
            (ref_loss, ref_logits), (loss, logits) = pick(want), pick(got)
            assert type(got) is type(want) and not logits._is_view()
            logits.mul_(1.0)  # an output may still be changed in place
            total = {"loss": lambda a, b: a, "logits": lambda a, b: b.sum(), "both": lambda a, b: a + b.sum()}
            (total[used](ref_loss, ref_logits) / GAS).backward()
            total[used](loss, logits).backward()
        for p, q in zip(model.parameters(), ref.parameters(), strict=True):
            assert torch.allclose(safe_get_full_grad(p), q.grad, rtol=1e-6, atol=0), (used, p, q.grad)


@pytest.mark.parametrize("transform", ["grad", "vmap-grad", "jacrev"])
def test_a_torch_func_transform_is_refused_and_the_engine_goes_on(transform, tmp_path):
    """DeepSpeed's test_zero_torch_func runs torch.func over ZeRO 0-2 engines; over a zswap model (always
    partitioned) torch's own failure was an internal assert, then a crash: now a clear error, and autograd
    works after it."""
    from zswap.errors import FunctionalTransformError

    engine = engine_for(tmp_path, gradient_accumulation_steps=1)
    x = batch(0)[0]

    def f(xi: torch.Tensor) -> torch.Tensor:
        return engine(xi).sum()

    run = {
        "grad": lambda: torch.func.grad(f)(x),
        "vmap-grad": lambda: torch.func.vmap(torch.func.grad(f))(torch.stack([x, x + 0.1])),
        "jacrev": lambda: torch.func.jacrev(f)(x),
    }[transform]
    with engine:
        with pytest.raises(FunctionalTransformError, match=r"inside a torch.func transform .*autograd"):
            run()
        assert isinstance(FunctionalTransformError(), RuntimeError)
        engine.backward(engine(batch(1)).pow(2).mean())
        engine.step()
