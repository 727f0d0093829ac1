"""Checkpoints that need transformers' weight conversions, streamed under ``zswap.Init`` one target at a time.

transformers 5 saves the experts of mixture-of-experts models one tensor per expert (``save_pretrained``
reverses the fusion) and stacks them into one 3-D param on load (``WeightConverter``: ``MergeModulelist``,
``Concatenate``). Tiny Mixtral, Qwen2-MoE, OLMoE and Qwen3-MoE models saved so are loaded with
``from_pretrained`` under ``Init`` (cpu and nvme) and with ``zswap.load_weights``: gathered weights bitwise
a plain ``from_pretrained`` of the same folder, the forward bitwise the plain model's, each conversion
reading only its own source tensors and at most one conversion's result held at a time. A one-to-many
conversion (``Chunk``) streams too; an operation zswap does not know is refused by name, as is one that
fails.
"""

from __future__ import annotations

import os
import re
from pathlib import Path

import pytest
import torch

import zswap
import zswap._hfconv as hfconv
import zswap._stfile as stfile
from zswap import Status, param_state
from zswap.checkpoint import _hf_revert, export

from ._pretrained import file_tensors, gathered_named, init_for
from .test_checkpoint import build, cfg

transformers = pytest.importorskip("transformers")

pytestmark = pytest.mark.usefixtures("quiet_transformers")

SMALL = {
    "vocab_size": 128, "hidden_size": 32, "intermediate_size": 64, "num_hidden_layers": 2,
    "num_attention_heads": 4, "num_key_value_heads": 2, "max_position_embeddings": 64,
    "num_experts_per_tok": 2,
}  # fmt: skip

MOES = {
    "mixtral": lambda: transformers.MixtralForCausalLM(
        transformers.MixtralConfig(**SMALL, num_local_experts=4)
    ),
    "qwen2-moe": lambda: transformers.Qwen2MoeForCausalLM(
        transformers.Qwen2MoeConfig(
            **SMALL, num_experts=4, moe_intermediate_size=16, shared_expert_intermediate_size=32
        )
    ),
    "olmoe": lambda: transformers.OlmoeForCausalLM(  # shares Qwen2-MoE's conversion mapping
        transformers.OlmoeConfig(**SMALL, num_experts=4)
    ),
    "qwen3-moe": lambda: transformers.Qwen3MoeForCausalLM(
        transformers.Qwen3MoeConfig(**SMALL, num_experts=4, moe_intermediate_size=16, head_dim=8)
    ),
}


def _save(model: str, path: Path, *, sharded: bool) -> Path:
    torch.manual_seed(0)
    MOES[model]().save_pretrained(path, max_shard_size="20KB" if sharded else "5GB")
    keys = list(file_tensors(path))
    assert any(re.search(r"\.experts\.\d+\.", k) for k in keys)  # the legacy layout: one tensor per expert
    assert not any(k.endswith(("experts.gate_up_proj", "experts.down_proj")) for k in keys)
    return path


def _plain(path: Path, **kwargs: object) -> torch.nn.Module:
    return transformers.AutoModelForCausalLM.from_pretrained(path, **kwargs).eval()


def _logits(model: torch.nn.Module) -> torch.Tensor:
    ids = torch.randint(0, 128, (2, 9), generator=torch.Generator().manual_seed(3))
    with torch.no_grad(), zswap.GatheredParameters(list(model.parameters())):
        return model(input_ids=ids).logits


def _params(model: torch.nn.Module) -> dict[str, torch.Tensor]:
    return {n: p.detach() for n, p in model.named_parameters(remove_duplicate=False)}


def _different(got: dict[str, torch.Tensor], want: dict[str, torch.Tensor]) -> list[str]:
    assert got.keys() == want.keys()
    return [n for n, t in want.items() if got[n].dtype != t.dtype or not torch.equal(got[n], t)]


