"""Checkpoints in one process: atomic layout, every bad input (nothing of the model changes when a load
fails), load options, a torch optimizer, files readable by plain safetensors, kill -9 during a save."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import warnings
from pathlib import Path
from typing import Any

import pytest
import torch
from safetensors.torch import load_file
from torch import nn

import zswap
from zswap.checkpoint import CheckpointCorruptError, CheckpointMismatchError, CheckpointNotFoundError

from .test_runtime import MLP

TIERS = ("cpu", "nvme")


def cfg(tmp_path: Path, ptier: str = "cpu", otier: str = "cpu", optimizer: bool = True) -> dict[str, Any]:
    swap = tmp_path / "swap"
    swap.mkdir(exist_ok=True)
    out: dict[str, Any] = {
        "zero_optimization": {
            "offload_param": {"device": ptier, "nvme_path": str(swap)},
            "offload_optimizer": {"device": otier, "nvme_path": str(swap)},
            "sub_group_size": 200,
        }
    }
    if optimizer:
        out["optimizer"] = {"type": "AdamW", "params": {"lr": 1e-2}}
    return out


def build(
    config: dict[str, Any], make: Any = MLP, seed: int = 0, **kw: Any
) -> tuple[nn.Module, zswap.Engine]:
    torch.manual_seed(seed)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", zswap.ZswapWarning)
        with zswap.Init(config):
            m = make()
        return m, zswap.initialize(m, config, **kw)


def train(m: nn.Module, engine: zswap.Engine, steps: int = 2) -> None:
    for i in range(steps):
        x = torch.randn(4, 12, generator=torch.Generator().manual_seed(i))
        m(x).square().mean().backward()
        engine.step()


def snapshot(m: nn.Module, engine: zswap.Engine) -> dict[str, Any]:
    return {
        "weights": {k: v.clone() for k, v in m.state_dict().items()},
        "optim": engine.optimizer.state_dict() if engine.optimizer is not None else None,
        "steps": engine.global_steps,
    }


def same(a: dict[str, Any], b: dict[str, Any]) -> bool:
    if a["steps"] != b["steps"] or a["weights"].keys() != b["weights"].keys():
        return False
    if not all(torch.equal(a["weights"][k], b["weights"][k]) for k in a["weights"]):
        return False
    sa, sb = a["optim"]["state"], b["optim"]["state"]
    return sa.keys() == sb.keys() and all(all(torch.equal(sa[i][k], sb[i][k]) for k in sa[i]) for i in sa)


@pytest.fixture
def saved(tmp_path: Path) -> tuple[Path, dict[str, Any]]:
    """A checkpoint of a trained MLP (params and optimizer on nvme) at ``tmp_path/ckpt``."""
    config = cfg(tmp_path, "nvme", "nvme")
    m, engine = build(config)
    with engine:
        train(m, engine)
        engine.save_checkpoint(tmp_path / "ckpt", client_state={"epoch": 3})
    return tmp_path / "ckpt", config


def test_layout_latest_and_manifest(saved):
    ckpt, _ = saved
    assert (ckpt / "latest").read_text() == "global_step2\n"
    assert sorted(p.name for p in ckpt.iterdir()) == ["global_step2", "latest"]  # no temp folder left
    m = json.loads((ckpt / "global_step2" / "manifest.json").read_text())
    assert m["world_size"] == 1 and m["zswap_version"] == zswap.__version__ and m["global_steps"] == 2
    assert [p["name"] for p in m["params"]] == [n for n, _ in MLP().named_parameters()]
    p0 = m["params"][0]
    assert p0["shape"] == [32, 12] and p0["dtype"] == "float32"
    assert p0["partition"] == {"kind": "flat", "ranks": 1, "partition_numel": 384}
    names = {f["name"] for f in m["files"]}
    assert {
        f"rank00000-of-00001.{k}.safetensors" for k in ("params", "exp_avg", "exp_avg_sq", "master")
    } <= names
    assert all(isinstance(f["crc32c"], int) and f["block_crc32c"] for f in m["files"])


def test_checkpoint_files_are_plain_safetensors(saved, tmp_path):
    ckpt, config = saved
    tag = ckpt / "global_step2"
    params = load_file(tag / "rank00000-of-00001.params.safetensors")
    m, engine = build(config, seed=5)
    with engine:
        engine.load_checkpoint(ckpt)
        sd = m.state_dict()
        opt = engine.optimizer.state_dict()
    for i, (name, value) in enumerate(sd.items()):
        assert torch.equal(params[name], value.reshape(-1)), name
        exp_avg = load_file(tag / "rank00000-of-00001.exp_avg.safetensors")[name]
        assert torch.equal(exp_avg, opt["state"][i]["exp_avg"]), name


def test_round_trip_restores_weights_optimizer_counters_and_client_state(saved):
    ckpt, config = saved
    m, engine = build(config)
    with engine:
        train(m, engine)
        want = snapshot(m, engine)
    m2, engine2 = build(config, seed=7)
    with engine2:
        assert engine2.load_checkpoint(ckpt) == {"epoch": 3}
        assert same(snapshot(m2, engine2), want)


def test_tag_names_and_overwrite(tmp_path):
    config = cfg(tmp_path)
    m, engine = build(config)
    with engine:
        train(m, engine, 1)
        engine.save_checkpoint(tmp_path / "c", tag="first")
        train(m, engine, 1)
        engine.save_checkpoint(tmp_path / "c", tag="first")  # its checkpoint replaced whole
        engine.save_checkpoint(tmp_path / "c")
        assert (tmp_path / "c" / "latest").read_text().strip() == "global_step2"
        want = snapshot(m, engine)
        with pytest.raises(ValueError, match="tag"):
            engine.save_checkpoint(tmp_path / "c", tag="latest")
        with pytest.raises(ValueError, match="tag"):
            engine.save_checkpoint(tmp_path / "c", tag="a/b")
    m2, engine2 = build(config, seed=1)
    with engine2:
        engine2.load_checkpoint(tmp_path / "c", tag="first")
        assert same(snapshot(m2, engine2), want)


def test_a_save_over_a_tag_keeps_the_files_it_did_not_write(tmp_path):
    """A tag saved again replaces its checkpoint's files (those its manifest lists) and keeps everything
    else there — a tokenizer, a folder, links (a dangling one too), a FIFO, a file of the user's named like
    a rank file — as DeepSpeed, which writes into the folder, leaves them; so does a save into a folder
    that holds no checkpoint, where rank files by their names alone are taken for an earlier save's."""
    config = cfg(tmp_path)
    m, engine = build(config)
    root = tmp_path / "c"
    best = root / "best"
    with engine:
        train(m, engine, 1)
        engine.save_checkpoint(root, tag="best")
        (best / "tokenizer.json").write_text("{}")
        (best / "eval").mkdir()
        (best / "eval" / "scores.txt").write_text("0.9")
        (best / "link").symlink_to("tokenizer.json")
        (best / "dangling").symlink_to("nowhere")
        os.mkfifo(best / "pipe")
        (best / "rank00000-of-00001.eval.json").write_text("mine")
        (root / "notes").mkdir()
        (root / "notes" / "run.txt").write_text("kept")
        (root / "notes" / "rank00001-of-00002.params.safetensors").write_bytes(b"stale")
        train(m, engine, 1)
        engine.save_checkpoint(root, tag="best")
        engine.save_checkpoint(root, tag="notes")
        want = snapshot(m, engine)
    assert (best / "tokenizer.json").read_text() == "{}"
    assert (best / "eval" / "scores.txt").read_text() == "0.9"
    assert os.readlink(best / "link") == "tokenizer.json" and os.readlink(best / "dangling") == "nowhere"
    assert (best / "pipe").is_fifo() and (best / "rank00000-of-00001.eval.json").read_text() == "mine"
    assert (root / "notes" / "run.txt").read_text() == "kept"
    assert not (root / "notes" / "rank00001-of-00002.params.safetensors").exists()
    for tag in ("best", "notes"):
        m2, engine2 = build(config, seed=1)
        with engine2:
            engine2.load_checkpoint(root, tag=tag)
            assert same(snapshot(m2, engine2), want)


