"""DeepSpeed's top-level features outside zswap's sections: ``torch_autocast`` and ``dataloader_drop_last``
honoured; the ones that change results and that zswap does not implement refused where switched on; the
monitors' named in the "ignored" warning (DeepSpeed's tests/unit/runtime/test_autocast.py and
zero/test_zero_autocast_mixed_dtype.py, adapted)."""

from __future__ import annotations

import copy
import json
import warnings
from typing import Any

import pytest
import torch
from torch import nn
from torch.utils.data import TensorDataset

import zswap
import zswap.deepspeed as deepspeed
from zswap import ConfigError, load_config
from zswap.device import StandInDevice

from ._ds_common import base_config


@pytest.fixture
def quiet() -> Any:
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", zswap.ZswapWarning)
        yield


REFUSED = [
    ({"amp": {"enabled": True}}, r"amp\.enabled .*apex AMP does not combine with ZeRO"),
    ({"progressive_layer_drop": {"enabled": True, "theta": 0.5}}, r"progressive_layer_drop\.enabled"),
    ({"curriculum_learning": {"enabled": True}}, r"curriculum_learning\.enabled .*data loader"),
    (
        {"data_efficiency": {"enabled": "true", "data_sampling": {"enabled": True}}},
        r"data_efficiency\.data_sampling\.enabled",
    ),
    ({"quantize_training": {"enabled": True}}, r"quantize_training\.enabled"),
    ({"elasticity": {"enabled": True}}, r"elasticity\.enabled .*train_batch_size"),
    ({"hybrid_engine": {"enabled": True}}, r"hybrid_engine\.enabled .*unwrap_model_for_generation"),
    ({"eigenvalue": {"enabled": True}}, r"eigenvalue\.enabled"),
    (
        {"compression_training": {"sparse_pruning": {"shared_parameters": {"enabled": True}}}},
        r"compression_training\.sparse_pruning\.shared_parameters\.enabled .*prune",
    ),
    ({"weight_quantization": {"post_init_quant": {"fc": {}}}}, r"weight_quantization\.post_init_quant"),
    ({"tensor_parallel": {"autotp_size": 2}}, r"tensor_parallel\.autotp_size .*no tensor parallelism"),
    ({"tensor_parallel": {"tp": {"tp_size": 4}}}, r"tensor_parallel\.tp\.tp_size"),
    ({"sequence_parallel_size": 2}, r"sequence_parallel_size .*whole sequences"),
    (
        {"expert_parallel": {"enabled": True, "autoep_size": 2}},
        r"expert_parallel\.enabled .*expert parallelism",
    ),
    ({"prescale_gradients": True}, r"prescale_gradients .*averages the ranks' gradients over the world size"),
    ({"gradient_predivide_factor": 2.0}, r"gradient_predivide_factor .*may only be 1\.0"),
    ({"gradient_allreduce_op": "SUM"}, r"gradient_allreduce_op .*DeepSpeed's ZeRO-3 does whatever"),
    ({"gradient_allreduce_op": "max"}, r"gradient_allreduce_op must be 'mean' or 'sum', got 'max'"),
    ({"communication_data_type": "int8"}, r"communication_data_type must be a floating-point dtype"),
    (
        {"checkpoint": {"tag_validation": "ignore"}},
        r"tag_validation 'Ignore' is not supported: .*different tags",
    ),
    ({"checkpoint": {"tag_validation": "foo"}}, r"must be 'Warn', 'Ignore' or 'Fail', got 'foo'"),
]


@pytest.mark.parametrize(("extra", "message"), REFUSED, ids=[next(iter(e)) for e, _ in REFUSED])
def test_a_result_changing_feature_switched_on_is_refused_naming_it(extra, message):
    with pytest.raises(ConfigError, match=message):
        load_config(base_config(**extra))


ACCEPTED = [
    {"amp": {"enabled": False}},
    {"data_efficiency": {"enabled": True, "data_sampling": {"enabled": False}}},
    {"progressive_layer_drop": {"enabled": False}},
    {"compression_training": {"weight_quantization": {"shared_parameters": {"enabled": False}}}},
    {"weight_quantization": {}},
    {"tensor_parallel": {"autotp_size": 0, "tp": {"tp_size": 1}}},
    {"sequence_parallel_size": 1},
    {"prescale_gradients": False, "gradient_predivide_factor": 1.0},
    {"gradient_allreduce_op": "Mean"},
    {"communication_data_type": "bfloat16", "bf16": {"enabled": True}},
    {"communication_data_type": "torch.float32"},
    {"communication_data_type": "fp32", "bf16": {"enabled": True}},  # ranks reduce in it
    {"pipeline": {"stages": "auto"}, "activation_checkpointing": {"partition_activations": False}},
    {"checkpoint": {"tag_validation": "Warn"}},  # DeepSpeed's default (zswap fails on different tags)
    {"checkpoint": {"tag_validation": "FAIL", "use_node_local_storage": False}},
]