class _Watch:
    """Records, for each conversion run for real, which checkpoint tensors it read and how many other
    conversions still held their result when it started."""

    def __init__(self, monkeypatch: pytest.MonkeyPatch) -> None:
        self.groups: list[hfconv._Group] = []
        self.runs: list[tuple[str, list[str], list[str], int]] = []  # (first target, inputs, reads, held)
        self._current: list[str] | None = None
        real_run, real_read = hfconv._Group.run, stfile.read_range
        watch = self

        def run(group: hfconv._Group, meta: bool) -> dict[str, torch.Tensor]:
            if meta:
                watch.groups.append(group)
                return real_run(group, meta)
            held = sum(g.out is not None for g in watch.groups)
            watch._current = reads = []
            try:
                return real_run(group, meta)
            finally:
                watch._current = None
                watch.runs.append((group.first, [k for _, k, _ in group.inputs], reads, held))

        def read_range(entry: stfile.TensorEntry, start: int, out: torch.Tensor) -> None:
            if watch._current is not None:
                watch._current.append(entry.name)
            real_read(entry, start, out)

        monkeypatch.setattr(hfconv._Group, "run", run)
        monkeypatch.setattr(stfile, "read_range", read_range)

    def check(self, n_targets: int) -> None:
        assert len(self.runs) == n_targets  # each converted target converted once
        for first, inputs, reads, held in self.runs:
            assert sorted(reads) == sorted(inputs), first  # only its own sources, each once
            assert held == 0, first  # one conversion's result at a time
        assert all(g.out is None for g in self.groups)  # nothing left behind


def _fused(model: torch.nn.Module) -> list[str]:
    return [
        n for n, _ in model.named_parameters() if n.endswith(("experts.gate_up_proj", "experts.down_proj"))
    ]


@pytest.mark.parametrize("tier", ["cpu", "nvme"])
@pytest.mark.parametrize("sharded", [False, True], ids=["one-file", "sharded"])
@pytest.mark.parametrize("model", MOES)
def test_a_legacy_moe_checkpoint_streams_into_partitions(model, sharded, tier, tmp_path, monkeypatch):
    ckpt = _save(model, tmp_path / "ckpt", sharded=sharded)
    ref = _plain(ckpt)
    watch = _Watch(monkeypatch)
    init = init_for(tier, tmp_path)
    with init:
        m = transformers.AutoModelForCausalLM.from_pretrained(ckpt)
    m.eval()
    for p in m.parameters():
        st = param_state(p)
        assert st is not None and st.status is Status.NOT_AVAILABLE and st.tier == tier and p.numel() == 0
    if tier == "nvme":
        assert init._placement.store.engine.stats()["bytes_read"] == 0
    assert _different(gathered_named(m), _params(ref)) == []
    watch.check(len(_fused(ref)))
    assert torch.equal(_logits(m), _logits(ref))


@pytest.mark.parametrize("model", ["mixtral", "qwen3-moe"])
def test_dtype_casts_the_experts_as_the_plain_load(model, tmp_path):
    ckpt = _save(model, tmp_path / "ckpt", sharded=False)
    ref = _plain(ckpt, dtype=torch.bfloat16)
    with init_for("nvme", tmp_path):
        m = transformers.AutoModelForCausalLM.from_pretrained(ckpt, dtype=torch.bfloat16)
    assert {param_state(p).dtype for p in m.parameters()} == {p.dtype for p in ref.parameters()}
    assert _different(gathered_named(m), _params(ref)) == []
    assert torch.equal(_logits(m.eval()), _logits(ref))


@pytest.mark.parametrize("model", ["mixtral", "qwen2-moe"])
def test_load_weights_converts_a_legacy_folder(model, tmp_path, monkeypatch):
    ckpt = _save(model, tmp_path / "ckpt", sharded=True)
    ref = _plain(ckpt)
    torch.manual_seed(7)
    with init_for("cpu", tmp_path):
        m = MOES[model]()
    watch = _Watch(monkeypatch)
    assert zswap.load_weights(m, ckpt) == ([], [])
    watch.check(len(_fused(ref)))
    assert _different(gathered_named(m), _params(ref)) == []
    assert torch.equal(_logits(m.eval()), _logits(ref))


