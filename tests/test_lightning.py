"""`zswap.lightning.ZswapStrategy`: a LightningModule trained, validated, tested and predicted through the
strategy gives bitwise the losses, outputs and weights of the same module run by a plain Trainer with
``torch.optim.AdamW(fused=True)`` (whose CPU kernel zswap's offloaded AdamW matches bit for bit; forward
and backward on partitioned params are bitwise those of the plain model), with params and optimizer state
on NVMe (a temp dir)."""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Any, ClassVar

import pytest
import torch
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

import zswap

pl = pytest.importorskip(
    "lightning.pytorch", reason="the 'lightning' package (zswap[lightning]) is not installed"
)

from zswap.lightning import ZswapPrecision, ZswapStrategy  # noqa: E402

pytestmark = [
    # Lightning's own notices about this tiny setup (no DataLoader workers, a log interval longer than
    # the run) and a deprecation inside its pytree helper: not what these tests are about.
    pytest.mark.filterwarnings("ignore::lightning.fabric.utilities.warnings.PossibleUserWarning"),
    pytest.mark.filterwarnings("ignore:.*LeafSpec.*:FutureWarning"),
]

STEPS = 5


class Regressor(pl.LightningModule):
    """Builds its network in ``configure_model`` (so under zswap.Init) and records every loss."""

    def __init__(self, optimizer: str = "adamw", schedule: bool = False) -> None:
        super().__init__()
        self.net: nn.Module | None = None
        self.losses: list[torch.Tensor] = []
        self.evals: list[torch.Tensor] = []
        self.optimizer_kind = optimizer
        self.schedule = schedule

    def configure_model(self) -> None:
        if self.net is None:  # Lightning calls it at every fit/validate/test/predict
            self.net = nn.Sequential(
                nn.Linear(6, 24), nn.Tanh(), nn.Linear(24, 24), nn.Tanh(), nn.Linear(24, 1)
            )

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        assert self.net is not None
        return self.net(x)

    def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
        x, y = batch
        loss = nn.functional.mse_loss(self(x), y)
        self.losses.append(loss.detach().clone())
        return loss

    def validation_step(self, batch: Any, batch_idx: int) -> None:
        x, y = batch
        self.evals.append(nn.functional.mse_loss(self(x), y))

    def test_step(self, batch: Any, batch_idx: int) -> None:
        self.validation_step(batch, batch_idx)

    def predict_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
        return self(batch[0])

    def configure_optimizers(self) -> Any:
        params = self.parameters()
        if self.optimizer_kind == "none":
            return None
        if self.optimizer_kind == "sgd":
            return torch.optim.SGD(params, lr=0.05)
        if self.optimizer_kind == "adam":
            opt: torch.optim.Optimizer = torch.optim.Adam(params, lr=2e-2, weight_decay=0.1, fused=True)
        else:
            opt = torch.optim.AdamW(params, lr=2e-2, betas=(0.8, 0.95), weight_decay=0.1, fused=True)
        if not self.schedule:
            return opt
        sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda step: 1.0 / (1 + step))
        return {"optimizer": opt, "lr_scheduler": {"scheduler": sched, "interval": "step"}}


def _data(n: int = 48) -> DataLoader:
    g = torch.Generator().manual_seed(0)
    x = torch.randn(n, 6, generator=g)
    y = x[:, :1].sin() + 0.1 * torch.randn(n, 1, generator=g)
    return DataLoader(TensorDataset(x, y), batch_size=4)


def _config(tmp_path: Path, **extra: Any) -> dict[str, Any]:
    return {
        "zero_optimization": {
            "stage": 3,
            "offload_param": {"device": "nvme", "nvme_path": str(tmp_path)},
            "offload_optimizer": {"device": "nvme", "nvme_path": str(tmp_path)},
            "stage3_param_persistence_threshold": 0,
        },
        **extra,
    }


def _trainer(strategy: Any = None, **kw: Any) -> Any:
    args = {
        "max_steps": STEPS,
        "accelerator": "cpu",
        "devices": 1,
        "logger": False,
        "enable_checkpointing": False,
        "enable_progress_bar": False,
        "enable_model_summary": False,
        **kw,
    }
    if strategy is not None:
        args["strategy"] = strategy
    return pl.Trainer(**args)


def _fit(
    strategy: Any = None,
    module: Regressor | None = None,
    samples: int = 48,
    ckpt_path: str | None = None,
    **kw: Any,
) -> tuple[Regressor, Any]:
    torch.manual_seed(0)
    module = module if module is not None else Regressor()
    trainer = _trainer(strategy, **kw)
    trainer.fit(module, _data(samples), ckpt_path=ckpt_path)
    return module, trainer


def _weights(module: Regressor) -> list[torch.Tensor]:
    assert module.net is not None
    params = list(module.net.parameters())
    with zswap.GatheredParameters(params):
        return [p.detach().clone() for p in params]


