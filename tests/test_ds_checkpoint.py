"""DeepSpeed's checkpoint tests (``tests/unit/checkpoint/``: ``common.checkpoint_correctness_verification``,
``test_latest_checkpoint.py``, ``test_tag_validation.py``, ``test_lr_scheduler.py``,
``test_zero_optimizer.py``'s load options), adapted: train one model, save, build a second one, load, and
compare params, optimizer state, counters and schedule."""

from __future__ import annotations

import os
import warnings
from pathlib import Path
from typing import Any

import pytest
import torch

import zswap
import zswap.deepspeed as deepspeed
from zswap.checkpoint import CheckpointArgumentError, CheckpointNotFoundError

from ._ds_common import TwoLayer, base_config, batches
from .conftest import run_ranks

WORKER = Path(__file__).with_name("_ds_ckpt_worker.py")


@pytest.fixture(autouse=True)
def _quiet() -> Any:
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", zswap.ZswapWarning)
        yield


def ds_config(tmp_path: Path, tier: str, **extra: Any) -> dict[str, Any]:
    cfg = base_config(**extra)
    cfg["optimizer"]["params"].update({"betas": [0.8, 0.999], "eps": 1e-8, "weight_decay": 3e-7})
    zero: dict[str, Any] = {"stage": 3}
    if tier != "none":
        zero["offload_param"] = {"device": tier}
        zero["offload_optimizer"] = {"device": tier}
        if tier == "nvme":
            (tmp_path / "swap").mkdir(exist_ok=True)
            zero["offload_param"]["nvme_path"] = zero["offload_optimizer"]["nvme_path"] = str(
                tmp_path / "swap"
            )
    cfg["zero_optimization"] = zero
    return cfg


def make(cfg: dict[str, Any], seed: int) -> tuple[Any, Any]:
    torch.manual_seed(seed)
    with deepspeed.zero.Init(config_dict_or_path=cfg):
        model = TwoLayer()
    engine, _, _, sched = deepspeed.initialize(config=cfg, model=model, model_parameters=model.parameters())
    return engine, sched


def full_params(engine: Any) -> list[torch.Tensor]:
    params = list(engine.module.parameters())
    with zswap.GatheredParameters(params):
        return [p.detach().clone() for p in params]


def trained(cfg: dict[str, Any], steps: int = 6) -> Any:
    engine, _ = make(cfg, seed=1)
    for x, y in batches(steps):
        engine.backward(engine(x, y))
        engine.step()
    engine.empty_partition_cache()  # DeepSpeed's tests flush the stage-3 cache before saving
    return engine


def same_optimizer_state(a: Any, b: Any) -> bool:
    sa, sb = a.optimizer.state_dict()["state"], b.optimizer.state_dict()["state"]
    if sa.keys() != sb.keys():
        return False
    for k in sa:
        for name, value in sa[k].items():
            other = sb[k][name]
            same = torch.equal(value, other) if isinstance(value, torch.Tensor) else value == other
            if not same:
                return False
    return True


WARMUP = {
    "type": "WarmupLR",
    "params": {"warmup_min_lr": 0, "warmup_max_lr": 0.001, "warmup_num_steps": 1000},
}


@pytest.mark.parametrize("tier", ["none", "cpu", "nvme"])
@pytest.mark.parametrize(
    ("load_optimizer_states", "load_lr_scheduler_states", "load_module_only"),
    [
        (True, True, False),
        (False, True, False),
        (True, False, False),
        (False, False, False),
        (True, True, True),
    ],
)
def test_save_then_load_into_another_model(
    tmp_path, tier, load_optimizer_states, load_lr_scheduler_states, load_module_only
):
    cfg = ds_config(tmp_path, tier, scheduler=WARMUP)
    saved = trained(cfg)
    folder = tmp_path / "saved_checkpoint"
    assert saved.save_checkpoint(str(folder), tag="1", client_state={"epoch": 3}) is True
    assert (folder / "latest").read_text().strip() == "1"

    loaded, sched = make(cfg, seed=2)
    fresh = full_params(loaded)
    assert not all(torch.equal(p, q) for p, q in zip(fresh, full_params(saved), strict=True))
    path, client = loaded.load_checkpoint(
        str(folder),
        tag="1",
        load_optimizer_states=load_optimizer_states,
        load_lr_scheduler_states=load_lr_scheduler_states,
        load_module_only=load_module_only,
    )
    assert path == os.path.join(str(folder), "1")
    assert all(torch.equal(p, q) for p, q in zip(full_params(loaded), full_params(saved), strict=True))
    assert [p.dtype for p in loaded.module.parameters()] == [p.dtype for p in saved.module.parameters()]
    if load_module_only:
        assert client == {"epoch": 3}  # DeepSpeed returns it with the module alone too
        assert loaded.global_steps == 0 and sched.last_batch_iteration == -1
        assert loaded.optimizer.state_dict()["state"] == {}
    else:
        assert client == {"epoch": 3}
        assert (loaded.global_steps, loaded.skipped_steps) == (saved.global_steps, saved.skipped_steps)
        assert loaded.global_samples == saved.global_samples == saved.global_steps * 2  # train_batch_size 2
        if load_optimizer_states:
            assert same_optimizer_state(saved, loaded)
        else:  # nothing of the saved optimizer was read
            assert loaded.optimizer.state_dict()["state"] == {}
        if load_lr_scheduler_states:
            assert sched.state_dict() == saved.lr_scheduler.state_dict()
            assert loaded.get_lr() == saved.get_lr()
        else:  # the schedule stays at its start; the optimizer's groups hold the lr they were saved with
            assert sched.last_batch_iteration == -1 and sched.get_lr() == [0.0]
            assert loaded.get_lr() == (saved.get_lr() if load_optimizer_states else [0.0])
    saved.close()
    loaded.close()


