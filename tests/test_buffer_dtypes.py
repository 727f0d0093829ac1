"""Buffers under a bf16 / fp16 ``Init`` and DeepSpeed's ``data_types`` section.

- ``Init(dtype=…)`` gives its dtype to the buffers a build with torch's default dtype set to it would have
  made in it (BatchNorm's running statistics, a scale computed from ``torch.ones``), not to those asked for
  in float32 (a rotary ``inv_freq``): as transformers' ``from_pretrained(dtype=…)`` builds, and as
  DeepSpeed's Init does for the same modules; a bf16 BatchNorm model runs and matches plain PyTorch.
- ``from_pretrained`` under such an Init loads those buffers in its dtype: bitwise a plain
  ``from_pretrained(dtype=…)`` (a ResNet's running statistics; every tiny architecture's buffers).
- Buffers a Hugging Face model lists in ``_keep_in_fp32_modules_strict`` stay float32, and
  ``data_types.keep_in_fp32_modules`` names others (``[]``: none).
- ``data_types.buffer_dtype`` casts every other floating buffer at `zswap.initialize`;
  ``data_types.param_dtype`` must be the params' dtype; ``data_types.grad_accum_dtype`` must be the dtype
  zswap sums gradients in where it accumulates (refused, with the fix, otherwise).
"""

from __future__ import annotations

from typing import Any, ClassVar

import pytest
import torch
from torch import nn

import zswap
from zswap.deepspeed.utils import safe_get_full_fp32_param
from zswap.device import StandInDevice
from zswap.errors import ConfigError