def _assert_same_run(ours: Regressor, ref: Regressor, steps: int) -> None:
    assert len(ours.losses) == len(ref.losses) == steps
    assert torch.equal(torch.stack(ours.losses), torch.stack(ref.losses))
    for a, b in zip(_weights(ours), _weights(ref), strict=True):
        assert torch.equal(a, b)


# -- training --------------------------------------------------------------------------------------


@pytest.mark.parametrize("accumulate", [1, 2])
def test_fit_equals_plain_trainer(tmp_path, accumulate):
    ref, _ = _fit(accumulate_grad_batches=accumulate)
    ours, trainer = _fit(ZswapStrategy(_config(tmp_path)), accumulate_grad_batches=accumulate)
    assert ours.net is not None
    for p in ours.net.parameters():
        st = zswap.param_state(p)
        assert st is not None and st.tier == "nvme" and p.numel() == 0
    _assert_same_run(ours, ref, STEPS * accumulate)
    opt = trainer.optimizers[0]
    assert isinstance(opt, zswap.optim.OffloadedAdamW) and opt.tier == "nvme"
    group = opt.param_groups[0]
    assert (group["lr"], group["betas"], group["eps"], group["weight_decay"]) == (
        2e-2,
        (0.8, 0.95),
        1e-8,
        0.1,
    )
    assert trainer.strategy.engine.optimizer is opt
    assert trainer.global_step == STEPS


def test_a_fitted_run_is_freed_with_its_trainer_and_module(tmp_path):
    # The engine stays open after fit; once the trainer, the strategy and the module are dropped, its
    # buffers go too (a finalizer holding the run, and hooks holding params strongly, kept them mapped
    # for good: one engine per fit, across the test suite).
    import gc

    from zswap import memory

    gc.collect()
    start = memory.live()

    def fit_and_drop() -> None:
        _, trainer = _fit(ZswapStrategy(_config(tmp_path)))
        assert trainer.strategy.engine.optimizer is not None
        assert memory.live()["fetch"] > start["fetch"] and memory.live()["optimizer"] > start["optimizer"]

    fit_and_drop()
    gc.collect()
    assert memory.live() == start


def test_adam_with_l2_decay_equals_plain_trainer(tmp_path):
    ref, _ = _fit(module=Regressor("adam"))
    ours, trainer = _fit(ZswapStrategy(_config(tmp_path)), module=Regressor("adam"))
    _assert_same_run(ours, ref, STEPS)
    assert trainer.optimizers[0].param_groups[0]["decoupled_weight_decay"] is False


@pytest.mark.parametrize("extra", [{}, {"gradient_clipping": "auto"}], ids=["absent", "auto"])
def test_gradient_clipping_by_norm_equals_plain_trainer(tmp_path, extra):
    """``"auto"`` (Hugging Face's "the front end's") is the Trainer's gradient_clip_val here."""
    ref, _ = _fit(gradient_clip_val=0.05)
    ours, trainer = _fit(ZswapStrategy(_config(tmp_path, **extra)), gradient_clip_val=0.05)
    _assert_same_run(ours, ref, STEPS)
    assert trainer.strategy.engine.last_grad_norm is not None


class _EveryStep(pl.Callback):
    """The weights after every optimizer step; ``early=False`` turns the engine's early step off."""

    def __init__(self, early: bool = True) -> None:
        self.early = early
        self.weights: list[list[torch.Tensor]] = []

    def on_fit_start(self, trainer: Any, module: Any) -> None:
        if not self.early:
            trainer.strategy.engine.early_step = False

    def on_train_batch_end(self, trainer: Any, module: Any, *args: Any) -> None:
        if trainer.global_step > len(self.weights):
            self.weights.append(_weights(module))


class ClipsLate(Regressor):
    """Decides after backward whether this step clips: at 0.05 (below the norm) on odd steps only."""

    def configure_gradient_clipping(self, optimizer: Any, gradient_clip_val: Any = None, **kw: Any) -> None:
        if self.trainer.global_step % 2:
            self.clip_gradients(optimizer, gradient_clip_val=0.05, gradient_clip_algorithm="norm")


class Manual(Regressor):
    """Manual optimization: the module calls backward and step itself."""

    def __init__(self) -> None:
        super().__init__()
        self.automatic_optimization = False

    def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
        opt = self.optimizers()
        opt.zero_grad()
        loss = nn.functional.mse_loss(self(batch[0]), batch[1])
        self.losses.append(loss.detach().clone())
        self.manual_backward(loss)
        self.before_step(opt)
        opt.step()
        return loss

    def before_step(self, opt: Any) -> None:
        """Between ``manual_backward`` and ``opt.step()``."""


class ManualClips(Manual):
    """Manual optimization clipping at 0.05 (below the norm) on odd steps, between backward and step."""

    def before_step(self, opt: Any) -> None:
        if self.trainer.global_step % 2:
            self.clip_gradients(opt, gradient_clip_val=0.05, gradient_clip_algorithm="norm")


