"""`zswap.initialize`'s config against what `zswap.Init` did with the model's params: a placement or a dtype
section the built params did not get is refused, naming the key (it used to be accepted and not honoured)."""

from __future__ import annotations

import warnings
from pathlib import Path
from typing import Any

import pytest
import torch
from torch import nn

import zswap
from zswap.parts.params import param_state


def _nvme(path: Path, **extra: Any) -> dict[str, Any]:
    return {"zero_optimization": {"offload_param": {"device": "nvme", "nvme_path": str(path)}}, **extra}


def _built(cfg: dict[str, Any]) -> nn.Module:
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", zswap.ZswapWarning)
        with zswap.Init(cfg):
            return nn.Sequential(nn.Linear(4, 4), nn.Linear(4, 2))


ADVICE = "give zswap.Init and zswap.initialize the same config (or leave the key out of initialize's)"


def test_an_offload_device_other_than_the_built_params_is_refused(tmp_path):
    m = _built(_nvme(tmp_path))
    with pytest.raises(zswap.ConfigError) as e:
        zswap.initialize(m, {"zero_optimization": {"offload_param": {"device": "cpu"}}})
    assert str(e.value) == (
        "zero_optimization.offload_param.device is 'cpu' but 0.weight, 0.bias, 1.weight and 1 more were "
        f"built under zswap.Init on 'nvme', where they stay: {ADVICE}"
    )
    assert all(param_state(p).tier == "nvme" for p in m.parameters())  # nothing changed
    m = _built({"zero_optimization": {"offload_param": {"device": "cpu"}}})
    with pytest.raises(zswap.ConfigError, match=r"device is 'nvme' but .* on 'cpu', where they stay"):
        zswap.initialize(m, _nvme(tmp_path))


def test_another_swap_directory_or_aio_section_is_refused(tmp_path):
    a, b = tmp_path / "a", tmp_path / "b"
    a.mkdir(), b.mkdir()
    m = _built(_nvme(a))
    with pytest.raises(zswap.ConfigError) as e:
        zswap.initialize(m, _nvme(b))
    assert str(e.value) == (
        f"zero_optimization.offload_param.nvme_path is {b} but the params were built under zswap.Init "
        f"swapping to {a}, where they stay: {ADVICE}"
    )
    with pytest.raises(zswap.ConfigError) as e:
        zswap.initialize(m, _nvme(a, aio={"checksum": "crc32c"}))
    assert str(e.value) == (
        "the aio section asks for checksum='crc32c' but the params were built under zswap.Init with "
        f"checksum='off', and their swap engine keeps those settings: {ADVICE}"
    )


@pytest.mark.parametrize("given", ["same", "none", "buffers"])
def test_the_same_placement_or_none_given_is_taken(tmp_path, given):
    """The config Init had, one without offload_param (the model is taken as built), or one that only
    sizes initialize's own buffers (``buffer_count``: initialize's to apply)."""
    m = _built(_nvme(tmp_path, aio={"checksum": "crc32c"}))
    cfg = {
        "same": _nvme(tmp_path, aio={"checksum": "crc32c"}),
        "none": {},
        "buffers": {"zero_optimization": {"offload_param": {"buffer_count": 7}}},
    }[given]
    opt = torch.optim.AdamW(m.parameters(), lr=0.1)
    with zswap.initialize(m, cfg, optimizer=opt) as engine:
        engine.backward(m(torch.randn(3, 4)).sum())
        engine.step()


@pytest.mark.parametrize("section", ["bf16", "fp16"])
def test_a_half_section_over_params_built_in_float32_is_refused(section):
    m = _built({})
    with pytest.raises(zswap.ConfigError) as e:
        zswap.initialize(m, {section: {"enabled": True}})
    assert str(e.value) == (
        f"the config's {section} section is on but every param is float32 (0.weight, 0.bias, 1.weight and 1 "
        f"more; built under a zswap.Init whose config has no {section} section?): the engine would train in "
        "float32, not as the section says. Give zswap.Init the same config as initialize"
    )
    plain = nn.Linear(4, 4)  # not built under Init: initialize partitions it in the section's dtype
    with zswap.initialize(plain, {section: {"enabled": True}}):
        assert param_state(plain.weight).dtype == (torch.bfloat16 if section == "bf16" else torch.float16)
