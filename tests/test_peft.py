"""PEFT adapters (LoRA, IA3) on a model built under `zswap.Init`: the frozen base stays offloaded, the
adapters (made by ``get_peft_model`` after the build, partitioned by `zswap.initialize`) train bitwise as on
the plain model with ``clip_grad_norm_`` + ``AdamW(fused=True)`` over the trainable params, and
``save_pretrained`` writes their trained values. PEFT finds GPT-2's Conv1D shapes in ``ds_shape``."""

from __future__ import annotations

import warnings
from pathlib import Path
from typing import Any

import pytest
import torch

import zswap
from zswap.checkpoint import CheckpointMismatchError
from zswap.parts import peft_seam

peft = pytest.importorskip("peft")
transformers = pytest.importorskip("transformers")

pytestmark = pytest.mark.usefixtures("quiet_transformers")

LR = 1e-2


def _llama() -> Any:
    conf = transformers.LlamaConfig(
        vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=2, max_position_embeddings=32,
    )  # fmt: skip
    return transformers.LlamaForCausalLM(conf)


def _llama_classifier() -> Any:
    conf = transformers.LlamaConfig(
        vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=2, max_position_embeddings=32, num_labels=3, pad_token_id=0,
    )  # fmt: skip
    return transformers.LlamaForSequenceClassification(conf)


def _gpt2() -> Any:
    conf = transformers.GPT2Config(
        vocab_size=64, n_positions=32, n_embd=32, n_layer=2, n_head=4, bos_token_id=0, eos_token_id=0,
        resid_pdrop=0, embd_pdrop=0, attn_pdrop=0,
    )  # fmt: skip
    return transformers.GPT2LMHeadModel(conf)


# (base model, adapter config, trainable tensors). GPT-2's Conv1D layers: PEFT reads their real shape
# from ``ds_shape`` (the placeholder's is torch.Size([0])). DoRA (the base weight's norm), PiSSA (an SVD of
# it, the base rewritten to the residual) and a classifier's ``modules_to_save`` copy read the whole base
# weight while ``get_peft_model`` runs: through PEFT's ZeRO-3 seam, which zswap points at its own params
# (`zswap.parts.peft_seam`).
CASES = {
    "llama-lora": (
        _llama,
        lambda: peft.LoraConfig(r=4, lora_alpha=8, target_modules=["q_proj", "v_proj"]),
        8,
    ),
    "llama-dora": (
        _llama,
        lambda: peft.LoraConfig(r=4, target_modules=["q_proj", "v_proj"], use_dora=True),
        12,
    ),
    "llama-pissa": (
        _llama,
        lambda: peft.LoraConfig(r=4, target_modules=["q_proj"], init_lora_weights="pissa"),
        4,
    ),
    "llama-classifier-lora": (
        _llama_classifier,
        lambda: peft.LoraConfig(task_type="SEQ_CLS", r=4, target_modules=["q_proj", "v_proj"]),
        9,  # and the classifier's trainable copy (modules_to_save)
    ),
    "llama-lora-tokens": (  # trainable_token_indices: new rows of the embedding, read from the base weight
        _llama,
        lambda: peft.LoraConfig(r=4, target_modules=["q_proj"], trainable_token_indices=[1, 2, 5]),
        5,
    ),
    "llama-loha": (  # sizes its factors from base_layer.weight.shape (before: IndexError on the placeholder)
        _llama,
        lambda: peft.LoHaConfig(r=4, target_modules=["q_proj", "v_proj"]),
        16,
    ),
    "gpt2-lora": (_gpt2, lambda: peft.LoraConfig(r=4, target_modules=["c_attn"], fan_in_fan_out=True), 4),
    "gpt2-ia3": (
        _gpt2,
        lambda: peft.IA3Config(
            target_modules=["c_attn", "mlp.c_proj"], feedforward_modules=["mlp.c_proj"], fan_in_fan_out=True
        ),
        4,
    ),
}


def _saved_name(name: str) -> str:
    """The key PEFT saves a trainable param under: no adapter name, DoRA's magnitude without ``.weight``, a
    ``modules_to_save`` copy under the module it stands for."""
    name = name.replace(".modules_to_save.default", "").replace(".default", "")
    return name.replace("lora_magnitude_vector.weight", "lora_magnitude_vector")


def _adapted(case: str, config: dict[str, Any] | None) -> Any:
    build, adapter, _ = CASES[case]
    torch.manual_seed(0)
    if config is None:
        model = build()
    else:
        with zswap.Init(config):
            model = build()
    torch.manual_seed(1)  # LoRA's A matrices are random
    return peft.get_peft_model(model, adapter())