@pytest.mark.parametrize("extra", ACCEPTED, ids=[next(iter(e)) for e in ACCEPTED])
def test_the_same_features_at_their_defaults_load_silently(extra):
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        load_config(base_config(**extra))


def test_monitors_switched_on_are_named_in_the_ignored_warning():
    extra = {
        "tensorboard": {"enabled": True},
        "wandb": {"enabled": False},
        "flops_profiler": {"enabled": True},
        "wall_clock_breakdown": True,
        "compile": {"deepcompile": True},
        # read by deepspeed.checkpointing.configure alone (zswap's refuses them): once accepted silently
        "activation_checkpointing": {"partition_activations": True, "cpu_checkpointing": False},
    }
    with pytest.warns(zswap.ZswapWarning) as record:
        load_config(base_config(**extra))
    named = (
        "tensorboard.enabled, flops_profiler.enabled, wall_clock_breakdown, "
        "activation_checkpointing.partition_activations, compile.deepcompile"
    )
    assert str(record[0].message).endswith(f"change no result: {named}")


@pytest.mark.parametrize(
    ("given", "expected"),
    [("bfloat16", torch.bfloat16), ("torch.float16", torch.float16), ("half", torch.float16),
     (torch.bfloat16, torch.bfloat16), ("auto", None), (None, None)],
)  # fmt: skip
def test_torch_autocast_takes_deepspeeds_dtype_spellings_and_round_trips(given, expected):
    cfg = load_config({"torch_autocast": {"enabled": True, "dtype": given}})
    assert cfg.torch_autocast.enabled and cfg.torch_autocast.torch_dtype() == expected
    assert load_config(cfg.to_dict()) == cfg


@pytest.mark.parametrize(
    ("section", "message"),
    [({"enabled": True, "dtype": "int8"}, r"torch_autocast\.dtype must be a floating-point dtype"),
     ({"enabled": True, "lower_precision_safe_modules": ["torch.nn.Linearr"]},
      r"torch_autocast\.lower_precision_safe_modules must name classes by their full import path "
      r"\('torch\.nn\.Linearr' imports none\)"),
     ({"enabeld": True}, r"unknown key 'enabeld' in torch_autocast; did you mean 'enabled'\?")],
)  # fmt: skip
def test_a_bad_torch_autocast_section_is_an_error_naming_the_key(section, message):
    with pytest.raises(ConfigError, match=message):
        load_config({"torch_autocast": section})


