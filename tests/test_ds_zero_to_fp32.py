"""DeepSpeed's ``zero_to_fp32`` over zswap's checkpoints (`zswap.deepspeed.utils.zero_to_fp32`; its
tests/unit/checkpoint/test_shared_weights.py and the conversions of test_zero_optimizer.py, adapted): the
float32 values training goes on from — a bf16 param's master —, every tied name, the buffers; in memory,
written as ``pytorch_model.bin`` or safetensors shards, or loaded into a plain model."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import warnings
from pathlib import Path
from typing import Any

import pytest
import torch
from safetensors.torch import load_file
from torch import nn

import zswap
import zswap.deepspeed as deepspeed
from zswap.checkpoint import CheckpointArgumentError, CheckpointNotFoundError
from zswap.checkpoint._validate import canonical_checksum
from zswap.deepspeed.utils import safe_get_full_fp32_param
from zswap.deepspeed.utils.zero_to_fp32 import (
    convert_zero_checkpoint_to_fp32_state_dict,
    get_fp32_state_dict_from_zero_checkpoint,
    load_state_dict_from_zero_checkpoint,
)


class SharedWeights(nn.Module):
    """DeepSpeed's ModelWithSharedWeights (layer 1 tied to layer 2), with a buffer, a frozen layer and a
    layer whose bias no forward uses (trained, never stepped)."""

    def __init__(self) -> None:
        super().__init__()
        self.layer0 = nn.Linear(10, 10)
        self.layer1 = nn.Linear(20, 20)
        self.layer2 = nn.Linear(30, 30)
        self.layer1.weight = self.layer2.weight
        self.norm = nn.LayerNorm(10)
        self.register_buffer("seen", torch.zeros(3, dtype=torch.int64))
        self.register_buffer("scale", torch.full((2,), 1.5))  # bf16 in a bf16 run
        self.frozen = nn.Linear(4, 4)
        self.frozen.requires_grad_(False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        self.seen += 1
        return self.norm(self.layer0(x)).square().mean() + self.layer2.weight.float().square().mean()


def trained(tmp_path: Path, bf16: bool) -> tuple[nn.Module, Path, dict[str, torch.Tensor]]:
    """The model after two steps, its checkpoint folder, and its params' float32 values (masters)."""
    cfg: dict[str, Any] = {
        "train_micro_batch_size_per_gpu": 2,
        "optimizer": {"type": "AdamW", "params": {"lr": 1e-2}},
        "zero_optimization": {"stage": 3, "offload_param": {"device": "nvme", "nvme_path": str(tmp_path)}},
        "bf16": {"enabled": bf16},
    }
    torch.manual_seed(0)
    model = SharedWeights()
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", zswap.ZswapWarning)
        engine, *_ = deepspeed.initialize(
            config=cfg, model=model, model_parameters=[p for p in model.parameters() if p.requires_grad]
        )
    with engine:
        g = torch.Generator().manual_seed(1)
        for _ in range(2):
            x = torch.randn(4, 10, generator=g).to(torch.bfloat16 if bf16 else torch.float32)
            engine.backward(engine(x))
            engine.step()
        engine.save_checkpoint(tmp_path / "ckpt")
        values = {}
        for name, p in model.named_parameters(remove_duplicate=False):
            got = safe_get_full_fp32_param(p) if p.requires_grad else None
            if got is None:  # frozen: its value, widened
                with zswap.GatheredParameters([p]):
                    got = p.detach().float().clone()
            values[name] = got
    return model, tmp_path / "ckpt", values


@pytest.mark.parametrize("bf16", [False, True], ids=["fp32", "bf16"])
def test_the_state_dict_is_the_float32_values_under_every_name(bf16, tmp_path):
    _, ckpt, values = trained(tmp_path, bf16)
    state = get_fp32_state_dict_from_zero_checkpoint(ckpt)
    plain = SharedWeights().state_dict()
    assert set(state) == {*values, "seen", "scale"} == set(plain)
    for name, value in values.items():
        assert state[name].dtype == torch.float32 and torch.equal(state[name], value), name
    assert state["layer1.weight"] is state["layer2.weight"]  # one tensor, two names
    assert torch.equal(state["seen"], torch.full((3,), 2, dtype=torch.int64))
    # A floating buffer comes back in float32 as DeepSpeed's zero_to_fp32 gives it (saved in bf16 there).
    assert state["scale"].dtype == torch.float32 and torch.equal(state["scale"], torch.full((2,), 1.5))
    fresh = load_state_dict_from_zero_checkpoint(SharedWeights(), ckpt)  # strict
    assert fresh.layer1.weight is fresh.layer2.weight
    assert torch.equal(fresh.layer0.weight, values["layer0.weight"])


def test_excluding_frozen_params_leaves_out_those_that_did_not_require_grad(tmp_path):
    _, ckpt, _ = trained(tmp_path, False)
    state = get_fp32_state_dict_from_zero_checkpoint(ckpt, exclude_frozen_parameters=True, lazy_mode=True)
    assert "frozen.weight" not in state and "frozen.bias" not in state
    assert "layer1.bias" in state  # trained, though no forward used it
    whole = get_fp32_state_dict_from_zero_checkpoint(ckpt)
    assert torch.equal(state["layer0.weight"].contiguous(), whole["layer0.weight"])


