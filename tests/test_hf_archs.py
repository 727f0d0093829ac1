"""The common Hugging Face architectures under ``zswap.Init``: built, loaded, trained as the plain model.

For each tiny model of `tests._hf_archs.ARCHS` (BERT heads, RoBERTa, ALBERT, DistilBERT, T5, BART, Whisper,
OPT, GPT-NeoX, GPT-J, Falcon, BLOOM, Mistral, Qwen2/3, Gemma/Gemma2, Phi/Phi3, Starcoder2, OLMo2, Mamba,
GPT-OSS, DeepSeek-V3, Qwen3-Next, ModernBERT):

- built under Init, its weights gather to bitwise the same-seed plain build's;
- saved with ``save_pretrained`` (one file, and 20 kB shards with an index) and loaded with its class's
  ``from_pretrained`` under ``Init`` on the cpu and nvme tiers: every param partitioned, gathered weights
  bitwise the plain load's and the files', ties the plain model's, every buffer (persistent or not) the
  plain model's, the forward bitwise the plain model's;
- ``zswap.load_weights`` and ``model.load_state_dict`` into a model built under Init give the same weights;
- ``dtype=`` (bf16/fp16) loads as the plain load does, ``_keep_in_fp32_modules`` included;
- six of them (three with experts in 3-D params) train three steps through ``zswap.initialize`` as the
  plain model does with torch's AdamW;
- BERT's masked-LM head, whose decoder bias transformers pads on tying, resizes as the plain model does.
"""

from __future__ import annotations

import warnings
from pathlib import Path

import pytest
import torch

import zswap
from zswap import Status, param_state

from ._hf_archs import ARCHS, Arch
from ._pretrained import file_tensors, gathered_named, init_for, nvme_training_config

transformers = pytest.importorskip("transformers")

pytestmark = pytest.mark.usefixtures("quiet_transformers")

TIERS = ("cpu", "nvme")


def _save(arch: Arch, path: Path, *, sharded: bool, seed: int = 0) -> Path:
    torch.manual_seed(seed)
    arch.build().save_pretrained(path, max_shard_size="20KB" if sharded else "5GB")
    if sharded:
        assert (path / "model.safetensors.index.json").exists()
    return path


def _ties(model: torch.nn.Module) -> set[frozenset[str]]:
    """The model's params as groups of the names that share one tensor."""
    by_id: dict[int, set[str]] = {}
    for n, p in model.named_parameters(remove_duplicate=False):
        by_id.setdefault(id(p), set()).add(n)
    return {frozenset(names) for names in by_id.values()}


def _different(got: dict[str, torch.Tensor], want: dict[str, torch.Tensor]) -> list[str]:
    assert got.keys() == want.keys()
    return [n for n, t in want.items() if got[n].dtype != t.dtype or not torch.equal(got[n], t)]


def _plain_params(model: torch.nn.Module) -> dict[str, torch.Tensor]:
    return {n: p.detach() for n, p in model.named_parameters(remove_duplicate=False)}


def _assert_partitioned(model: torch.nn.Module, tier: str) -> None:
    loose = [n for n, p in model.named_parameters() if param_state(p) is None]
    assert loose == []
    for p in model.parameters():
        st = param_state(p)
        assert st.status is Status.NOT_AVAILABLE and st.tier == tier and p.numel() == 0


def _logits(model: torch.nn.Module, inputs: dict[str, torch.Tensor]) -> torch.Tensor:
    with torch.no_grad(), zswap.GatheredParameters(list(model.parameters())):
        return model(**inputs).logits


@pytest.mark.parametrize("arch", ARCHS)
def test_built_under_init_is_the_plain_build(arch, tmp_path):
    a = ARCHS[arch]
    torch.manual_seed(0)
    ref = a.build()
    rng = torch.get_rng_state()
    torch.manual_seed(0)
    with init_for("nvme", tmp_path):
        m = a.build()
    assert torch.equal(torch.get_rng_state(), rng)
    _assert_partitioned(m, "nvme")
    assert _ties(m) == _ties(ref)
    assert _different(gathered_named(m), _plain_params(ref)) == []


# Every architecture one file on cpu and sharded on nvme; a few in the other two combinations as well (the
# layout and the tier are independent: the sweep stays fast).
LOADS = [(arch, False, "cpu") for arch in ARCHS] + [(arch, True, "nvme") for arch in ARCHS]
LOADS += [
    (arch, sharded, tier)
    for arch in ("bert-mlm", "t5", "qwen2")
    for sharded, tier in ((False, "nvme"), (True, "cpu"))
]