# -- bad input: a ZswapError naming the thing, and nothing changes ------------------------------------


def _fails_cleanly(
    config: dict[str, Any], load: Any, error: type[Exception], match: str, make: Any = MLP
) -> None:
    m, engine = build(config, make=make, seed=9)
    with engine:
        train(m, engine, 1)
        before = snapshot(m, engine)
        with pytest.raises(error, match=match) as info:
            load(engine)
        assert isinstance(info.value, zswap.ZswapError)
        assert same(snapshot(m, engine), before), "a failed load changed the model"


def test_missing_folder_tag_and_latest(saved, tmp_path):
    ckpt, config = saved
    _fails_cleanly(config, lambda e: e.load_checkpoint(tmp_path / "nope"), CheckpointNotFoundError, "nope")
    _fails_cleanly(
        config, lambda e: e.load_checkpoint(ckpt, tag="global_step9"), CheckpointNotFoundError, "global_step9"
    )
    (ckpt / "latest").unlink()
    _fails_cleanly(config, lambda e: e.load_checkpoint(ckpt), CheckpointNotFoundError, "latest")
    assert issubclass(CheckpointNotFoundError, FileNotFoundError)


class Wider(nn.Module):
    def __init__(self, out: int = 5, dtype: torch.dtype = torch.float32, rename: bool = False) -> None:
        super().__init__()
        self.net = MLP().net.to(dtype)
        if out != 5:
            self.net[4] = nn.Linear(32, out)
        if rename:
            self.other = self.net
            del self.net

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return (self.net if hasattr(self, "net") else self.other)(x)