@pytest.mark.parametrize("tier", ["cpu", "nvme"])
@pytest.mark.parametrize("case", list(CASES))
def test_adapters_train_bitwise_as_on_the_plain_model_and_save(case, tier, tmp_path: Path):
    cfg = {
        "zero_optimization": {
            "offload_param": {"device": tier, "nvme_path": str(tmp_path)},
            "offload_optimizer": {"device": "nvme", "nvme_path": str(tmp_path)},
        },
        "optimizer": {"type": "AdamW", "params": {"lr": LR, "weight_decay": 0.0}},
        "gradient_clipping": 1.0,
    }
    ref, model = _adapted(case, None), _adapted(case, cfg)
    trainable = [p for p in ref.parameters() if p.requires_grad]
    assert len(trainable) == CASES[case][2]
    ref_opt = torch.optim.AdamW(trainable, lr=LR, weight_decay=0.0, fused=True)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", zswap.ZswapWarning)
        engine = zswap.initialize(model, cfg)
    g = torch.Generator().manual_seed(0)
    with engine:
        assert all(zswap.param_state(p) is not None for p in model.parameters())  # the adapters too
        assert model.get_nb_trainable_parameters() == ref.get_nb_trainable_parameters()  # by ds_numel
        for _ in range(3):
            ids = torch.randint(1, 64, (2, 8), generator=g)
            labels = ids[:, 0] % 3 if "classifier" in case else ids
            loss = model(input_ids=ids, labels=labels).loss
            loss.backward()
            engine.step()
            want = ref(input_ids=ids, labels=labels).loss
            want.backward()
            torch.nn.utils.clip_grad_norm_(trainable, 1.0)
            ref_opt.step()
            ref_opt.zero_grad()
            assert torch.equal(loss.detach(), want.detach())
        stats = engine.stats()  # after the first step, which makes the records: in backward, or at the norm
        assert (
            stats["steps_in_backward"] + stats["steps_deferred"] == 2
        )  # where clipping bit (the classifier)
        named = dict(model.named_parameters())
        with zswap.GatheredParameters(list(named.values())):
            got = {n: p.detach().clone() for n, p in named.items()}
        model.save_pretrained(tmp_path / "adapter")
    assert [n for n, p in ref.named_parameters() if not torch.equal(got[n], p.detach())] == []
    from safetensors.torch import load_file

    saved = load_file(tmp_path / "adapter" / "adapter_model.safetensors")
    adapters = {_saved_name(n): p for n, p in ref.named_parameters() if p.requires_grad}
    assert saved.keys() == adapters.keys()
    for key, value in saved.items():
        assert torch.equal(value, adapters[key].detach()), key


def test_merge_and_unload_inside_gathered_parameters_merges_as_on_the_plain_model(tmp_path: Path):
    """PEFT merges by reading the adapters' and base layers' weights directly: inside
    ``GatheredParameters(..., modifier_rank=0)`` they are whole and the merged weights are written back."""
    cfg = {"zero_optimization": {"offload_param": {"device": "nvme", "nvme_path": str(tmp_path)}}}
    ref, model = _adapted("gpt2-lora", None), _adapted("gpt2-lora", cfg)
    for m in (ref, model):  # adapters that change the output (LoRA's B starts at zero)
        with zswap.GatheredParameters([p for p in m.parameters() if p.requires_grad], modifier_rank=0):
            for n, p in m.named_parameters():
                if "lora_B" in n:
                    torch.nn.init.normal_(p, generator=torch.Generator().manual_seed(len(n)))
    ids = torch.randint(0, 64, (2, 8), generator=torch.Generator().manual_seed(0))
    want = ref.merge_and_unload()
    with zswap.GatheredParameters(list(model.parameters()), modifier_rank=0):
        merged = model.merge_and_unload()
    with zswap.initialize(merged, cfg, optimizer=None):
        got = merged(input_ids=ids).logits
    assert torch.equal(got, want(input_ids=ids).logits)
    assert not any("lora" in n for n, _ in merged.named_parameters())


def _count_gathers(monkeypatch: pytest.MonkeyPatch) -> list[tuple[int, ...]]:
    """The shapes of the params a save gathers whole, as it gathers them (through the bounded save's
    `full_copy` or the state-dict hook's)."""
    import zswap.checkpoint.peft_save as peft_save
    import zswap.checkpoint.statedict as statedict

    gathered: list[tuple[int, ...]] = []
    for mod in (peft_save, statedict):
        real = mod.full_copy

        def counting(p: Any, st: Any, real: Any = real) -> Any:
            gathered.append(tuple(st.shape))
            return real(p, st)

        monkeypatch.setattr(mod, "full_copy", counting)
    return gathered