@pytest.mark.parametrize("sharded", [False, True], ids=["one-file", "sharded"])
@pytest.mark.parametrize("model", MOES)
def test_save_weights_writes_the_layout_save_pretrained_writes(model, sharded, tmp_path, monkeypatch):
    """The experts go back to one tensor per expert, bitwise what ``save_pretrained`` of the same weights
    writes, one param read and reversed at a time; plain ``from_pretrained`` loads it back bitwise."""
    ckpt = _save(model, tmp_path / "ckpt", sharded=False)
    ref = _plain(ckpt)
    with init_for("nvme", tmp_path):
        m = transformers.AutoModelForCausalLM.from_pretrained(ckpt)
    reads: list[list[str]] = []
    real = _hf_revert.Reversal.run

    def run(r: _hf_revert.Reversal, values: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
        reads.append(list(values))
        return real(r, values)

    monkeypatch.setattr(_hf_revert.Reversal, "run", run)
    shard = "20KB" if sharded else "5GB"
    zswap.save_weights(m, tmp_path / "saved", max_shard_size=shard)
    assert reads and all(len(keys) == 1 for keys in reads)  # no conversion of these joins tensors
    ref.save_pretrained(tmp_path / "plain", max_shard_size=shard)
    got, want = file_tensors(tmp_path / "saved"), file_tensors(tmp_path / "plain")
    assert got.keys() == want.keys() == file_tensors(ckpt).keys()
    assert [k for k in want if got[k].dtype != want[k].dtype or not torch.equal(got[k], want[k])] == []
    assert (tmp_path / "saved" / "model.safetensors.index.json").exists() == sharded
    assert _different(_params(_plain(tmp_path / "saved")), _params(ref)) == []


@pytest.mark.parametrize("model", ["mixtral", "qwen2-moe"])
def test_export_reverses_the_conversions_as_save_weights(model, tmp_path):
    """``zswap export`` of a checkpoint writes the files `zswap.save_weights` writes for the same weights,
    byte for byte (the conversions found from the class ``config.json`` names, built on meta), and those
    hold what ``save_pretrained`` writes."""
    m, engine = build(cfg(tmp_path, "nvme", "nvme"), make=MOES[model])
    ids = torch.randint(0, 128, (2, 9), generator=torch.Generator().manual_seed(3))
    with engine:
        m(input_ids=ids, labels=ids).loss.backward()
        engine.step()
        engine.save_checkpoint(tmp_path / "ckpt")
        zswap.save_weights(m, tmp_path / "direct", max_shard_size="20KB")
        m.save_pretrained(tmp_path / "hf")  # the whole model in memory: the reference
    export(tmp_path / "ckpt", tmp_path / "exported", max_shard_size="20KB")
    files = sorted(p.name for p in (tmp_path / "direct").iterdir())
    assert files == sorted(p.name for p in (tmp_path / "exported").iterdir())
    assert "model.safetensors.index.json" in files
    for f in files:
        assert (tmp_path / "direct" / f).read_bytes() == (tmp_path / "exported" / f).read_bytes(), f
    got, want = file_tensors(tmp_path / "exported"), file_tensors(tmp_path / "hf")
    assert got.keys() == want.keys() and any(re.search(r"\.experts\.\d+\.", k) for k in got)
    assert [k for k in want if not torch.equal(got[k], want[k])] == []


def test_a_model_loaded_from_its_own_layout_is_saved_and_exported_in_it(tmp_path):
    """Loaded from a folder that already holds the stacked experts (an older zswap's save_weights), a model
    records no conversion, and ``save_pretrained`` keeps them stacked: so do `zswap.save_weights` and
    ``zswap export`` of its checkpoint, byte for byte alike (the checkpoint says the save did not reverse)."""
    from safetensors.torch import save_file

    torch.manual_seed(0)
    plain = MOES["mixtral"]()
    (tmp_path / "own").mkdir()
    plain.config.save_pretrained(tmp_path / "own")
    own = {k: v.contiguous() for k, v in plain.state_dict().items()}
    save_file(own, tmp_path / "own" / "model.safetensors", metadata={"format": "pt"})
    config = cfg(tmp_path, "nvme", "nvme")
    with init_for("nvme", tmp_path):
        m = transformers.AutoModelForCausalLM.from_pretrained(tmp_path / "own")
    with zswap.initialize(m, config) as engine:
        engine.save_checkpoint(tmp_path / "ckpt")
        zswap.save_weights(m, tmp_path / "direct")
        m.save_pretrained(tmp_path / "hf")
    export(tmp_path / "ckpt", tmp_path / "exported")
    assert file_tensors(tmp_path / "direct").keys() == file_tensors(tmp_path / "hf").keys() == own.keys()
    for f in ("model.safetensors", "config.json"):
        assert (tmp_path / "direct" / f).read_bytes() == (tmp_path / "exported" / f).read_bytes(), f


def test_a_reversal_that_joins_tensors_reads_their_block(tmp_path, monkeypatch):
    """A conversion that splits one checkpoint tensor on load (``Chunk``: a fused qkv) is joined again
    on save, from the tensors of its block read together."""
    ckpt, conv = _qkv_checkpoint(tmp_path / "ckpt")
    _with_mapping(monkeypatch, conv)
    with init_for("cpu", tmp_path):
        m = transformers.AutoModelForCausalLM.from_pretrained(ckpt)
    zswap.save_weights(m, tmp_path / "saved")
    got, want = file_tensors(tmp_path / "saved"), file_tensors(ckpt)
    assert got.keys() == want.keys()
    assert [k for k in want if not torch.equal(got[k], want[k])] == []


def test_load_weights_on_a_plain_module_needs_the_model_names(tmp_path):
    ckpt = _save("mixtral", tmp_path / "ckpt", sharded=False)
    with torch.device("meta"):
        hf = MOES["mixtral"]()

    class Plain(torch.nn.Module):  # the same params, but not a transformers model: no conversion mapping
        def __init__(self) -> None:
            super().__init__()
            self.model = hf.model

    with init_for("cpu", tmp_path):
        m = Plain()
    with pytest.raises(zswap.LoadWeightsError, match=r"missing keys?: .*experts\.gate_up_proj") as info:
        zswap.load_weights(m, ckpt)
    assert any(re.search(r"experts\.0\.", k) for k in info.value.unexpected_keys)


def _qkv_checkpoint(path: Path) -> tuple[Path, object]:
    """A tiny Llama whose attention is saved fused (one qkv tensor per layer), and the converter (Chunk)
    that splits it into q, k, v on load."""
    from safetensors.torch import save_file
    from transformers.core_model_loading import Chunk, WeightConverter

    cfg = transformers.LlamaConfig(
        vocab_size=128, hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=4, max_position_embeddings=64, bos_token_id=0, eos_token_id=0,
        tie_word_embeddings=False,
    )  # fmt: skip
    torch.manual_seed(0)
    sd = {k: v.detach().clone() for k, v in transformers.LlamaForCausalLM(cfg).state_dict().items()}
    for i in range(cfg.num_hidden_layers):
        pre = f"model.layers.{i}.self_attn."
        sd[pre + "qkv_proj.weight"] = torch.cat([sd.pop(pre + f"{x}_proj.weight") for x in "qkv"])
    path.mkdir()
    cfg.save_pretrained(path)
    save_file(sd, path / "model.safetensors", metadata={"format": "pt"})
    conv = WeightConverter(
        "self_attn.qkv_proj.weight",
        ["self_attn.q_proj.weight", "self_attn.k_proj.weight", "self_attn.v_proj.weight"],
        operations=[Chunk(dim=0)],
    )
    return path, conv


def _with_mapping(monkeypatch: pytest.MonkeyPatch, *extra: object) -> None:
    import transformers.modeling_utils as mu

    real = mu.get_model_conversion_mapping
    monkeypatch.setattr(mu, "get_model_conversion_mapping", lambda *a, **k: [*real(*a, **k), *extra])


@pytest.mark.parametrize("tier", ["cpu", "nvme"])
def test_a_one_to_many_conversion_streams_too(tier, tmp_path, monkeypatch):
    ckpt, conv = _qkv_checkpoint(tmp_path / "ckpt")
    _with_mapping(monkeypatch, conv)
    ref = _plain(ckpt)
    watch = _Watch(monkeypatch)
    with init_for(tier, tmp_path):
        m = transformers.AutoModelForCausalLM.from_pretrained(ckpt)
    assert _different(gathered_named(m), _params(ref)) == []
    assert len(watch.runs) == 2  # one per layer: q, k and v from one read of the fused tensor
    for first, inputs, reads, held in watch.runs:
        assert reads == inputs and len(inputs) == 1 and held == 0, first
    assert all(g.out is None for g in watch.groups)
    assert torch.equal(_logits(m.eval()), _logits(ref))


def test_an_operation_zswap_does_not_know_is_refused_by_name(tmp_path, monkeypatch):
    from transformers.core_model_loading import ConversionOps, WeightConverter

    class Doubled(ConversionOps):  # as a quantizer's or a user's op: nothing says it is a pure function
        def convert(self, input_dict, source_patterns, target_patterns, **kwargs):
            return {target_patterns[0]: 2 * next(iter(input_dict.values()))[0]}

    ckpt, _ = _qkv_checkpoint(tmp_path / "ckpt")
    conv = WeightConverter("self_attn.qkv_proj.weight", "self_attn.q_proj.weight", operations=[Doubled()])
    _with_mapping(monkeypatch, conv)
    with (
        pytest.raises(
            zswap.ZswapError, match=r"model\.layers\.0\.self_attn\.qkv_proj\.weight: .*conversion .*\.Doubled"
        ) as info,
        init_for("cpu", tmp_path),
    ):
        transformers.AutoModelForCausalLM.from_pretrained(ckpt)
    assert isinstance(info.value, RuntimeError)
    assert "zswap.save_weights(model, folder)" in str(info.value)  # the way round


def test_a_conversion_that_fails_is_an_error_naming_it(tmp_path, monkeypatch):
    from transformers.core_model_loading import Concatenate, WeightConverter

    ckpt, _ = _qkv_checkpoint(tmp_path / "ckpt")
    conv = WeightConverter(
        "self_attn.qkv_proj.weight", "self_attn.q_proj.weight", operations=[Concatenate(dim=5)]
    )
    _with_mapping(monkeypatch, conv)
    with (
        pytest.raises(
            hfconv.ConversionError,
            match=r"model\.layers\.0\.self_attn\.q_proj\.weight: .*\(Concatenate\) of "
            r"model\.layers\.0\.self_attn\.qkv_proj\.weight failed",
        ),
        init_for("cpu", tmp_path),
    ):
        transformers.AutoModelForCausalLM.from_pretrained(ckpt)


@pytest.mark.dist
def test_two_ranks_each_convert_and_keep_their_slice(tmp_path):
    from .conftest import run_ranks

    _save("mixtral", tmp_path / "ckpt", sharded=True)
    run_ranks(Path(__file__).with_name("_hfconv_dist_worker.py"), tmp_path)


@pytest.mark.slow
@pytest.mark.skipif(not os.path.exists("/proc/self/clear_refs"), reason="needs Linux's /proc/self/clear_refs")
def test_peak_memory_of_a_converted_load_under_init_nvme(tmp_path):
    # A ~270 MiB per-expert Mixtral checkpoint: the load holds one converted param (8 MiB) at a time, within
    # the bound of issue 9 (0.25 x the checkpoint + 300 MiB), never the whole model.
    from .test_pretrained import load_peak_growth

    cfg = transformers.MixtralConfig(
        vocab_size=1024, hidden_size=256, intermediate_size=512, num_hidden_layers=20, num_attention_heads=4,
        num_key_value_heads=4, num_local_experts=8, max_position_embeddings=64,
    )  # fmt: skip
    torch.manual_seed(0)
    transformers.MixtralForCausalLM(cfg).save_pretrained(tmp_path / "big", max_shard_size="64MB")
    size = sum(f.stat().st_size for f in (tmp_path / "big").glob("*.safetensors"))
    grew = load_peak_growth(tmp_path / "big", tmp_path / "swap")
    bound = 0.25 * size + (300 << 20)
    print(f"converted load: peak RSS grew {grew / 2**20:.0f} MiB for {size / 2**20:.0f} MiB")
    assert 0 < grew <= bound, f"peak RSS grew {grew / 2**20:.0f} MiB loading {size / 2**20:.0f} MiB"


def test_a_legacy_state_dict_argument_is_converted_too(tmp_path):
    ckpt = _save("mixtral", tmp_path / "ckpt", sharded=False)
    ref = _plain(ckpt)
    sd = {k: v.clone() for k, v in file_tensors(ckpt).items()}
    with init_for("nvme", tmp_path):
        config = transformers.AutoConfig.from_pretrained(ckpt)
        m = transformers.MixtralForCausalLM.from_pretrained(None, config=config, state_dict=sd)
    assert all(param_state(p) is not None for p in m.parameters())
    assert _different(gathered_named(m), _params(ref)) == []


def test_export_builds_only_a_transformers_model_config_json_names(caplog):
    """``zswap export`` builds the class ``config.json`` names on meta for its conversions: never another
    attribute of transformers, and a config that cannot be built leaves the model's own keys, warned."""
    assert _hf_revert.meta_model(b'{"architectures": ["pipeline"]}') is None
    assert _hf_revert.meta_model(b'{"architectures": ["AutoConfig"]}') is None
    assert _hf_revert.meta_model(b"[1, 2]") is None
    built = _hf_revert.meta_model(
        b'{"architectures": ["MixtralForCausalLM"], "model_type": "mixtral", "hidden_size": 32, '
        b'"intermediate_size": 48, "num_hidden_layers": 1, "num_attention_heads": 4, "vocab_size": 64}'
    )
    assert isinstance(built, transformers.MixtralForCausalLM)
    assert next(built.parameters()).device.type == "meta"
    with caplog.at_level("WARNING", logger="zswap.checkpoint._hf_revert"):
        assert _hf_revert.meta_model(b"not json") is None
        assert (
            _hf_revert.meta_model(b'{"architectures": ["MixtralForCausalLM"], "num_attention_heads": 0}')
            is None
        )
    assert caplog.text.count("could not be built") == 2