@pytest.mark.parametrize(
    ("make", "match"),
    [
        (lambda: Wider(out=6), r"param 'net\.4\.weight' is float32 \(5, 32\) there, float32 \(6, 32\) here"),
        (lambda: Wider(rename=True), r"param 0 is 'net\.0\.weight' there, 'other\.0\.weight' here"),
        (
            lambda: Wider(dtype=torch.bfloat16),
            r"param 'net\.0\.weight' is float32 \(32, 12\) there, bfloat16",
        ),
    ],
)
def test_checkpoint_of_another_model_names_the_first_differing_param(saved, tmp_path, make, match):
    ckpt, _ = saved
    config = cfg(tmp_path, "cpu", "cpu")
    _, engine = build(config, make=make)
    with engine, pytest.raises(CheckpointMismatchError, match=match):
        engine.load_checkpoint(ckpt)


def test_checksum_mismatch_names_the_file(saved):
    ckpt, config = saved
    path = ckpt / "global_step2" / "rank00000-of-00001.exp_avg.safetensors"
    data = bytearray(path.read_bytes())
    data[-3] ^= 0x40
    path.write_bytes(bytes(data))
    _fails_cleanly(
        config,
        lambda e: e.load_checkpoint(ckpt),
        CheckpointCorruptError,
        r"exp_avg\.safetensors: checksum mismatch",
    )


def test_truncated_file(saved):
    ckpt, config = saved
    path = ckpt / "global_step2" / "rank00000-of-00001.params.safetensors"
    os.truncate(path, path.stat().st_size - 10)
    _fails_cleanly(
        config, lambda e: e.load_checkpoint(ckpt), CheckpointCorruptError, r"params\.safetensors: truncated"
    )


