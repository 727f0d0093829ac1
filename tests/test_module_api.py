"""The module API on a partitioned model works on the partitions or refuses: ``load_state_dict``,
``resize_token_embeddings``, ``.to(dtype)`` and friends, devices, param counts; ``Init(dtype=)`` is a plain
float32 build cast at the end (same seed: bitwise ``plain.to(dtype)``, same random-generator state)."""

from __future__ import annotations

import pytest
import torch
from torch import nn

import zswap
from zswap import Status, ZswapError, param_state

from ._pretrained import gathered_named, init_for
from .test_hf_models import MODELS

TIERS = ("cpu", "nvme")


class Net(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.a = nn.Linear(7, 5)
        self.norm = nn.LayerNorm(5)
        self.b = nn.Linear(5, 3)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.b(torch.relu(self.norm(self.a(x))))


def pair(tier, tmp_path, make=Net, **kwargs):
    """(plain build, the same build under Init) from the same seed."""
    torch.manual_seed(0)
    plain = make()
    torch.manual_seed(0)
    with init_for(tier, tmp_path, **kwargs):
        m = make()
    return plain, m


def same(m: nn.Module, plain: nn.Module) -> list[str]:
    got = gathered_named(m)
    return [n for n, p in plain.named_parameters(remove_duplicate=False) if not torch.equal(got[n], p.data)]


# -- load_state_dict -------------------------------------------------------------------------------


@pytest.mark.parametrize("tier", TIERS)
def test_load_state_dict_writes_into_the_partitions(tier, tmp_path):
    plain, m = pair(tier, tmp_path)
    torch.manual_seed(5)
    sd = Net().state_dict()
    assert m.load_state_dict(sd) == plain.load_state_dict(sd)
    assert same(m, plain) == []
    assert all(param_state(p).status is Status.NOT_AVAILABLE and p.numel() == 0 for p in m.parameters())
    half = {k: v.half() for k, v in sd.items()}  # cast to the param dtype, as torch's copy_
    m.load_state_dict(half)
    plain.load_state_dict(half)
    assert same(m, plain) == []


def test_load_state_dict_strict_errors_are_torchs_with_the_real_shape(tmp_path):
    plain, m = pair("cpu", tmp_path)
    sd = plain.state_dict()
    before = gathered_named(m)
    missing = {k: v for k, v in sd.items() if k != "a.bias"}
    with pytest.raises(RuntimeError, match=r'Missing key\(s\) in state_dict: "a\.bias"'):
        m.load_state_dict({**missing, "zzz": torch.ones(1)})
    res = m.load_state_dict({**missing, "zzz": torch.ones(1)}, strict=False)
    assert (res.missing_keys, res.unexpected_keys) == (["a.bias"], ["zzz"])
    wrong = {**sd, "b.weight": torch.ones(4, 5)}
    with pytest.raises(RuntimeError) as info:
        m.load_state_dict(wrong)
    with pytest.raises(RuntimeError) as plain_info:
        plain.load_state_dict(wrong)
    assert str(info.value) == str(plain_info.value)  # "... the shape in current model is torch.Size([3, 5])."
    assert "torch.Size([3, 5])" in str(info.value)
    assert torch.equal(gathered_named(m)["b.weight"], before["b.weight"])


def test_load_state_dict_assign_is_refused(tmp_path):
    _, m = pair("cpu", tmp_path)
    with pytest.raises(ZswapError, match=r"assign=True\) would replace the partitioned param 'a\.weight'"):
        m.load_state_dict(Net().state_dict(), assign=True)


def test_load_state_dict_after_initialize(tmp_path):
    torch.manual_seed(0)
    plain = Net()
    m = Net()  # built plainly: initialize partitions it
    cfg = {
        "offload_param": {"device": "cpu"},
        "zero_optimization": {"stage3_param_persistence_threshold": 10},
    }
    with zswap.initialize(m, cfg, optimizer=torch.optim.SGD(m.parameters(), lr=0.1)):
        assert {param_state(p).status for p in m.parameters()} == {Status.AVAILABLE, Status.NOT_AVAILABLE}
        x = torch.randn(3, 7)
        with torch.no_grad():
            m(x), m(x)  # traced and prefetching
        m.load_state_dict(plain.state_dict())
        with torch.no_grad():
            assert torch.equal(m(x), plain(x))
    assert same(m, plain) == []


# -- resize_token_embeddings -----------------------------------------------------------------------


@pytest.mark.usefixtures("quiet_transformers")
@pytest.mark.parametrize("mean_resizing", [False, True])
@pytest.mark.parametrize("tier", TIERS)
@pytest.mark.parametrize("model", MODELS)
def test_resize_token_embeddings_after_init(model, tier, mean_resizing, tmp_path):
    plain, m = pair(tier, tmp_path, MODELS[model])
    for n in (150, 100):
        torch.manual_seed(n)
        plain.resize_token_embeddings(n, mean_resizing=mean_resizing)
        want_rng = torch.get_rng_state()
        torch.manual_seed(n)
        m.resize_token_embeddings(n, mean_resizing=mean_resizing)
        assert torch.equal(torch.get_rng_state(), want_rng)
        emb = m.get_input_embeddings()
        st = param_state(emb.weight)
        assert (
            st is not None and st.shape == (n, 64) and st.status is Status.NOT_AVAILABLE and st.tier == tier
        )
        assert m.get_output_embeddings().weight is emb.weight  # still tied: one param
        assert m.config.vocab_size == n and emb.num_embeddings == n
        assert same(m, plain) == []
        assert m.num_parameters() == plain.num_parameters()


def _llama_untied() -> nn.Module:
    import transformers

    m = MODELS["llama"]()
    cfg = m.config
    cfg.tie_word_embeddings = False
    return transformers.LlamaForCausalLM(cfg)


RESIZE_MODELS = {"gpt2": MODELS["gpt2"], "llama-untied": _llama_untied}


def _train_config(tier, tmp_path, with_optimizer):
    swap = tmp_path / "swap"
    swap.mkdir(exist_ok=True)
    z = {
        "stage": 3,
        "offload_param": {"device": tier, "nvme_path": str(swap)},
        "offload_optimizer": {"device": tier, "nvme_path": str(swap)},
        "stage3_param_persistence_threshold": 0,
        "sub_group_size": 5000,
    }
    cfg: dict = {"zero_optimization": z, "train_batch_size": "auto"}
    if with_optimizer:
        cfg["optimizer"] = {
            "type": "AdamW",
            "params": {"lr": 3e-3, "betas": [0.8, 0.95], "weight_decay": 0.1},
        }
    return cfg


def _adamw(params):
    return torch.optim.AdamW(params, lr=3e-3, betas=(0.8, 0.95), weight_decay=0.1, fused=True)


@pytest.mark.usefixtures("quiet_transformers")
@pytest.mark.parametrize(("tier", "opt"), [("nvme", "config"), ("cpu", "torch")])
@pytest.mark.parametrize("model", RESIZE_MODELS)
def test_resize_token_embeddings_after_initialize_trains_like_plain(model, tier, opt, tmp_path):
    # The engine is wired again over the resized params (budgets, hooks, gradient stores); an optimizer
    # without state for them yet lays their state out at the new size on its first step.
    cfg = _train_config(tier, tmp_path, opt == "config")
    plain, m = pair(tier, tmp_path, RESIZE_MODELS[model])
    engine = zswap.initialize(m, cfg, optimizer=None if opt == "config" else _adamw(m.parameters()))
    with engine:
        ids = torch.randint(0, 128, (2, 8), generator=torch.Generator().manual_seed(3))
        with torch.no_grad():
            m(ids)  # traced and prefetching at the old size
        torch.manual_seed(7)
        plain.resize_token_embeddings(150)  # mean_resizing draws from the generator: same draws in both
        torch.manual_seed(7)
        m.resize_token_embeddings(150)
        assert param_state(m.get_input_embeddings().weight).shape == (150, 64)
        assert param_state(m.get_output_embeddings().weight).shape == (150, 64)
        assert (m.get_output_embeddings().weight is m.get_input_embeddings().weight) == (model == "gpt2")
        assert same(m, plain) == []
        assert engine.sizing.total == plain.num_parameters()
        ref_opt = _adamw(plain.parameters())
        ids = torch.randint(0, 150, (2, 8), generator=torch.Generator().manual_seed(4))
        for step in range(3):
            torch.manual_seed(step)
            loss = m(input_ids=ids, labels=ids, use_cache=False).loss
            torch.manual_seed(step)
            want = plain(input_ids=ids, labels=ids, use_cache=False).loss
            assert torch.allclose(loss.detach(), want.detach(), rtol=1e-6, atol=1e-7), (step, loss, want)
            engine.backward(loss)
            want.backward()
            engine.step()
            ref_opt.step()
            ref_opt.zero_grad()
        got = gathered_named(m)
        far = [
            n for n, p in plain.named_parameters() if not torch.allclose(got[n], p.data, rtol=1e-6, atol=1e-7)
        ]
        assert far == []


@pytest.mark.usefixtures("quiet_transformers")
@pytest.mark.parametrize(("tier", "opt"), [("nvme", "config"), ("cpu", "torch")])
def test_resize_after_an_optimizer_step_is_refused_and_changes_nothing(tier, opt, tmp_path):
    cfg = _train_config(tier, tmp_path, opt == "config")
    _, m = pair(tier, tmp_path, MODELS["gpt2"])
    engine = zswap.initialize(m, cfg, optimizer=None if opt == "config" else _adamw(m.parameters()))
    ids = torch.randint(0, 128, (2, 8), generator=torch.Generator().manual_seed(3))
    with engine:
        engine.backward(m(input_ids=ids, labels=ids).loss)
        with pytest.raises(ZswapError, match="while gradients are accumulated"):
            m.resize_token_embeddings(150)
        engine.step()
        before = gathered_named(m)
        with pytest.raises(ZswapError, match=r"optimizer already holds state .* 'transformer.wte.weight'"):
            m.resize_token_embeddings(150)
        assert param_state(m.get_input_embeddings().weight).shape == (128, 64)
        assert m.config.vocab_size == 128
        got = gathered_named(m)
        assert [n for n in before if not torch.equal(before[n], got[n])] == []
        engine.backward(m(input_ids=ids, labels=ids).loss)  # the engine still runs as it was
        engine.step()


@pytest.mark.usefixtures("quiet_transformers")
def test_resize_token_embeddings_after_close_and_initialize_again(tmp_path):
    torch.manual_seed(0)
    plain = MODELS["gpt2"]()
    torch.manual_seed(0)
    m = MODELS["gpt2"]()
    cfg = {"offload_param": {"device": "cpu"}}
    engine = zswap.initialize(m, cfg, optimizer=torch.optim.SGD(m.parameters(), lr=0.1))
    engine.close()
    torch.manual_seed(1)
    plain.resize_token_embeddings(140, mean_resizing=False)
    torch.manual_seed(1)
    m.resize_token_embeddings(140, mean_resizing=False)
    assert param_state(m.get_input_embeddings().weight).shape == (140, 64)
    ids = torch.randint(0, 140, (2, 8))
    with zswap.initialize(m, cfg, optimizer=torch.optim.SGD(m.parameters(), lr=0.1)), torch.no_grad():
        assert torch.equal(m.eval()(ids).logits, plain.eval()(ids).logits)


# -- dtype and device ------------------------------------------------------------------------------


@pytest.mark.parametrize("tier", TIERS)
@pytest.mark.parametrize(
    "convert",
    [
        lambda m: m.to(torch.bfloat16),
        lambda m: m.half(),
        lambda m: m.bfloat16().float(),
        lambda m: m.double(),
        lambda m: m.to(dtype=torch.float16, device="cpu"),
    ],
    ids=["to-bf16", "half", "bf16-float", "double", "to-kw"],
)
def test_dtype_conversion_converts_the_partitions(convert, tier, tmp_path):
    plain, m = pair(tier, tmp_path)
    assert convert(m) is m
    convert(plain)
    want = {p.dtype for p in plain.parameters()}
    assert {param_state(p).dtype for p in m.parameters()} == want == {p.dtype for p in m.parameters()}
    assert same(m, plain) == []
    x = torch.randn(3, 7, dtype=next(iter(want)))
    with zswap.initialize(m, {"offload_param": {"device": tier}}), torch.no_grad():
        assert torch.equal(m(x), plain(x))


def test_hf_model_to_bf16_runs_in_bf16(tmp_path, quiet_transformers):
    plain, m = pair("nvme", tmp_path, MODELS["llama"])
    m.to(torch.bfloat16)
    plain.to(torch.bfloat16)
    assert same(m, plain) == []
    ids = torch.randint(0, 128, (2, 6))
    with zswap.initialize(m, {}), torch.no_grad():
        out = m.eval()(ids).logits
    assert out.dtype == torch.bfloat16 and torch.equal(out, plain.eval()(ids).logits)


@pytest.mark.parametrize("target", ["meta", torch.device("meta")])
def test_moving_to_meta_is_refused_and_changes_nothing(target, tmp_path):
    plain, m = pair("cpu", tmp_path)
    with pytest.raises(ZswapError, match=r"to meta would drop its partitioned weights \(param 'a\.weight'"):
        m.to(target)
    with pytest.raises(ZswapError, match="to meta"):
        m.to(target, torch.bfloat16)
    assert all(p.device.type == "cpu" and param_state(p).dtype == torch.float32 for p in m.parameters())
    assert same(m, plain) == []


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
@pytest.mark.gpu
def test_moving_to_a_gpu_is_refused(tmp_path):
    _, m = pair("cpu", tmp_path)
    with pytest.raises(ZswapError, match="to cuda:0 is not supported yet"):
        m.cuda()


def test_dtype_change_under_an_open_engine_is_refused(tmp_path):
    _, m = pair("cpu", tmp_path)
    with zswap.initialize(m, {}, optimizer=torch.optim.SGD(m.parameters(), lr=0.1)):
        with pytest.raises(ZswapError, match="cannot convert the dtype of params an open zswap Engine runs"):
            m.half()
        # Named, with the way out for a model that converts its own params as it runs (Switch's router).
        linear = next(c for c in m.modules() if isinstance(c, nn.Linear))
        named = r"runs \(weight, bias of a Linear, to torch\.bfloat16\).*call \.to\(torch\.bfloat16\) on that"
        with pytest.raises(ZswapError, match=named):
            linear.to(torch.bfloat16)
        assert {param_state(p).dtype for p in m.parameters()} == {torch.float32}
    m.half()  # closed: fine
    assert {param_state(p).dtype for p in m.parameters()} == {torch.float16}


def test_param_counts(tmp_path):
    plain, m = pair("nvme", tmp_path)
    assert [param_state(p).numel for p in m.parameters()] == [p.numel() for p in plain.parameters()]
    assert all(p.numel() == 0 for p in m.parameters())  # the contract: not gathered, empty data


# -- Init(dtype=) ----------------------------------------------------------------------------------


@pytest.mark.usefixtures("quiet_transformers")
@pytest.mark.parametrize("tier", ("cpu", "none", "nvme"))
@pytest.mark.parametrize(
    "make", [lambda: nn.Linear(64, 32), MODELS["gpt2"], MODELS["llama"]], ids=["linear", *MODELS]
)
def test_init_dtype_is_the_plain_build_cast(make, tier, tmp_path):
    torch.manual_seed(0)
    plain = make()
    rng = torch.get_rng_state()
    buffers = {n: b.clone() for n, b in plain.named_buffers()}
    plain.to(torch.bfloat16)
    torch.manual_seed(0)
    with init_for(tier, tmp_path, dtype=torch.bfloat16):
        m = make()
    assert torch.equal(torch.get_rng_state(), rng)
    assert {param_state(p).dtype for p in m.parameters()} == {torch.bfloat16}
    assert same(m, plain) == []
    assert torch.get_default_dtype() == torch.float32
    # Buffers are not cast (Llama's rotary inv_freq stays float32), as with zero.Init and from_pretrained.
    got = dict(m.named_buffers())
    assert got.keys() == buffers.keys()
    assert all(got[n].dtype == b.dtype and torch.equal(got[n], b) for n, b in buffers.items())


# -- pickling --------------------------------------------------------------------------------------


@pytest.mark.parametrize("tier", TIERS)
def test_pickling_a_partitioned_param_is_refused_not_saved_empty(tier, tmp_path):
    """``torch.save(model)`` wrote each partitioned param's empty placeholder: the file loaded as a model
    without weights and nothing said so. Pickling a managed param is refused (naming the ways that write
    values) unless it is gathered; a plain model, a shallow copy, a deep copy and the state dict behave as
    before."""
    import copy
    import io
    import pickle

    plain, m = pair(tier, tmp_path)
    refused = r"^pickling a param zswap partitioned \(shape \(5, 7\);.*model\.state_dict\(\)"
    for save in (
        lambda: torch.save(m, io.BytesIO()),
        lambda: pickle.dumps(m),
        lambda: torch.save(m.state_dict(keep_vars=True), io.BytesIO()),  # the params themselves
    ):
        with pytest.raises(ZswapError, match=refused):
            save()
    with zswap.GatheredParameters(list(m.parameters())):  # gathered: the full values, as a plain model's
        whole = pickle.loads(pickle.dumps(m))
    assert param_state(whole.a.weight) is None and same(whole, plain) == []
    assert copy.copy(m).a.weight is m.a.weight  # a shallow copy pickles nothing
    assert same(copy.deepcopy(m), plain) == []
    buf = io.BytesIO()
    torch.save(m.state_dict(), buf)  # the values, as the plain model's
    buf.seek(0)
    loaded = torch.load(buf)
    assert all(torch.equal(loaded[n], v) for n, v in plain.state_dict().items())
    buf = io.BytesIO()
    torch.save(plain, buf)  # a plain model pickles as torch's
    buf.seek(0)
    assert torch.equal(torch.load(buf, weights_only=False).a.weight, plain.a.weight)


# -- copy.deepcopy ---------------------------------------------------------------------------------


@pytest.mark.parametrize("tier", TIERS)
def test_deepcopy_is_a_real_copy_with_its_own_partitions(tier, tmp_path):
    import copy

    plain, m = pair(tier, tmp_path)
    c = copy.deepcopy(m)
    assert same(c, plain) == [] and same(m, plain) == []
    for (n, p), q in zip(m.named_parameters(), c.parameters(), strict=True):
        st, sq = param_state(p), param_state(q)
        assert sq is not None and q is not p, n
        assert (sq.shape, sq.dtype, sq.tier, sq.status) == (st.shape, st.dtype, tier, Status.NOT_AVAILABLE)
        assert sq.key != st.key and q.numel() == 0
    torch.manual_seed(9)
    sd = Net().state_dict()
    c.load_state_dict(sd)  # the copy is partitioned and equipped: writes its own partitions only
    assert same(m, plain) == []
    plain.load_state_dict(sd)
    assert same(c, plain) == []
    x = torch.randn(4, 7)
    with zswap.initialize(c, {"offload_param": {"device": tier}}), torch.no_grad():
        assert torch.equal(c(x), plain(x))
    del m
    assert same(c, plain) == []  # the original's partitions freed, the copy's kept


@pytest.mark.usefixtures("quiet_transformers")
def test_deepcopy_of_a_partitioned_hf_model_keeps_ties(tmp_path):
    import copy

    plain, m = pair("nvme", tmp_path, MODELS["gpt2"])
    c = copy.deepcopy(m)
    assert c.get_output_embeddings().weight is c.get_input_embeddings().weight
    assert c.get_input_embeddings().weight is not m.get_input_embeddings().weight
    assert same(c, plain) == []
    assert c.num_parameters() == plain.num_parameters()
    c.resize_token_embeddings(140, mean_resizing=False)  # the copy's wrappers are bound to the copy
    assert param_state(c.get_input_embeddings().weight).shape == (140, 64)
    assert param_state(m.get_input_embeddings().weight).shape == (128, 64)


def test_deepcopy_inside_gathered_parameters_copies_the_gathered_data(tmp_path):
    import copy

    plain, m = pair("cpu", tmp_path)
    with zswap.GatheredParameters(list(m.parameters()), modifier_rank=0):
        m.a.weight.data.add_(1.0)
        c = copy.deepcopy(m)
    with torch.no_grad():
        plain.a.weight.add_(1.0)
    assert same(c, plain) == [] and same(m, plain) == []


def test_deepcopy_under_an_open_engine_is_refused(tmp_path):
    import copy

    _, m = pair("cpu", tmp_path)
    with (
        zswap.initialize(m, {"offload_param": {"device": "cpu"}}),
        pytest.raises(ZswapError, match=r"copy\.deepcopy of a Net whose params an open zswap Engine runs"),
    ):
        copy.deepcopy(m)
    c = copy.deepcopy(m)  # closed: fine
    a, b = gathered_named(m), gathered_named(c)
    assert [n for n in a if not torch.equal(a[n], b[n])] == []