@pytest.mark.parametrize("case", ["llama-lora", "llama-classifier-lora"])
def test_save_pretrained_gathers_only_what_peft_writes(case, tmp_path: Path, monkeypatch):
    """PEFT builds the adapter file from ``model.state_dict()``, which on a partitioned model gathers every
    param: the whole base in CPU memory to write adapters a thousandth its size. zswap hands PEFT a state
    dict holding only the entries PEFT's own selection picks (`zswap.checkpoint.peft_save`): the same file,
    no base weight gathered."""
    gathered = _count_gathers(monkeypatch)
    cfg = {"zero_optimization": {"offload_param": {"device": "nvme", "nvme_path": str(tmp_path)}}}
    ref, model = _adapted(case, None), _adapted(case, cfg)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", zswap.ZswapWarning)
        engine = zswap.initialize(model, cfg, optimizer=None)  # the adapters partitioned too
    with engine:
        model.save_pretrained(tmp_path / "got")
    ref.save_pretrained(tmp_path / "want")
    trainable = [tuple(p.shape) for p in ref.parameters() if p.requires_grad]
    # The adapters alone (PEFT takes a modules_to_save copy's own state_dict(), which gathers that module):
    # no base weight's shape among them.
    assert set(gathered) == set(trainable) and len(gathered) >= len(trainable)
    from safetensors.torch import load_file

    got, want = (load_file(tmp_path / d / "adapter_model.safetensors") for d in ("got", "want"))
    assert got.keys() == want.keys() and all(torch.equal(got[k], want[k]) for k in want)


def test_an_add_adapter_models_save_pretrained_gathers_only_its_adapter(tmp_path: Path, monkeypatch):
    """transformers' own adapters (``add_adapter``): its ``save_pretrained`` reads them through
    ``get_adapter_state_dict``, which PEFT fills from ``state_dict()`` — the whole base gathered; zswap hands
    it the adapter's entries alone (`zswap.checkpoint.peft_save`): the same file, no base weight gathered."""
    gathered = _count_gathers(monkeypatch)
    cfg = {"zero_optimization": {"offload_param": {"device": "nvme", "nvme_path": str(tmp_path)}}}
    lora = CASES["llama-lora"][1]
    torch.manual_seed(0)
    ref = _llama()
    torch.manual_seed(1)
    ref.add_adapter(lora())
    torch.manual_seed(0)
    with zswap.Init(cfg):
        model = _llama()
    torch.manual_seed(1)
    model.add_adapter(lora())
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", zswap.ZswapWarning)
        engine = zswap.initialize(model, cfg, optimizer=None)
    with engine:
        model.save_pretrained(tmp_path / "got")
    ref.save_pretrained(tmp_path / "want")
    assert set(gathered) == {tuple(p.shape) for p in ref.parameters() if p.requires_grad}
    from safetensors.torch import load_file

    got, want = (load_file(tmp_path / d / "adapter_model.safetensors") for d in ("got", "want"))
    assert got.keys() == want.keys() and all(torch.equal(got[k], want[k]) for k in want)


