"""Hugging Face models built under zswap.Init gather to bitwise the weights of a plain build (same seed).

Tiny configs, built from config objects: nothing is downloaded. ``post_init`` initialises every weight
after its module was partitioned (through ``smart_apply``, not ``nn.Module.apply``), and ties embeddings.
"""

from __future__ import annotations

from collections.abc import Callable

import pytest
import torch
from torch import nn

import zswap
import zswap.init as zinit
from zswap import Status, param_state

from ._init_helpers import TIERS, gathered, make_init

transformers = pytest.importorskip("transformers")


pytestmark = pytest.mark.usefixtures("quiet_transformers")


def gpt2() -> nn.Module:
    cfg = transformers.GPT2Config(
        n_layer=2, n_embd=64, n_head=4, vocab_size=128, n_positions=32, bos_token_id=0, eos_token_id=0
    )
    return transformers.GPT2LMHeadModel(cfg)


def llama() -> nn.Module:
    cfg = transformers.LlamaConfig(
        num_hidden_layers=2,
        hidden_size=64,
        intermediate_size=128,
        num_attention_heads=4,
        num_key_value_heads=2,
        vocab_size=128,
        max_position_embeddings=32,
        bos_token_id=0,
        eos_token_id=0,
        tie_word_embeddings=True,
    )
    return transformers.LlamaForCausalLM(cfg)


MODELS = {"gpt2": gpt2, "llama": llama}


def _compare(make: Callable[[], nn.Module], init: zswap.Init) -> nn.Module:
    torch.manual_seed(0)
    ref = make()
    ref_rng = torch.get_rng_state()
    torch.manual_seed(0)
    with init:
        m = make()
    assert torch.equal(torch.get_rng_state(), ref_rng)
    ref_params, params = dict(ref.named_parameters()), dict(m.named_parameters())
    assert list(ref_params) == list(params)
    for p in params.values():
        st = param_state(p)
        assert st is not None and st.status is Status.NOT_AVAILABLE and p.numel() == 0
    names = list(params)
    bad = [
        n
        for n, a, b in zip(names, gathered(ref_params.values()), gathered(params.values()), strict=True)
        if not torch.equal(a, b)
    ]
    assert bad == []
    return m


@pytest.mark.parametrize("tier", TIERS)
@pytest.mark.parametrize("model", MODELS)
def test_bitwise_same_weights_as_a_plain_build(model, tier, tmp_path):
    m = _compare(MODELS[model], make_init(tier, tmp_path))
    assert m.get_output_embeddings().weight is m.get_input_embeddings().weight  # still tied
    assert {param_state(p).tier for p in m.parameters()} == {tier}


@pytest.mark.parametrize("model", MODELS)
def test_post_init_never_holds_the_whole_model(model, monkeypatch, tmp_path):
    # A budget below one param: every weight post_init touches is written back before the next is read.
    monkeypatch.setattr(zinit, "TOUCH_BUDGET_BYTES", 1)
    peak = 0
    real_touch = zinit._InitContext.touch

    def touch(self, items):
        nonlocal peak
        real_touch(self, items)
        peak = max(peak, len(self.touched))

    monkeypatch.setattr(zinit._InitContext, "touch", touch)
    _compare(MODELS[model], make_init("nvme", tmp_path))
    assert 0 < peak <= 2


def test_forward_after_gathering_matches(tmp_path):
    torch.manual_seed(0)
    ref = gpt2().eval()
    init = make_init("nvme", tmp_path)
    torch.manual_seed(0)
    with init:
        m = gpt2().eval()
    ids = torch.randint(0, 128, (2, 8))
    with torch.no_grad(), zswap.GatheredParameters(m.parameters()):
        assert torch.equal(m(ids).logits, ref(ids).logits)


def test_bf16_config_builds_bf16(tmp_path):
    with zswap.Init({"offload_param": {"device": "cpu"}, "bf16": {"enabled": True}}):
        m = llama()
    assert {param_state(p).dtype for p in m.parameters()} == {torch.bfloat16}
    assert torch.get_default_dtype() == torch.float32