@pytest.mark.parametrize("optimizer", [True, False], ids=["config-optimizer", "no-optimizer"])
def test_frozen_is_requires_grad_at_the_save_whatever_the_optimizer_holds(optimizer, tmp_path):
    """DeepSpeed's frozen params are those with ``requires_grad`` False: an optimizer built from the
    config's section holds every param, frozen ones too, and a checkpoint without one still knows which
    were frozen (before: the optimizer's groups decided — all kept, or the call refused)."""
    swap = {"device": "nvme", "nvme_path": str(tmp_path)}
    cfg: dict[str, Any] = {"zero_optimization": {"offload_param": swap}}
    if optimizer:
        cfg["optimizer"] = {"type": "AdamW", "params": {"lr": 1e-2}}
    torch.manual_seed(0)
    model = SharedWeights()
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", zswap.ZswapWarning)
        engine = zswap.initialize(model, cfg)
    with engine:
        if optimizer:
            assert any(p is model.frozen.weight for g in engine.optimizer.param_groups for p in g["params"])
            engine.backward(model(torch.randn(4, 10)))
            engine.step()
        engine.save_checkpoint(tmp_path / "ckpt")
    state = get_fp32_state_dict_from_zero_checkpoint(tmp_path / "ckpt", exclude_frozen_parameters=True)
    whole = get_fp32_state_dict_from_zero_checkpoint(tmp_path / "ckpt")
    assert set(whole) - set(state) == {"frozen.weight", "frozen.bias"}
    # A checkpoint of an older zswap does not record it: its optimizer's groups tell, where it has one.
    path = next((tmp_path / "ckpt").glob("*/manifest.json"))
    manifest = json.loads(path.read_text())
    for spec in manifest["params"]:
        del spec["requires_grad"]
    manifest["checksum"] = {"crc32c": canonical_checksum(manifest)}
    path.write_text(json.dumps(manifest))
    if optimizer:
        old = get_fp32_state_dict_from_zero_checkpoint(tmp_path / "ckpt", exclude_frozen_parameters=True)
        assert set(old) == set(whole)  # the config's optimizer held them all
    else:
        with pytest.raises(CheckpointArgumentError, match="saved without an optimizer"):
            get_fp32_state_dict_from_zero_checkpoint(tmp_path / "ckpt", exclude_frozen_parameters=True)


@pytest.mark.parametrize("safe", [False, True], ids=["bin", "safetensors"])
@pytest.mark.parametrize("shard", ["5GB", "2KB"], ids=["one-file", "shards"])
def test_conversion_writes_what_get_returns(safe, shard, tmp_path):
    _, ckpt, _ = trained(tmp_path, True)
    state = get_fp32_state_dict_from_zero_checkpoint(ckpt)
    out = tmp_path / "out"
    convert_zero_checkpoint_to_fp32_state_dict(ckpt, out, max_shard_size=shard, safe_serialization=safe)
    stem, ext = ("model", "safetensors") if safe else ("pytorch_model", "bin")
    files = sorted(p.name for p in out.iterdir())
    if shard == "5GB":
        assert files == [f"{stem}.{ext}"]
        shards = [out / files[0]]
    else:
        index = json.loads((out / f"{stem}.{ext}.index.json").read_text())
        shards = sorted({out / f for f in index["weight_map"].values()})
        assert len(shards) > 1 and set(index["weight_map"]) == set(state)
    loaded: dict[str, torch.Tensor] = {}
    for f in shards:
        loaded.update(load_file(f) if safe else torch.load(f, weights_only=True))
    assert set(loaded) == set(state) and all(torch.equal(loaded[k], v) for k, v in state.items())


def test_refusals_say_why(tmp_path):
    model, ckpt, _ = trained(tmp_path, False)
    with pytest.raises(zswap.ZswapError, match="loads into a plain model"):
        load_state_dict_from_zero_checkpoint(model, ckpt)
    with pytest.raises(CheckpointNotFoundError, match="checkpoint tag 'nope' does not exist"):
        get_fp32_state_dict_from_zero_checkpoint(ckpt, tag="nope")


def test_the_script_left_in_the_folder_runs_as_deepspeeds(tmp_path):
    """DeepSpeed's ``save_checkpoint`` leaves ``zero_to_fp32.py`` in ``save_dir``, and Hugging Face's docs run
    it there (``python zero_to_fp32.py . OUT``): zswap's does the same work, with DeepSpeed's arguments."""
    _, ckpt, _ = trained(tmp_path, True)
    script = ckpt / "zero_to_fp32.py"
    assert os.access(script, os.X_OK)
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(sys.path)}
    args = [".", str(tmp_path / "out"), "--safe_serialization", "-t", "global_step2"]
    run = subprocess.run(
        [sys.executable, script.name, *args],
        cwd=ckpt, env=env, capture_output=True, text=True, timeout=120,
    )  # fmt: skip
    assert run.returncode == 0, run.stderr
    state = get_fp32_state_dict_from_zero_checkpoint(ckpt)
    loaded = load_file(tmp_path / "out" / "model.safetensors")
    assert set(loaded) == set(state) and all(torch.equal(loaded[k], v) for k, v in state.items())
    bad = subprocess.run(
        [sys.executable, script.name, ".", str(tmp_path / "out2"), "--tag", "nope"],
        cwd=ckpt, env=env, capture_output=True, text=True, timeout=120,
    )  # fmt: skip
    assert bad.returncode == 1 and bad.stderr.startswith("zero_to_fp32.py: error: ")
    assert "checkpoint tag 'nope' does not exist" in bad.stderr and "Traceback" not in bad.stderr
    assert not (tmp_path / "out2").exists()
