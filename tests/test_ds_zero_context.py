"""DeepSpeed's ``zero.Init`` / ``GatheredParameters`` / engine tests (``tests/unit/runtime/zero/
test_zero_context.py``, ``test_zero_context_return.py``, ``test_zero_context_ancestry.py``,
``test_zero_nesting_init.py``), adapted to `zswap.deepspeed` and checked against plain torch where the
scenario trains."""

from __future__ import annotations

import warnings
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import pytest
import torch
from torch import nn

import zswap
import zswap.deepspeed as deepspeed
from zswap import Status, param_state

from ._ds_common import TwoLayer, batches
from .conftest import run_ranks

WORKER = Path(__file__).with_name("_ds_dist_worker.py")

STAGE3 = {
    "train_batch_size": 1,
    "steps_per_print": 1,
    "optimizer": {"type": "Adam", "params": {"lr": 0.00015}},
    "zero_optimization": {"stage": 3, "stage3_param_persistence_threshold": 1},
}


@pytest.fixture(autouse=True)
def _quiet() -> Any:
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", zswap.ZswapWarning)
        yield


class ConvX(nn.Conv1d):
    """A subclass of a torch layer adding a param of its own."""

    def __init__(self, *args: Any) -> None:
        super().__init__(*args)
        self.param_in = nn.Parameter(torch.empty(5).uniform_())