def test_corrupt_state_file_and_manifest(saved):
    ckpt, config = saved
    tag = ckpt / "global_step2"
    state = tag / "rank00000-of-00001.state.pt"
    state.write_bytes(state.read_bytes()[:-1] + b"x")
    _fails_cleanly(
        config, lambda e: e.load_checkpoint(ckpt), CheckpointCorruptError, r"state\.pt: checksum mismatch"
    )
    (tag / "manifest.json").write_text("{not json")
    _fails_cleanly(
        config, lambda e: e.load_checkpoint(ckpt), CheckpointCorruptError, r"manifest\.json: not valid JSON"
    )


def test_optimizer_mismatch_and_missing_state(saved, tmp_path):
    ckpt, config = saved
    m, engine = build(cfg(tmp_path, optimizer=False), optimizer=None)
    with engine:
        engine.save_checkpoint(tmp_path / "noopt")  # no optimizer: params and counters only
    _fails_cleanly(
        config,
        lambda e: e.load_checkpoint(tmp_path / "noopt"),
        CheckpointMismatchError,
        "load_optimizer_states=False",
    )
    torch_opt = cfg(tmp_path, optimizer=False)
    m, engine = build(torch_opt)
    with engine:
        engine.optimizer = torch.optim.AdamW(m.parameters())
        with pytest.raises(CheckpointMismatchError, match="OffloadedAdamW optimizer; this engine's is AdamW"):
            engine.load_checkpoint(ckpt)


# -- load options -------------------------------------------------------------------------------------


def test_load_module_only_and_without_optimizer_states(saved):
    ckpt, config = saved
    ref, ref_engine = build(config)
    with ref_engine:
        train(ref, ref_engine)
        want = {k: v.clone() for k, v in ref.state_dict().items()}
    m, engine = build(config, seed=3)
    with engine:
        # The client state comes back as DeepSpeed returns it; nothing else of the state file is used.
        assert engine.load_checkpoint(ckpt, load_module_only=True) == {"epoch": 3}
        assert all(torch.equal(v, want[k]) for k, v in m.state_dict().items())
        assert engine.global_steps == 0 and engine.optimizer.state_dict()["state"] == {}
    m, engine = build(config, seed=3)
    with engine:
        assert engine.load_checkpoint(ckpt, load_optimizer_states=False) == {"epoch": 3}
        assert engine.global_steps == 2 and engine.optimizer.state_dict()["state"] == {}


@pytest.mark.parametrize("how", ["load_optimizer_states=False", "load_module_only"])
def test_a_load_without_optimizer_states_sets_the_masters_as_deepspeed_does(how, tmp_path):
    """bf16 params with float32 masters in an engine that has stepped: a load that leaves the optimizer's
    state makes each master the checkpoint's (``load_optimizer_states=False``: DeepSpeed's ZeRO-3 copies
    its fp32 partitions) or the loaded param widened (``load_module_only``: its ``refresh_fp32_params``);
    the moments stay. The engine's own masters stayed, and its next step rounded them into the params:
    the loaded weights were lost."""
    from zswap.deepspeed.utils import safe_get_full_fp32_param, safe_get_full_optimizer_state

    config = {**cfg(tmp_path, "nvme", "nvme"), "bf16": {"enabled": True}}
    m, engine = build(config)

    def steps(n: int) -> None:
        for i in range(n):
            x = torch.randn(4, 12, generator=torch.Generator().manual_seed(i)).bfloat16()
            m(x).float().square().mean().backward()
            engine.step()

    def masters() -> list[torch.Tensor]:
        return [safe_get_full_fp32_param(p).clone() for p in m.parameters()]

    with engine:
        steps(3)
        engine.save_checkpoint(tmp_path / "ck")
        saved_masters, saved = masters(), {k: v.clone() for k, v in m.state_dict().items()}
        steps(2)
        moments = [safe_get_full_optimizer_state(p, "exp_avg").clone() for p in m.parameters()]
        assert not all(torch.equal(a, b) for a, b in zip(masters(), saved_masters, strict=True))
        engine.load_checkpoint(tmp_path / "ck", **{how.split("=")[0]: how == "load_module_only"})
        assert all(torch.equal(v, saved[k]) for k, v in m.state_dict().items())
        with zswap.GatheredParameters(list(m.parameters())):
            widened = [p.data.float().reshape(-1) for p in m.parameters()]
        want = saved_masters if how != "load_module_only" else widened
        assert all(torch.equal(a.reshape(-1), b.reshape(-1)) for a, b in zip(masters(), want, strict=True))
        assert all(
            torch.equal(safe_get_full_optimizer_state(p, "exp_avg"), mo)
            for p, mo in zip(m.parameters(), moments, strict=True)
        )
        differ = [not torch.equal(a.reshape(-1), b) for a, b in zip(saved_masters, widened, strict=True)]
        assert how == "load_module_only" or any(differ)  # (the masters are not the bf16 weights widened)


