"""DeepSpeed engine calls beyond checkpoints and queries (`zswap.deepspeed._extras`): the data-parallel
rank, resizing the batch between steps, ``load_module_state_dict``, ``offload_states`` /
``reload_states`` — each as DeepSpeed's, checked against plain PyTorch runs."""

from __future__ import annotations

import enum
import warnings
from typing import Any

import pytest
import torch

import zswap
import zswap.deepspeed as deepspeed
from zswap import ConfigError, param_state
from zswap.parts.params import Status

from .test_deepspeed_compat import ds_config
from .test_runtime import TinyLM, all_released, ids, sq


@pytest.fixture(autouse=True)
def _quiet() -> Any:
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", zswap.ZswapWarning)
        yield


def engine_of(cfg: dict[str, Any], seed: int = 0) -> tuple[Any, TinyLM]:
    torch.manual_seed(seed)
    with deepspeed.zero.Init(config_dict_or_path=cfg):
        model = TinyLM()
    engine, *_ = deepspeed.initialize(model=model, model_parameters=model.parameters(), config=cfg)
    return engine, model


def reference(seed: int = 0) -> tuple[TinyLM, torch.optim.AdamW]:
    torch.manual_seed(seed)
    ref = TinyLM()
    return ref, torch.optim.AdamW(ref.parameters(), lr=1e-2, betas=(0.8, 0.95), weight_decay=0.1, fused=True)


def ref_step(ref: TinyLM, opt: torch.optim.AdamW, batches: list[torch.Tensor]) -> None:
    for b in batches:
        (sq(ref(b)) / len(batches)).backward()
    torch.nn.utils.clip_grad_norm_(ref.parameters(), 1.0)  # DeepSpeed's default gradient_clipping
    opt.step()
    opt.zero_grad()


def assert_equal(model: TinyLM, ref: TinyLM) -> None:
    with zswap.GatheredParameters(list(model.parameters())):
        for p, q in zip(model.parameters(), ref.parameters(), strict=True):
            assert torch.equal(p.data, q.data)


def test_ranks_without_model_parallelism():
    engine, _ = engine_of(ds_config())
    with engine:
        assert engine.get_data_parallel_rank() == 0
        assert engine.get_model_parallel_rank() == engine.get_tensor_parallel_rank() == 0
        assert engine.mpu is None


def test_allreduce_gradients_after_backward_changes_nothing():
    """DeepSpeed's ``engine.allreduce_gradients()`` (its ZeRO-3 tests call it after backward): zswap reduced
    each gradient in backward, so the step is the same with or without it (before: AttributeError)."""
    engine, model = engine_of(ds_config())  # micro batch 3, 2 micro-batches a step
    ref, opt = reference()
    batches = [ids(seed=s) for s in range(4)]
    with engine:
        for b in batches:
            engine.backward(sq(engine(b)))
            engine.allreduce_gradients()
            engine.allreduce_gradients(bucket_size=5e8)
            engine.step()
        ref_step(ref, opt, batches[:2])
        ref_step(ref, opt, batches[2:])
        assert_equal(model, ref)