# (Trainer arguments, the module, samples: 44 is 11 batches, an epoch whose last window is one batch)
EARLY_SETUPS = {
    "clip-below-norm": ({"gradient_clip_val": 0.05}, Regressor, 48),
    "clip-above-norm": ({"gradient_clip_val": 100.0}, Regressor, 48),
    "clip-set-after-backward": ({}, ClipsLate, 48),
    "manual-clip-after-backward": ({}, ManualClips, 48),
    "accumulate-2": ({"accumulate_grad_batches": 2, "max_steps": 8}, Regressor, 44),
    "accumulate-2-clip-below": (
        {"accumulate_grad_batches": 2, "max_steps": 8, "gradient_clip_val": 0.05},
        Regressor,
        44,
    ),
    "accumulate-2-clip-above": (
        {"accumulate_grad_batches": 2, "max_steps": 8, "gradient_clip_val": 100.0},
        Regressor,
        44,
    ),
    "accumulate-2-clip-after-backward": ({"accumulate_grad_batches": 2, "max_steps": 8}, ClipsLate, 44),
}


@pytest.mark.parametrize("setup", list(EARLY_SETUPS))
def test_update_in_backward_under_clipping_and_accumulation_is_exact(tmp_path, setup):
    """With clipping (the Trainer's, or one a hook decides after backward) and accumulation (an epoch's
    last window cut short), the update runs in backward and the weights after every optimizer step are
    bitwise those of the same run with the early step off, and of a plain Trainer."""
    kw, kind, samples = EARLY_SETUPS[setup]
    (tmp_path / "off").mkdir()
    (tmp_path / "on").mkdir()
    runs = []
    for strategy, early in (
        (None, True),
        (ZswapStrategy(_config(tmp_path / "off")), False),
        (ZswapStrategy(_config(tmp_path / "on")), True),
    ):
        steps = _EveryStep(early)
        module, trainer = _fit(strategy, module=kind(), samples=samples, callbacks=[steps], **kw)
        runs.append((module, trainer, steps.weights))
    (ref, ref_trainer, want), (_, off_trainer, got_off), (on, on_trainer, got_on) = runs
    steps = kw.get("max_steps", STEPS)
    assert ref_trainer.global_step == on_trainer.global_step == steps
    assert len(want) == len(got_off) == len(got_on) == steps
    for i, (a, b, c) in enumerate(zip(want, got_off, got_on, strict=True)):
        for x, y, z in zip(a, b, c, strict=True):
            assert torch.equal(y, z), f"step {i + 1}: early step on vs off"
            assert torch.equal(x, z), f"step {i + 1}: zswap vs the plain Trainer"
    _assert_same_run(on, ref, len(ref.losses))
    stats = on_trainer.strategy.engine.stats()
    fast = stats["steps_in_backward"] + stats["steps_deferred"]
    if "after-backward" in setup:  # a step that clips after all is redone from the kept gradients
        assert fast > 0 and stats["steps_redone"] > 0, stats
    elif "below" in setup:  # clipping bit at the last step: held through backward, updated at the step
        assert stats["steps_deferred"] == steps - 1, stats
    else:  # the first step makes the optimizer's records: every later one runs in backward
        assert stats["steps_in_backward"] == steps - 1, stats
    assert stats["steps_in_backward"] + stats["steps_deferred"] + stats["steps_ordinary"] == steps
    off_stats = off_trainer.strategy.engine.stats()
    assert off_stats["steps_ordinary"] == steps
    assert stats["bytes_read"] < off_stats["bytes_read"], (stats, off_stats)
    assert off_stats["steps_ordinary_reason"] == "engine.early_step is False"


def test_value_clipping_is_refused(tmp_path):
    with pytest.raises(zswap.ConfigError, match="gradient_clip_algorithm='value' is not supported"):
        _fit(ZswapStrategy(_config(tmp_path)), gradient_clip_val=0.05, gradient_clip_algorithm="value")


def test_clip_conflicting_with_the_config_is_refused(tmp_path):
    strategy = ZswapStrategy(_config(tmp_path, gradient_clipping=1.0))
    with pytest.raises(
        zswap.ConfigError, match=r"gradient_clip_val=0.5\) and the config's gradient_clipping"
    ):
        _fit(strategy, gradient_clip_val=0.5)


def test_lr_scheduler_drives_the_offloaded_optimizer(tmp_path):
    ref, ref_trainer = _fit(module=Regressor(schedule=True))
    ours, trainer = _fit(ZswapStrategy(_config(tmp_path)), module=Regressor(schedule=True))
    _assert_same_run(ours, ref, STEPS)
    sched = trainer.lr_scheduler_configs[0].scheduler
    assert sched.optimizer is trainer.optimizers[0]
    assert sched.get_last_lr() == ref_trainer.lr_scheduler_configs[0].scheduler.get_last_lr()
    assert trainer.optimizers[0].param_groups[0]["lr"] == ref_trainer.optimizers[0].param_groups[0]["lr"]


