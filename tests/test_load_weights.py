"""``zswap.load_weights``: a safetensors file, index or folder streamed into a partitioned model.

Checks: bitwise equality with the file (cast where the param's dtype differs), every layout of a checkpoint,
one error listing every missing/unexpected/mismatched key before anything is written, torch's
``(missing_keys, unexpected_keys)`` with ``strict=False``, unmanaged params and buffers, tied params,
malformed files, params kept gathered by a running engine, and the optimizer-master refusal.
"""

from __future__ import annotations

import json
import struct
from pathlib import Path

import pytest
import torch
from safetensors.torch import save_file
from torch import nn

import zswap
from zswap import LoadWeightsError, ZswapError, load_weights, param_state

from ._pretrained import gathered_named, init_for

TIERS = ("cpu", "nvme")


class Net(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.a = nn.Linear(7, 5)
        self.norm = nn.BatchNorm1d(5)  # buffers: running_mean, running_var, num_batches_tracked
        self.b = nn.Linear(5, 3)
        self.register_buffer("scratch", torch.zeros(2), persistent=False)  # not in checkpoints

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.b(self.norm(self.a(x)))


def reference(seed: int = 1) -> dict[str, torch.Tensor]:
    torch.manual_seed(seed)
    ref = Net()
    with torch.no_grad():
        ref.norm.running_mean.uniform_()
        ref.norm.running_var.uniform_(1, 2)
        ref.norm.num_batches_tracked.fill_(7)
    return {k: v.clone() for k, v in ref.state_dict().items()}


def current(m: nn.Module) -> dict[str, torch.Tensor]:
    params = list(m.parameters())
    with zswap.GatheredParameters(params):
        out = {k: v.clone() for k, v in m.named_parameters()}
    out.update({k: v.clone() for k, v in m.named_buffers() if not k.endswith("scratch")})
    return out


def build(tier: str, tmp_path: Path, **kwargs) -> Net:
    torch.manual_seed(0)
    with init_for(tier, tmp_path, **kwargs):
        return Net()


def write_sharded(sd: dict[str, torch.Tensor], folder: Path, per_file: int = 2) -> Path:
    folder.mkdir()
    names = list(sd)
    weight_map = {}
    for i in range(0, len(names), per_file):
        fname = f"model-{i // per_file:05d}.safetensors"
        save_file({k: sd[k].contiguous() for k in names[i : i + per_file]}, folder / fname)
        weight_map.update(dict.fromkeys(names[i : i + per_file], fname))
    index = folder / "model.safetensors.index.json"
    index.write_text(json.dumps({"metadata": {}, "weight_map": weight_map}))
    return index


@pytest.mark.parametrize("tier", TIERS)
@pytest.mark.parametrize("layout", ["file", "index", "folder", "folder-of-one"])
def test_bitwise_the_checkpoint_in_every_layout(layout, tier, tmp_path):
    sd = reference()
    if layout == "file":
        path = tmp_path / "w.safetensors"
        save_file(sd, path)
    elif layout == "folder-of-one":
        (tmp_path / "ck").mkdir()
        save_file(sd, tmp_path / "ck" / "model.safetensors")
        path = tmp_path / "ck"
    else:
        index = write_sharded(sd, tmp_path / "ck")
        path = index if layout == "index" else index.parent
    m = build(tier, tmp_path)
    missing, unexpected = load_weights(m, path)
    assert (missing, unexpected) == ([], [])
    assert all(param_state(p) is not None and p.numel() == 0 for p in m.parameters())
    got = current(m)
    assert set(got) == set(sd) and all(torch.equal(got[k], sd[k]) for k in sd), layout


def test_a_folder_with_model_safetensors_beside_an_index_loads_that_file(tmp_path):
    """As ``from_pretrained`` resolves the folder: ``model.safetensors`` first (the index came first, so the
    two loaded different weights from one folder)."""
    index = write_sharded(reference(seed=2), tmp_path / "ck")
    save_file(reference(), index.parent / "model.safetensors")
    m = build("nvme", tmp_path)
    load_weights(m, index.parent)
    got, want = current(m), reference()
    assert all(torch.equal(got[k], want[k]) for k in want)


def test_values_are_cast_to_the_param_dtype(tmp_path):
    sd = reference()
    save_file(sd, tmp_path / "w.safetensors")
    m = build("nvme", tmp_path, dtype=torch.bfloat16)
    load_weights(m, tmp_path / "w.safetensors")
    got = current(m)
    for k, v in sd.items():
        want = v.to(torch.bfloat16) if v.is_floating_point() else v  # BatchNorm's stats: bf16 under Init too
        assert torch.equal(got[k], want), k


def test_strict_lists_every_problem_at_once_and_writes_nothing(tmp_path):
    sd = reference()
    del sd["a.bias"], sd["norm.running_var"]
    sd["extra.weight"] = torch.ones(3)
    sd["b.weight"] = torch.ones(4, 5)
    save_file(sd, tmp_path / "w.safetensors")
    m = build("cpu", tmp_path)
    before = current(m)
    with pytest.raises(LoadWeightsError) as info:
        load_weights(m, tmp_path / "w.safetensors")
    err = info.value
    assert isinstance(err, ZswapError) and isinstance(err, ValueError)
    msg = str(err)
    assert "2 missing keys: a.bias, norm.running_var" in msg
    assert "1 unexpected key: extra.weight" in msg and "1 shape mismatch: b.weight" in msg
    assert "b.weight is [4, 5] in the checkpoint, [3, 5] in the model" in msg
    assert (err.missing_keys, err.unexpected_keys) == (["a.bias", "norm.running_var"], ["extra.weight"])
    after = current(m)
    assert all(torch.equal(before[k], after[k]) for k in before)  # nothing was written


def test_non_strict_returns_what_torch_returns(tmp_path):
    sd = reference()
    del sd["a.bias"]
    sd["extra.weight"] = torch.ones(3)
    save_file(sd, tmp_path / "w.safetensors")
    m = build("nvme", tmp_path)
    torch.manual_seed(0)
    plain = Net()
    want = plain.load_state_dict(sd, strict=False)
    got = load_weights(m, tmp_path / "w.safetensors", strict=False)
    assert got == want and got.missing_keys == ["a.bias"] and got.unexpected_keys == ["extra.weight"]
    now = current(m)
    for k, v in plain.state_dict().items():
        if k != "scratch":
            assert torch.equal(now[k], v), k


def test_shape_mismatch_raises_even_without_strict(tmp_path):
    sd = reference()
    sd["a.weight"] = torch.ones(5, 8)
    save_file(sd, tmp_path / "w.safetensors")
    m = build("cpu", tmp_path)
    with pytest.raises(LoadWeightsError, match=r"a\.weight is \[5, 8\] in the checkpoint, \[5, 7\]"):
        load_weights(m, tmp_path / "w.safetensors", strict=False)


def test_unmanaged_params_and_buffers_are_copied(tmp_path):
    sd = reference()
    save_file(sd, tmp_path / "w.safetensors")
    m = build("cpu", tmp_path)
    m.b.bias = nn.Parameter(torch.zeros(3))  # added after Init: not managed
    assert param_state(m.b.bias) is None
    load_weights(m, tmp_path / "w.safetensors")
    assert torch.equal(m.b.bias.data, sd["b.bias"]) and torch.equal(
        m.norm.running_var, sd["norm.running_var"]
    )
    assert m.norm.num_batches_tracked.item() == 7


class Tied(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.emb = nn.Embedding(6, 4)
        self.head = nn.Linear(4, 6, bias=False)
        self.head.weight = self.emb.weight


@pytest.mark.parametrize("names", [["emb.weight"], ["head.weight"], ["emb.weight", "head.weight"]])
def test_tied_params_load_from_any_of_their_names(names, tmp_path):
    w = torch.randn(6, 4)
    save_file(
        {n: w for n in names} if len(names) == 1 else {names[0]: w, names[1]: w.clone()}, tmp_path / "w.st"
    )
    with init_for("nvme", tmp_path):
        m = Tied()
    assert load_weights(m, tmp_path / "w.st") == ([], [])
    assert m.head.weight is m.emb.weight
    with zswap.GatheredParameters(m.emb.weight):
        assert torch.equal(m.emb.weight.data, w)


def test_bad_paths_and_files(tmp_path):
    m = build("cpu", tmp_path)
    with pytest.raises(FileNotFoundError, match="no checkpoint"):
        load_weights(m, tmp_path / "nope.safetensors")
    (tmp_path / "empty").mkdir()
    with pytest.raises(ZswapError, match=r"no \*\.safetensors file"):
        load_weights(m, tmp_path / "empty")
    bad = tmp_path / "bad.safetensors"
    bad.write_bytes(struct.pack("<Q", 10) + b"{not json}")
    with pytest.raises(ZswapError, match="header is not valid JSON"):
        load_weights(m, bad)
    header = json.dumps({"a.weight": {"dtype": "F32", "shape": [5, 7], "data_offsets": [0, 140]}}).encode()
    short = tmp_path / "short.safetensors"
    short.write_bytes(struct.pack("<Q", len(header)) + header + b"\0" * 20)
    with pytest.raises(ZswapError, match=r"'a\.weight' .* lie past the end of the file"):
        load_weights(m, short)
    index = write_sharded(reference(), tmp_path / "ck")
    next(index.parent.glob("model-00001*")).unlink()
    with pytest.raises(FileNotFoundError, match=r"shard named by model\.safetensors\.index\.json is missing"):
        load_weights(m, index)
    with pytest.raises(TypeError, match=r"nn\.Module"):
        load_weights("model", bad)  # type: ignore[arg-type]


def test_params_kept_gathered_by_an_engine_change_too(tmp_path):
    sd = reference()
    save_file(sd, tmp_path / "w.safetensors")
    m = build("nvme", tmp_path)
    cfg = {"zero_optimization": {"stage3_param_persistence_threshold": 1000}}  # all kept gathered
    with zswap.initialize(m, cfg, optimizer=torch.optim.SGD(m.parameters(), lr=0.1)) as engine:
        assert all(param_state(p).status is zswap.Status.AVAILABLE for p in m.parameters())
        with torch.no_grad():
            m(torch.randn(4, 7))  # a forward first: the engine holds gathered copies
        load_weights(m, tmp_path / "w.safetensors")
        torch.manual_seed(0)
        plain = Net()
        plain.load_state_dict(sd)
        x = torch.randn(4, 7)
        m.eval(), plain.eval()
        with torch.no_grad():
            assert torch.equal(m(x), plain(x))
        engine.zero_grad()
    assert current(m)["a.weight"].equal(sd["a.weight"])  # the partitions changed as well


def test_refused_once_the_optimizer_holds_a_master_copy(tmp_path):
    save_file({"weight": torch.ones(3, 4), "bias": torch.ones(3)}, tmp_path / "w.safetensors")
    with init_for("cpu", tmp_path, dtype=torch.bfloat16):
        m = nn.Linear(4, 3)
    opt = zswap.optim.OffloadedAdamW(m.parameters(), lr=0.1)
    with zswap.initialize(m, {}, optimizer=opt) as engine:
        load_weights(m, tmp_path / "w.safetensors")  # before the first step: fine
        m(torch.randn(2, 4, dtype=torch.bfloat16)).float().sum().backward()
        engine.step()
        with pytest.raises(
            ZswapError, match=r"weight: the optimizer of an open zswap Engine holds a float32"
        ):
            load_weights(m, tmp_path / "w.safetensors")


def test_nvme_load_buffers_are_reused_for_same_sized_params_and_the_pool_restored(tmp_path, monkeypatch):
    import zswap.weights as weights
    from zswap.swap import SwapEngine

    torch.manual_seed(3)
    ref = nn.Sequential(*[nn.Linear(256, 256, bias=False) for _ in range(6)])
    save_file(ref.state_dict(), tmp_path / "w.safetensors")
    with init_for("nvme", tmp_path):
        m = nn.Sequential(*[nn.Linear(256, 256, bias=False) for _ in range(6)])
    store = param_state(m[0].weight).store
    pool_before = store.pool_bytes
    sizes: list[int] = []
    real_empty = SwapEngine.empty

    def counted(self, shape, dtype=torch.float32):
        sizes.append(shape[0] if isinstance(shape, tuple) else shape)
        return real_empty(self, shape, dtype)

    monkeypatch.setattr(SwapEngine, "empty", counted)
    monkeypatch.setattr(weights, "LOAD_INFLIGHT_BYTES", 0)  # each write waited for before the next one's
    load_weights(m, tmp_path / "w.safetensors")
    # The first two partitions take a buffer each (the first is still being written while the second
    # fills); every later one reuses a buffer whose write has landed.
    assert sizes == [256 * 256, 256 * 256]
    assert store.pool_bytes == pool_before and store._pooled <= pool_before
    got = current(m)
    assert all(torch.equal(got[k], v) for k, v in ref.state_dict().items())


def _marian() -> nn.Module:
    import transformers

    cfg = transformers.MarianConfig(
        vocab_size=50, d_model=16, encoder_layers=1, decoder_layers=1, encoder_attention_heads=2,
        decoder_attention_heads=2, encoder_ffn_dim=32, decoder_ffn_dim=32, max_position_embeddings=32,
        decoder_start_token_id=0, pad_token_id=0,
    )  # fmt: skip
    return transformers.MarianMTModel(cfg)


def test_names_a_transformers_model_tells_from_pretrained_to_pass_over_are_not_missing(tmp_path):
    """Marian's sinusoidal position tables are left out by ``save_pretrained`` and listed in its
    ``_keys_to_ignore_on_load_missing``: ``from_pretrained`` loads the folder, so ``load_weights`` does,
    strict, with the same weights (the tables are made at build)."""
    torch.manual_seed(0)
    _marian().save_pretrained(tmp_path / "ckpt")
    with init_for("nvme", tmp_path):
        m = _marian()
    assert load_weights(m, tmp_path / "ckpt") == ([], [])
    ref = type(m).from_pretrained(tmp_path / "ckpt")
    got, want = gathered_named(m), dict(ref.named_parameters(remove_duplicate=False))
    assert got.keys() == want.keys()
    for name, t in want.items():
        assert torch.equal(got[name], t), name