class Mlp(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.body = nn.Sequential(nn.Linear(16, 32), nn.GELU(), nn.LayerNorm(32), nn.Linear(32, 8))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.body(x)


@pytest.mark.parametrize("device", ["cpu", "stand-in"])
@pytest.mark.parametrize("call", ["engine", "module"])
def test_torch_autocast_runs_every_forward_under_autocast_as_plain_pytorch_does(device, call, tmp_path):
    """The forward under the config's autocast — whether the engine or the module itself is called (as
    the Lightning and Hugging Face loops do) — trains bitwise as plain PyTorch's forward under
    ``torch.autocast``; outside the forward autocast is as it was."""
    torch.manual_seed(0)
    model = Mlp()
    ref = copy.deepcopy(model)
    cfg = {
        "offload_param": {"device": "nvme", "nvme_path": str(tmp_path)},
        "offload_optimizer": {"device": "nvme", "nvme_path": str(tmp_path)},
        "optimizer": {"type": "AdamW", "params": {"lr": 1e-2}},
        "torch_autocast": {
            "enabled": True,
            "dtype": "bf16",
            "lower_precision_safe_modules": ["torch.nn.Linear"],
        },
    }
    engine = zswap.initialize(model, cfg, device=StandInDevice() if device == "stand-in" else "cpu")
    plain = torch.optim.AdamW(ref.parameters(), lr=1e-2, weight_decay=0.0, fused=True)
    g = torch.Generator().manual_seed(1)
    with engine:
        for _ in range(3):
            x = torch.randn(4, 16, generator=g)
            out = engine(x) if call == "engine" else model(x)
            assert out.dtype == torch.bfloat16
            assert not torch.is_autocast_enabled("cpu")
            loss = out.float().square().mean()
            engine.backward(loss)
            engine.step()
            with torch.autocast("cpu", dtype=torch.bfloat16):
                expected = ref(x).float().square().mean()
            expected.backward()
            plain.step()
            plain.zero_grad()
            assert loss.item() == expected.item()
        params = list(model.parameters())
        with zswap.GatheredParameters(params):
            assert all(torch.equal(a, b) for a, b in zip(params, ref.parameters(), strict=True))


@pytest.mark.parametrize("loop", ["engine.backward", "engine.scale"])
def test_fp16_torch_autocast_scales_the_loss_as_torchs_grad_scaler(loop, tmp_path):
    """fp16 autocast scales the loss as DeepSpeed does for it (torch's GradScaler: 2**16, halved and the step
    skipped at an overflow, doubled after 2000 clean steps): bitwise plain PyTorch under
    ``torch.autocast`` with ``torch.amp.GradScaler`` — an overflow injected at step 2 included."""
    import zswap.deepspeed as deepspeed

    torch.manual_seed(0)
    model = Mlp()
    ref = copy.deepcopy(model)
    cfg = {
        "train_micro_batch_size_per_gpu": 4,
        "zero_optimization": {
            "offload_param": {"device": "nvme", "nvme_path": str(tmp_path)},
            "offload_optimizer": {"device": "nvme", "nvme_path": str(tmp_path)},
        },
        "optimizer": {"type": "AdamW", "params": {"lr": 1e-2, "weight_decay": 0.0}},
        "gradient_clipping": 0.0,
        "torch_autocast": {"enabled": True, "dtype": "fp16"},
    }
    engine, *_ = deepspeed.initialize(model=model, config=cfg, model_parameters=model.parameters())
    plain = torch.optim.AdamW(ref.parameters(), lr=1e-2, weight_decay=0.0, fused=True)
    scaler = torch.amp.GradScaler("cpu")
    g = torch.Generator().manual_seed(1)
    with engine:
        for step in range(4):
            x = torch.randn(4, 16, generator=g)
            boost = 1e30 if step == 2 else 1.0  # fp16 overflows: the step is skipped, the scale halved
            loss = engine(x).float().square().mean() * boost
            if loop == "engine.scale":
                engine.scale(loss).backward()
            else:
                engine.backward(loss)
            engine.step()
            with torch.autocast("cpu", dtype=torch.float16):
                expected = ref(x).float().square().mean() * boost
            scaler.scale(expected).backward()
            scaler.step(plain)
            scaler.update()
            plain.zero_grad()
            assert engine.optimizer.cur_scale == scaler.get_scale(), step
        assert engine.skipped_steps == 1
        params = list(model.parameters())
        with zswap.GatheredParameters(params):
            assert all(torch.equal(a, b) for a, b in zip(params, ref.parameters(), strict=True))


def test_a_forward_that_raises_leaves_autocast_as_it_was(tmp_path):
    class Fails(Mlp):
        def forward(self, x: torch.Tensor) -> torch.Tensor:
            self.body(x)
            raise ValueError("in forward")

    cfg = {"offload_param": {"device": "cpu"}, "torch_autocast": {"enabled": True}}
    engine = zswap.initialize(Fails(), cfg)
    with engine, pytest.raises(ValueError, match="in forward"):
        engine(torch.randn(2, 16))
    assert not torch.is_autocast_enabled("cpu")


def test_without_torch_autocast_a_callers_own_autocast_is_kept(tmp_path, quiet):
    engine = zswap.initialize(Mlp(), {"offload_param": {"device": "cpu"}})
    with engine, torch.autocast("cpu", dtype=torch.bfloat16):
        assert engine(torch.randn(2, 16)).dtype == torch.bfloat16


@pytest.mark.parametrize("drop", [False, True])
def test_the_loader_drops_a_short_last_batch_where_dataloader_drop_last_says(drop, quiet):
    data = TensorDataset(torch.randn(5, 16))
    cfg = base_config(train_micro_batch_size_per_gpu=2, dataloader_drop_last=drop)
    cfg.pop("train_batch_size", None)
    engine, _, loader, _ = deepspeed.initialize(model=Mlp(), config=cfg, training_data=data)
    with engine:
        assert [len(b[0]) for b in loader] == ([2, 2] if drop else [2, 2, 1])


def test_repeating_loader_starts_a_new_pass_where_one_ends(quiet):
    """DeepSpeed's test_repeating_loader, and over the loader `initialize` returns (each pass reshuffled,
    the short last batch dropped as configured); an empty loader stops instead of looping for ever."""
    from zswap.deepspeed.utils import RepeatingLoader

    loader = RepeatingLoader([1, 2, 3])
    assert [next(loader) for _ in range(150)] == [1, 2, 3] * 50
    data = TensorDataset(torch.arange(5.0))
    cfg = base_config(train_micro_batch_size_per_gpu=2, dataloader_drop_last=True)
    cfg.pop("train_batch_size", None)
    engine, _, plain, _ = deepspeed.initialize(model=Mlp(), config=cfg, training_data=data)
    with engine:
        torch.manual_seed(0)
        batches = [b[0] for b, _ in zip(RepeatingLoader(plain), range(6), strict=False)]
    assert [len(b) for b in batches] == [2] * 6
    for epoch in range(3):  # each pass is a fresh one over the dataset
        assert len(set(torch.cat(batches[2 * epoch : 2 * epoch + 2]).tolist())) == 4
    with pytest.raises(StopIteration):
        next(RepeatingLoader([]))


def test_log_dist_logs_as_deepspeeds_on_one_process(caplog):
    from zswap.deepspeed.utils import log_dist, logger

    with caplog.at_level("INFO", logger=logger.name):
        log_dist("hello", ranks=[0])
        log_dist("world")  # without torch.distributed every call logs
    assert [r.getMessage() for r in caplog.records] == ["[Rank -1] hello", "[Rank -1] world"]


@pytest.mark.parametrize(
    "section", [{"type": "Adam"}, {"type": "AdamW", "params": {}}, {"type": "Adam", "params": None}]
)
@pytest.mark.parametrize("source", ["dict", "file"])
def test_a_config_optimizer_without_lr_runs_at_deepspeeds_default(section, source, tmp_path, quiet):
    cfg = {"train_batch_size": 1, "optimizer": section}
    path = tmp_path / "ds.json"
    path.write_text(json.dumps(cfg))
    engine, optimizer, _, _ = deepspeed.initialize(model=Mlp(), config=cfg if source == "dict" else str(path))
    with engine:
        assert [g["lr"] for g in optimizer.param_groups] == [deepspeed.OPTIMIZER_LR_DEFAULT] == [1e-3]
    assert cfg == {"train_batch_size": 1, "optimizer": section}  # the caller's dict is left as it was


def test_an_auto_lr_stays_an_error_naming_the_key(quiet):
    cfg = {"train_batch_size": 1, "optimizer": {"type": "Adam", "params": {"lr": "auto"}}}
    with pytest.raises(ConfigError, match=r"optimizer\.params\.lr is 'auto' \(or missing\)") as e:
        deepspeed.initialize(model=Mlp(), config=cfg)
    assert "lr= to zswap.optim.OffloadedAdamW.from_config, or pass optimizer= to zswap.init" in str(e.value)


def test_a_communication_dtype_on_one_rank_reduces_nothing(tmp_path):
    """One rank reduces nothing (DeepSpeed's cast there changes no value): fp32 for bf16 params trains
    bitwise as without the key; over two ranks the reduction runs in it
    (`_ds_dist_worker.communication_dtype`)."""
    runs = []
    for key in ({"communication_data_type": "fp32"}, {}):
        path = tmp_path / str(len(runs))
        path.mkdir()
        cfg = base_config(
            bf16={"enabled": True},
            zero_optimization={"stage": 3, "offload_param": {"device": "nvme", "nvme_path": str(path)}},
            **key,
        )
        torch.manual_seed(0)
        with zswap.Init(cfg):
            model = nn.Linear(8, 8)
        with zswap.initialize(model, cfg) as engine:
            for s in range(3):
                torch.manual_seed(s)
                engine.backward(engine(torch.randn(2, 8, dtype=torch.bfloat16)).float().pow(2).sum())
                engine.step()
            with zswap.GatheredParameters(list(model.parameters())):
                runs.append([p.detach().clone() for p in model.parameters()])
    assert all(torch.equal(a, b) for a, b in zip(*runs, strict=True))