def test_config_optimizer_is_used_when_configure_optimizers_returns_none(tmp_path):
    class Reference(Regressor):
        def configure_optimizers(self) -> Any:
            return torch.optim.AdamW(
                self.parameters(), lr=1e-2, betas=(0.7, 0.9), weight_decay=0.2, fused=True
            )

    cfg = _config(
        tmp_path,
        optimizer={"type": "AdamW", "params": {"lr": 1e-2, "betas": [0.7, 0.9], "weight_decay": 0.2}},
    )
    ref, _ = _fit(module=Reference())
    ours, trainer = _fit(ZswapStrategy(cfg), module=Regressor("none"))
    _assert_same_run(ours, ref, STEPS)
    assert trainer.optimizers[0] is trainer.strategy.engine.optimizer
    assert trainer.optimizers[0].tier == "nvme"


WARMUP = {
    "type": "WarmupLR",
    "params": {"warmup_max_lr": 2e-2, "warmup_num_steps": 8, "warmup_type": "linear"},
}


def test_config_scheduler_is_stepped_by_the_engine_at_each_optimizer_step(tmp_path):
    class Reference(Regressor):
        """Lightning steps the same DeepSpeed schedule (zswap's implementation) over a torch AdamW."""

        def configure_optimizers(self) -> Any:
            opt = super().configure_optimizers()
            sched = zswap.schedules.build(zswap.load_config({"scheduler": WARMUP}).scheduler, opt)
            return {"optimizer": opt, "lr_scheduler": {"scheduler": sched, "interval": "step"}}

        def lr_scheduler_step(self, scheduler: Any, metric: Any) -> None:
            scheduler.step()

    ref, ref_trainer = _fit(module=Reference(), accumulate_grad_batches=2)
    ours, trainer = _fit(ZswapStrategy(_config(tmp_path, scheduler=WARMUP)), accumulate_grad_batches=2)
    _assert_same_run(ours, ref, 2 * STEPS)
    engine = trainer.strategy.engine
    assert engine.get_lr() == [ref_trainer.optimizers[0].param_groups[0]["lr"]]
    assert engine.lr_scheduler.last_batch_iteration == STEPS - 1 and engine.global_steps == STEPS


def test_module_scheduler_and_config_scheduler_together_are_refused(tmp_path):
    with pytest.raises(zswap.ConfigError, match=r"the config has a 'scheduler' section \(WarmupLR\)"):
        _fit(ZswapStrategy(_config(tmp_path, scheduler=WARMUP)), module=Regressor(schedule=True))


def test_no_optimizer_anywhere_runs_without_steps_as_lightning_does(tmp_path):
    with pytest.warns(UserWarning, match="configure_optimizers` returned `None`"):
        ref, _ = _fit(module=Regressor("none"))
    with pytest.warns(UserWarning, match="configure_optimizers` returned `None`"):
        ours, trainer = _fit(ZswapStrategy(_config(tmp_path)), module=Regressor("none"))
    _assert_same_run(ours, ref, STEPS)
    torch.manual_seed(0)
    untouched = Regressor()
    untouched.configure_model()
    for a, b in zip(_weights(ours), _weights(untouched), strict=True):
        assert torch.equal(a, b)
    assert trainer.strategy.engine.optimizer is None


def test_config_optimizer_and_module_optimizer_together_are_refused(tmp_path):
    cfg = _config(tmp_path, optimizer={"type": "AdamW", "params": {"lr": 1e-2}})
    with pytest.raises(zswap.ConfigError, match="returned a AdamW and the config has an 'optimizer' section"):
        _fit(ZswapStrategy(cfg))


def test_other_torch_optimizers_run_as_given(tmp_path):
    cfg = _config(tmp_path)
    cfg["zero_optimization"]["offload_optimizer"] = {"device": "cpu"}
    ref, _ = _fit(module=Regressor("sgd"))
    ours, trainer = _fit(ZswapStrategy(cfg), module=Regressor("sgd"))
    _assert_same_run(ours, ref, STEPS)
    assert type(trainer.optimizers[0]) is torch.optim.SGD


def test_other_optimizers_with_nvme_optimizer_state_are_refused(tmp_path):
    with pytest.raises(
        zswap.ConfigError, match=r"offload_optimizer\.device is 'nvme' but configure_optimizers returned"
    ):
        _fit(ZswapStrategy(_config(tmp_path)), module=Regressor("sgd"))


def test_amsgrad_is_refused_not_dropped(tmp_path):
    class AmsGrad(Regressor):
        def configure_optimizers(self) -> Any:
            return torch.optim.AdamW(self.parameters(), amsgrad=True)

    with pytest.raises(zswap.ConfigError, match="configure_optimizers, param group 0: amsgrad=True is not"):
        _fit(ZswapStrategy(_config(tmp_path)), module=AmsGrad())


