"""`ZswapStrategy` in the patterns Lightning's own DeepSpeed tests and callbacks use: a module that keeps
the optimizer it returned and sets its lr, a ``GradientAccumulationScheduler`` that lengthens the windows
mid-fit, and what ``on_save_checkpoint`` adds to a checkpoint's ``state_dict`` — each against the plain
Trainer."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import torch

import zswap

pl = pytest.importorskip(
    "lightning.pytorch", reason="the 'lightning' package (zswap[lightning]) is not installed"
)

from tests.test_lightning import (  # noqa: E402
    Regressor,
    _assert_same_run,
    _config,
    _data,
    _fit,
    _trainer,
    pytestmark,  # noqa: F401 (the same filters)
)
from zswap.lightning import ZswapStrategy  # noqa: E402


class KeepsItsOptimizer(Regressor):
    """Sets the lr through the optimizer it returned, kept as ``self.opt``: a common hand-made warmup."""

    def configure_optimizers(self) -> Any:
        self.opt = super().configure_optimizers()
        return self.opt

    def on_train_batch_start(self, batch: Any, batch_idx: int) -> None:
        self.opt.param_groups[0]["lr"] = 2e-3 * (batch_idx + 1)


def test_an_optimizer_kept_by_the_module_sets_what_the_engine_steps(tmp_path):
    """The AdamW the module returned became zswap's offloaded AdamW; its groups are that AdamW's own
    dicts now, so the module's writes reach the steps. Before, they went to the old object: training ran at
    the first lr throughout, silently."""
    ref, _ = _fit(module=KeepsItsOptimizer())
    ours, trainer = _fit(ZswapStrategy(_config(tmp_path)), module=KeepsItsOptimizer())
    _assert_same_run(ours, ref, 5)
    assert trainer.optimizers[0].param_groups[0]["lr"] == ref.opt.param_groups[0]["lr"] == 1e-2


def test_an_accumulation_schedule_that_lengthens_the_windows_equals_plain(tmp_path):
    """``GradientAccumulationScheduler({0: 1, 1: 2})``: one batch a step in the first epoch, two in the
    second. Before, the engine learned of windows only where the fit began with several batches a step,
    and the second epoch's first backward failed (a second backward before engine.step())."""

    def fit(strategy: Any) -> Regressor:
        schedule = pl.callbacks.GradientAccumulationScheduler({0: 1, 1: 2})
        module, _ = _fit(strategy, max_steps=-1, max_epochs=2, callbacks=[schedule])
        return module

    ref = fit(None)
    ours = fit(ZswapStrategy(_config(tmp_path)))
    _assert_same_run(ours, ref, 24)  # 12 batches an epoch: 12 + 6 optimizer steps


class Ema(Regressor):
    """Adds a tensor of its own to the checkpoint's ``state_dict`` and reads it back (an EMA's weights)."""

    loaded: dict[str, torch.Tensor] | None = None

    def on_save_checkpoint(self, checkpoint: dict[str, Any]) -> None:
        checkpoint["state_dict"]["ema.weight"] = torch.arange(4.0)

    def on_load_checkpoint(self, checkpoint: dict[str, Any]) -> None:
        self.loaded = dict(checkpoint["state_dict"])


def test_what_on_save_checkpoint_adds_to_the_state_dict_comes_back(tmp_path):
    """The module's own weights go into the engine checkpoint; an entry a hook adds beside them is saved
    with the Trainer's state and handed to ``on_load_checkpoint``. Before, it was dropped without a word."""
    (tmp_path / "swap").mkdir()
    _, trainer = _fit(ZswapStrategy(_config(tmp_path / "swap")), module=Ema())
    path = Path(tmp_path / "ema.ckpt")
    trainer.save_checkpoint(path)
    again = Ema()
    _trainer(ZswapStrategy(_config(tmp_path / "swap"))).validate(again, _data(8), ckpt_path=str(path))
    assert again.loaded is not None and torch.equal(again.loaded["ema.weight"], torch.arange(4.0))


class BuiltInInit(Regressor):
    """Builds its network in ``__init__`` (under ``trainer.init_module()``), not in ``configure_model``."""

    def __init__(self) -> None:
        super().__init__()
        self.net = torch.nn.Sequential(
            torch.nn.Linear(6, 24),
            torch.nn.Tanh(),
            torch.nn.Linear(24, 24),
            torch.nn.Tanh(),
            torch.nn.Linear(24, 1),
        )


def test_trainer_init_module_partitions_the_model_as_it_is_built(tmp_path):
    """As Lightning's DeepSpeed strategy runs ``zero.Init`` there: built under ``trainer.init_module()``
    each param is partitioned and offloaded at once (was built whole in memory), and fit equals plain."""
    torch.manual_seed(0)
    ref = BuiltInInit()
    ref_trainer = _trainer()
    ref_trainer.fit(ref, _data())
    trainer = _trainer(ZswapStrategy(_config(tmp_path)))
    torch.manual_seed(0)
    with trainer.init_module():
        ours = BuiltInInit()
    assert all(zswap.param_state(p) is not None and p.numel() == 0 for p in ours.parameters())
    trainer.fit(ours, _data())
    _assert_same_run(ours, ref, 5)


@pytest.mark.parametrize("switch", ["partition_activations", "cpu_checkpointing", "profile"])
def test_deepspeeds_activation_checkpointing_extras_are_refused(tmp_path, switch):
    """Lightning's DeepSpeed strategy hands them to ``deepspeed.checkpointing.configure``; zswap's
    checkpoint does none of them, so they were dropped without a word."""
    with pytest.raises(zswap.ConfigError, match=rf"^activation_checkpointing\.{switch} is on: zswap's "):
        ZswapStrategy(_config(tmp_path, activation_checkpointing={switch: True}))
    ZswapStrategy(_config(tmp_path, activation_checkpointing={switch: False}))


def test_a_plain_lightning_checkpoint_file_is_refused_saying_how_to_load_it(tmp_path):
    _, plain = _fit()
    path = tmp_path / "plain.ckpt"
    plain.save_checkpoint(path)
    (tmp_path / "swap").mkdir()
    with pytest.raises(zswap.ZswapError, match=r"is a file: a plain Lightning checkpoint, not the engine"):
        _fit(ZswapStrategy(_config(tmp_path / "swap")), ckpt_path=str(path))