def test_set_train_batch_size_changes_the_accumulation_steps_from_the_next_window():
    engine, model = engine_of(ds_config())  # micro batch 3, 2 micro-batches a step
    ref, opt = reference()
    batches = [ids(seed=s) for s in range(10)]
    with engine:
        for b in batches[:2]:
            engine.backward(sq(engine(b)))
            engine.step()
        ref_step(ref, opt, batches[:2])
        engine.set_train_batch_size(9)
        assert engine.get_batch_info() == (9, 3, 3) and engine.gradient_accumulation_steps() == 3
        assert engine.config.batch.gradient_accumulation_steps == 3
        for i, b in enumerate(batches[2:5]):
            assert engine.is_gradient_accumulation_boundary() == (i == 2)
            engine.backward(sq(engine(b)))  # divided by 3 now
            engine.step()
        ref_step(ref, opt, batches[2:5])
        engine.backward(sq(engine(batches[5])))
        engine.step()
        with pytest.raises(
            zswap.ZswapError, match=r"inside an accumulation window \(its gradients summed over 3"
        ):
            engine.set_train_batch_size(3)
        engine.backward(sq(engine(batches[6])))
        engine.step()
        engine.backward(sq(engine(batches[7])))
        engine.step()
        ref_step(ref, opt, batches[5:8])
        engine.set_train_batch_size(3)
        engine.backward(sq(engine(batches[8])))
        with pytest.raises(zswap.ZswapError, match=r"right after the engine\.step"):
            engine.set_train_batch_size(6)
        engine.step()
        ref_step(ref, opt, batches[8:9])
        for b in batches[9:]:
            engine.backward(sq(engine(b)))
            engine.step()
            ref_step(ref, opt, [b])
        assert engine.global_steps == 5 and engine.global_samples == 6 + 9 + 9 + 3 + 3
        assert_equal(model, ref)


def test_set_train_micro_batch_size_keeps_the_accumulation_steps():
    engine, _ = engine_of(ds_config())
    with engine:
        engine.set_train_micro_batch_size(5)
        assert engine.get_batch_info() == (10, 5, 2)
        assert engine.train_micro_batch_size_per_gpu() == 5


@pytest.mark.parametrize(
    ("call", "value", "error", "match"),
    [
        (
            "set_train_batch_size",
            7,
            ValueError,
            r"multiple of train_micro_batch_size_per_gpu \(3\) × world size",
        ),
        ("set_train_batch_size", 0, ValueError, "train_batch_size must be positive, got 0"),
        ("set_train_batch_size", 6.0, TypeError, "train_batch_size must be an int, got float"),
        ("set_train_batch_size", True, TypeError, "must be an int, got bool"),
        ("set_train_micro_batch_size", -1, ValueError, "micro_batch_size must be positive, got -1"),
    ],
)
def test_batch_sizes_that_cannot_be_are_refused(call, value, error, match):
    engine, _ = engine_of(ds_config())
    with engine:
        with pytest.raises(error, match=match):
            getattr(engine, call)(value)
        assert engine.get_batch_info() == (6, 3, 2)


def test_set_train_batch_size_needs_a_micro_batch():
    cfg = ds_config()
    del cfg["train_micro_batch_size_per_gpu"]
    engine, _ = engine_of(cfg)
    with engine, pytest.raises(ConfigError, match="gives no batch size"):
        engine.set_train_batch_size(4)


def test_set_train_batch_size_checks_the_summing_dtype():
    cfg = ds_config(data_types={"grad_accum_dtype": "bf16"}, gradient_accumulation_steps=1)  # fp32 params
    engine, _ = engine_of(cfg)
    with engine:
        with pytest.raises(ConfigError, match="grad_accum_dtype is 'bf16' but zswap sums"):
            engine.set_train_batch_size(6)
        assert engine.get_batch_info() == (3, 3, 1)


def test_load_module_state_dict_then_training_matches_torch():
    engine, model = engine_of(ds_config(gradient_accumulation_steps=1))
    ref, opt = reference()
    other, _ = reference(seed=5)  # the weights loaded
    with engine:
        engine.backward(sq(engine(ids(seed=9))))
        engine.step()
        ref_step(ref, opt, [ids(seed=9)])
        engine.load_module_state_dict({"module": other.state_dict(), "other": 1})
        ref.load_state_dict(other.state_dict())  # in place: the optimizer's moments stay, as the engine's
        assert_equal(model, ref)
        for s in range(2):
            engine.backward(sq(engine(ids(seed=s))))
            engine.step()
            ref_step(ref, opt, [ids(seed=s)])
        assert_equal(model, ref)