@pytest.mark.parametrize("early", [True, False], ids=["update in backward", "ordinary step"])
def test_a_fresh_engine_steps_from_the_checkpoints_masters_without_its_moments(early, tmp_path):
    """``load_optimizer_states=False`` into an engine that has not stepped (bf16 params): its first step
    starts Adam afresh from the checkpoint's float32 masters (DeepSpeed's ZeRO-3 restores its fp32
    partitions whatever that flag says), not from the bf16 params — bitwise torch's AdamW over the saved
    masters with fresh state. It took them from the params, a bf16 rounding off. A param written after the
    load starts from what was written."""
    from zswap.deepspeed.utils import safe_get_full_fp32_param, safe_get_full_grad

    config = {**cfg(tmp_path, "nvme", "nvme"), "bf16": {"enabled": True}}
    config["optimizer"]["params"]["weight_decay"] = 0.0

    def batch(i: int) -> torch.Tensor:
        return torch.randn(4, 12, generator=torch.Generator().manual_seed(i)).bfloat16()

    m, engine = build(config)
    with engine:
        for i in range(3):
            m(batch(i)).float().square().mean().backward()
            engine.step()
        engine.save_checkpoint(tmp_path / "ck")
        saved = [safe_get_full_fp32_param(p).clone() for p in m.parameters()]
    m, engine = build(config, seed=3)
    with engine:
        engine.early_step, engine.keep_applied_grads = early, True
        engine.load_checkpoint(tmp_path / "ck", load_optimizer_states=False)
        with zswap.GatheredParameters([m.net[4].bias], modifier_rank=0):
            m.net[4].bias.data.fill_(0.5)  # written since the load: its first step starts from the param
        saved[-1] = torch.full_like(saved[-1], 0.5)
        seeds = [safe_get_full_fp32_param(p) for p in m.parameters()]  # what the first step starts from
        assert all(torch.equal(a, b) for a, b in zip(seeds, saved, strict=True))
        m(batch(9)).float().square().mean().backward()
        grads = [safe_get_full_grad(p).clone() for p in m.parameters()]
        engine.step()
        got = [safe_get_full_fp32_param(p) for p in m.parameters()]
        with zswap.GatheredParameters(list(m.parameters())):
            assert all(torch.equal(p.data, g.bfloat16()) for p, g in zip(m.parameters(), got, strict=True))
        assert engine.stats()["steps_in_backward"] == int(early)
    want = [s.clone().requires_grad_(True) for s in saved]
    for w, g in zip(want, grads, strict=True):
        w.grad = g
    torch.optim.AdamW(want, lr=1e-2, weight_decay=0.0, fused=True).step()
    assert all(torch.equal(a, b.detach()) for a, b in zip(got, want, strict=True))