@pytest.mark.parametrize(
    ("arch", "sharded", "tier"),
    LOADS,
    ids=[f"{a}-{'sharded' if s else 'one-file'}-{t}" for a, s, t in LOADS],
)
def test_from_pretrained_is_the_plain_load(arch, sharded, tier, tmp_path):
    a = ARCHS[arch]
    ckpt = _save(a, tmp_path / "ckpt", sharded=sharded)
    cls = a.model_class()
    ref = cls.from_pretrained(ckpt).eval()
    init = init_for(tier, tmp_path)
    with init:
        m = cls.from_pretrained(ckpt)
    m.eval()
    _assert_partitioned(m, tier)
    if tier == "nvme":
        assert init._placement.store.engine.stats()["bytes_read"] == 0  # nothing gathered while loading
    assert _ties(m) == _ties(ref)
    got = gathered_named(m)
    assert _different(got, _plain_params(ref)) == []
    files = file_tensors(ckpt)
    assert [n for n, t in files.items() if n in got and not torch.equal(got[n], t)] == []
    buffers = dict(m.named_buffers())
    assert _different(buffers, dict(ref.named_buffers())) == []
    ins = a.inputs()
    assert torch.equal(_logits(m, ins), _logits(ref, ins))


@pytest.mark.parametrize("arch", ARCHS)
def test_load_weights_and_load_state_dict_into_a_model_built_under_init(arch, tmp_path):
    a = ARCHS[arch]
    ckpt = _save(a, tmp_path / "ckpt", sharded=True)
    ref = a.model_class().from_pretrained(ckpt).eval()
    want = _plain_params(ref)
    torch.manual_seed(5)  # other weights than the checkpoint's
    with init_for("nvme", tmp_path):
        m = a.build()
        n = a.build()
    missing, unexpected = zswap.load_weights(m, ckpt)
    assert (missing, unexpected) == ([], [])
    assert _different(gathered_named(m), want) == []
    assert _ties(m) == _ties(ref)
    n.load_state_dict(ref.state_dict())
    assert _different(gathered_named(n), want) == []
    ins = a.inputs()
    assert torch.equal(_logits(m.eval(), ins), _logits(ref, ins))


def test_load_weights_resolves_legacy_names_as_from_pretrained(tmp_path):
    # save_pretrained writes GPT-NeoX's head under its legacy name, embed_out (renamed lm_head on load)
    a = ARCHS["gpt-neox"]
    ckpt = _save(a, tmp_path / "ckpt", sharded=False)
    assert "embed_out.weight" in file_tensors(ckpt) and "lm_head.weight" not in file_tensors(ckpt)
    with init_for("cpu", tmp_path):
        m = a.build()
    assert zswap.load_weights(m, ckpt) == ([], [])
    assert torch.equal(gathered_named(m)["lm_head.weight"], file_tensors(ckpt)["embed_out.weight"])


DTYPE_CASES = {
    "t5-bf16": ("t5", torch.bfloat16),
    "t5-fp16": ("t5", torch.float16),  # the wo layers stay float32 (_keep_in_fp32_modules, fp16 only)
    "bart-fp16": ("bart", torch.float16),
    "mistral-bf16": ("mistral", torch.bfloat16),
    "gemma2-bf16": ("gemma2", torch.bfloat16),
    "bert-mlm-fp16": ("bert-mlm", torch.float16),
}


@pytest.mark.parametrize("case", DTYPE_CASES)
def test_dtype_loads_as_the_plain_load(case, tmp_path):
    arch, dtype = DTYPE_CASES[case]
    a = ARCHS[arch]
    ckpt = _save(a, tmp_path / "ckpt", sharded=False)
    ref = a.model_class().from_pretrained(ckpt, dtype=dtype).eval()
    with init_for("nvme", tmp_path):
        m = a.model_class().from_pretrained(ckpt, dtype=dtype)
    want = _plain_params(ref)
    assert {n: param_state(p).dtype for n, p in m.named_parameters(remove_duplicate=False)} == {
        n: t.dtype for n, t in want.items()
    }
    assert _different(gathered_named(m), want) == []
    assert _different(dict(m.named_buffers()), dict(ref.named_buffers())) == []
    if case == "t5-fp16":
        assert {t.dtype for n, t in want.items() if ".wo." in n} == {torch.float32}
    ins = a.inputs()
    assert torch.equal(_logits(m.eval(), ins), _logits(ref, ins))


