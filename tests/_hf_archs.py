"""Tiny Hugging Face models of the common architectures, built from config objects (nothing is downloaded).

Each entry of `ARCHS` is an `Arch`: the model class name, its config, and the inputs of one forward. Sizes
are the smallest that still exercise each architecture (2 layers, hidden 32, vocabulary 128), so a whole
sweep stays fast; token ids are set inside the vocabulary.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch

VOCAB = 128
COMMON = {"vocab_size": VOCAB, "max_position_embeddings": 64}
DECODER = {
    **COMMON,
    "hidden_size": 32,
    "intermediate_size": 64,
    "num_hidden_layers": 2,
    "num_attention_heads": 4,
    "bos_token_id": 0,
    "eos_token_id": 0,
    "pad_token_id": 0,
}


@dataclass(frozen=True)
class Arch:
    cls: str
    """The transformers model class."""
    config: Callable[[Any], Any]
    """``transformers -> config``."""
    seq2seq: bool = False
    speech: int = 0
    """Mel bins of a speech encoder's input features (0: the encoder reads token ids)."""

    def build(self) -> Any:
        import transformers

        return getattr(transformers, self.cls)(self.config(transformers))

    def model_class(self) -> Any:
        import transformers

        return getattr(transformers, self.cls)

    def inputs(self, seed: int = 1) -> dict[str, torch.Tensor]:
        g = torch.Generator().manual_seed(seed)
        ids = torch.randint(3, VOCAB, (2, 10), generator=g)
        out = {"input_ids": ids}
        if self.speech:  # 2 x max_source_positions frames (the encoder's convolutions halve them)
            out = {"input_features": torch.randn(2, self.speech, 32, generator=g)}
        if self.seq2seq:
            out["decoder_input_ids"] = torch.randint(3, VOCAB, (2, 6), generator=g)
        return out

    def loss_inputs(self, seed: int = 1) -> dict[str, torch.Tensor]:
        """Inputs of a forward that returns a loss (labels shaped as the head wants them)."""
        ins = self.inputs(seed)
        if self.cls.endswith("SequenceClassification"):
            return {**ins, "labels": torch.tensor([0, 2])}
        if self.seq2seq:
            first = "input_features" if self.speech else "input_ids"
            return {first: ins[first], "labels": ins["decoder_input_ids"]}
        return {**ins, "labels": ins["input_ids"]}


def _bert(t: Any, **kw: Any) -> Any:
    return t.BertConfig(
        **COMMON, hidden_size=32, num_hidden_layers=2, num_attention_heads=4, intermediate_size=64, **kw
    )