def test_accumulation_in_the_config_must_agree_with_the_trainer(tmp_path):
    ref, _ = _fit(accumulate_grad_batches=2)
    ours, _ = _fit(ZswapStrategy(_config(tmp_path, gradient_accumulation_steps=2)), accumulate_grad_batches=2)
    _assert_same_run(ours, ref, 2 * STEPS)
    with pytest.raises(
        zswap.ConfigError,
        match=r"gradient_accumulation_steps=4 \(given or derived from its batch sizes\) differs from "
        r"Trainer\(accumulate_grad_batches=2\)",
    ):
        _fit(ZswapStrategy(_config(tmp_path, gradient_accumulation_steps=4)), accumulate_grad_batches=2)
    derived = _config(tmp_path, train_batch_size=16, train_micro_batch_size_per_gpu=4)  # 16 / 4 = 4 steps
    with pytest.raises(zswap.ConfigError, match=r"gradient_accumulation_steps=4 \(given or derived"):
        _fit(ZswapStrategy(derived), accumulate_grad_batches=2)
    agreeing = _config(tmp_path, train_batch_size=8, train_micro_batch_size_per_gpu=4)
    again, _ = _fit(ZswapStrategy(agreeing), accumulate_grad_batches=2)
    _assert_same_run(again, ref, 2 * STEPS)


def test_a_grad_accum_dtype_zswap_does_not_sum_in_is_refused_at_fit(tmp_path):
    """float32 params' gradients are summed in float32 over Lightning's windows: bf16 sums are refused when
    the engine is built (and it is closed), and ``fp32`` (what zswap does) trains as the plain Trainer."""
    bad = ZswapStrategy(_config(tmp_path, data_types={"grad_accum_dtype": "bf16"}))
    refused = r"grad_accum_dtype is 'bf16' .* over the 2 .* set it to fp32$"
    with pytest.raises(zswap.ConfigError, match=refused):
        _fit(bad, accumulate_grad_batches=2)
    ref, _ = _fit(accumulate_grad_batches=2)
    good = ZswapStrategy(_config(tmp_path, data_types={"grad_accum_dtype": "fp32"}))
    ours, _ = _fit(good, accumulate_grad_batches=2)
    _assert_same_run(ours, ref, 2 * STEPS)


def test_manual_optimization_equals_plain_trainer(tmp_path):
    ref, _ = _fit(module=Manual())
    ours, _ = _fit(ZswapStrategy(_config(tmp_path)), module=Manual())
    _assert_same_run(ours, ref, STEPS)


def test_default_config_keeps_everything_in_memory():
    ref, _ = _fit()
    ours, trainer = _fit(ZswapStrategy())
    _assert_same_run(ours, ref, STEPS)
    assert ours.net is not None and all(zswap.param_state(p) is not None for p in ours.net.parameters())
    assert trainer.optimizers[0].tier == "cpu"


def test_the_strategy_is_registered_by_name():
    ref, _ = _fit()
    ours, trainer = _fit("zswap")
    assert type(trainer.strategy) is ZswapStrategy
    _assert_same_run(ours, ref, STEPS)
    assert ours.net is not None and all(zswap.param_state(p) is not None for p in ours.net.parameters())
    assert "zswap" in pl.strategies.StrategyRegistry.available_strategies()


# -- evaluation and prediction ---------------------------------------------------------------------


def test_validate_test_predict_equal_plain_trainer(tmp_path):
    ref, ref_trainer = _fit()
    ours, trainer = _fit(ZswapStrategy(_config(tmp_path)))
    for run in ("validate", "test"):
        ref.evals.clear()
        ours.evals.clear()
        expected = getattr(ref_trainer, run)(ref, _data(16), verbose=False)
        got = getattr(trainer, run)(ours, _data(16), verbose=False)
        assert got == expected
        assert torch.equal(torch.stack(ours.evals), torch.stack(ref.evals))
    expected = ref_trainer.predict(ref, _data(16))
    got = trainer.predict(ours, _data(16))
    assert len(got) == len(expected) == 4
    for a, b in zip(got, expected, strict=True):
        assert torch.equal(a, b)
    assert ours.net is not None and all(p.numel() == 0 for p in ours.net.parameters())


def test_module_stays_usable_after_fit_and_a_new_strategy_takes_it_over(tmp_path):
    ref, _ = _fit()
    ours, _ = _fit(ZswapStrategy(_config(tmp_path)))
    x = torch.randn(3, 6)
    with torch.no_grad():
        assert torch.equal(ours(x), ref(x))  # the fit's engine is still open
    # Another Trainer with another strategy over the same module closes the first engine and runs.
    got = _trainer(ZswapStrategy(_config(tmp_path))).predict(ours, _data(8))
    expected = _trainer().predict(ref, _data(8))
    for a, b in zip(got, expected, strict=True):
        assert torch.equal(a, b)