@pytest.mark.parametrize("arch", ["bert-mlm", "t5", "qwen3-cls", "gpt-oss", "deepseek-v3", "qwen3-next"])
def test_trains_like_the_plain_model_loaded_the_plain_way(arch, tmp_path):
    a = ARCHS[arch]
    ckpt = _save(a, tmp_path / "ckpt", sharded=True)
    cfg = nvme_training_config(tmp_path)
    cls = a.model_class()
    ref = cls.from_pretrained(ckpt).train()
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", zswap.ZswapWarning)
        with zswap.Init(cfg):
            m = cls.from_pretrained(ckpt)
        m.train()
        engine = zswap.initialize(m, cfg)
    ref_opt = torch.optim.AdamW(ref.parameters(), lr=3e-3, betas=(0.8, 0.95), weight_decay=0.1, fused=True)
    ins = a.loss_inputs()
    with engine:
        for step in range(3):
            torch.manual_seed(step)  # the same dropout masks
            loss = m(**ins).loss
            torch.manual_seed(step)
            want = ref(**ins).loss
            assert torch.allclose(loss.detach(), want.detach(), rtol=1e-6, atol=1e-7), (step, loss, want)
            loss.backward()
            want.backward()
            engine.step()
            ref_opt.step()
            ref_opt.zero_grad()
        got = gathered_named(m)
        for n, q in ref.named_parameters():
            assert torch.allclose(got[n], q.data, rtol=1e-6, atol=1e-7), n


def _built_pair(arch: str, tier: str, tmp_path: Path) -> tuple[torch.nn.Module, torch.nn.Module]:
    a = ARCHS[arch]
    torch.manual_seed(0)
    plain = a.build()
    torch.manual_seed(0)
    with init_for(tier, tmp_path):
        m = a.build()
    return plain, m


@pytest.mark.parametrize("tier", TIERS)
def test_resize_token_embeddings_pads_the_tied_bias_of_a_masked_lm_head(tier, tmp_path):
    # tie_weights pads BERT's decoder bias (tied to cls.predictions.bias) to the resized weight's rows
    plain, m = _built_pair("bert-mlm", tier, tmp_path)
    for n in (150, 100):
        torch.manual_seed(n)
        plain.resize_token_embeddings(n)
        torch.manual_seed(n)
        m.resize_token_embeddings(n)
        bias = m.cls.predictions.bias
        assert m.cls.predictions.decoder.bias is bias and param_state(bias).shape == (n,)
        assert param_state(bias).status is Status.NOT_AVAILABLE and bias.numel() == 0
        assert _ties(m) == _ties(plain)
        assert _different(gathered_named(m), _plain_params(plain)) == []
    ins = {"input_ids": torch.randint(0, 100, (2, 10), generator=torch.Generator().manual_seed(2))}
    assert torch.equal(_logits(m.eval(), ins), _logits(plain.eval(), ins))


def test_resize_after_initialize_trains_a_masked_lm_like_plain(tmp_path):
    cfg = nvme_training_config(tmp_path)
    plain, m = _built_pair("bert-mlm", "nvme", tmp_path)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", zswap.ZswapWarning)
        engine = zswap.initialize(m, cfg)
    with engine:
        torch.manual_seed(7)
        plain.resize_token_embeddings(150)
        torch.manual_seed(7)
        m.resize_token_embeddings(150)
        assert param_state(m.cls.predictions.bias).shape == (150,)
        ref_opt = torch.optim.AdamW(
            plain.parameters(), lr=3e-3, betas=(0.8, 0.95), weight_decay=0.1, fused=True
        )
        ids = torch.randint(0, 150, (2, 10), generator=torch.Generator().manual_seed(4))
        for step in range(3):
            torch.manual_seed(step)
            loss = m(input_ids=ids, labels=ids).loss
            torch.manual_seed(step)
            want = plain(input_ids=ids, labels=ids).loss
            assert torch.allclose(loss.detach(), want.detach(), rtol=1e-6, atol=1e-7), (step, loss, want)
            loss.backward()
            want.backward()
            engine.step()
            ref_opt.step()
            ref_opt.zero_grad()
        got = gathered_named(m)
        far = [
            n for n, p in plain.named_parameters() if not torch.allclose(got[n], p.data, rtol=1e-6, atol=1e-7)
        ]
        assert far == []


def test_padding_a_partitioned_bias_under_an_open_engine_is_refused(tmp_path):
    _, m = _built_pair("bert-mlm", "cpu", tmp_path)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", zswap.ZswapWarning)
        engine = zswap.initialize(m, {"zero_optimization": {"offload_param": {"device": "cpu"}}})
    with engine:
        m.tie_weights()  # as built: the real shapes agree, nothing to pad
        before = gathered_named(m)
        decoder = m.cls.predictions.decoder
        decoder.weight = m.bert.encoder.layer[0].intermediate.dense.weight  # 64 rows, against 128 entries
        with pytest.raises(
            zswap.ZswapError, match=r"cannot pad the bias of params an open zswap Engine runs"
        ):
            m._adjust_bias(decoder, m.get_input_embeddings())
        assert param_state(m.cls.predictions.bias).shape == (128,)
        assert torch.equal(gathered_named(m)["cls.predictions.bias"], before["cls.predictions.bias"])