@pytest.mark.parametrize("case", ["llama-lora", "gpt2-ia3", "llama-lora-tokens"])
def test_merging_gathers_each_layer_as_peft_merges_it(case, tmp_path: Path, monkeypatch):
    """``merge_adapter`` / ``unmerge_adapter`` / ``merge_and_unload`` with no block around them, after
    training: each layer's base weight is gathered, merged and written back (before: PEFT computed on the
    empty placeholders and nothing was merged, silently; trainable tokens' rows were dropped by
    ``merge_and_unload``). It gathers one layer at a time: the modules with nothing to merge, which
    ``merge_and_unload`` visits too (the model itself among them), gather nothing (before: each whole).
    ``save_weights`` of the merged model loads in plain transformers; of the `PeftModel` itself it is a
    `TypeError` naming the ways."""
    blocks: list[int] = []
    real = peft_seam.GatheredParameters

    class Counted(real):  # type: ignore[misc, valid-type]
        def __init__(self, params: Any, **kwargs: Any) -> None:
            blocks.append(len(list(params)))
            super().__init__(params, **kwargs)

    monkeypatch.setattr(peft_seam, "GatheredParameters", Counted)
    cfg = {
        "zero_optimization": {"offload_param": {"device": "nvme", "nvme_path": str(tmp_path)}},
        "optimizer": {"type": "AdamW", "params": {"lr": LR, "weight_decay": 0.0}},
    }
    ref, model = _adapted(case, None), _adapted(case, cfg)
    trainable = [p for p in ref.parameters() if p.requires_grad]
    ref_opt = torch.optim.AdamW(trainable, lr=LR, weight_decay=0.0, fused=True)
    ids = torch.randint(1, 64, (2, 8), generator=torch.Generator().manual_seed(0))
    ids[:, :3] = torch.tensor([1, 2, 5])  # the trainable tokens' (llama-lora-tokens)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", zswap.ZswapWarning)
        engine = zswap.initialize(model, cfg)
    with engine:
        for _ in range(2):  # LoRA's B leaves zero: outputs the merge changes
            model(input_ids=ids, labels=ids).loss.backward()
            engine.step()
            ref(input_ids=ids, labels=ids).loss.backward()
            ref_opt.step()
            ref_opt.zero_grad()
        with torch.no_grad():
            before = model(input_ids=ids).logits
            model.merge_adapter()
            ref.merge_adapter()
            merged_out = model(input_ids=ids).logits
            assert torch.equal(merged_out, ref(input_ids=ids).logits)
            assert not torch.equal(merged_out, before)
            with warnings.catch_warnings():
                warnings.filterwarnings("ignore", "Unmerge result can be inaccurate", UserWarning)  # IA3's
                model.unmerge_adapter()
                ref.unmerge_adapter()
            assert torch.equal(model(input_ids=ids).logits, ref(input_ids=ids).logits)
        with pytest.raises(TypeError, match=r"is a PeftModel.*merge_and_unload\(\)"):
            zswap.save_weights(model, tmp_path / "peft")
        blocks.clear()
        merged, want = model.merge_and_unload(), ref.merge_and_unload()
        assert blocks and max(blocks) <= 3  # a base weight and its adapters, never a container's all
        assert not any(
            k in n for n, _ in merged.named_parameters() for k in ("lora", "ia3", "trainable_tokens")
        )
        with torch.no_grad():
            assert torch.equal(merged(input_ids=ids).logits, want(input_ids=ids).logits)
        zswap.save_weights(merged, tmp_path / "merged")
    assert not (tmp_path / "peft").exists()
    plain = transformers.AutoModelForCausalLM.from_pretrained(tmp_path / "merged")
    with torch.no_grad():
        assert torch.equal(plain(input_ids=ids).logits, want(input_ids=ids).logits)


def test_a_model_with_adapters_saves_its_adapter_not_weights(tmp_path: Path):
    """A model holding PEFT adapters has PEFT's state dict (``base_layer``, the adapters' keys), which no
    ``from_pretrained`` loads as a model: `zswap.save_weights` refuses it however the adapters came (a
    PeftModel, its ``get_base_model()``, transformers' ``add_adapter``), naming ``save_pretrained``; so does
    ``zswap export`` of its checkpoint (before: written, and loaded as a model with random weights)."""
    from zswap.checkpoint import export

    cfg = {
        "zero_optimization": {"offload_param": {"device": "nvme", "nvme_path": str(tmp_path)}},
        "optimizer": {"type": "AdamW", "params": {"lr": LR}},
    }
    model = _adapted("llama-lora", cfg)
    torch.manual_seed(0)
    with zswap.Init(cfg):
        hf = _llama()
    hf.add_adapter(peft.LoraConfig(r=4, target_modules=["q_proj"]))
    for m, kind in (
        (model, "a PeftModel"),
        (model.get_base_model(), "PEFT tuner layers"),
        (hf, "add_adapter"),
    ):
        with pytest.raises(TypeError, match=rf"{kind}.*model\.save_pretrained\(folder\) writes the adapter"):
            zswap.save_weights(m, tmp_path / "w")
    assert not (tmp_path / "w").exists()
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", zswap.ZswapWarning)
        engine = zswap.initialize(model, cfg)
    with engine:
        engine.save_checkpoint(tmp_path / "ckpt")
    with pytest.raises(CheckpointMismatchError, match=r"checkpoint of a PeftModel: .*save_pretrained"):
        export(tmp_path / "ckpt", tmp_path / "out")
    assert not (tmp_path / "out").exists()