class ConvNet(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.conv1 = ConvX(1, 3, 4)
        self.param = nn.Parameter(torch.empty(5).uniform_())


def test_gathered_params_are_full_inside_and_freed_after():
    with deepspeed.zero.Init(config_dict_or_path={"train_batch_size": 1, "zero_optimization": {"stage": 3}}):
        layer = nn.Linear(10, 10)
    with deepspeed.zero.GatheredParameters(list(layer.parameters())):
        assert layer.weight.numel() == 100 and layer.bias.numel() == 10
    assert layer.weight.numel() == 0 and layer.bias.numel() == 0


def test_params_of_subclasses_and_their_own_params_are_partitioned():
    with deepspeed.zero.Init(config={**STAGE3, "bf16": {"enabled": True}}):
        m = ConvNet()
    for p in (m.param, m.conv1.param_in, m.conv1.weight, m.conv1.bias):
        assert param_state(p).status is Status.NOT_AVAILABLE
        assert p.dtype == torch.bfloat16


def test_init_without_arguments_partitions_and_leaves_later_modules_alone():
    with deepspeed.zero.Init():
        inside = nn.Linear(6, 3)
    outside = nn.Linear(6, 3)
    assert param_state(inside.weight).status is Status.NOT_AVAILABLE and inside.weight.numel() == 0
    assert param_state(inside.weight).shape == (3, 6)
    assert param_state(outside.weight) is None and outside.weight.numel() == 18
    with deepspeed.zero.GatheredParameters(inside.weight):  # one param, not a list
        assert param_state(inside.weight).status is Status.AVAILABLE and inside.weight.numel() == 18


class ExtLinear(nn.Module):
    """Uses ``linear1.weight`` again outside its module's forward."""

    def __init__(self, dim: int = 16) -> None:
        super().__init__()
        self.dim = dim
        self.linear1 = nn.Linear(dim, dim)
        self.linear2 = nn.Linear(dim, dim)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return nn.functional.linear(self.linear2(self.linear1(x)), self.linear1.weight).sum()


def test_a_param_used_outside_its_module_trains_as_plain_torch():
    torch.manual_seed(0)
    ref = ExtLinear()
    torch.manual_seed(0)
    net = ExtLinear()
    engine, _, _, _ = deepspeed.initialize(
        args=SimpleNamespace(local_rank=0), model=net, model_parameters=net.parameters(), config=STAGE3
    )
    ref_opt = torch.optim.AdamW(ref.parameters(), lr=0.00015, weight_decay=0.0, fused=True)
    with engine:
        with deepspeed.zero.GatheredParameters(net.linear1.weight):
            assert net.linear1.weight.numel() == net.dim**2
        for _ in range(3):
            x = torch.rand(net.dim).to(engine.device)  # DeepSpeed scripts move inputs to engine.device
            loss, want = engine(x), ref(x)
            assert torch.equal(loss, want)
            engine.backward(loss)
            engine.step()
            want.backward()
            torch.nn.utils.clip_grad_norm_(ref.parameters(), 1.0)  # DeepSpeed's default gradient_clipping
            ref_opt.step()
            ref_opt.zero_grad()


def test_engine_device_is_a_torch_device():
    net = ExtLinear()
    engine, *_ = deepspeed.initialize(model=net, model_parameters=net.parameters(), config=STAGE3)
    with engine:
        assert isinstance(engine.device, torch.device) and engine.device == torch.device("cpu")
        assert torch.rand(2).to(engine.device).device == engine.device


@pytest.mark.parametrize("dtype", ["bf16", "fp16"])
def test_reduced_precision_configs_train(dtype):
    cfg = {**STAGE3, dtype: {"enabled": True, **({"loss_scale": 138.0} if dtype == "fp16" else {})}}
    net = ExtLinear()
    engine, *_ = deepspeed.initialize(model=net, model_parameters=net.parameters(), config=cfg)
    half = torch.bfloat16 if dtype == "bf16" else torch.float16
    with engine:
        assert all(param_state(p).dtype == half for p in net.parameters())
        for _ in range(3):
            loss = engine(torch.rand(net.dim).to(engine.device).to(half))
            engine.backward(loss)
            engine.step()
        assert engine.global_steps == 3 and engine.skipped_steps == 0
        if dtype == "fp16":
            assert engine.optimizer.cur_scale == engine.loss_scale() == 138.0  # a static scale stays


class DanglingBias(nn.Linear):
    def forward(self, *inputs: Any) -> Any:
        return super().forward(*inputs), self.bias  # returns its own param to the caller


class DanglingAttention(nn.Linear):
    def __init__(self, dim: int = 16) -> None:
        super().__init__(dim, dim)
        self.d_linear = DanglingBias(dim, dim)

    def forward(self, x: torch.Tensor) -> Any:
        return self.d_linear(super().forward(x))


class Container(nn.Module):
    def __init__(self, dim: int = 16) -> None:
        super().__init__()
        self.dim = dim
        self.linear1 = nn.Linear(dim, dim)
        self.dangler = DanglingAttention(dim)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        out, bias = self.dangler(self.linear1(x))  # bias is dangler.d_linear.bias, used by the parent
        return (out + bias).sum()


def test_a_param_returned_by_forward_trains_as_plain_torch():
    torch.manual_seed(0)
    ref = Container()
    torch.manual_seed(0)
    net = Container()
    engine, *_ = deepspeed.initialize(model=net, model_parameters=net.parameters(), config=STAGE3)
    ref_opt = torch.optim.AdamW(ref.parameters(), lr=0.00015, weight_decay=0.0, fused=True)
    with engine:
        for _ in range(5):
            x = torch.rand(net.dim)
            loss, want = engine(x), ref(x)
            assert torch.equal(loss, want)
            engine.backward(loss)
            engine.step()
            want.backward()
            torch.nn.utils.clip_grad_norm_(ref.parameters(), 1.0)  # DeepSpeed's default gradient_clipping
            ref_opt.step()
            ref_opt.zero_grad()
        with deepspeed.zero.GatheredParameters(list(net.parameters())):
            for p, q in zip(net.parameters(), ref.parameters(), strict=True):
                assert torch.equal(p, q)


class VariableOutput(nn.Module):
    def __init__(self, kind: str | None) -> None:
        super().__init__()
        self.kind = kind
        self.linear1 = nn.Linear(16, 16)

    def forward(self, x: torch.Tensor) -> Any:
        out = self.linear1(x)
        if self.kind == "dict":
            return {"loss": out.sum()}
        if self.kind == "tensor":
            return out.sum()
        return None


@pytest.mark.parametrize("kind", ["tensor", "dict", None])
def test_forward_may_return_a_tensor_a_dict_or_none(kind):
    net = VariableOutput(kind)
    engine, *_ = deepspeed.initialize(model=net, model_parameters=net.parameters(), config=STAGE3)
    with engine:
        out = engine(torch.rand(16))
        if kind is None:
            assert out is None
            return
        loss = out["loss"] if kind == "dict" else out
        engine.backward(loss)
        engine.step()
        assert engine.global_steps == 1


def test_nested_inits_partition_once_and_initialize():
    cfg = {"train_batch_size": 1, "zero_optimization": {"stage": 3}}
    with deepspeed.zero.Init(config_dict_or_path=cfg), deepspeed.zero.Init(config_dict_or_path=cfg):
        m = nn.Linear(4, 4)
    assert param_state(m.weight) is not None
    engine, optimizer, loader, sched = deepspeed.initialize(model=m, config_params=cfg)
    with engine:
        assert optimizer is None and loader is None and sched is None


def test_initialize_inside_an_outer_init_and_a_later_inner_one():
    cfg = {"train_batch_size": 1, "zero_optimization": {"stage": 3}}
    with deepspeed.zero.Init(config_dict_or_path=cfg):
        with deepspeed.zero.Init(config_dict_or_path=cfg):
            m1 = nn.Linear(4, 4)
        e1, *_ = deepspeed.initialize(model=m1, config_params=cfg)
        with deepspeed.zero.Init(config_dict_or_path=cfg):
            m2 = nn.Linear(4, 4)
    assert param_state(m1.weight) is not None and param_state(m2.weight) is not None
    e2, *_ = deepspeed.initialize(model=m2, config_params=cfg)
    e1.close()
    e2.close()


class GrandPa(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.param_grandpa = nn.Parameter(torch.ones(5))
        self.param_grandpa.data = (self.param_grandpa.data + 1).data


class Pa(GrandPa):
    def __init__(self) -> None:
        super().__init__()
        self.param_pa = nn.Parameter(torch.ones(5))
        self.param_pa.data = (self.param_pa.data + 1).data
        self.param_grandpa.data = (self.param_grandpa.data + 1).data


class Son(Pa):
    def __init__(self) -> None:
        super().__init__()
        self.param = nn.Parameter(torch.ones(5))
        self.param.data = (self.param.data + 1).data
        self.param_pa.data = (self.param_pa.data + 1).data
        self.param_grandpa.data = (self.param_grandpa.data + 1).data


def test_data_assigned_in_every_ancestors_init_is_kept():
    cfg = {**STAGE3, "fp16": {"enabled": True, "loss_scale": 138.0}}
    with deepspeed.zero.Init(config=cfg):
        m = Son().cpu()
    for p in m.parameters(recurse=False):
        assert param_state(p).status is Status.NOT_AVAILABLE
    ones = torch.ones(5, dtype=torch.float16)
    with deepspeed.zero.GatheredParameters(list(m.parameters(recurse=False))):
        assert torch.equal(m.param, ones + 1)
        assert torch.equal(m.param_pa, ones + 2)
        assert torch.equal(m.param_grandpa, ones + 3)


class WithMethod(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.linear = nn.Linear(4, 4)
        self.label = "mine"

    def magic(self) -> int:
        return 42


def test_the_engine_hands_unknown_attributes_to_the_module():
    cfg = {"train_batch_size": 1, "optimizer": {"type": "Adam", "params": {"lr": 0.00015}}}
    with deepspeed.zero.Init():
        m = WithMethod()
        engine, *_ = deepspeed.initialize(model=m, config=cfg, model_parameters=m.parameters())
    with engine:
        assert engine.magic() == 42 and engine.label == "mine"
        assert engine.linear is m.linear
        with pytest.raises(AttributeError, match="no attribute 'nothing_here'"):
            engine.nothing_here  # noqa: B018


class Tiny(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.fc = nn.Linear(16, 16, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = self.fc(x)
        return self.late(y) if hasattr(self, "late") else y


def test_a_module_attached_after_initialize_runs_as_plain_torch():
    m = Tiny()
    cfg = {"train_batch_size": 1, "zero_optimization": {"stage": 3}}
    engine, *_ = deepspeed.initialize(model=m, config=cfg, model_parameters=list(m.parameters()))
    with engine:
        late = nn.Linear(16, 16, bias=False).to(device=engine.device)
        late._parameters = dict(late._parameters)  # torch >= 2.5's plain dict, as DeepSpeed's test forces
        engine.module.late = late
        x = torch.randn(2, 16)
        out = engine(x)
        with zswap.GatheredParameters(m.fc.weight):
            want = late(nn.functional.linear(x, m.fc.weight))
        assert torch.equal(out, want)
        assert torch.equal(engine(x), want)


def test_a_module_attached_after_initialize_is_named_as_untrained_at_the_step():
    """Its params get gradients but the optimizer does not hold them (as in plain PyTorch and DeepSpeed):
    the step warns, once, naming them; the model's own params train as ever."""
    m = Tiny()
    cfg = {"train_batch_size": 1, "zero_optimization": {"stage": 3}, "optimizer": {"type": "Adam"}}
    engine, *_ = deepspeed.initialize(model=m, config=cfg, model_parameters=list(m.parameters()))
    with engine:
        engine.module.late = late = nn.Linear(16, 16, bias=False)
        before = late.weight.detach().clone()
        for step in range(2):
            engine.backward(engine(torch.randn(2, 16)).square().sum())  # (its forward runs late)
            if step == 0:  # (pytest's warns and catch_warnings: beside this module's `_quiet`)
                with pytest.warns(zswap.ZswapWarning, match=r"^late.weight get gradients but are not"):
                    engine.step()
            else:
                with warnings.catch_warnings():
                    warnings.simplefilter("error", zswap.ZswapWarning)
                    engine.step()
        assert torch.equal(late.weight, before) and late.weight.grad is None


def test_classes_declared_inside_init_are_partitioned():
    cfg = {"train_batch_size": 1, "zero_optimization": {"stage": 3}}
    with deepspeed.zero.Init(config_dict_or_path=cfg):

        class Outer(nn.Module):
            def __init__(self) -> None:
                super().__init__()
                self.fc = nn.Linear(4, 4)

        with deepspeed.zero.Init(config_dict_or_path=cfg):
            nested = Outer()
        inside = Outer()
    for m in (nested, inside):
        assert param_state(m.fc.weight) is not None and m.fc.weight.numel() == 0
        assert hasattr(m.fc.weight, "ds_id")  # DeepSpeed's test of "zero3 processed the parameter"
        engine, *_ = deepspeed.initialize(model=m, config_params=cfg)
        engine.close()
    assert nested.fc.weight.ds_id != inside.fc.weight.ds_id


def test_partitioned_params_carry_deepspeeds_real_shape_and_size():
    """``ds_shape`` / ``ds_numel``: what PEFT and other ZeRO-3-aware code read where ``p.shape`` is the
    placeholder's."""
    with deepspeed.zero.Init():
        layer = nn.Linear(6, 3)
    assert layer.weight.shape == (0,)
    assert (layer.weight.ds_shape, layer.weight.ds_numel) == (torch.Size([3, 6]), 18)
    assert (layer.bias.ds_shape, layer.bias.ds_numel) == (torch.Size([3]), 3)
    plain = nn.Linear(6, 3)
    assert not hasattr(plain.weight, "ds_shape") and not hasattr(plain.weight, "ds_id")


def test_a_torch_optimizer_built_before_initialize_trains_as_plain_fused_torch():
    """It becomes the engine's offloaded AdamW over the same params (as DeepSpeed hands back its own
    optimizer wrapper, not the client's), whose kernel gives torch's ``fused=True`` bits."""
    torch.manual_seed(20260728)
    model = nn.Linear(4, 3)
    optimizer = torch.optim.AdamW(model.parameters(), lr=0.1)
    x = torch.arange(8, dtype=torch.float32).reshape(2, 4) / 8
    w, b = (t.detach().clone().requires_grad_() for t in (model.weight, model.bias))
    ref = nn.functional.linear(x, w, b)
    ref.sum().backward()
    ref_opt = torch.optim.AdamW([w, b], lr=0.1, fused=True)
    cfg = {
        "train_micro_batch_size_per_gpu": 2,
        "zero_optimization": {
            "stage": 3,
            "memory_efficient_linear": True,
            "stage3_param_persistence_threshold": 0,
            "stage3_max_reuse_distance": 0,
        },
    }
    engine, opt, _, _ = deepspeed.initialize(model=model, optimizer=optimizer, config_params=cfg)
    with engine:
        assert opt is engine.optimizer and isinstance(opt, zswap.optim.OffloadedAdamW)
        assert param_state(model.weight) is not None
        out = engine(x.to(engine.device))
        engine.backward(out.sum())
        assert torch.equal(out, ref)
        assert torch.equal(zswap.full_grad(model.weight), w.grad)
        assert torch.equal(zswap.full_grad(model.bias), b.grad)
        engine.step()
        torch.nn.utils.clip_grad_norm_([w, b], 1.0)  # DeepSpeed's default gradient_clipping
        ref_opt.step()
        with zswap.GatheredParameters([model.weight, model.bias]):
            assert torch.equal(model.weight, w) and torch.equal(model.bias, b)


class UnusedParams(nn.Module):
    def __init__(self, hidden: int = 4) -> None:
        super().__init__()
        self.used = nn.Linear(hidden, hidden)
        self.unused = nn.Linear(hidden, hidden)

    def forward(self, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        return nn.functional.cross_entropy(self.used(x), y)


class Scaled(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.ones(3, 5))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.weight * x


class ThreeScaled(nn.Module):
    """DeepSpeed's TestZero3ParamPartitioningBase: each layer's params' status right after its forward."""

    def __init__(self) -> None:
        super().__init__()
        self.layers = nn.ModuleList(Scaled() for _ in range(3))
        self.after: list[set[Status]] = []

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        self.after.clear()
        for layer in self.layers:
            x = layer(x)
            self.after.append({st.status for p in layer.parameters() if (st := param_state(p)) is not None})
        return x


def train_three_scaled(zero: dict[str, Any], after: list[set[Status]]) -> dict[str, Any]:
    """Three steps of `ThreeScaled` under ``zero`` (stage 3, no persistence, no clipping), each layer's
    params' statuses right after its forward checked against ``after``; the params against plain torch's
    fused Adam at the end, every one released. Returns ``engine.stats()``."""
    cfg = {
        "train_micro_batch_size_per_gpu": 1,
        "optimizer": {"type": "Adam", "params": {"lr": 0.5}},
        "gradient_clipping": 0.0,
        "zero_optimization": {"stage": 3, "stage3_param_persistence_threshold": 0, **zero},
    }
    model, plain = ThreeScaled(), ThreeScaled()
    opt = torch.optim.Adam(plain.parameters(), lr=0.5, fused=True)
    engine, *_ = deepspeed.initialize(model=model, model_parameters=model.parameters(), config=cfg)
    x = torch.arange(15.0).reshape(3, 5)
    with engine:
        for it in range(3):
            out = engine(x)
            assert model.after == after, (it, model.after)
            engine.backward(out.square().sum())
            engine.step()
            plain(x).square().sum().backward()
            opt.step()
            opt.zero_grad()
        assert {param_state(p).status for p in model.parameters()} == {Status.NOT_AVAILABLE}
        with zswap.GatheredParameters(list(model.parameters())):
            assert all(torch.equal(p, q) for p, q in zip(model.parameters(), plain.parameters(), strict=True))
        return engine.stats()


@pytest.mark.parametrize("prefetching", [False, True])
def test_no_reuse_distance_and_no_prefetch_let_each_param_go_after_its_use(prefetching):
    """``stage3_max_reuse_distance: 0`` with ``stage3_prefetch_bucket_size: 0``: each layer's param is let
    go as its forward ends, the last one's too (not kept for its backward); with a bucket covering the
    model, each stays gathered for its backward (DeepSpeed: prefetched for its later use; from the second
    iteration on, once its trace is recorded: zswap guesses the first). They train as plain torch."""
    want = {Status.AVAILABLE} if prefetching else {Status.NOT_AVAILABLE}
    zero = {"stage3_max_reuse_distance": 0, "stage3_prefetch_bucket_size": 45 if prefetching else 0}
    train_three_scaled(zero, [want] * 3)


def test_a_live_budget_below_one_module_gathers_one_module_at_a_time():
    """``stage3_max_live_parameters`` below a module's own params (DeepSpeed's TestNVMeCheckpointing sets
    100): as in DeepSpeed, the module running gets its params whatever the budget, and nothing is prefetched
    or kept beside them (but what the very next step uses: the last layer stays for its backward, nothing
    gathered between); it trains as plain torch."""
    zero = {
        "stage3_max_live_parameters": 4,  # a layer holds 15
        "stage3_max_reuse_distance": 0,
        "stage3_prefetch_bucket_size": 45,
    }
    stats = train_three_scaled(zero, [{Status.NOT_AVAILABLE}] * 2 + [{Status.AVAILABLE}])
    assert stats["prefetch_issued"] == 0 and stats["max_live_elements"] == 4


@pytest.mark.parametrize("ignore_unused_parameters", [True, False])
def test_unused_params_train_and_stay_as_they_were(ignore_unused_parameters):
    cfg = {
        "train_micro_batch_size_per_gpu": 2,
        "gradient_accumulation_steps": 2,
        "zero_optimization": {
            "stage": 2,
            "cpu_offload": True,
            "ignore_unused_parameters": ignore_unused_parameters,
        },
        "optimizer": {"type": "Adam", "params": {"lr": 1e-3}},
        "bf16": {"enabled": True},
    }
    torch.manual_seed(0)
    model = UnusedParams()
    engine, *_ = deepspeed.initialize(config=cfg, model=model, model_parameters=model.parameters())
    with engine:
        with zswap.GatheredParameters(list(model.unused.parameters())):
            before = [p.detach().clone() for p in model.unused.parameters()]
        g = torch.Generator().manual_seed(1)
        for _ in range(5):
            x = torch.randn(2, 4, generator=g).to(torch.bfloat16)
            y = torch.randint(0, 4, (2,), generator=g)
            engine.backward(engine(x, y))
            engine.step()
        assert engine.global_steps == 2 and engine.micro_steps == 5
        assert zswap.full_grad(model.unused.weight) is None
        with zswap.GatheredParameters(list(model.unused.parameters())):
            assert all(torch.equal(p, q) for p, q in zip(model.unused.parameters(), before, strict=True))


def test_unwrap_model_for_generation_gathers_once_and_training_goes_on(tmp_path):
    """DeepSpeed's TestUnwrapModel and TestUnwrapModelTraceInvalidate: inside the block every param is
    whole and forwards read nothing; steps before and after it train as plain PyTorch does."""
    cfg = {
        **STAGE3,
        "zero_optimization": {"stage": 3, "offload_param": {"device": "nvme", "nvme_path": str(tmp_path)}},
    }
    torch.manual_seed(0)
    plain = TwoLayer(6)
    torch.manual_seed(0)
    with deepspeed.zero.Init(config_dict_or_path=cfg):
        model = TwoLayer(6)
    engine, *_ = deepspeed.initialize(model=model, model_parameters=model.parameters(), config=cfg)
    opt = torch.optim.Adam(plain.parameters(), lr=0.00015, fused=True)
    data = list(batches(6, hidden=6))
    with engine:
        for i, (x, y) in enumerate(data):
            if i == 3:
                with deepspeed.zero.unwrap_model_for_generation(engine) as unwrapped:
                    assert unwrapped is engine and all(p.numel() > 0 for p in model.parameters())
                    read = engine.stats()["bytes_read"]  # (the block's entry read the model once)
                    with torch.no_grad():
                        for a, b in data:
                            assert torch.equal(engine(a, b), plain(a, b))
                    assert engine.stats()["bytes_read"] == read
                assert all(p.numel() == 0 for p in model.parameters())
            engine.backward(engine(x, y))
            plain(x, y).backward()
            torch.nn.utils.clip_grad_norm_(plain.parameters(), deepspeed.GRADIENT_CLIPPING_DEFAULT)
            engine.step()
            opt.step()
            opt.zero_grad()
        with zswap.GatheredParameters(list(model.parameters())):
            assert all(torch.equal(p, q) for p, q in zip(model.parameters(), plain.parameters(), strict=True))


@pytest.mark.dist
def test_two_ranks_scatter_gather_and_modifier_rank(tmp_path):
    run_ranks(WORKER, tmp_path)


@pytest.mark.parametrize("training", [True, False])
def test_empty_partition_cache_lets_the_persistent_params_go_too(training):
    """DeepSpeed's TestZeroPartitionCache: the bias (within the persistence threshold) stays gathered
    through training or inference; ``empty_partition_cache`` releases every param, it too; the next
    forward gathers it again, and training goes on as plain torch."""
    cfg: dict[str, Any] = {
        "train_batch_size": 2,
        "gradient_clipping": 0.0,
        "zero_optimization": {"stage": 3, "stage3_param_persistence_threshold": 10},
    }
    if training:
        cfg["optimizer"] = {"type": "Adam", "params": {"lr": 0.1}}
    torch.manual_seed(0)
    with deepspeed.zero.Init(config_dict_or_path=cfg):
        model = TwoLayer()
    plain = TwoLayer()
    with zswap.GatheredParameters(list(model.parameters())):
        plain.load_state_dict(model.state_dict())
    opt = torch.optim.Adam(plain.parameters(), lr=0.1, fused=True)
    engine, *_ = deepspeed.initialize(model=model, model_parameters=model.parameters(), config=cfg)

    def run(x: torch.Tensor, y: torch.Tensor) -> None:
        loss = engine(x, y)
        if training:
            engine.backward(loss)
            engine.step()
            plain(x, y).backward()
            opt.step()
            opt.zero_grad()

    data = list(batches(4))
    with engine:
        for x, y in data[:3]:
            run(x, y)
        assert [p.numel() for p in model.parameters()] == [0, 10, 0, 10]  # the biases persist
        engine.empty_partition_cache()
        assert {param_state(p).status for p in model.parameters()} == {Status.NOT_AVAILABLE}
        assert sum(p.numel() for p in model.parameters()) == 0
        run(*data[3])
        assert [p.numel() for p in model.parameters()] == [0, 10, 0, 10]
        with zswap.GatheredParameters(list(model.parameters())):
            assert all(torch.equal(p, q) for p, q in zip(model.parameters(), plain.parameters(), strict=True))


def test_mics_init_is_init_with_a_warning_naming_it():
    """MiCS only changes where params are sharded: ``MiCS_Init`` builds what ``zero.Init`` builds (the same
    values, partitioned over the whole group), saying so."""
    cfg = {"zero_optimization": {"stage": 3, "mics_shard_size": 1}, "train_batch_size": 1}
    torch.manual_seed(0)
    ref = TwoLayer(hidden=4)
    torch.manual_seed(0)
    with pytest.warns(zswap.ZswapWarning) as caught, deepspeed.zero.MiCS_Init(config_dict_or_path=cfg):
        model = TwoLayer(hidden=4)
    assert any(
        "MiCS_Init partitions each param over the whole process group" in str(w.message) for w in caught
    )
    assert all(param_state(p) is not None for p in model.parameters())
    with zswap.GatheredParameters(list(model.parameters())):
        assert all(torch.equal(p, q) for p, q in zip(model.parameters(), ref.parameters(), strict=True))


class _MixedDtype(nn.Module):
    """DeepSpeed's test_zero_autocast_mixed_dtype.py: a frozen base weight built under Init, float32
    adapters attached after it."""

    def __init__(self, h: int = 8) -> None:
        super().__init__()
        self.h = h
        self.base = nn.Parameter(torch.randn(h, h) * 0.01, requires_grad=False)

    def attach(self) -> None:
        g = torch.Generator().manual_seed(1)
        self.a = nn.Parameter(torch.randn(4, self.h, generator=g) * 0.01)
        self.b = nn.Parameter(torch.randn(self.h, 4, generator=g) * 0.01)

    def forward(self, x: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
        out = nn.functional.linear(x, self.base) + nn.functional.linear(
            nn.functional.linear(x, self.a), self.b
        )
        return nn.functional.mse_loss(out.float(), target.float())


@pytest.mark.parametrize("entry", ["deepspeed", "zswap"])
def test_params_added_after_init_keep_their_dtype_as_deepspeeds(entry, tmp_path):
    """bf16 with ``torch_autocast``: the base is bf16, the float32 adapters attached after the Init stay
    float32 (DeepSpeed's test asserts it) and train bitwise as plain torch under ``torch.autocast`` (before:
    cast to bf16 with float32 masters, 1e-3 off after four steps). A model built with no Init at all is
    cast whole, as DeepSpeed's engine casts it; without autocast, so are params added after Init."""
    swap = {"device": "nvme", "nvme_path": str(tmp_path)}
    cfg = {
        "train_micro_batch_size_per_gpu": 1, "gradient_clipping": 0, "bf16": {"enabled": True},
        "zero_optimization": {"stage": 3, "offload_param": swap, "offload_optimizer": swap},
        "torch_autocast": {"enabled": True, "dtype": "torch.bfloat16",
                           "lower_precision_safe_modules": [f"{__name__}._MixedDtype"]},
    }  # fmt: skip
    torch.manual_seed(0)
    with deepspeed.zero.Init(config_dict_or_path=cfg):
        model = _MixedDtype()
    model.attach()
    with deepspeed.zero.GatheredParameters([model.base]):
        base = model.base.detach().clone()
    ref = _MixedDtype()
    ref.base.data = base
    ref.attach()
    trainable = [model.a, model.b]
    ref_opt = torch.optim.AdamW([ref.a, ref.b], lr=0.1, fused=True)
    if entry == "deepspeed":
        engine, *_ = deepspeed.initialize(
            config=cfg,
            model=model,
            model_parameters=trainable,
            optimizer=torch.optim.AdamW(trainable, lr=0.1),
        )
    else:
        engine = zswap.initialize(model, cfg, optimizer=torch.optim.AdamW(trainable, lr=0.1))
    assert [param_state(p).dtype for p in (model.base, model.a, model.b)] == [torch.bfloat16] + [
        torch.float32
    ] * 2
    g = torch.Generator().manual_seed(2)
    with engine:
        for _ in range(4):
            x, t = torch.randn(2, 8, generator=g), torch.randn(2, 8, generator=g)
            loss = engine(x, t) if entry == "deepspeed" else model(x, t)
            engine.backward(loss)
            engine.step()
            with torch.autocast("cpu", dtype=torch.bfloat16):
                want = ref(x, t)
            want.backward()
            ref_opt.step()
            ref_opt.zero_grad()
            assert torch.equal(loss.detach(), want.detach())
        with deepspeed.zero.GatheredParameters(trainable):
            assert torch.equal(model.a, ref.a) and torch.equal(model.b, ref.b)
    whole = _MixedDtype()
    whole.attach()
    zswap.initialize(whole, cfg).close()  # no Init: everything in the config's dtype
    assert all(param_state(p).dtype == torch.bfloat16 for p in whole.parameters())
    # Without torch_autocast a plain layer attached after the build is cast: float32 beside bf16
    # activations its matmul would fail (PEFT's adapters, which cast their inputs, keep theirs: test_peft).
    with deepspeed.zero.Init(config_dict_or_path=cfg):
        headed = _MixedDtype()
    headed.attach()
    zswap.initialize(headed, {k: v for k, v in cfg.items() if k != "torch_autocast"}).close()
    assert all(param_state(p).dtype == torch.bfloat16 for p in headed.parameters())


@pytest.mark.parametrize(("section", "built"), [("bf16", torch.float16), ("fp16", torch.bfloat16)])
def test_params_in_the_other_16_bit_dtype_than_the_section_are_refused(section, built):
    """``Init(dtype=)`` beside the config's section builds in its dtype (as DeepSpeed's); an engine over
    those params under the other section would train them against it (before: bf16 on, float16 params
    trained with fp16 loss scaling, silently)."""
    cfg = {**STAGE3, section: {"enabled": True}}
    with zswap.Init(cfg, dtype=built):
        model = nn.Linear(4, 4)
    assert param_state(model.weight).dtype == built
    name = str(built).removeprefix("torch.")
    with pytest.raises(zswap.ConfigError, match=rf"{section} section is on but weight, bias are {name}"):
        zswap.initialize(model, cfg)
    zswap.initialize(model, {**STAGE3, ("fp16" if section == "bf16" else "bf16"): {"enabled": True}}).close()
