"""LoRA through PEFT on a model built under `zswap.Init`: the frozen base stays offloaded, the adapters
(made by ``get_peft_model`` after the build, partitioned by `zswap.initialize`) train bitwise as on the plain
model with ``clip_grad_norm_`` + ``AdamW(fused=True)`` over the trainable params, and ``save_pretrained``
writes the adapters' trained values."""

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


def _lora_llama(config: dict[str, Any] | None) -> Any:
    conf = transformers.LlamaConfig(
        vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=2, max_position_embeddings=32,
    )  # fmt: skip
    torch.manual_seed(0)
    if config is None:
        model = transformers.LlamaForCausalLM(conf)
    else:
        with zswap.Init(config):
            model = transformers.LlamaForCausalLM(conf)
    torch.manual_seed(1)  # LoRA's A matrices are random
    lora = peft.LoraConfig(r=4, lora_alpha=8, target_modules=["q_proj", "v_proj"], lora_dropout=0.0)
    return peft.get_peft_model(model, lora)


@pytest.mark.parametrize("tier", ["cpu", "nvme"])
def test_lora_adapters_train_bitwise_as_on_the_plain_model_and_save(tier, tmp_path: Path):
    cfg = {
        "zero_optimization": {
            "offload_param": {"device": tier, "nvme_path": str(tmp_path)},
            "offload_optimizer": {"device": "nvme", "nvme_path": str(tmp_path)},
        },
        "optimizer": {"type": "AdamW", "params": {"lr": LR, "weight_decay": 0.0}},
        "gradient_clipping": 1.0,
    }
    ref, model = _lora_llama(None), _lora_llama(cfg)
    trainable = [p for p in ref.parameters() if p.requires_grad]
    assert len(trainable) == 8  # A and B of q_proj and v_proj in two layers
    ref_opt = torch.optim.AdamW(trainable, lr=LR, weight_decay=0.0, fused=True)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", zswap.ZswapWarning)
        engine = zswap.initialize(model, cfg)
    g = torch.Generator().manual_seed(0)
    with engine:
        assert all(zswap.param_state(p) is not None for p in model.parameters())  # the adapters too
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
    lora = {n: p for n, p in ref.named_parameters() if "lora_" in n}
    assert len(saved) == len(lora) == 8
    for key, value in saved.items():
        assert torch.equal(value, lora[key.replace(".weight", ".default.weight")].detach()), key