@pytest.mark.parametrize("otier", TIERS)
def test_a_params_state_reset_by_a_load_is_left_out_of_the_next_save(otier, tmp_path):
    """A checkpoint from before any step resets every param's optimizer state while their records keep
    their places; a param frozen since, so not stepped again, has none: the next save leaves it out and
    loads back as it was saved (it used to stop walking that record: "out of their layout order")."""
    config = cfg(tmp_path, "nvme", otier)
    m, engine = build(config)
    with engine:
        engine.save_checkpoint(tmp_path / "early")
        train(m, engine)
        m.net[4].requires_grad_(False)
        with pytest.warns(zswap.ZswapWarning, match="net.4.weight, net.4.bias: frozen here but trainable"):
            engine.load_checkpoint(tmp_path / "early")
        train(m, engine, 1)
        want = snapshot(m, engine)
        engine.save_checkpoint(tmp_path / "again")
    assert sorted(want["optim"]["state"]) == [0, 1, 2, 3]  # the last layer's weight and bias: none
    m2, engine2 = build(config, seed=7)
    with engine2:
        m2.net[4].requires_grad_(False)
        engine2.load_checkpoint(tmp_path / "again")
        assert same(snapshot(m2, engine2), want)


@pytest.mark.parametrize("optimizer", ["zswap", "torch"])
def test_a_load_whose_frozen_params_changed_says_so(optimizer, tmp_path):
    """Unfreezing a layer between save and load (a second fine-tuning phase) loads, but not silently: its
    optimizer state starts fresh (the checkpoint has none for it), which the warning says; freezing one
    keeps its loaded state unused. A load with the same frozen set warns of nothing."""
    config = cfg(tmp_path, "nvme", "nvme", optimizer=optimizer == "zswap")

    def make(frozen: bool) -> tuple[nn.Module, zswap.Engine]:
        m, engine = build(config)
        m.net[0].requires_grad_(not frozen)
        if optimizer == "torch":
            engine.close()
            opt = torch.optim.AdamW(m.parameters(), lr=1e-2)
            engine = zswap.initialize(m, config, optimizer=opt)
        return m, engine

    m, engine = make(frozen=True)
    with engine:
        train(m, engine)
        engine.save_checkpoint(tmp_path / "phase1")
    m, engine = make(frozen=False)
    with engine:
        with pytest.warns(zswap.ZswapWarning) as got:
            engine.load_checkpoint(tmp_path / "phase1")
        assert [str(w.message) for w in got] == [
            "net.0.weight, net.0.bias: trainable here but frozen when the checkpoint was saved, which holds "
            "no optimizer state for them: their moments start at zero and their step count at 0"
        ]
        assert got[0].filename == __file__
        train(m, engine, 1)
        engine.save_checkpoint(tmp_path / "phase2")
    m, engine = make(frozen=False)
    with engine, warnings.catch_warnings():
        warnings.simplefilter("error", zswap.ZswapWarning)
        engine.load_checkpoint(tmp_path / "phase2")


def test_a_torch_optimizer_resumes_exactly(tmp_path):
    config = cfg(tmp_path, "nvme", optimizer=False)

    def run(seed: int, load: bool) -> list[float]:
        m, engine = build(config, seed=seed)
        engine_opt = torch.optim.AdamW(m.parameters(), lr=1e-2)
        engine.close()
        engine = zswap.initialize(m, config, optimizer=engine_opt)
        losses = []
        with engine:
            if load:
                engine.load_checkpoint(tmp_path / "t")
            else:
                train(m, engine, 2)
                engine.save_checkpoint(tmp_path / "t")
            for i in range(2, 4):
                x = torch.randn(4, 12, generator=torch.Generator().manual_seed(i))
                loss = m(x).square().mean()
                loss.backward()
                engine.step()
                losses.append(loss.item())
        return losses

    assert run(0, load=False) == run(5, load=True)


# -- kill -9 in the middle of a save --------------------------------------------------------------------

