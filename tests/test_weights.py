"""Weights that leave zswap: `zswap.save_weights` and ``zswap export`` write the Hugging Face layout that
plain safetensors and ``from_pretrained`` read back bitwise; ``state_dict()`` of a partitioned model returns
full values (so ``torch.save`` and ``save_pretrained`` are correct); the optimizer's state_dict works."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import warnings
from pathlib import Path

import pytest
import torch
from safetensors import safe_open
from safetensors.torch import load_file

import zswap
from zswap import GatheredParameters, param_state
from zswap.checkpoint import export

from .test_checkpoint import build, cfg, train
from .test_runtime import MLP, TinyLM

transformers = pytest.importorskip("transformers")
from .test_hf_models import MODELS  # noqa: E402

pytestmark = pytest.mark.usefixtures("quiet_transformers")


def gathered(m: torch.nn.Module) -> dict[str, torch.Tensor]:
    out = {}
    for name, p in m.named_parameters():
        with GatheredParameters([p]):
            out[name] = p.data.clone()
    return out


def trained_hf(tmp_path: Path, kind: str, tier: str = "nvme") -> tuple[torch.nn.Module, zswap.Engine]:
    m, engine = build(cfg(tmp_path, tier, tier), make=MODELS[kind])
    ids = torch.randint(0, 128, (2, 10), generator=torch.Generator().manual_seed(0))
    for _ in range(2):
        m(input_ids=ids, labels=ids).loss.backward()
        engine.step()
    return m, engine


def read_folder(d: Path) -> dict[str, torch.Tensor]:
    index = d / "model.safetensors.index.json"
    files = (
        sorted(set(json.loads(index.read_text())["weight_map"].values()))
        if index.exists()
        else ["model.safetensors"]
    )
    out: dict[str, torch.Tensor] = {}
    for f in files:
        out.update(load_file(d / f))
    return out


@pytest.mark.parametrize("kind", ["gpt2", "llama"])
def test_save_weights_loads_with_plain_transformers(tmp_path, kind):
    m, engine = trained_hf(tmp_path, kind)
    with engine:
        want = gathered(m)
        zswap.save_weights(m, tmp_path / "w")
    with safe_open(str(tmp_path / "w" / "model.safetensors"), "pt") as f:
        assert f.metadata() == {"format": "pt"}
        keys = set(f.keys())
    tied = {"gpt2": "lm_head.weight", "llama": "lm_head.weight"}[kind]
    assert tied not in keys, "a tied weight must be stored once, as transformers does"
    loaded = transformers.AutoModelForCausalLM.from_pretrained(tmp_path / "w")  # no zswap involved
    got = dict(loaded.named_parameters())
    assert got.keys() == want.keys()
    for name, t in want.items():
        assert torch.equal(got[name].data, t), name
    assert loaded.lm_head.weight is loaded.get_input_embeddings().weight


def test_save_weights_matches_transformers_keys_and_shards(tmp_path):
    m, engine = trained_hf(tmp_path, "gpt2", "cpu")
    with engine:
        want = gathered(m)
        zswap.save_weights(m, tmp_path / "w", max_shard_size=40_000)
        zswap.save_weights(m, tmp_path / "bf16", dtype=torch.bfloat16)
    torch.manual_seed(0)
    plain = MODELS["gpt2"]()
    plain.save_pretrained(tmp_path / "hf", max_shard_size=40_000)
    ours = json.loads((tmp_path / "w" / "model.safetensors.index.json").read_text())
    theirs = json.loads((tmp_path / "hf" / "model.safetensors.index.json").read_text())
    assert ours["weight_map"] == theirs["weight_map"]  # same keys, same shard for each
    assert ours["metadata"] == theirs["metadata"]
    assert read_folder(tmp_path / "w").keys() == read_folder(tmp_path / "hf").keys()
    loaded = transformers.AutoModelForCausalLM.from_pretrained(tmp_path / "w")
    for name, p in loaded.named_parameters():
        assert torch.equal(p.data, want[name]), name
    half = load_file(tmp_path / "bf16" / "model.safetensors")
    assert all(t.dtype == torch.bfloat16 for t in half.values())
    assert torch.equal(half["transformer.wte.weight"], want["transformer.wte.weight"].bfloat16())
    assert json.loads((tmp_path / "bf16" / "config.json").read_text())["dtype"] == "bfloat16"


def test_save_weights_of_a_plain_module_and_tied_params(tmp_path):
    m, engine = build(cfg(tmp_path, "nvme"), make=TinyLM)
    with engine:
        want = gathered(m)
        zswap.save_weights(m, tmp_path / "w", max_shard_size="1KB")
    got = read_folder(tmp_path / "w")
    assert "head.weight" not in got and set(got) == set(want) - {"head.weight"} | {"wte.weight"}
    for k, v in got.items():
        assert torch.equal(v, want[k]), k


@pytest.mark.parametrize("shard", ["5GB", 30_000])
def test_export_writes_what_save_weights_writes(tmp_path, shard):
    m, engine = trained_hf(tmp_path, "gpt2")
    with engine:
        engine.save_checkpoint(tmp_path / "ckpt")
        zswap.save_weights(m, tmp_path / "direct", max_shard_size=shard)
        zswap.save_weights(m, tmp_path / "direct16", dtype=torch.float16, max_shard_size=shard)
    export(tmp_path / "ckpt", tmp_path / "exported", max_shard_size=shard)
    export(tmp_path / "ckpt", tmp_path / "exported16", dtype=torch.float16, max_shard_size=shard)
    for a, b in (("direct", "exported"), ("direct16", "exported16")):
        files = sorted(p.name for p in (tmp_path / a).iterdir())
        assert files == sorted(p.name for p in (tmp_path / b).iterdir())
        for f in files:
            assert (tmp_path / a / f).read_bytes() == (tmp_path / b / f).read_bytes(), f"{b}/{f}"


def test_the_config_records_the_dtype_of_the_params_and_the_class_saved(tmp_path):
    """Under ``bf16`` the params are bfloat16 though ``model.config.dtype`` says float32 or nothing:
    ``config.json`` says what the weights are, as ``save_pretrained`` writes it, so a plain
    ``from_pretrained`` builds the bf16 model that was trained (before: float32, other logits); and the
    class saved is the architecture (before: a submodule's folder named its parent's class)."""
    config = {**cfg(tmp_path, "nvme", "nvme"), "bf16": {"enabled": True}}
    m, engine = build(config, make=MODELS["llama"])
    assert m.config.dtype in (None, torch.float32) and m.dtype == torch.bfloat16
    ids = torch.randint(0, 128, (2, 10), generator=torch.Generator().manual_seed(0))
    with engine:
        m(input_ids=ids, labels=ids).loss.backward()
        engine.step()
        with torch.no_grad():
            want = m(input_ids=ids).logits
        zswap.save_weights(m, tmp_path / "direct")
        zswap.save_weights(m.model, tmp_path / "base")  # the class saved, as save_pretrained names it
        engine.save_checkpoint(tmp_path / "ckpt")
        m.save_pretrained(tmp_path / "hf")
    export(tmp_path / "ckpt", tmp_path / "exported")
    assert json.loads((tmp_path / "base" / "config.json").read_text())["architectures"] == ["LlamaModel"]
    for d in ("direct", "exported", "hf", "base"):
        assert json.loads((tmp_path / d / "config.json").read_text())["dtype"] == "bfloat16", d
    for d in ("direct", "exported"):
        assert json.loads((tmp_path / d / "config.json").read_text())["architectures"] == ["LlamaForCausalLM"]
        plain = transformers.AutoModelForCausalLM.from_pretrained(tmp_path / d)
        assert plain.dtype == torch.bfloat16
        with torch.no_grad():
            assert torch.equal(plain(input_ids=ids).logits, want), d


def _cli(*args: str) -> subprocess.CompletedProcess[str]:
    env = {**os.environ, "PYTHONPATH": str(Path(zswap.__file__).parents[1])}
    return subprocess.run(
        [sys.executable, "-m", "zswap.cli", *args], env=env, capture_output=True, text=True, timeout=120
    )


def test_cli_export(tmp_path):
    m, engine = build(cfg(tmp_path, "nvme", "nvme"))
    with engine:
        train(m, engine)
        engine.save_checkpoint(tmp_path / "ckpt", tag="t1")
        zswap.save_weights(m, tmp_path / "direct", dtype=torch.bfloat16)
    r = _cli("export", str(tmp_path / "ckpt"), str(tmp_path / "out"), "--tag", "t1", "--dtype", "bfloat16")
    assert r.returncode == 0, r.stderr
    assert (tmp_path / "out" / "model.safetensors").read_bytes() == (
        tmp_path / "direct" / "model.safetensors"
    ).read_bytes()
    bad = _cli("export", str(tmp_path / "missing"), str(tmp_path / "out2"))
    assert bad.returncode == 1 and "Traceback" not in bad.stderr
    assert bad.stderr.strip().count("\n") == 0 and str(tmp_path / "missing") in bad.stderr
    wrong_tag = _cli("export", str(tmp_path / "ckpt"), str(tmp_path / "out2"), "--tag", "nope")
    assert wrong_tag.returncode == 1 and "'nope' does not exist" in wrong_tag.stderr
    usage = _cli("export", str(tmp_path / "ckpt"), str(tmp_path / "out2"), "--dtype", "int8")
    assert usage.returncode == 2


# -- state_dict of a partitioned model ------------------------------------------------------------------


@pytest.mark.parametrize("tier", ["cpu", "nvme"])
def test_state_dict_returns_full_values(tmp_path, tier):
    torch.manual_seed(0)
    ref = TinyLM()
    m, engine = build(cfg(tmp_path, tier, optimizer=False), make=TinyLM)
    with engine:
        sd = m.state_dict()
        assert sd.keys() == ref.state_dict().keys()
        for k, v in ref.state_dict().items():
            assert torch.equal(sd[k], v), k
        assert all(
            param_state(p).partition_numel and p.numel() == 0
            for p in m.parameters()
            if param_state(p).status.value != "available"
        )
        torch.save(sd, tmp_path / "sd.pt")
        assert torch.equal(torch.load(tmp_path / "sd.pt")["wte.weight"], ref.wte.weight)
        kept = m.state_dict(keep_vars=True)
        assert kept["wte.weight"] is m.wte.weight  # keep_vars: the params themselves


def test_hf_save_pretrained_of_a_partitioned_model_is_correct(tmp_path):
    m, engine = trained_hf(tmp_path, "gpt2")
    with engine:
        want = gathered(m)
        m.save_pretrained(tmp_path / "hf")
    loaded = transformers.AutoModelForCausalLM.from_pretrained(tmp_path / "hf")
    for name, p in loaded.named_parameters():
        assert torch.equal(p.data, want[name]), name


def test_state_dict_under_init_without_engine(tmp_path):
    torch.manual_seed(0)
    ref = MLP()
    torch.manual_seed(0)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", zswap.ZswapWarning)
        with zswap.Init(cfg(tmp_path, "nvme")):
            m = MLP()
    for k, v in ref.state_dict().items():
        assert torch.equal(m.state_dict()[k], v), k


# -- optimizer state_dict on a partitioned model ---------------------------------------------------------


@pytest.mark.parametrize("tier", ["cpu", "nvme"])
def test_optimizer_state_dict_round_trips_on_a_partitioned_model(tmp_path, tier):
    m, engine = build(cfg(tmp_path, tier, tier))
    with engine:
        train(m, engine)
        sd = engine.optimizer.state_dict()
        st = sd["state"][0]
        assert st["exp_avg"].shape == (32 * 12,) and st["exp_avg"].abs().sum() > 0
        _, engine2 = build(cfg(tmp_path, tier, tier), seed=1)
        with engine2:
            engine2.optimizer.load_state_dict(sd)
            sd2 = engine2.optimizer.state_dict()
            assert all(
                torch.equal(sd2["state"][i][k], v) for i in sd["state"] for k, v in sd["state"][i].items()
            )
            bad = {**sd, "state": {0: {**st, "exp_avg": torch.zeros(7), "exp_avg_sq": torch.zeros(7)}}}
            with pytest.raises(ValueError, match=r"its partition on this rank 384; .*save_checkpoint"):
                engine2.optimizer.load_state_dict(bad)