def test_load_module_state_dict_strictness():
    engine, model = engine_of(ds_config())
    other, _ = reference(seed=5)
    partial = {k: v for k, v in other.state_dict().items() if k != "ln_f.bias"}
    with engine:
        with pytest.raises(RuntimeError, match=r'Missing key\(s\) in state_dict: "ln_f.bias"'):
            engine.load_module_state_dict({"module": partial})
        with pytest.raises(RuntimeError, match=r"outside allowed_missing_keys: missing=\['ln_f.bias'\]"):
            engine.load_module_state_dict({"module": partial}, allowed_missing_keys=["pos"])
        with zswap.GatheredParameters([model.ln_f.bias]):
            kept = model.ln_f.bias.data.clone()
        engine.load_module_state_dict({"module": partial}, allowed_missing_keys=["ln_f.bias"])
        with zswap.GatheredParameters([model.ln_f.bias, model.ln_f.weight]):
            assert torch.equal(model.ln_f.bias.data, kept)
            assert torch.equal(model.ln_f.weight.data, other.ln_f.weight)
        engine.load_module_state_dict({"module": partial}, strict=False)
        with pytest.raises(KeyError, match="state dict under 'module'"):
            engine.load_module_state_dict(other.state_dict())
        with pytest.raises(TypeError, match=r"custom_load_fn=.* is not supported"):
            engine.load_module_state_dict({"module": partial}, custom_load_fn=print)


class OffloadStateTypeEnum(str, enum.Enum):  # DeepSpeed's, as scripts pass it
    optim_states = "optim_states"
    lp_params = "lp_params"


@pytest.mark.parametrize(
    "include", [None, ["lp_params"], [OffloadStateTypeEnum.lp_params, OffloadStateTypeEnum.optim_states]]
)
def test_offload_states_lets_go_of_every_gathered_param(include):
    cfg = ds_config(gradient_accumulation_steps=1)
    cfg["zero_optimization"]["stage3_param_persistence_threshold"] = 10_000  # every param stays gathered
    engine, model = engine_of(cfg)
    ref, opt = reference()
    with engine:
        for s in range(2):
            engine.backward(sq(engine(ids(seed=s))))
            engine.step()
            ref_step(ref, opt, [ids(seed=s)])
        assert any(param_state(p).status is Status.AVAILABLE for p in model.parameters())
        engine.offload_states(include=include, device="cpu", pin_memory=False, non_blocking=True)
        assert all_released(model)
        engine.reload_states()
        engine.backward(sq(engine(ids(seed=2))))
        engine.step()
        ref_step(ref, opt, [ids(seed=2)])
        assert_equal(model, ref)


def test_offload_states_of_optimizer_states_only_keeps_gathered_params():
    cfg = ds_config()
    cfg["zero_optimization"]["stage3_param_persistence_threshold"] = 10_000
    engine, model = engine_of(cfg)
    with engine:
        engine(ids())
        gathered = {id(p) for p in model.parameters() if param_state(p).status is Status.AVAILABLE}
        engine.offload_states(include=["optim_states", "hp_params"])
        assert gathered == {id(p) for p in model.parameters() if param_state(p).status is Status.AVAILABLE}


@pytest.mark.parametrize(
    ("kwargs", "match"),
    [
        (
            {"include": ["lp_params", "weights"]},
            r"include names \['weights'\], not states DeepSpeed offloads",
        ),
        ({"device": "nvme"}, "NVMe is not supported for offloading states"),
        ({"device": "cuda"}, "device must be 'cpu', got 'cuda'"),
    ],
)
def test_offload_states_refuses_what_deepspeed_refuses(kwargs, match):
    engine, _ = engine_of(ds_config())
    with engine, pytest.raises(ValueError, match=match):
        engine.offload_states(**kwargs)


def test_calls_on_a_closed_engine_raise():
    engine, _ = engine_of(ds_config())
    engine.close()
    for call in (engine.offload_states, engine.reload_states, engine.allreduce_gradients):
        with pytest.raises(zswap.ZswapError, match="closed"):
            call()