ARCHS: dict[str, Arch] = {
    # masked LM: decoder weight tied to the word embeddings, decoder bias tied to cls.predictions.bias;
    # position_ids / token_type_ids are non-persistent buffers
    "bert-mlm": Arch("BertForMaskedLM", lambda t: _bert(t)),
    "bert-cls": Arch("BertForSequenceClassification", lambda t: _bert(t, num_labels=3)),
    # encoder-decoder: shared embedding tied into encoder, decoder and lm_head; _keep_in_fp32_modules = ["wo"]
    "t5": Arch(
        "T5ForConditionalGeneration",
        lambda t: t.T5Config(
            vocab_size=VOCAB,
            d_model=32,
            d_kv=8,
            d_ff=64,
            num_layers=2,
            num_decoder_layers=2,
            num_heads=4,
            decoder_start_token_id=0,
            relative_attention_num_buckets=8,
            relative_attention_max_distance=16,
        ),
        seq2seq=True,
    ),
    # encoder-decoder with a persistent buffer (final_logits_bias) and learned positions (offset 2)
    "bart": Arch(
        "BartForConditionalGeneration",
        lambda t: t.BartConfig(
            **COMMON,
            d_model=32,
            encoder_layers=2,
            decoder_layers=2,
            encoder_attention_heads=4,
            decoder_attention_heads=4,
            encoder_ffn_dim=64,
            decoder_ffn_dim=64,
        ),
        seq2seq=True,
    ),
    "opt": Arch(
        "OPTForCausalLM",
        lambda t: t.OPTConfig(
            **COMMON,
            hidden_size=32,
            num_hidden_layers=2,
            ffn_dim=64,
            num_attention_heads=4,
            word_embed_proj_dim=32,
        ),
    ),
    # untied head; rotary inv_freq buffer
    "gpt-neox": Arch(
        "GPTNeoXForCausalLM",
        lambda t: t.GPTNeoXConfig(
            **COMMON, hidden_size=32, num_hidden_layers=2, num_attention_heads=4, intermediate_size=64
        ),
    ),
    "falcon": Arch(
        "FalconForCausalLM",
        lambda t: t.FalconConfig(
            **COMMON,
            hidden_size=32,
            num_hidden_layers=2,
            num_attention_heads=4,
            bos_token_id=0,
            eos_token_id=0,
            new_decoder_architecture=True,
            num_kv_heads=2,
        ),
    ),
    "bloom": Arch(
        "BloomForCausalLM",
        lambda t: t.BloomConfig(
            vocab_size=VOCAB, hidden_size=32, n_layer=2, n_head=4, bos_token_id=0, eos_token_id=0
        ),
    ),
    "mistral": Arch("MistralForCausalLM", lambda t: t.MistralConfig(**DECODER, num_key_value_heads=2)),
    "qwen2": Arch(
        "Qwen2ForCausalLM",
        lambda t: t.Qwen2Config(**DECODER, num_key_value_heads=2, tie_word_embeddings=True),
    ),
    # q_norm / k_norm per layer
    "qwen3": Arch("Qwen3ForCausalLM", lambda t: t.Qwen3Config(**DECODER, num_key_value_heads=2, head_dim=8)),
    "qwen3-cls": Arch(
        "Qwen3ForSequenceClassification",
        lambda t: t.Qwen3Config(**DECODER, num_key_value_heads=2, head_dim=8, num_labels=3),
    ),
    # embeddings scaled by a normalizer computed in forward; tied head
    "gemma": Arch("GemmaForCausalLM", lambda t: t.GemmaConfig(**DECODER, num_key_value_heads=2, head_dim=8)),
    # sliding-window layers, logit soft-capping
    "gemma2": Arch(
        "Gemma2ForCausalLM",
        lambda t: t.Gemma2Config(
            **DECODER, num_key_value_heads=2, head_dim=8, query_pre_attn_scalar=8, sliding_window=4
        ),
    ),
    # partial rotary, biased untied head
    "phi": Arch("PhiForCausalLM", lambda t: t.PhiConfig(**DECODER)),
    # fused qkv_proj and gate_up_proj
    "phi3": Arch("Phi3ForCausalLM", lambda t: t.Phi3Config(**DECODER)),
    # positions offset past the padding index
    "roberta-mlm": Arch(
        "RobertaForMaskedLM",
        lambda t: t.RobertaConfig(
            **COMMON, hidden_size=32, num_hidden_layers=2, num_attention_heads=4, intermediate_size=64
        ),
    ),
    # one layer's params shared by every layer; factorised embeddings (16 -> 32)
    "albert-mlm": Arch(
        "AlbertForMaskedLM",
        lambda t: t.AlbertConfig(
            **COMMON,
            embedding_size=16,
            hidden_size=32,
            num_hidden_layers=2,
            num_attention_heads=4,
            intermediate_size=64,
        ),
    ),
    # sinusoidal position embeddings: a param _init_weights fills
    "distilbert-mlm": Arch(
        "DistilBertForMaskedLM",
        lambda t: t.DistilBertConfig(
            **COMMON, n_layers=2, n_heads=4, dim=32, hidden_dim=64, sinusoidal_pos_embds=True
        ),
    ),
    # sin/cos position table as a buffer, partial rotary
    "gpt-j": Arch(
        "GPTJForCausalLM",
        lambda t: t.GPTJConfig(
            vocab_size=VOCAB,
            n_positions=64,
            n_embd=32,
            n_layer=2,
            n_head=4,
            rotary_dim=4,
            bos_token_id=0,
            eos_token_id=0,
        ),
    ),
    "starcoder2": Arch(
        "Starcoder2ForCausalLM", lambda t: t.Starcoder2Config(**DECODER, num_key_value_heads=2)
    ),
    "olmo2": Arch("Olmo2ForCausalLM", lambda t: t.Olmo2Config(**DECODER, num_key_value_heads=2)),
    # a state-space model: A_log, D, convolutions (the slow path without the CUDA kernels)
    "mamba": Arch(
        "MambaForCausalLM",
        lambda t: t.MambaConfig(
            vocab_size=VOCAB,
            hidden_size=32,
            state_size=8,
            num_hidden_layers=2,
            expand=2,
            conv_kernel=4,
            time_step_rank=4,
            bos_token_id=0,
            eos_token_id=0,
            pad_token_id=0,
        ),
    ),
    # speech encoder-decoder: convolutions, a sinusoidal encoder position table filled at init
    "whisper": Arch(
        "WhisperForConditionalGeneration",
        lambda t: t.WhisperConfig(
            vocab_size=VOCAB,
            num_mel_bins=8,
            encoder_layers=2,
            encoder_attention_heads=4,
            decoder_layers=2,
            decoder_attention_heads=4,
            d_model=32,
            encoder_ffn_dim=64,
            decoder_ffn_dim=64,
            max_source_positions=16,
            max_target_positions=32,
            decoder_start_token_id=0,
            pad_token_id=0,
            bos_token_id=0,
            eos_token_id=0,
            suppress_tokens=None,
            begin_suppress_tokens=None,
        ),
        seq2seq=True,
        speech=8,
    ),
    # mixture of experts, all experts in one module's 3-D params; sliding and full attention, sinks
    "gpt-oss": Arch(
        "GptOssForCausalLM",
        lambda t: t.GptOssConfig(
            **{**DECODER, "intermediate_size": 32},
            num_key_value_heads=2,
            head_dim=8,
            num_local_experts=4,
            num_experts_per_tok=2,
            layer_types=["sliding_attention", "full_attention"],
            sliding_window=4,
        ),
    ),
    # multi-head latent attention (low-rank q and kv), a dense first layer, then routed and shared experts
    "deepseek-v3": Arch(
        "DeepseekV3ForCausalLM",
        lambda t: t.DeepseekV3Config(
            **DECODER,
            num_key_value_heads=4,
            moe_intermediate_size=16,
            n_routed_experts=4,
            num_experts_per_tok=2,
            n_group=1,
            topk_group=1,
            first_k_dense_replace=1,
            q_lora_rank=16,
            kv_lora_rank=16,
            qk_rope_head_dim=4,
            qk_nope_head_dim=4,
            v_head_dim=8,
        ),
    ),
    # linear attention (gated delta rule, a causal convolution) beside full attention, experts
    "qwen3-next": Arch(
        "Qwen3NextForCausalLM",
        lambda t: t.Qwen3NextConfig(
            **DECODER,
            num_key_value_heads=2,
            head_dim=8,
            num_experts=4,
            num_experts_per_tok=2,
            moe_intermediate_size=16,
            shared_expert_intermediate_size=16,
            linear_num_value_heads=4,
            linear_num_key_heads=2,
            linear_key_head_dim=8,
            linear_value_head_dim=8,
            layer_types=["linear_attention", "full_attention"],
        ),
    ),
    # encoder with alternating local and global attention, unpadded
    "modernbert": Arch(
        "ModernBertForMaskedLM",
        lambda t: t.ModernBertConfig(
            vocab_size=VOCAB,
            hidden_size=32,
            intermediate_size=64,
            num_hidden_layers=2,
            num_attention_heads=4,
            max_position_embeddings=64,
            pad_token_id=0,
            bos_token_id=1,
            eos_token_id=2,
            cls_token_id=1,
            sep_token_id=2,
        ),
    ),
}