KILLER = """
import os, signal, sys, warnings, torch
sys.path.insert(0, {repo!r})
import zswap
from zswap.checkpoint import _atomic, _safetensors
from tests.test_checkpoint import build, cfg, train
from pathlib import Path
tmp = Path({tmp!r})
m, engine = build(cfg(tmp, "nvme", "nvme"))
train(m, engine, 1)
engine.save_checkpoint(tmp / "ckpt")
train(m, engine, 1)
where = {where!r}
die = lambda *a, **k: os.kill(os.getpid(), signal.SIGKILL)
if where == "write":
    calls = [0]
    orig = _safetensors.StreamWriter.write
    def write(self, t):
        calls[0] += 1
        if calls[0] == 5:
            die()
        orig(self, t)
    _safetensors.StreamWriter.write = write
elif where == "commit":
    _atomic.commit = die
else:
    _atomic.write_latest = die
engine.save_checkpoint(tmp / "ckpt")
"""


@pytest.mark.parametrize("where", ["write", "commit", "latest"])
def test_kill_during_a_save_leaves_the_previous_checkpoint(tmp_path, where):
    repo = str(Path(__file__).resolve().parents[1])
    code = KILLER.format(repo=repo, tmp=str(tmp_path), where=where)
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([repo + "/python", os.environ.get("PYTHONPATH", "")])}
    r = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=120)
    assert r.returncode == -signal.SIGKILL, r.stderr
    ckpt = tmp_path / "ckpt"
    assert (ckpt / "latest").read_text().strip() == "global_step1"
    tags = sorted(p.name for p in ckpt.iterdir() if not p.name.startswith(".") and p.is_dir())
    # Killed before the rename: only the old tag. Killed between rename and `latest`: the new tag is complete.
    assert tags == (["global_step1", "global_step2"] if where == "latest" else ["global_step1"])
    _, engine = build(cfg(tmp_path, "nvme", "nvme"), seed=4)
    with engine:
        engine.load_checkpoint(ckpt)
        assert engine.global_steps == 1
        engine.save_checkpoint(ckpt)  # the next save clears what the killed one left
    assert not [p for p in ckpt.iterdir() if p.name.startswith(".")]


def _micro(m: nn.Module, engine: zswap.Engine, i: int) -> None:
    x = torch.randn(4, 12, generator=torch.Generator().manual_seed(100 + i))
    m(x).square().mean().backward()
    engine.step()


def test_a_load_begins_a_new_accumulation_window(tmp_path: Path) -> None:
    """A checkpoint holds no gradient, so a load begins a new window, as DeepSpeed's does: of this run's
    ``gradient_accumulation_steps`` (a resume that changes it 2 → 4 stepped after 2 micro-batches, with half
    the gradient), and without the gradients of the window the load abandoned (they were applied at the
    next boundary). A save inside a window says its gradients are not saved."""
    config = cfg(tmp_path, "nvme", "nvme") | {"gradient_accumulation_steps": 2}
    m, engine = build(config)
    with engine:
        for i in range(6):  # three optimizer steps
            _micro(m, engine, i)
        engine.save_checkpoint(tmp_path / "ckpt")
        _micro(m, engine, 6)  # a window opened
        with pytest.warns(zswap.ZswapWarning, match=r"accumulation window \(1 of its 2 micro-batches"):
            engine.save_checkpoint(tmp_path / "mid")
    # The run resumed with gas 4, straight from the checkpoint: the reference.
    four = config | {"gradient_accumulation_steps": 4}
    ref, ref_engine = build(four, seed=5)
    with ref_engine:
        ref_engine.load_checkpoint(tmp_path / "ckpt")
        for i in range(4):
            assert ref_engine.global_steps == 3
            _micro(ref, ref_engine, 10 + i)
        assert ref_engine.global_steps == 4
        want = snapshot(ref, ref_engine)
    # The same, loaded into an engine with half a window of gradients of its own.
    m, engine = build(four, seed=5)
    with engine:
        _micro(m, engine, 20)
        engine.load_checkpoint(tmp_path / "ckpt")
        for i in range(4):
            assert engine.global_steps == 3
            _micro(m, engine, 10 + i)
        assert same(snapshot(m, engine), want)