class Net(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.lin = nn.Linear(8, 8)
        self.bn = nn.BatchNorm1d(8)
        self.register_buffer("scale", torch.ones(8) * 0.5)  # derived from a constructor: the Init's dtype
        self.register_buffer("inv", torch.arange(0, 8, 2, dtype=torch.float32) / 8)  # asked for: float32

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.bn(self.lin(x)) * self.scale


def cfg(tmp_path: Any, **extra: Any) -> dict[str, Any]:
    return {
        "zero_optimization": {
            "offload_param": {"device": "nvme", "nvme_path": str(tmp_path)},
            "offload_optimizer": {"device": "cpu"},
        },
        "bf16": {"enabled": True},
        "optimizer": {"type": "AdamW", "params": {"lr": 1e-3}},
        **extra,
    }


def dtypes(model: nn.Module) -> dict[str, torch.dtype]:
    return {n: b.dtype for n, b in model.named_buffers() if b.is_floating_point()}


LOW = {"scale": torch.bfloat16, "inv": torch.float32, "bn.running_mean": torch.bfloat16}
LOW["bn.running_var"] = torch.bfloat16


def test_bf16_buffers_are_those_a_bf16_default_dtype_builds_and_batchnorm_matches_plain(tmp_path):
    torch.manual_seed(0)
    with zswap.Init(cfg(tmp_path)):
        model = Net()
    assert dtypes(model) == LOW
    torch.manual_seed(0)
    plain = Net().to(torch.bfloat16)
    plain.inv = plain.inv.float()
    assert dtypes(plain) == LOW
    xs = [torch.randn(4, 8, dtype=torch.bfloat16) for _ in range(3)]
    with zswap.initialize(model, cfg(tmp_path)) as engine:
        got = [engine(x) for x in xs]  # training mode: the running statistics move, in bf16
    want = [plain(x) for x in xs]
    assert all(torch.equal(g, w) for g, w in zip(got, want, strict=True))
    for name, buf in plain.named_buffers():
        assert torch.equal(dict(model.named_buffers())[name], buf), name


class Tables(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.lin = nn.Linear(4, 4)
        table = torch.arange(4, dtype=torch.int64).float() * 0.25
        self.register_buffer("table", table.to(torch.get_default_dtype()))  # M2M100's position tables
        kept = torch.arange(4, dtype=torch.int64).float() * 0.25
        self.register_buffer("kept", kept.to(torch.float32))  # named: float32 whatever the default


def test_a_buffer_cast_to_torchs_default_dtype_takes_the_inits_as_a_bf16_default_build_gives_it(tmp_path):
    with zswap.Init(cfg(tmp_path)):
        model = Tables()
    torch.set_default_dtype(torch.bfloat16)
    try:
        plain = Tables()
    finally:
        torch.set_default_dtype(torch.float32)
    assert dtypes(model) == dtypes(plain) == {"table": torch.bfloat16, "kept": torch.float32}
    assert all(torch.equal(b, dict(plain.named_buffers())[n]) for n, b in model.named_buffers())


def test_a_buffer_from_outside_or_in_an_init_without_dtype_keeps_its_dtype(tmp_path):
    outside = torch.zeros(3)

    class Holder(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.register_buffer("given", outside)
            self.register_buffer("made", torch.zeros(3))

    with zswap.Init(cfg(tmp_path)):
        held = Holder()
    assert dtypes(held) == {"given": torch.float32, "made": torch.bfloat16}
    assert held.given is outside
    with zswap.Init(remote_device="cpu"):
        plain = Holder()
    assert dtypes(plain) == {"given": torch.float32, "made": torch.float32}


class Routed(nn.Module):
    # transformers' list (a MoE router's correction bias)
    _keep_in_fp32_modules_strict: ClassVar[list[str]] = ["gate.bias_corr"]

    def __init__(self) -> None:
        super().__init__()
        self.gate = nn.Module()
        self.gate.register_buffer("bias_corr", torch.zeros(4))
        self.register_buffer("other", torch.zeros(4))


@pytest.mark.parametrize(
    ("keep", "want"),
    [
        (None, {"gate.bias_corr": torch.float32, "other": torch.bfloat16}),
        ("auto", {"gate.bias_corr": torch.float32, "other": torch.bfloat16}),
        ([], {"gate.bias_corr": torch.bfloat16, "other": torch.bfloat16}),
        (["oth*"], {"gate.bias_corr": torch.bfloat16, "other": torch.float32}),
    ],
)
def test_buffers_kept_in_fp32(keep, want, tmp_path):
    extra = {} if keep is None else {"data_types": {"keep_in_fp32_modules": keep}}
    with zswap.Init(cfg(tmp_path, **extra)):
        model = Routed()
    assert dtypes(model) == want


def test_buffer_dtype_casts_the_rest_at_initialize_and_kept_ones_come_back_to_fp32(tmp_path):
    with zswap.Init(cfg(tmp_path)):
        model = Routed()
    model.gate.bias_corr.data = model.gate.bias_corr.data.bfloat16()  # as a model.to(bf16) leaves it
    alias = model.other
    config = {k: v for k, v in cfg(tmp_path, data_types={"buffer_dtype": "fp16"}).items() if k != "optimizer"}
    with zswap.initialize(model, config):
        assert dtypes(model) == {"gate.bias_corr": torch.float32, "other": torch.float16}
        assert model.other is alias


@pytest.mark.parametrize(
    ("extra", "message"),
    [
        ({"data_types": {"param_dtype": "fp16"}}, "data_types.param_dtype is 'fp16' but the bf16 / fp16"),
        ({"bf16": {"enabled": False}, "data_types": {"param_dtype": "bf16"}}, "they make the params fp32"),
        ({"data_types": {"param_dtype": "int8"}}, "data_types.param_dtype must be a floating-point dtype"),
        ({"data_types": {"buffer_dtype": "int8"}}, "data_types.buffer_dtype"),
        ({"data_types": {"keep_in_fp32_modules": [1]}}, "data_types.keep_in_fp32_modules"),
        ({"data_types": {"grad_acc_dtype": "fp32"}}, "unknown key 'grad_acc_dtype' in data_types"),
    ],
)
def test_data_types_refused(extra, message, tmp_path):
    with pytest.raises(ConfigError, match=message.replace("(", r"\(")):
        zswap.load_config(cfg(tmp_path, **extra))


def test_data_types_read_and_written_back(tmp_path):
    given = {"param_dtype": "bfloat16", "grad_accum_dtype": "torch.float32", "keep_in_fp32_modules": []}
    config = zswap.load_config(cfg(tmp_path, data_types=given))
    assert (config.data_types.param_dtype, config.data_types.grad_accum_dtype) == ("bf16", "fp32")
    assert config.data_types.keep_in_fp32_modules == ()
    assert zswap.load_config(config.to_dict()) == config


@pytest.mark.parametrize(
    ("device", "gas", "asked", "refused"),
    [
        ("cpu", 2, "fp16", "sums the gradients of torch.bfloat16 params on the CPU in torch.bfloat16"),
        ("cpu", 2, "fp32", None),  # summed in float32 (`test_fp32_accumulation_on_the_cpu_…`)
        ("cpu", 2, "bf16", None),
        ("cpu", 1, "fp32", None),  # nothing is summed
        ("standin", 2, "fp32", None),
        ("standin", 2, "bf16", "from a compute device in torch.float32 over the 2 micro-batches"),
    ],
)
def test_grad_accum_dtype_must_be_what_zswap_sums_in(device, gas, asked, refused, tmp_path):
    config = cfg(tmp_path, gradient_accumulation_steps=gas, data_types={"grad_accum_dtype": asked})
    with zswap.Init(config):
        model = nn.Linear(4, 4)
    dev = StandInDevice() if device == "standin" else "cpu"
    if refused is None:
        zswap.initialize(model, config, device=dev).close()
        return
    with pytest.raises(ConfigError, match=refused + r".*drop data_types.grad_accum_dtype or set it to fp32"):
        zswap.initialize(model, config, device=dev)
    zswap.initialize(model, cfg(tmp_path), device=dev).close()  # the failed one left nothing wired


def _accumulated(
    tmp_path: Any, device: Any, offload: str, clip: float | None, early: bool, **types: Any
) -> tuple[list[torch.Tensor], list[torch.Tensor], dict[str, Any]]:
    """bf16 params, GAS 2: the params' values and fp32 masters after 3 steps, and the stats."""
    path = tmp_path / f"{len(list(tmp_path.iterdir()))}"
    path.mkdir()
    config = cfg(path, gradient_accumulation_steps=2, data_types=types)
    config["zero_optimization"]["offload_optimizer"] = {"device": offload, "nvme_path": str(path)}
    config["zero_optimization"]["stage3_param_persistence_threshold"] = 0
    if clip is not None:
        config["gradient_clipping"] = clip
    torch.manual_seed(0)
    with zswap.Init(config):
        model = nn.Sequential(nn.Linear(16, 32), nn.GELU(), nn.Linear(32, 16))
    with zswap.initialize(model, config, device=device) as engine:
        engine.early_step = early
        for s in range(6):
            torch.manual_seed(s)
            x = torch.randn(4, 16, dtype=torch.bfloat16)
            engine.backward(engine(x).float().pow(2).mean())
            engine.step()
        stats = engine.stats()
        with zswap.GatheredParameters(list(model.parameters())):
            values = [p.detach().clone() for p in model.parameters()]
        masters = [safe_get_full_fp32_param(p) for p in model.parameters()]
    return values, masters, stats


@pytest.mark.parametrize("offload", ["nvme", "cpu"])
@pytest.mark.parametrize("clip", [None, 1e-3])
def test_fp32_accumulation_on_the_cpu_is_the_compute_devices(offload, clip, tmp_path):
    """``grad_accum_dtype: fp32`` sums bf16 gradients in float32 on the CPU: bitwise what the stand-in
    device (which always sums them in float32) trains, early step or not; without it the sums are bf16's
    (the values differ)."""
    wide = _accumulated(tmp_path, "cpu", offload, clip, True, grad_accum_dtype="fp32")
    ordinary = _accumulated(tmp_path, "cpu", offload, clip, False, grad_accum_dtype="fp32")
    device = _accumulated(tmp_path, StandInDevice(), offload, clip, True)
    narrow = _accumulated(tmp_path, "cpu", offload, clip, True)
    for other in (ordinary, device):
        assert all(torch.equal(a, b) for a, b in zip(wide[0] + wide[1], other[0] + other[1], strict=True))
    assert not all(torch.equal(a, b) for a, b in zip(wide[1], narrow[1], strict=True))
    assert wide[2]["steps_ordinary"] == 1 and ordinary[2]["steps_ordinary"] == 3, (wide[2], ordinary[2])


def test_hf_batchnorm_from_pretrained_is_the_plain_bf16_load(tmp_path):
    transformers = pytest.importorskip("transformers")
    torch.manual_seed(0)
    conf = transformers.ResNetConfig(embedding_size=8, hidden_sizes=[8, 16], depths=[1, 1], num_labels=3)
    saved = transformers.ResNetForImageClassification(conf)
    for m in saved.modules():
        if isinstance(m, nn.BatchNorm2d):  # values bf16 rounds
            m.running_mean.uniform_(-1, 1)
            m.running_var.uniform_(0.5, 2)
    saved.save_pretrained(tmp_path / "ckpt")
    (tmp_path / "swap").mkdir()
    config = cfg(tmp_path / "swap")
    with zswap.Init(config):
        model = transformers.ResNetForImageClassification.from_pretrained(tmp_path / "ckpt").eval()
    plain = transformers.ResNetForImageClassification.from_pretrained(tmp_path / "ckpt", dtype=torch.bfloat16)
    want = dict(plain.eval().named_buffers())
    assert {n: b.dtype for n, b in model.named_buffers()} == {n: b.dtype for n, b in want.items()}
    assert [n for n, b in model.named_buffers() if not torch.equal(b, want[n])] == []
    x = torch.randn(2, 3, 32, 32, dtype=torch.bfloat16)
    with zswap.initialize(model, config) as engine, torch.no_grad():
        assert torch.equal(engine(pixel_values=x).logits, plain(pixel_values=x).logits)


@pytest.mark.parametrize("arch", ["qwen2", "gemma", "bart", "gpt-neox"])
@pytest.mark.parametrize("how", ["built", "from_pretrained"])
def test_hf_buffers_are_the_plain_bf16_loads(arch, how, tmp_path):
    """Rotary frequencies asked for in float32 stay float32; every buffer the plain load's value."""
    pytest.importorskip("transformers")
    from ._hf_archs import ARCHS

    a = ARCHS[arch]
    torch.manual_seed(0)
    a.build().save_pretrained(tmp_path / "ckpt")
    plain = a.model_class().from_pretrained(tmp_path / "ckpt", dtype=torch.bfloat16)
    with zswap.Init({"offload_param": {"device": "cpu"}, "bf16": {"enabled": True}}):
        torch.manual_seed(0)
        model = a.build() if how == "built" else a.model_class().from_pretrained(tmp_path / "ckpt")
    want = dict(plain.named_buffers())
    assert dtypes(model) == dtypes(plain)
    differ = [n for n, b in model.named_buffers() if b.is_floating_point() and not torch.equal(b, want[n])]
    assert differ == []


@pytest.mark.parametrize("buffer_dtype", [None, "bf16"])
def test_deepspeeds_mixed_precision_end_to_end(buffer_dtype, tmp_path):
    """DeepSpeed's test_mixed_precision_dtype, through `zswap.deepspeed.initialize`: a model built without
    Init gets bf16 params and keeps its float32 buffer (a rotary ``inv_freq``'s stand-in) unless
    ``data_types.buffer_dtype`` asks otherwise."""
    import zswap.deepspeed as deepspeed

    model = nn.Sequential(nn.Linear(16, 16))
    model.register_buffer("inv_freq", torch.ones(16, dtype=torch.float32))
    config: dict[str, Any] = {
        "train_batch_size": 1,
        "optimizer": {"type": "Adam", "params": {"lr": 1e-3, "torch_adam": True}},
        "bf16": {"enabled": True},
        "data_types": {} if buffer_dtype is None else {"buffer_dtype": buffer_dtype},
        "zero_optimization": {"stage": 3, "offload_param": {"device": "nvme", "nvme_path": str(tmp_path)}},
    }
    engine, *_ = deepspeed.initialize(model=model, config=config, model_parameters=model.parameters())
    with engine:
        assert {zswap.param_state(p).dtype for p in model.parameters()} == {torch.bfloat16}
        assert model.inv_freq.dtype == (torch.float32 if buffer_dtype is None else torch.bfloat16)
        out = engine(torch.randn(1, 16, dtype=torch.bfloat16))
        engine.backward(out.float().sum())
        engine.step()