def test_predict_without_fit_on_a_module_built_under_init(tmp_path):
    torch.manual_seed(0)
    ours = Regressor()
    got = _trainer(ZswapStrategy(_config(tmp_path))).predict(ours, _data(8))  # configure_model, then data
    torch.manual_seed(0)
    ref = Regressor()
    ref.configure_model()
    expected = _trainer().predict(ref, _data(8))
    for a, b in zip(got, expected, strict=True):
        assert torch.equal(a, b)


# -- checkpoints -----------------------------------------------------------------------------------


def test_save_and_resume_through_the_trainer_equals_lightnings_own(tmp_path):
    """fit → trainer.save_checkpoint → fit(ckpt_path=…) in a new Trainer on a new module, and
    validate(ckpt_path=…): the same losses and weights as Lightning's own checkpoints give a plain run."""

    def run(strategy: Any, folder: Path) -> tuple[list[torch.Tensor], Regressor, list[Any]]:
        first, trainer = _fit(strategy(), samples=24)
        path = folder / "half.ckpt"
        trainer.save_checkpoint(path)
        resumed, _ = _fit(
            strategy(), module=Regressor(), samples=24, max_steps=2 * STEPS, ckpt_path=str(path)
        )
        evaluated = Regressor()
        scores = _trainer(strategy()).validate(evaluated, _data(8), ckpt_path=str(path), verbose=False)
        return first.losses + resumed.losses, resumed, [scores, evaluated.evals]

    swap = tmp_path / "swap"
    swap.mkdir()
    (tmp_path / "ours").mkdir()
    (tmp_path / "plain").mkdir()
    ours = run(lambda: ZswapStrategy(_config(swap)), tmp_path / "ours")
    plain = run(lambda: None, tmp_path / "plain")
    assert len(ours[0]) == 2 * STEPS
    assert torch.equal(torch.stack(ours[0]), torch.stack(plain[0]))
    for a, b in zip(_weights(ours[1]), _weights(plain[1]), strict=True):
        assert torch.equal(a, b)
    assert ours[2][0] == plain[2][0]
    assert torch.equal(torch.stack(ours[2][1]), torch.stack(plain[2][1]))
    assert (tmp_path / "ours" / "half.ckpt").is_dir()  # an engine checkpoint: partitions, not empty tensors


def test_a_weights_only_checkpoint_leaves_the_optimizer_state_out(tmp_path):
    """``save_checkpoint(path, weights_only=True)`` (what ``ModelCheckpoint(save_weights_only=True)`` calls):
    the params without the optimizer's records (before: the whole engine checkpoint); it validates as the
    full one does, and fit refuses to resume from it, as Lightning refuses its own."""
    swap = tmp_path / "swap"
    swap.mkdir()
    _, trainer = _fit(ZswapStrategy(_config(swap)), samples=24)
    trainer.save_checkpoint(tmp_path / "full")
    trainer.save_checkpoint(tmp_path / "weights", weights_only=True)
    full = {p.name for p in (tmp_path / "full").glob("*/*")}
    weights = {p.name for p in (tmp_path / "weights").glob("*/*")}
    assert {n for n in full - weights} == {n for n in full if "exp_avg" in n or "master" in n} != set()
    scores = [
        _trainer(ZswapStrategy(_config(swap))).validate(Regressor(), _data(8), ckpt_path=str(tmp_path / d))
        for d in ("full", "weights")
    ]
    assert scores[0] == scores[1]
    with pytest.raises(zswap.ZswapError, match=r"holds no optimizer state .*weights_only=True"):
        _fit(
            ZswapStrategy(_config(swap)), samples=24, max_steps=2 * STEPS, ckpt_path=str(tmp_path / "weights")
        )


class ClosureFirst(Regressor):
    """Runs the step's closure (training_step, backward) itself, then steps: Lightning's documented way to
    look at the loss before stepping."""

    def optimizer_step(
        self, epoch: int, batch_idx: int, optimizer: Any, optimizer_closure: Any = None
    ) -> None:
        optimizer_closure()
        optimizer.step()


def test_an_optimizer_step_that_runs_the_closure_first_clips_as_lightning(tmp_path):
    """The backward runs before ``optimizer.step()`` reaches the strategy: the early step must already
    know that clipping may come (before: `GradientsNotKeptError` at the first clipped step)."""
    ref, _ = _fit(module=ClosureFirst(), gradient_clip_val=0.05)
    ours, _ = _fit(ZswapStrategy(_config(tmp_path)), module=ClosureFirst(), gradient_clip_val=0.05)
    _assert_same_run(ours, ref, STEPS)


class ReadsGrads(Regressor):
    def on_before_optimizer_step(self, optimizer: Any) -> None:
        self.seen = [p.grad for p in self.parameters()]


class _GradLogger(pl.Callback):
    def on_after_backward(self, trainer: Any, module: Any) -> None:
        pass


class CarriesGrads(Regressor):
    def optimizer_zero_grad(self, epoch: int, batch_idx: int, optimizer: Any) -> None:
        if batch_idx % 3 == 0:
            optimizer.zero_grad()


