"""``from_pretrained`` under ``zswap.Init`` loads each weight straight into its partition.

Tiny GPT-2 and Llama models are saved with ``save_pretrained`` (one file, or 20 kB shards with an index) and
loaded with ``AutoModelForCausalLM.from_pretrained`` inside ``Init`` on the cpu and nvme tiers: every param is
managed as soon as it is loaded, nothing is gathered (no swap read) during the load, the gathered weights are
bitwise the files' (cast where ``dtype`` asks), tied weights stay one param, and training from them matches
the plain model loaded the plain way.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap
import warnings
from pathlib import Path

import pytest
import torch

import zswap
from zswap import Status, param_state

from ._pretrained import file_tensors, gathered_named, init_for, nvme_training_config, save
from .test_hf_models import MODELS

transformers = pytest.importorskip("transformers")

pytestmark = pytest.mark.usefixtures("quiet_transformers")

TIERS = ("cpu", "nvme")


def _load(path: Path, **kwargs: object) -> torch.nn.Module:
    return transformers.AutoModelForCausalLM.from_pretrained(path, **kwargs)


@pytest.mark.parametrize("tier", TIERS)
@pytest.mark.parametrize("sharded", [False, True], ids=["one-file", "sharded"])
@pytest.mark.parametrize("model", MODELS)
def test_loaded_weights_are_the_files_and_partitioned_while_loading(
    model, sharded, tier, tmp_path, monkeypatch
):
    ckpt = save(model, tmp_path / "ckpt", sharded=sharded)
    files = file_tensors(ckpt)
    init = init_for(tier, tmp_path)
    managed_at_load: list[bool] = []
    real_write = zswap.weights.write

    def spy(items, placement=None, on_new=None):  # every tensor reaches write() before it is managed
        items = list(items)
        real_write(items, placement, on_new)
        managed_at_load.extend(param_state(t.tensor) is not None for t, _, _ in items if t.slots[0][2])

    monkeypatch.setattr(zswap.weights, "write", spy)
    with init:
        m = _load(ckpt)
        loaded = [p for p in m.parameters() if param_state(p) is not None]
        assert len(loaded) == len(list(m.parameters()))  # partitioned during the load, not at Init's exit
    assert managed_at_load and all(managed_at_load)
    if tier == "nvme":
        assert init._placement.store.engine.stats()["bytes_read"] == 0  # nothing was gathered to load it
    for p in m.parameters():
        st = param_state(p)
        assert st is not None and st.status is Status.NOT_AVAILABLE and st.tier == tier and p.numel() == 0
    assert m.get_output_embeddings().weight is m.get_input_embeddings().weight  # tied: one param
    got = gathered_named(m)
    assert set(files) <= set(got)
    bad = [n for n, t in files.items() if not torch.equal(got[n], t)]
    assert bad == []
    tied = dict(m.all_tied_weights_keys)
    for target, source in tied.items():
        assert torch.equal(got[target], files[source])
    assert not hasattr(transformers.PreTrainedModel._load_pretrained_model, "__zswap__")  # patch undone


@pytest.mark.parametrize("kw", ["dtype", "torch_dtype"])
def test_dtype_argument_casts_as_it_loads(kw, tmp_path):
    ckpt = save("llama", tmp_path / "ckpt", sharded=True)
    files = file_tensors(ckpt)
    with init_for("nvme", tmp_path):
        m = _load(ckpt, **{kw: torch.bfloat16})
    assert {param_state(p).dtype for p in m.parameters()} == {torch.bfloat16}
    got = gathered_named(m)
    assert all(torch.equal(got[n], t.to(torch.bfloat16)) for n, t in files.items())


def test_init_dtype_casts_the_loaded_weights(tmp_path):
    ckpt = save("gpt2", tmp_path / "ckpt", sharded=False)
    files = file_tensors(ckpt)
    init = init_for("nvme", tmp_path, dtype=torch.bfloat16)
    with init:
        m = _load(ckpt)
    assert init._placement.store.engine.stats()["bytes_read"] == 0  # cast as loaded: no pass at the exit
    assert {param_state(p).dtype for p in m.parameters()} == {torch.bfloat16}
    got = gathered_named(m)
    assert all(torch.equal(got[n], t.to(torch.bfloat16)) for n, t in files.items())


def test_missing_weights_are_initialised_and_partitioned(tmp_path):
    ckpt = save("llama", tmp_path / "ckpt", sharded=False)
    from safetensors.torch import load_file, save_file

    sd = load_file(ckpt / "model.safetensors")
    dropped = "model.layers.1.mlp.up_proj.weight"
    del sd[dropped]
    save_file(sd, ckpt / "model.safetensors", metadata={"format": "pt"})
    with init_for("cpu", tmp_path):
        m, info = _load(ckpt, output_loading_info=True)
    assert info["missing_keys"] == {dropped} or list(info["missing_keys"]) == [dropped]
    assert all(param_state(p) is not None for p in m.parameters())
    got = gathered_named(m)
    assert got[dropped].abs().sum() > 0  # initialised by transformers, then partitioned by Init
    assert all(torch.equal(got[n], t) for n, t in sd.items())


def test_state_dict_argument_is_streamed_too(tmp_path):
    ckpt = save("llama", tmp_path / "ckpt", sharded=False)
    files = file_tensors(ckpt)
    with init_for("nvme", tmp_path):
        config = transformers.AutoConfig.from_pretrained(ckpt)
        sd = {k: v.clone() for k, v in files.items()}
        m = transformers.LlamaForCausalLM.from_pretrained(None, config=config, state_dict=sd)
    assert all(param_state(p) is not None for p in m.parameters())
    got = gathered_named(m)
    assert all(torch.equal(got[n], t) for n, t in files.items())


@pytest.mark.parametrize("model", MODELS)
def test_save_pretrained_of_a_partitioned_model_writes_tied_weights_once(model, tmp_path):
    """``state_dict()`` gathers a param tied under two names (embeddings and LM head) once and puts the same
    tensor under both, as a plain model's state dict does: ``save_pretrained`` sees the tie and writes the
    file plain ``save_pretrained`` writes. Before, each name got its own copy and both were written."""
    from safetensors.torch import load_file

    ckpt = save(model, tmp_path / "ckpt", sharded=False)
    with init_for("nvme", tmp_path):
        m = _load(ckpt)
    sd = m.state_dict()
    tied = dict(m.all_tied_weights_keys)
    storage = {k: v.untyped_storage().data_ptr() for k, v in sd.items()}
    assert tied and all(storage[target] == storage[source] for target, source in tied.items())
    m.save_pretrained(tmp_path / "again")
    want, got = (load_file(d / "model.safetensors") for d in (ckpt, tmp_path / "again"))
    assert got.keys() == want.keys() and all(torch.equal(got[k], want[k]) for k in want)


def test_trains_like_the_plain_model_loaded_the_plain_way(tmp_path):
    ckpt = save("gpt2", tmp_path / "ckpt", sharded=True)
    cfg = nvme_training_config(tmp_path)
    ref = _load(ckpt).train()
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", zswap.ZswapWarning)
        with zswap.Init(cfg):
            m = _load(ckpt)
        m.train()
        engine = zswap.initialize(m, cfg)
    ref_opt = torch.optim.AdamW(ref.parameters(), lr=3e-3, betas=(0.8, 0.95), weight_decay=0.1, fused=True)
    ids = torch.randint(0, 128, (2, 12), generator=torch.Generator().manual_seed(1))
    with engine:
        for step in range(3):
            torch.manual_seed(step)
            loss = m(input_ids=ids, labels=ids, use_cache=False).loss
            torch.manual_seed(step)
            want = ref(input_ids=ids, labels=ids, use_cache=False).loss
            assert torch.allclose(loss.detach(), want.detach(), rtol=1e-6, atol=1e-7), (step, loss, want)
            loss.backward()
            want.backward()
            engine.step()
            ref_opt.step()
            ref_opt.zero_grad()
        got = gathered_named(m)
        for n, q in ref.named_parameters():
            assert torch.allclose(got[n], q.data, rtol=1e-6, atol=1e-7), n


def test_num_parameters_is_the_real_count(tmp_path):
    ckpt = save("llama", tmp_path / "ckpt", sharded=False)
    ref = _load(ckpt)
    with init_for("nvme", tmp_path):
        m = _load(ckpt)
    assert m.num_parameters() == ref.num_parameters() > 0
    assert m.num_parameters(exclude_embeddings=True) == ref.num_parameters(exclude_embeddings=True)
    assert sum(param_state(p).numel for p in m.parameters()) == sum(p.numel() for p in ref.parameters())


def test_pickle_checkpoints_are_refused(tmp_path):
    ckpt = save("gpt2", tmp_path / "ckpt", sharded=False)
    from safetensors.torch import load_file

    torch.save(load_file(ckpt / "model.safetensors"), ckpt / "pytorch_model.bin")
    os.remove(ckpt / "model.safetensors")
    with (
        pytest.raises(zswap.ZswapError, match=r"safetensors checkpoints only.*pytorch_model\.bin"),
        init_for("cpu", tmp_path),
    ):
        _load(ckpt)


def test_unsupported_transformers_version_is_named(tmp_path, monkeypatch):
    ckpt = save("gpt2", tmp_path / "ckpt", sharded=False)
    # transformers may swap its lazy module in sys.modules: patch the one `import transformers` gives now
    monkeypatch.setattr(sys.modules["transformers"], "__version__", "4.44.2")
    with (
        pytest.raises(zswap.ZswapError, match=r"transformers 4\.44\.2 is not supported") as info,
        init_for("cpu", tmp_path),
    ):
        _load(ckpt)
    assert isinstance(info.value, RuntimeError)
    assert "_zswap" not in repr(transformers.PreTrainedModel.__dict__["from_pretrained"])
    _load(ckpt)  # outside Init: transformers' own path, whatever the version says


@pytest.mark.dist
def test_two_ranks_read_only_their_own_slices(tmp_path):
    from .conftest import run_ranks

    save("gpt2", tmp_path / "ckpt", sharded=True)
    save("llama", tmp_path / "llama", sharded=False)
    run_ranks(Path(__file__).with_name("_pretrained_dist_worker.py"), tmp_path)


# Peak RSS of the load alone: the address space's high-water mark (VmHWM; what ru_maxrss reports for it)
# reset right before the load. ru_maxrss by itself would start at the forked pytest process's peak.
MEM_SCRIPT = textwrap.dedent(
    """
    import json, sys, warnings
    import torch, transformers, zswap
    transformers.logging.set_verbosity_error()
    warnings.simplefilter("ignore", zswap.ZswapWarning)
    ckpt, swap = sys.argv[1], sys.argv[2]
    def status(key):
        for line in open("/proc/self/status"):
            if line.startswith(key + ":"):
                return int(line.split()[1]) * 1024
    init = zswap.Init({"offload_param": {"device": "nvme", "nvme_path": swap}})
    cls = transformers.MODEL_FOR_CAUSAL_LM_MAPPING[type(transformers.AutoConfig.from_pretrained(ckpt))]
    with open("/proc/self/clear_refs", "w") as f:
        f.write("5")  # reset VmHWM to the current RSS
    base = status("VmRSS")
    with init:
        m = cls.from_pretrained(ckpt)
    assert all(zswap.param_state(p) is not None for p in m.parameters())
    print(json.dumps({"base": base, "peak": status("VmHWM")}))
    """
)


def write_big_checkpoint(path: Path, target_bytes: int) -> int:
    """A Llama checkpoint of about ``target_bytes`` (float32), written shard by shard with an index, from
    random tensors (never the whole model in memory). Returns its size in bytes."""
    from safetensors.torch import save_file

    layers = max(1, round((target_bytes / 4 - 2 * 8192 * 512) / (4 * 512 * 512 + 3 * 512 * 1408 + 2 * 512)))
    cfg = transformers.LlamaConfig(
        hidden_size=512,
        intermediate_size=1408,
        num_hidden_layers=layers,
        num_attention_heads=8,
        num_key_value_heads=8,
        vocab_size=8192,
        max_position_embeddings=64,
        tie_word_embeddings=False,
    )
    path.mkdir()
    cfg.save_pretrained(path)
    with torch.device("meta"):
        shapes = {n: p.shape for n, p in transformers.LlamaForCausalLM(cfg).named_parameters()}
    weight_map: dict[str, str] = {}
    shard: dict[str, torch.Tensor] = {}
    total = 0
    gen = torch.Generator().manual_seed(0)

    def flush() -> None:
        name = f"model-{len(set(weight_map.values())) + 1:05d}.safetensors"
        save_file(shard, path / name, metadata={"format": "pt"})
        weight_map.update(dict.fromkeys(shard, name))
        shard.clear()

    for n, shape in shapes.items():
        shard[n] = torch.randn(shape, generator=gen) * 0.02
        total += shard[n].numel() * 4
        if sum(t.numel() * 4 for t in shard.values()) >= 64 << 20:
            flush()
    if shard:
        flush()
    index = {"metadata": {"total_size": total}, "weight_map": weight_map}
    (path / "model.safetensors.index.json").write_text(json.dumps(index))
    return total


def load_peak_growth(ckpt: Path, swap: Path) -> int:
    """Bytes the peak RSS of a fresh process grew while `MEM_SCRIPT` loaded ``ckpt`` under Init(nvme) in
    ``swap`` (made here)."""
    swap.mkdir()
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(sys.path)}
    out = subprocess.run(
        [sys.executable, "-c", MEM_SCRIPT, str(ckpt), str(swap)],
        capture_output=True,
        text=True,
        env=env,
        timeout=300,
    )
    assert out.returncode == 0, out.stderr
    r = json.loads(out.stdout.strip().splitlines()[-1])
    return int(r["peak"] - r["base"])


@pytest.mark.slow
@pytest.mark.skipif(not os.path.exists("/proc/self/clear_refs"), reason="needs Linux's /proc/self/clear_refs")
def test_peak_memory_of_a_load_under_init_nvme(tmp_path):
    size = write_big_checkpoint(tmp_path / "big", 256 << 20)
    grew = load_peak_growth(tmp_path / "big", tmp_path / "swap")
    bound = 0.25 * size + (300 << 20)
    assert grew <= bound, (
        f"peak RSS grew {grew / 2**20:.0f} MiB loading {size / 2**20:.0f} MiB (bound {bound / 2**20:.0f})"
    )
    assert grew > 0  # the measurement saw the load
