"""End to end: a tiny GPT-2 built under ``Init(nvme)`` and trained through ``initialize`` with an AdamW
config (optimizer states on NVMe too) gives the losses and weights of the plain model trained with
``torch.optim.AdamW``, within rtol 1e-6 / atol 1e-7 at every step.

The reference is ``torch.optim.AdamW(fused=True)``, whose CPU kernel zswap's matches bit for bit. torch's
default (for-loop) implementation takes ``sqrt`` from MKL's vector library, which is not correctly rounded
(about 1 element in 5 differs by an ulp): an element whose gradient is near ``eps`` turns such a 1-ulp
difference into a visibly different update, so after a few steps a handful of weights drift apart by
~1e-5 — between any two AdamW implementations, including torch's own fused and for-loop ones."""

from __future__ import annotations

import warnings

import pytest
import torch

import zswap

pytest.importorskip("transformers")

from .test_hf_models import MODELS

pytestmark = pytest.mark.usefixtures("quiet_transformers")

RTOL, ATOL = 1e-6, 1e-7


def _config(tmp_path, **extra) -> dict:
    return {
        "zero_optimization": {
            "stage": 3,
            "offload_param": {"device": "nvme", "nvme_path": str(tmp_path)},
            "offload_optimizer": {"device": "nvme", "nvme_path": str(tmp_path)},
            "stage3_param_persistence_threshold": 0,
            "sub_group_size": 5000,  # several sub-groups, so the pipelined walk is exercised
        },
        "optimizer": {"type": "AdamW", "params": {"lr": 3e-3, "betas": [0.8, 0.95], "weight_decay": 0.1}},
        "train_batch_size": "auto",
        **extra,
    }


def _close(a: torch.Tensor, b: torch.Tensor) -> bool:
    return torch.allclose(a, b, rtol=RTOL, atol=ATOL)


@pytest.mark.parametrize("clip", [None, 0.05])
def test_gpt2_trains_like_torch_adamw(clip, tmp_path):
    cfg = _config(tmp_path, **({"gradient_clipping": clip} if clip else {}))
    torch.manual_seed(0)
    ref = MODELS["gpt2"]()
    torch.manual_seed(0)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", zswap.ZswapWarning)
        with zswap.Init(cfg):
            m = MODELS["gpt2"]()
        engine = zswap.initialize(m, cfg)
    ref_opt = torch.optim.AdamW(ref.parameters(), lr=3e-3, betas=(0.8, 0.95), weight_decay=0.1, fused=True)
    ids = torch.randint(0, 128, (2, 12), generator=torch.Generator().manual_seed(1))
    clipped = False
    with engine:
        assert isinstance(engine.optimizer, zswap.optim.OffloadedAdamW)
        for step in range(5):
            torch.manual_seed(step)  # the same dropout masks in both
            loss = m(input_ids=ids, labels=ids, use_cache=False).loss
            torch.manual_seed(step)
            want = ref(input_ids=ids, labels=ids, use_cache=False).loss
            assert _close(loss.detach(), want.detach()), (step, float(loss), float(want))
            loss.backward()
            want.backward()
            if clip:
                norm = torch.nn.utils.clip_grad_norm_(ref.parameters(), clip)
                clipped |= bool(norm > clip)
            engine.step()
            ref_opt.step()
            ref_opt.zero_grad()
            if clip:
                assert engine.last_grad_norm == pytest.approx(float(norm), rel=1e-5)
        assert all(zswap.full_grad(p) is None for p in m.parameters())  # step() cleared them
        with zswap.GatheredParameters(list(m.parameters())):
            names = [n for n, _ in ref.named_parameters()]
            for name, p, q in zip(names, m.parameters(), ref.parameters(), strict=True):
                assert _close(p.data, q.data), (name, float((p.data - q.data).abs().max()))
    assert clipped or not clip  # the clipping case really clipped


def test_lr_auto_needs_a_value_where_the_optimizer_is_built(tmp_path):
    cfg = _config(tmp_path)
    cfg["optimizer"]["params"]["lr"] = "auto"
    zswap.load_config(cfg)  # fine to load
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", zswap.ZswapWarning)
        with zswap.Init(cfg):
            m = torch.nn.Linear(4, 4)
    with pytest.raises(zswap.ConfigError, match=r"optimizer\.params\.lr"):
        zswap.initialize(m, cfg)
    with pytest.raises(zswap.ConfigError, match=r"optimizer section \(AdamW\) and optimizer= was passed too"):
        zswap.initialize(m, cfg, optimizer=torch.optim.SGD(m.parameters(), lr=0.1))  # the section is read
    del cfg["optimizer"]
    with zswap.initialize(m, cfg, optimizer=torch.optim.SGD(m.parameters(), lr=0.1)) as engine:
        assert isinstance(engine.optimizer, torch.optim.SGD)


def test_fp16_overflow_skips_the_step_before_any_state_is_read(tmp_path):
    cfg = {"offload_param": {"device": "cpu"}, "fp16": {"enabled": True}}
    with zswap.Init(cfg):
        m = torch.nn.Linear(8, 8)
    opt = zswap.optim.OffloadedAdamW(m.parameters(), lr=0.1)
    with zswap.initialize(m, cfg, optimizer=opt) as engine:
        with zswap.GatheredParameters(list(m.parameters())):
            before = [p.data.clone() for p in m.parameters()]
        x = torch.full((2, 8), 1e4, dtype=torch.float16)
        (m(x).float() * 1e4).sum().backward()  # overflows fp16 gradients
        engine.step()
        assert engine.skipped_steps == 1 and opt.sub_groups == ()  # no state was ever placed or read
        with zswap.GatheredParameters(list(m.parameters())):
            assert all(torch.equal(p.data, b) for p, b in zip(m.parameters(), before, strict=True))
        assert all(zswap.full_grad(p) is None for p in m.parameters())


def test_max_grad_norm_argument_wins_over_the_config(tmp_path):
    cfg = {"offload_param": {"device": "cpu"}, "gradient_clipping": 1.0}
    with zswap.Init(cfg):
        m = torch.nn.Linear(3, 3)
    with zswap.initialize(m, cfg, optimizer=torch.optim.SGD(m.parameters(), lr=0.1), max_grad_norm=0.5) as e:
        assert e.max_grad_norm == 0.5
    with pytest.raises(ValueError, match="max_grad_norm must be a positive number"):
        zswap.initialize(m, cfg, max_grad_norm=-1)