def _train_beside(model: Any, engine: zswap.Engine, ref: Any, ref_opt: torch.optim.Optimizer) -> None:
    """Three steps of ``model`` under ``engine`` and of ``ref`` under ``ref_opt``, on the same batches: the
    losses equal bitwise at each."""
    g = torch.Generator().manual_seed(0)
    for _ in range(3):
        ids = torch.randint(1, 64, (2, 8), generator=g)
        loss = model(input_ids=ids, labels=ids).loss
        loss.backward()
        engine.step()
        want = ref(input_ids=ids, labels=ids).loss
        want.backward()
        ref_opt.step()
        ref_opt.zero_grad()
        assert torch.equal(loss.detach(), want.detach())


@pytest.mark.parametrize("kind", ["prompt", "prefix"])
def test_prompt_learning_on_a_bf16_base_stays_float32_as_peft_makes_it(kind, tmp_path: Path):
    """Prompt and prefix tuning's encoders are float32 on a bf16 base (PEFT casts their output): kept so,
    they train bitwise as plain PEFT's on the same bf16 model (before: cast to bf16, other losses)."""
    cfg = {
        "zero_optimization": {"offload_param": {"device": "cpu"}, "offload_optimizer": {"device": "cpu"}},
        "optimizer": {"type": "AdamW", "params": {"lr": LR, "weight_decay": 0.0}},
        "bf16": {"enabled": True},
    }

    def adapter() -> Any:
        if kind == "prompt":
            return peft.PromptTuningConfig(task_type="CAUSAL_LM", num_virtual_tokens=4)
        return peft.PrefixTuningConfig(task_type="CAUSAL_LM", num_virtual_tokens=4)

    torch.manual_seed(0)
    base = _llama()
    for p in base.parameters():
        p.data = p.data.bfloat16()
    torch.manual_seed(1)
    ref = peft.get_peft_model(base, adapter())
    torch.manual_seed(0)
    with zswap.Init(cfg):
        built = _llama()
    torch.manual_seed(1)
    model = peft.get_peft_model(built, adapter())
    ref_opt = torch.optim.AdamW([p for p in ref.parameters() if p.requires_grad], lr=LR, weight_decay=0.0)
    engine = zswap.initialize(model, cfg)
    trained = [n for n, p in model.named_parameters() if p.requires_grad]
    named = dict(model.named_parameters())
    assert trained and {zswap.param_state(named[n]).dtype for n in trained} == {torch.float32}
    with engine:
        _train_beside(model, engine, ref, ref_opt)


def test_adapters_on_a_bf16_base_stay_float32_as_peft_makes_them(tmp_path: Path):
    """PEFT makes its adapters float32 on a bf16 base (and casts their inputs): ``initialize`` partitions
    them so, and they train bitwise as plain PEFT's (before: cast to bf16 with float32 masters). A checkpoint
    of them loads only into float32 adapters, and the refusal says how to build them so."""
    cfg = {
        "zero_optimization": {
            "offload_param": {"device": "nvme", "nvme_path": str(tmp_path)},
            "offload_optimizer": {"device": "nvme", "nvme_path": str(tmp_path)},
        },
        "optimizer": {"type": "AdamW", "params": {"lr": LR, "weight_decay": 0.0}},
        "bf16": {"enabled": True},
    }
    torch.manual_seed(0)
    base = _llama()
    for p in base.parameters():  # the params, not the buffers: Init keeps rotary inv_freq float32 too
        p.data = p.data.bfloat16()
    torch.manual_seed(1)
    ref = peft.get_peft_model(base, CASES["llama-lora"][1]())
    model = _adapted("llama-lora", cfg)
    adapters = [n for n, p in model.named_parameters() if p.requires_grad]
    trainable = [p for p in ref.parameters() if p.requires_grad]
    ref_opt = torch.optim.AdamW(trainable, lr=LR, weight_decay=0.0, fused=True)
    engine = zswap.initialize(model, cfg)
    named = dict(model.named_parameters())
    assert {str(zswap.param_state(named[n]).dtype) for n in adapters} == {"torch.float32"}
    assert zswap.param_state(named["base_model.model.lm_head.weight"]).dtype == torch.bfloat16
    with engine:
        _train_beside(model, engine, ref, ref_opt)
        engine.save_checkpoint(tmp_path / "ckpt")
    again = _adapted("llama-lora", cfg)
    for p in again.parameters():
        if p.requires_grad:
            p.data = p.data.bfloat16()  # as an older zswap cast them
    want_error = (
        r"is float32 \(4, 32\) there, bfloat16 .* here \(to load it, cast the param to float32 before"
    )
    with zswap.initialize(again, cfg) as other, pytest.raises(CheckpointMismatchError, match=want_error):
        other.load_checkpoint(tmp_path / "ckpt")