def test_hooks_written_for_p_grad_are_named_when_fit_starts(tmp_path):
    """Under zswap ``p.grad`` is None where Lightning's gradient hooks run, and an ``optimizer_zero_grad``
    that carries gradients over is not honoured: each is a `ZswapWarning` naming it (before: silently
    another run than Lightning's)."""
    with pytest.warns(zswap.ZswapWarning) as record:
        _fit(ZswapStrategy(_config(tmp_path)), module=ReadsGrads(), callbacks=[_GradLogger()])
    (warned,) = [str(w.message) for w in record if "p.grad" in str(w.message)]
    assert warned.startswith(
        "ZswapStrategy: ReadsGrads.on_before_optimizer_step, _GradLogger.on_after_backward run where "
        "Lightning has the gradients in p.grad; under zswap p.grad is None there"
    )
    assert "zswap.full_grad(p)" in warned
    with pytest.warns(zswap.ZswapWarning, match=r"CarriesGrads\.optimizer_zero_grad is overridden"):
        _fit(ZswapStrategy(_config(tmp_path)), module=CarriesGrads())


def test_params_added_after_init_module_take_the_trainers_precision(tmp_path):
    """``bf16-true`` casts the whole module in a plain Trainer: LoRA adapters injected after
    ``trainer.init_module()`` are bf16 too (``initialize`` alone keeps a PEFT tuner's float32 layers)."""
    peft = pytest.importorskip("peft")
    trainer = _trainer(ZswapStrategy(_config(tmp_path)), precision="bf16-true")
    with trainer.init_module():
        module = Regressor()
        module.configure_model()
    peft.inject_adapter_in_model(peft.LoraConfig(r=2, target_modules=["2"]), module.net)
    lora = [p for n, p in module.named_parameters() if "lora" in n]
    for p in lora:
        p.data = p.data.float()  # as get_peft_model makes them on a bf16 base
    assert lora and all(zswap.param_state(p) is None for p in lora)
    trainer.fit(module, _data())
    assert {zswap.param_state(p).dtype for p in module.parameters()} == {torch.bfloat16}


def test_sync_batchnorm_is_refused(tmp_path):
    """The strategy does not convert BatchNorm layers: the flag would change nothing (before: silently)."""
    with pytest.raises(zswap.ConfigError, match=r"Trainer\(sync_batchnorm=True\): ZswapStrategy does not"):
        _fit(ZswapStrategy(_config(tmp_path)), sync_batchnorm=True)


# -- configuration, precision, devices -------------------------------------------------------------


def test_config_as_path_or_dict_is_kept_as_a_private_dict(tmp_path):
    cfg = _config(tmp_path)
    path = tmp_path / "ds.json"
    path.write_text(json.dumps(cfg))
    from_path, from_dict = ZswapStrategy(str(path)), ZswapStrategy(cfg)
    assert from_path.config == from_dict.config == cfg
    cfg["zero_optimization"]["offload_param"]["device"] = "cpu"
    assert from_dict.config["zero_optimization"]["offload_param"]["device"] == "nvme"
    assert ZswapStrategy(os.fspath(path)).zswap_config == from_dict.zswap_config


def test_bad_config_fails_when_the_strategy_is_built(tmp_path):
    with pytest.raises(zswap.ConfigError, match="offload_parm"):
        ZswapStrategy({"zero_optimization": {"offload_parm": {"device": "nvme"}}})
    with pytest.raises(FileNotFoundError):
        ZswapStrategy(str(tmp_path / "missing.json"))
    with pytest.raises(TypeError, match="ZswapStrategy config must be a path"):
        ZswapStrategy(42)  # type: ignore[arg-type]


def test_checkpoint_io_plugins_are_refused(tmp_path):
    from lightning.pytorch.plugins import TorchCheckpointIO

    with pytest.raises(TypeError, match=r"a CheckpointIO plugin \(TorchCheckpointIO\) would not be used"):
        _trainer(ZswapStrategy(_config(tmp_path)), plugins=[TorchCheckpointIO()])