def test_no_tag_saves_under_the_step_and_loads_what_latest_names(tmp_path):
    cfg = ds_config(tmp_path, "cpu")
    saved = trained(cfg, steps=4)
    saved.save_checkpoint(tmp_path / "ck")
    assert (tmp_path / "ck" / "latest").read_text().strip() == "global_step4"
    loaded, _ = make(cfg, seed=2)
    path, client = loaded.load_checkpoint(tmp_path / "ck")
    assert path == os.path.join(str(tmp_path / "ck"), "global_step4") and client == {}
    assert all(torch.equal(p, q) for p, q in zip(full_params(loaded), full_params(saved), strict=True))
    assert same_optimizer_state(saved, loaded)


def test_training_goes_on_bitwise_after_a_load(tmp_path):
    cfg = ds_config(tmp_path, "cpu", scheduler=WARMUP)
    a = trained(cfg, steps=3)
    a.save_checkpoint(tmp_path / "ck")
    b, _ = make(cfg, seed=5)
    b.load_checkpoint(tmp_path / "ck")
    for x, y in batches(3, seed=9):
        for e in (a, b):
            e.backward(e(x, y))
            e.step()
    assert all(torch.equal(p, q) for p, q in zip(full_params(a), full_params(b), strict=True))


class Stack(torch.nn.Module):
    """DeepSpeed's SimpleModel: linear layers and a cross-entropy loss."""

    def __init__(self, hidden: int, layers: int = 2) -> None:
        super().__init__()
        self.linears = torch.nn.ModuleList(torch.nn.Linear(hidden, hidden) for _ in range(layers))

    def forward(self, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        for layer in self.linears:
            x = layer(x)
        return torch.nn.functional.cross_entropy(x, y)


@pytest.mark.parametrize(
    ("params", "states"),
    [("none", "nvme"), ("cpu", "nvme"), ("nvme", "none"), ("nvme", "cpu"), ("nvme", "nvme")],
)
@pytest.mark.parametrize("precision", ["fp16", "bf16"])
def test_nvme_tiers_resume_bitwise_and_leave_nothing(tmp_path, params, states, precision):
    """DeepSpeed's TestNVMeCheckpointing: train, save, train on; a second model loads the checkpoint and
    replays the same batches to the same loss, bitwise. Its budgets are far below one layer (a live budget
    of 100 elements, sub-groups of 100): one layer's params at a time. The swap folder is empty after
    ``destroy``."""
    swap = tmp_path / "zero"
    swap.mkdir()
    hidden, dtype = 64, torch.float16 if precision == "fp16" else torch.bfloat16
    cfg = {
        "train_micro_batch_size_per_gpu": 1,
        "optimizer": {"type": "Adam", "params": {"lr": 0.00015}},
        precision: {"enabled": True, **({"initial_scale_power": 8} if precision == "fp16" else {})},
        "zero_optimization": {
            "stage": 3,
            "offload_param": {"device": params, "nvme_path": str(swap)},
            "offload_optimizer": {"device": states, "nvme_path": str(swap)},
            "sub_group_size": 100,
            "stage3_max_live_parameters": 100,
            "stage3_param_persistence_threshold": 0,
        },
        "aio": {"block_size": 1048576},
    }

    def build() -> Any:
        torch.manual_seed(123)
        with deepspeed.zero.Init(config_dict_or_path=cfg):
            model = Stack(hidden)
        return deepspeed.initialize(model=model, model_parameters=model.parameters(), config=cfg)[0]

    def train(engine: Any, data: list[tuple[torch.Tensor, torch.Tensor]]) -> None:
        for x, y in data:
            engine.backward(engine(x, y))
            engine.step()

    first, second, last = (
        list(batches(n, hidden, batch=1, seed=s, dtype=dtype)) for n, s in [(2, 1), (2, 2), (1, 3)]
    )
    engine = build()
    engine.empty_partition_cache()
    train(engine, first)
    engine.save_checkpoint(str(tmp_path / "checkpoint"))
    train(engine, second)
    before = float(engine(*last[0]).detach())
    engine.destroy()
    assert list(swap.iterdir()) == []

    engine = build()
    engine.load_checkpoint(str(tmp_path / "checkpoint"))
    train(engine, second)
    assert float(engine(*last[0]).detach()) == before
    engine.destroy()
    assert list(swap.iterdir()) == []


def test_a_missing_latest_is_no_checkpoint_to_resume_from(tmp_path):
    engine, _ = make(ds_config(tmp_path, "cpu"), seed=0)
    before = full_params(engine)
    with pytest.warns(zswap.ZswapWarning, match="no 'latest' file"):
        assert engine.load_checkpoint(str(tmp_path)) == (None, None)
    with pytest.warns(zswap.ZswapWarning, match="no 'latest' file"):
        assert engine.load_checkpoint(str(tmp_path / "never_made")) == (None, None)
    assert all(torch.equal(p, q) for p, q in zip(full_params(engine), before, strict=True))
    # A tag that does not exist is an error, as is any missing checkpoint for zswap's own Engine.
    with pytest.raises(CheckpointNotFoundError, match="'nope' does not exist"):
        engine.load_checkpoint(str(tmp_path), tag="nope")
    with pytest.raises(CheckpointNotFoundError, match="no 'latest' file"):
        zswap.Engine.load_checkpoint(engine, tmp_path)
    engine.close()


@pytest.mark.parametrize("save_dir", [None, ""])
def test_saving_to_no_folder_is_a_value_error(tmp_path, save_dir, monkeypatch):
    monkeypatch.chdir(tmp_path)
    engine, _ = make(ds_config(tmp_path, "cpu"), seed=0)
    with engine:
        with pytest.raises(ValueError, match="save_dir must name a checkpoint folder") as info:
            engine.save_checkpoint(save_dir=save_dir)
        assert isinstance(info.value, CheckpointArgumentError | zswap.ZswapError)
        with pytest.raises(CheckpointArgumentError, match="load_dir must name a checkpoint folder"):
            zswap.Engine.load_checkpoint(engine, "")
    assert list(tmp_path.iterdir()) == []  # nothing was written to the current directory


def test_save_latest_false_leaves_latest_alone(tmp_path):
    engine = trained(ds_config(tmp_path, "cpu"), steps=2)
    with engine:
        engine.save_checkpoint(tmp_path, tag="first")
        engine.save_checkpoint(tmp_path, tag="second", save_latest=False)
        assert (tmp_path / "latest").read_text().strip() == "first"
        assert (tmp_path / "second").is_dir()


def test_deepspeed_arguments_zswap_cannot_honour_are_refused(tmp_path):
    engine = trained(ds_config(tmp_path, "cpu"), steps=1)
    with engine:
        with pytest.raises(TypeError, match="exclude_frozen_parameters=True is not supported"):
            engine.save_checkpoint(tmp_path, exclude_frozen_parameters=True)
        engine.save_checkpoint(tmp_path)
        with pytest.raises(TypeError, match="load_module_strict=False is not supported"):
            engine.load_checkpoint(tmp_path, load_module_strict=False)
        with pytest.raises(TypeError, match=r"custom_load_fn=.* is not supported"):
            engine.load_checkpoint(tmp_path, custom_load_fn=lambda *a: None)


def test_the_batch_queries_of_deepspeeds_engine(tmp_path):
    cfg = ds_config(tmp_path, "cpu", gradient_clipping=1.0)
    cfg.update(train_batch_size=8, gradient_accumulation_steps=4)
    engine, _ = make(cfg, seed=0)
    with engine:
        assert engine.train_batch_size() == 8
        assert engine.train_micro_batch_size_per_gpu() == 2
        assert engine.gradient_accumulation_steps() == 4
        for x, y in batches(4):
            engine.backward(engine(x, y))
            engine.step()
        assert engine.global_steps == 1 and engine.get_global_grad_norm() > 0


@pytest.mark.dist
def test_two_ranks_must_agree_on_the_tag(tmp_path):
    run_ranks(WORKER, tmp_path)
