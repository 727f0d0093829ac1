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


def _gpt2() -> Any:
    conf = transformers.GPT2Config(
        vocab_size=64, n_positions=32, n_embd=32, n_layer=2, n_head=4, bos_token_id=0, eos_token_id=0,
        resid_pdrop=0, embd_pdrop=0, attn_pdrop=0,
    )  # fmt: skip
    return transformers.GPT2LMHeadModel(conf)


# (base model, adapter config, trainable tensors). GPT-2's Conv1D layers: PEFT reads their real shape
# from ``ds_shape`` (the placeholder's is torch.Size([0])).
CASES = {
    "llama-lora": (
        _llama,
        lambda: peft.LoraConfig(r=4, lora_alpha=8, target_modules=["q_proj", "v_proj"]),
        8,
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
            ids = torch.randint(0, 64, (2, 8), generator=g)
            loss = model(input_ids=ids, labels=ids).loss
            loss.backward()
            engine.step()
            want = ref(input_ids=ids, labels=ids).loss
            want.backward()
            torch.nn.utils.clip_grad_norm_(trainable, 1.0)
            ref_opt.step()
            ref_opt.zero_grad()
            assert torch.equal(loss.detach(), want.detach())
        assert engine.stats()["steps_in_backward"] == 2  # after the first, which makes the records
        named = dict(model.named_parameters())
        with zswap.GatheredParameters(list(named.values())):
            got = {n: p.detach().clone() for n, p in named.items()}
        model.save_pretrained(tmp_path / "adapter")
    assert [n for n, p in ref.named_parameters() if not torch.equal(got[n], p.detach())] == []
    from safetensors.torch import load_file

    saved = load_file(tmp_path / "adapter" / "adapter_model.safetensors")
    adapters = {n.replace(".default", ""): p for n, p in ref.named_parameters() if p.requires_grad}
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