@pytest.mark.parametrize(("precision", "dtype"), [("bf16-true", torch.bfloat16), ("16-true", torch.float16)])
def test_half_precision_equals_zswaps_own_loop(tmp_path, precision, dtype):
    """Params in the half dtype (fp32 masters in the optimizer), inputs cast, fp16 loss-scaled: the run
    equals the same training written against zswap directly (``engine.backward`` + ``engine.step``)."""
    (tmp_path / "lightning").mkdir()
    ours, trainer = _fit(ZswapStrategy(_config(tmp_path / "lightning")), precision=precision)
    assert ours.net is not None
    assert {zswap.param_state(p).dtype for p in ours.net.parameters()} == {dtype}  # type: ignore[union-attr]

    cfg = _config(tmp_path, **{"bf16" if dtype == torch.bfloat16 else "fp16": {"enabled": True}})
    torch.manual_seed(0)
    module = Regressor()
    with zswap.Init(cfg):
        module.configure_model()
    assert module.net is not None
    opt = zswap.optim.OffloadedAdamW(
        module.net.parameters(),
        lr=2e-2,
        betas=(0.8, 0.95),
        weight_decay=0.1,
        device="nvme",
        nvme_path=tmp_path,
    )
    losses = []
    with zswap.initialize(module.net, cfg, optimizer=opt) as engine:
        for x, y in list(_data())[:STEPS]:
            x, y = x.to(dtype), y.to(dtype)
            previous = torch.get_default_dtype()
            torch.set_default_dtype(dtype)
            try:
                loss = nn.functional.mse_loss(module.net(x), y)
            finally:
                torch.set_default_dtype(previous)
            losses.append(loss.detach())
            engine.backward(loss)
            engine.step()
        assert trainer.strategy.engine.skipped_steps == engine.skipped_steps
        assert trainer.strategy.engine.loss_scale == engine.loss_scale
    opt.close()
    assert torch.equal(torch.stack(ours.losses), torch.stack(losses))


def test_precision_conflicting_with_the_config_is_refused(tmp_path):
    with pytest.raises(zswap.ConfigError, match=r"precision='bf16-true'\) asks for torch.bfloat16 params"):
        _fit(ZswapStrategy(_config(tmp_path, fp16={"enabled": True})), precision="bf16-true")


@pytest.mark.parametrize("precision", ["bf16-mixed", "64-true"])
def test_unsupported_precisions_are_refused_when_the_trainer_is_built(tmp_path, precision):
    with pytest.raises(zswap.ConfigError, match="ZswapStrategy supports Trainer"):
        _trainer(ZswapStrategy(_config(tmp_path)), precision=precision)


def test_precision_plugin_takes_true_precisions_only():
    assert ZswapPrecision("bf16-true").dtype == torch.bfloat16
    with pytest.raises(zswap.ConfigError, match="ZswapPrecision takes one of"):
        ZswapPrecision("16-mixed")  # type: ignore[arg-type]


@pytest.mark.skipif(torch.cuda.is_available(), reason="CUDA is here: the engine computes on it")
def test_cuda_accelerator_without_cuda_is_refused_by_the_engines_device_check(tmp_path):
    from lightning.pytorch.accelerators import CUDAAccelerator

    strategy = ZswapStrategy(_config(tmp_path))
    strategy.accelerator = CUDAAccelerator()
    strategy.parallel_devices = [torch.device("cuda", 0)]
    with pytest.raises(zswap.device.UnsupportedDeviceError, match="CUDA is not available on this machine"):
        strategy.setup_environment()


def test_without_lightning_the_import_error_says_what_to_install(monkeypatch):
    import importlib
    import sys

    for name in [n for n in sys.modules if n == "zswap.lightning" or n.startswith("zswap.lightning.")]:
        monkeypatch.delitem(sys.modules, name)
    monkeypatch.setitem(sys.modules, "lightning", None)
    monkeypatch.setitem(sys.modules, "lightning.pytorch", None)
    with pytest.raises(
        ImportError, match=r"zswap.lightning needs the 'lightning' package .*zswap\[lightning\]"
    ):
        importlib.import_module("zswap.lightning")


# -- model summary ---------------------------------------------------------------------------------


class _Recorded(pl.callbacks.ModelSummary):
    """Lightning's summary callback, keeping what it would print."""

    seen: ClassVar[list[tuple[Any, ...]]] = []

    @staticmethod
    def summarize(summary_data: Any, total: int, trainable: int, size: float, *args: Any, **kw: Any) -> None:
        _Recorded.seen.append((dict(summary_data), total, trainable, size))


@pytest.mark.parametrize("rich", [False, True])
def test_model_summary_counts_partitioned_params_by_their_real_size(rich, tmp_path):
    _Recorded.seen = []
    if rich:
        pytest.importorskip("rich")
        from lightning.pytorch.callbacks import RichModelSummary

        class Cb(RichModelSummary):
            summarize = staticmethod(_Recorded.summarize)
    else:
        Cb = _Recorded
    _fit(None, enable_model_summary=True, callbacks=[Cb(max_depth=2)], max_steps=1)
    _fit(
        ZswapStrategy(_config(tmp_path)), enable_model_summary=True, callbacks=[Cb(max_depth=2)], max_steps=1
    )
    (plain, p_total, p_trainable, p_size), (ours, total, trainable, size) = _Recorded.seen
    want = 6 * 24 + 24 + 24 * 24 + 24 + 24 + 1
    assert p_total == p_trainable == want  # the plain run: Lightning's own counts
    assert (total, trainable, size) == (p_total, p_trainable, p_size)
    assert ours["Params"] == plain["Params"]  # per layer too (net, net.0, ...)
    assert ours["Params"][0] != "0"
