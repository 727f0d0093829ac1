"""`zswap.transformers.Trainer` against the plain ``transformers.Trainer``: the same arguments and seed give
the same losses, logged gradient norms and learning rates, and the same weights (rtol 1e-4), with a linear
schedule with warmup, weight decay (biases and LayerNorms excluded), clipping that bites and gradient
accumulation 2; `save_model` writes what plain ``from_pretrained`` loads; a run stopped at a checkpoint and
resumed with ``resume_from_checkpoint=True`` ends with the weights of an uninterrupted run. An Accelerate
loop over a zswap model is refused at its first step, naming ``engine.step()``."""

from __future__ import annotations

import copy
import re
import warnings
from pathlib import Path
from typing import Any

import pytest
import torch

import zswap

transformers = pytest.importorskip("transformers")
pytest.importorskip("accelerate")

import zswap.transformers as zt  # noqa: E402

pytestmark = pytest.mark.usefixtures("quiet_transformers")

RTOL, ATOL = 1e-4, 1e-6
MAX_NORM = 0.05  # the tiny GPT-2's gradient norms are above 1: every step is clipped


def _build() -> Any:
    # Dropout off: the two runs must not depend on how many random numbers anything else draws.
    config = transformers.GPT2Config(
        vocab_size=128,
        n_positions=32,
        n_embd=32,
        n_layer=2,
        n_head=4,
        resid_pdrop=0,
        embd_pdrop=0,
        attn_pdrop=0,
    )
    return transformers.GPT2LMHeadModel(config)


def _data() -> list[dict[str, torch.Tensor]]:
    g = torch.Generator().manual_seed(1)
    out = []
    for _ in range(16):
        ids = torch.randint(0, 128, (12,), generator=g)
        out.append({"input_ids": ids, "labels": ids.clone()})
    return out


def _args(out: Path, **extra: Any) -> Any:
    kwargs: dict[str, Any] = {
        "output_dir": str(out),
        "per_device_train_batch_size": 2,
        "gradient_accumulation_steps": 2,
        "max_steps": 4,
        "learning_rate": 5e-3,
        "weight_decay": 0.1,
        "warmup_steps": 1,
        "lr_scheduler_type": "linear",
        "max_grad_norm": MAX_NORM,
        "logging_steps": 1,
        "save_strategy": "no",
        "report_to": [],
        "seed": 0,
        "use_cpu": True,
        "disable_tqdm": True,
    }
    kwargs.update(extra)
    return transformers.TrainingArguments(**kwargs)


def _config(tmp_path: Path) -> dict[str, Any]:
    """A Hugging Face-style DeepSpeed config: everything the arguments decide left "auto"."""
    return {
        "zero_optimization": {
            "stage": 3,
            "offload_param": {"device": "nvme", "nvme_path": str(tmp_path)},
            "offload_optimizer": {"device": "nvme", "nvme_path": str(tmp_path)},
            "stage3_param_persistence_threshold": 0,
        },
        "optimizer": {
            "type": "AdamW",
            "params": {"lr": "auto", "betas": "auto", "eps": "auto", "weight_decay": "auto"},
        },
        "gradient_clipping": "auto",
        "gradient_accumulation_steps": "auto",
        "train_micro_batch_size_per_gpu": "auto",
        "train_batch_size": "auto",
        "steps_per_print": 100,
    }


def _zswap_model(cfg: Any) -> Any:
    torch.manual_seed(0)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", zswap.ZswapWarning)
        with zswap.Init(cfg):
            return _build()


def _logged(trainer: Any) -> list[tuple[float, float, float]]:
    return [(h["loss"], h["grad_norm"], h["learning_rate"]) for h in trainer.state.log_history if "loss" in h]


def _weights(model: Any) -> dict[str, torch.Tensor]:
    with zswap.GatheredParameters(list(model.parameters())):
        return {n: p.detach().clone() for n, p in model.named_parameters()}


@pytest.fixture(scope="module")
def reference(tmp_path_factory: pytest.TempPathFactory) -> tuple[list[tuple[float, float, float]], dict]:
    """The plain Trainer's logs and final weights."""
    torch.manual_seed(0)
    model = _build()
    trainer = transformers.Trainer(
        model=model, args=_args(tmp_path_factory.mktemp("plain")), train_dataset=_data()
    )
    trainer.train()
    return _logged(trainer), {n: p.detach().clone() for n, p in model.named_parameters()}


def _assert_weights(got: dict[str, torch.Tensor], want: dict[str, torch.Tensor]) -> None:
    assert got.keys() == want.keys()
    for name in want:
        assert torch.allclose(got[name], want[name], rtol=RTOL, atol=ATOL), name


def test_trains_like_the_plain_trainer(reference, tmp_path):
    want_logs, want_weights = reference
    cfg = _config(tmp_path)
    given = copy.deepcopy(cfg)
    model = _zswap_model(cfg)
    trainer = zt.Trainer(model=model, args=_args(tmp_path / "out"), train_dataset=_data(), zswap_config=cfg)
    assert cfg == given  # "auto" filled in a private copy
    assert trainer.zswap_config["optimizer"]["params"] == {
        "lr": 5e-3,
        "betas": [0.9, 0.999],
        "eps": 1e-8,
        "weight_decay": 0.1,
    }
    assert trainer.zswap_config["gradient_clipping"] == MAX_NORM
    assert trainer.zswap_config["train_batch_size"] == 4
    opt = trainer.engine.optimizer
    assert isinstance(opt, zswap.optim.OffloadedAdamW) and opt.tier == "nvme"
    names = {id(p): n for n, p in model.named_parameters()}
    decay, no_decay = opt.param_groups
    assert decay["weight_decay"] == 0.1 and no_decay["weight_decay"] == 0.0
    assert all(names[id(p)].endswith("bias") or ".ln_" in names[id(p)] for p in no_decay["params"])
    assert not any(names[id(p)].endswith("bias") for p in decay["params"])
    trainer.train()
    got = _logged(trainer)
    assert len(got) == len(want_logs) == 4
    for (loss, norm, lr), (want_loss, want_norm, want_lr) in zip(got, want_logs, strict=True):
        assert loss == pytest.approx(want_loss, rel=RTOL)
        assert norm == pytest.approx(want_norm, rel=RTOL)  # the true global norm, before clipping
        assert lr == pytest.approx(want_lr, rel=1e-12)
    assert min(norm for _, norm, _ in got) > MAX_NORM  # clipping changed every step
    assert [lr for _, _, lr in got][:2] == [0.0, 5e-3]  # warmup, then linear decay
    _assert_weights(_weights(model), want_weights)
    trainer.close()


def test_save_model_loads_with_plain_from_pretrained(reference, tmp_path):
    _, want_weights = reference
    cfg = _config(tmp_path)
    model = _zswap_model(cfg)
    trainer = zt.Trainer(model=model, args=_args(tmp_path / "out"), train_dataset=_data(), zswap_config=cfg)
    trainer.train()
    trainer.save_model(str(tmp_path / "saved"))
    saved = {p.name for p in (tmp_path / "saved").iterdir()}
    plain = transformers.Trainer(model=_build(), args=_args(tmp_path / "plain_out"), train_dataset=_data())
    plain.save_model(str(tmp_path / "plain"))
    assert saved == {p.name for p in (tmp_path / "plain").iterdir()}  # the same files, no more
    assert {"config.json", "generation_config.json", "model.safetensors", "training_args.bin"} <= saved
    loaded = transformers.GPT2LMHeadModel.from_pretrained(str(tmp_path / "saved"))
    got = dict(loaded.named_parameters())
    mine = _weights(model)
    for name, value in mine.items():
        assert torch.equal(got[name].detach(), value), name
    _assert_weights({n: p.detach() for n, p in got.items()}, want_weights)
    trainer.close()


class _StopAt(transformers.TrainerCallback):
    def __init__(self, step: int) -> None:
        self.step = step

    def on_step_end(self, args: Any, state: Any, control: Any, **kwargs: Any) -> Any:
        if state.global_step == self.step:
            control.should_training_stop = True
        return control


def test_resume_from_checkpoint_is_exact(reference, tmp_path):
    _, want_weights = reference
    cfg = _config(tmp_path)
    out = tmp_path / "run"
    args = _args(out, save_strategy="steps", save_steps=2)
    first = zt.Trainer(
        model=_zswap_model(cfg), args=args, train_dataset=_data(), zswap_config=cfg, callbacks=[_StopAt(2)]
    )
    first.train()
    first.close()
    assert first.state.global_step == 2
    ckpt = out / "checkpoint-2"
    assert (ckpt / "latest").is_file() and (ckpt / "scheduler.pt").is_file()  # the engine checkpoint
    assert (ckpt / "zero_to_fp32.py").is_file()  # as DeepSpeed leaves it: Hugging Face's docs run it
    model = _zswap_model(cfg)  # fresh weights: the checkpoint must bring back the trained ones
    second = zt.Trainer(model=model, args=args, train_dataset=_data(), zswap_config=cfg)
    second.train(resume_from_checkpoint=True)
    assert second.state.global_step == 4
    _assert_weights(_weights(model), want_weights)
    second.close()


class _EveryStep(transformers.TrainerCallback):
    """The weights after every optimizer step."""

    def __init__(self) -> None:
        self.weights: list[dict[str, torch.Tensor]] = []

    def on_step_end(self, args: Any, state: Any, control: Any, model: Any = None, **kw: Any) -> None:
        self.weights.append(_weights(model))


# (max_grad_norm, gradient_accumulation_steps, samples): 14 samples are 7 batches of 2, so with
# accumulation an epoch's last window is one batch; 6 steps run into the second epoch.
EARLY_SETUPS = {
    "clip-below-norm": (MAX_NORM, 1, 10),
    "clip-above-norm": (1e3, 1, 10),
    "accumulate-2": (0.0, 2, 14),
    "accumulate-2-clip-below": (MAX_NORM, 2, 14),
    "accumulate-2-clip-above": (1e3, 2, 14),
}


@pytest.mark.parametrize("setup", list(EARLY_SETUPS))
def test_update_in_backward_under_clipping_and_accumulation_is_exact(tmp_path, setup):
    """With ``max_grad_norm`` below or above the norm and gradient accumulation (an epoch's last window cut
    short), the update runs in backward and the weights after every optimizer step and the logged grad
    norms are bitwise those of the same run with the early step off."""
    clip, gas, samples = EARLY_SETUPS[setup]
    runs = []
    for early in (False, True):
        cfg = _config(tmp_path / str(early))
        (tmp_path / str(early)).mkdir()
        args = _args(
            tmp_path / f"out-{early}",
            max_grad_norm=clip,
            gradient_accumulation_steps=gas,
            max_steps=6,
            lr_scheduler_type="constant",
        )
        steps = _EveryStep()
        trainer = zt.Trainer(
            model=_zswap_model(cfg),
            args=args,
            train_dataset=_data()[:samples],
            zswap_config=cfg,
            callbacks=[steps],
        )
        trainer.engine.early_step = early
        trainer.train()
        runs.append((trainer, steps.weights))
    (off, want), (on, got) = runs
    assert on.state.epoch > 1  # into the second epoch
    assert len(want) == len(got) == 6
    for i, (a, b) in enumerate(zip(want, got, strict=True)):
        for name in a:
            assert torch.equal(a[name], b[name]), f"step {i + 1}: {name}"
    assert [n for _, n, _ in _logged(on)] == [n for _, n, _ in _logged(off)]  # grad_norm, bitwise
    stats, off_stats = on.engine.stats(), off.engine.stats()
    if setup.endswith("below-norm") or setup.endswith("below"):
        assert min(n for _, n, _ in _logged(on)) > MAX_NORM  # clipping bit at every step
        assert stats["steps_deferred"] == 5, stats  # held through backward, updated at the step
    else:
        assert stats["steps_in_backward"] == 5, stats  # the first step makes the optimizer's records
    assert off_stats["steps_ordinary"] == 6
    assert stats["bytes_read"] < off_stats["bytes_read"], (stats, off_stats)
    assert off_stats["steps_ordinary_reason"] == "engine.early_step is False"
    on.close()
    off.close()


def test_config_file_and_config_section_schedule(tmp_path):
    """A config file with a scheduler section: its "auto" step counts are filled at train time, and a value
    that disagrees with the arguments is refused with every mismatch listed."""
    import json

    cfg = {
        **_config(tmp_path),
        "scheduler": {
            "type": "WarmupDecayLR",
            "params": {"warmup_min_lr": "auto", "warmup_max_lr": "auto", "warmup_num_steps": "auto",
                       "total_num_steps": "auto", "warmup_type": "linear"},
        },
    }  # fmt: skip
    path = tmp_path / "ds.json"
    path.write_text(json.dumps(cfg))
    trainer = zt.Trainer(
        model=_zswap_model(cfg), args=_args(tmp_path / "out"), train_dataset=_data(), zswap_config=path
    )
    trainer.train()
    assert isinstance(trainer.lr_scheduler, zswap.schedules.WarmupDecayLR)
    # DeepSpeed's WarmupDecayLR, stepped once per optimizer step from iteration -1 (warmup_min_lr): warmup
    # over at least 2 steps (warmup_num_steps, 1 here, is raised to 2), then down to 0 at step 4.
    assert [lr for _, _, lr in _logged(trainer)] == pytest.approx([0.0, 0.0, 0.0025, 0.005], abs=1e-15)
    assert trainer.lr_scheduler.total_num_steps == 4
    trainer.close()

    bad = {**_config(tmp_path), "gradient_clipping": 1.0, "train_micro_batch_size_per_gpu": 8}
    with pytest.raises(zswap.ConfigError) as info:
        zt.Trainer(model=_zswap_model(cfg), args=_args(tmp_path / "o2"), zswap_config=bad)
    assert str(info.value) == (
        "zswap_config disagrees with the TrainingArguments:\n"
        "- train_micro_batch_size_per_gpu=8 vs TrainingArguments per_device_train_batch_size=2\n"
        "- gradient_clipping=1.0 vs TrainingArguments max_grad_norm=0.05\n"
        'set these keys to "auto" (filled from the arguments) or make the two agree'
    )


def test_a_warmup_decay_section_without_its_peak_lr_must_agree_with_learning_rate(tmp_path):
    """WarmupDecayLR without ``warmup_max_lr`` warms up to DeepSpeed's 0.001 whatever ``learning_rate`` says:
    the schedule would drive the optimizer's lr there without a word. A mismatch, as an explicit value is;
    an explicit ``warmup_num_steps`` is named against the warmup the arguments give."""
    cfg = _config(tmp_path)
    cfg["scheduler"] = {"type": "WarmupDecayLR", "params": {"warmup_num_steps": 2, "total_num_steps": "auto"}}
    with pytest.raises(zswap.ConfigError) as info:
        zt.Trainer(model=_zswap_model(cfg), args=_args(tmp_path / "o"), zswap_config=cfg)
    assert (
        "- scheduler.params.warmup_max_lr unset (so 0.001) vs TrainingArguments learning_rate=0.005\n"
        in str(info.value)
    )
    cfg["scheduler"]["params"]["warmup_max_lr"] = "auto"
    trainer = zt.Trainer(model=_zswap_model(cfg), args=_args(tmp_path / "o", warmup_steps=0, max_steps=2),
                         train_dataset=_data(), zswap_config=cfg)  # fmt: skip
    with pytest.raises(zswap.ConfigError) as info:
        trainer.train()
    assert (
        "- scheduler.params.warmup_num_steps=2 vs TrainingArguments warmup steps (warmup_steps / "
        "warmup_ratio, at least 1)=1\n"
    ) in str(info.value)
    trainer.close()


def test_fp16_arguments_are_refused(tmp_path):
    with pytest.raises(
        zswap.ConfigError, match=re.escape("TrainingArguments(fp16=True) uses a gradient scaler")
    ):
        zt.Trainer(model=_build(), args=_args(tmp_path, fp16=True), zswap_config=_config(tmp_path))


def test_accelerate_loop_is_refused_at_the_first_step(tmp_path):
    from accelerate import Accelerator
    from accelerate.state import AcceleratorState

    cfg = _config(tmp_path)
    cfg["optimizer"]["params"] = {"lr": 1e-3}
    cfg["gradient_clipping"] = 1.0  # its "auto" is the Trainer's to fill: a hand-written loop says it
    model = _zswap_model(cfg)
    engine = zswap.initialize(model, cfg)
    accelerator = Accelerator(cpu=True)
    try:
        opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
        model, opt = accelerator.prepare(model, opt)
        batch = _data()[0]
        loss = model(input_ids=batch["input_ids"][None], labels=batch["labels"][None]).loss
        accelerator.backward(loss)
        # Accelerate 1.x takes the norm of p.grad itself (no torch clip_grad_norm_ to refuse): None for every
        # managed param, so 0 — the step that follows is what refuses.
        accelerator.clip_grad_norm_(model.parameters(), 1.0)
        with pytest.raises(zswap.ZswapError) as step:
            opt.step()
        assert str(step.value).startswith(
            "AdamW.step() over params zswap partitioned does nothing: their data and gradients live in "
            "zswap's stores, which only engine.step() applies the optimizer to."
        )
        before = _weights(model)
        engine.step()  # the zswap way trains
        after = _weights(model)
        assert all(not torch.equal(before[n], after[n]) for n in before)
    finally:
        engine.close()
        AcceleratorState._reset_state(reset_partial_state=True)


def test_given_optimizer_no_clipping_and_evaluate(tmp_path):
    """``optimizers=(SGD, None)`` is stepped by the engine as given; ``max_grad_norm=0`` still logs the true
    norm and never clips; ``evaluate`` works before and after training, as the plain Trainer's."""
    args = {"max_grad_norm": 0.0, "lr_scheduler_type": "constant", "warmup_steps": 0}
    data = _data()
    torch.manual_seed(0)
    ref = _build()
    plain = transformers.Trainer(
        model=ref,
        args=_args(tmp_path / "plain", **args),
        train_dataset=data,
        eval_dataset=data[:4],
        optimizers=(torch.optim.SGD(ref.parameters(), lr=0.5, momentum=0.9), None),
    )
    want_before = plain.evaluate()["eval_loss"]
    plain.train()
    want_after = plain.evaluate()["eval_loss"]

    cfg = _config(tmp_path)
    del cfg["optimizer"]
    cfg["zero_optimization"]["offload_optimizer"] = {"device": "cpu"}
    model = _zswap_model(cfg)
    sgd = torch.optim.SGD(model.parameters(), lr=0.5, momentum=0.9)
    trainer = zt.Trainer(
        model=model,
        args=_args(tmp_path / "z", **args),
        train_dataset=data,
        eval_dataset=data[:4],
        optimizers=(sgd, None),
        zswap_config=cfg,
    )
    assert trainer.engine.optimizer is sgd
    assert trainer.evaluate()["eval_loss"] == pytest.approx(want_before, rel=1e-6)
    trainer.train()
    assert trainer.evaluate()["eval_loss"] == pytest.approx(want_after, rel=RTOL)
    got, want = _logged(trainer), _logged(plain)
    for (loss, norm, _), (want_loss, want_norm, _) in zip(got, want, strict=True):
        assert loss == pytest.approx(want_loss, rel=RTOL)
        assert norm == pytest.approx(want_norm, rel=RTOL)
    _assert_weights(_weights(model), {n: p.detach() for n, p in ref.named_parameters()})
    trainer.close()


def test_a_given_torch_adamw_and_its_scheduler_become_the_engines(tmp_path):
    """``optimizers=(AdamW, scheduler)``: the AdamW becomes zswap's offloaded AdamW over its groups, its
    state on NVMe and the update in backward; the scheduler, built on the AdamW, drives it: the losses,
    norms and learning rates the plain Trainer logs with the same pair."""
    args = {"lr_scheduler_type": "constant", "warmup_steps": 0}
    data = _data()

    def pair(params: Any) -> tuple[torch.optim.Optimizer, Any]:
        opt = torch.optim.AdamW(params, lr=1e-3, weight_decay=0.01)
        return opt, torch.optim.lr_scheduler.LambdaLR(opt, lambda step: 1.0 / (1 + step))

    torch.manual_seed(0)
    ref = _build()
    given, out = pair(ref.parameters()), _args(tmp_path / "plain", **args)
    plain = transformers.Trainer(model=ref, args=out, train_dataset=data, optimizers=given)
    plain.train()

    cfg = _config(tmp_path)
    del cfg["optimizer"]
    model = _zswap_model(cfg)
    trainer = zt.Trainer(
        model=model,
        args=_args(tmp_path / "z", **args),
        train_dataset=data,
        optimizers=pair(model.parameters()),
        zswap_config=cfg,
    )
    assert isinstance(trainer.engine.optimizer, zswap.optim.OffloadedAdamW)
    assert trainer.engine.optimizer.tier == "nvme"
    trainer.train()
    got, want = _logged(trainer), _logged(plain)
    assert len(got) == len(want) > 1
    for (loss, norm, lr), (want_loss, want_norm, want_lr) in zip(got, want, strict=True):
        assert loss == pytest.approx(want_loss, rel=RTOL)
        assert norm == pytest.approx(want_norm, rel=RTOL)
        assert lr == want_lr
    stats = trainer.engine.stats()
    assert stats["steps_in_backward"] + stats["steps_deferred"] > 0, stats["steps_ordinary_reason"]
    _assert_weights(_weights(model), {n: p.detach() for n, p in ref.named_parameters()})
    trainer.close()


def test_a_config_section_sets_the_adam_knobs(tmp_path):
    """With an ``optimizer`` section the engine steps zswap's AdamW over the Trainer's param groups: the
    section's betas and eps are the ones stepped with, each group's lr and decay as the Trainer made them."""
    cfg = _config(tmp_path)
    cfg["optimizer"]["params"].update(betas=[0.8, 0.95], eps=1e-6)
    args = _args(tmp_path / "o", optim="adamw_torch", adam_beta1=0.8, adam_beta2=0.95, adam_epsilon=1e-6)
    trainer = zt.Trainer(model=_zswap_model(cfg), args=args, train_dataset=_data(), zswap_config=cfg)
    groups = trainer.engine.optimizer.param_groups
    assert [(g["betas"], g["eps"], g["lr"]) for g in groups] == [((0.8, 0.95), 1e-6, 5e-3)] * 2
    assert sorted(g["weight_decay"] for g in groups) == [0.0, 0.1]  # biases and norms undecayed
    trainer.close()


def test_an_optim_beside_an_optimizer_section_is_refused(tmp_path):
    """The section builds the optimizer (as DeepSpeed's wins over the arguments): an ``optim`` naming another
    would be dropped without a word, as ``lr_scheduler_type`` beside a ``scheduler`` section would."""
    cfg = _config(tmp_path)
    with pytest.raises(zswap.ConfigError) as info:
        zt.Trainer(model=_zswap_model(cfg), args=_args(tmp_path / "o", optim="sgd"), zswap_config=cfg)
    assert str(info.value) == (
        "zswap_config has an 'optimizer' section, which builds the optimizer, but TrainingArguments asks for "
        "optim='sgd': drop the section to use the arguments' optimizer, or leave optim at an AdamW"
    )


def test_torch_compile_is_refused(tmp_path):
    """dynamo guards on state zswap's hooks change every call: it recompiles to its limit, then runs eagerly
    with pages of warnings — refused by name rather than slow."""
    with pytest.raises(zswap.ConfigError, match=re.escape("TrainingArguments(torch_compile=True) compiles")):
        zt.Trainer(model=_build(), args=_args(tmp_path, torch_compile=True), zswap_config=_config(tmp_path))


def test_shape_dependent_optimizer_is_refused(tmp_path):
    """Adafactor factors a matrix's second moment by rows and columns: over a flat partition it would
    compute something else, silently. Refused, naming what works."""
    cfg = _config(tmp_path)
    del cfg["optimizer"]
    with pytest.raises(zswap.ConfigError) as info:
        zt.Trainer(model=_zswap_model(cfg), args=_args(tmp_path / "o", optim="adafactor"), zswap_config=cfg)
    assert str(info.value).startswith(
        "the optimizer TrainingArguments.optim builds is Adafactor; zswap steps each param as its flat "
        "partition, which only an element-wise optimizer (SGD, Adam, AdamW, "
    )
    # the way named works (an 'optimizer' section beside optim="adafactor" is refused too: not advised)
    assert str(info.value).endswith(
        "use one of those, or AdamW (optim adamw_torch, or torch.optim.AdamW in optimizers=), which becomes "
        "zswap's offloaded AdamW"
    )


def test_an_optimizer_without_float32_masters_is_refused_in_bf16(tmp_path):
    """An SGD would step the bf16 params themselves (zswap's float32 masters are its AdamW's), where the
    plain Trainer keeps float32 params under autocast and DeepSpeed float32 masters: refused by name."""
    cfg = _config(tmp_path)
    del cfg["optimizer"]
    cfg["bf16"] = {"enabled": True}
    args = _args(tmp_path / "o", optim="sgd", bf16=True)
    with pytest.raises(zswap.ConfigError) as info:
        zt.Trainer(model=_zswap_model(cfg), args=args, train_dataset=_data(), zswap_config=cfg)
    assert str(info.value) == (
        "the config enables bf16 and the optimizer TrainingArguments.optim builds is SGD: DeepSpeed would "
        "step it over float32 master weights, which zswap keeps for Adam / AdamW only (it would step the "
        "bf16 params themselves, losing updates below their precision). Use an adamw optim, or train in "
        "float32"
    )


def test_bf16_auto_needs_the_filled_config_at_init(tmp_path):
    """``bf16.enabled: "auto"`` with ``bf16=True`` means bf16 params, which only Init can give: a model built
    from the unfilled config (fp32) is refused; built under ``Init(fill_config(config, args))`` it is bf16
    and trains."""
    cfg = _config(tmp_path)
    cfg["bf16"] = {"enabled": "auto"}
    args = _args(tmp_path / "o", bf16=True, max_steps=1, gradient_accumulation_steps=1)
    with pytest.raises(zswap.ConfigError) as info:
        zt.Trainer(model=_zswap_model(cfg), args=args, train_dataset=_data(), zswap_config=cfg)
    assert str(info.value) == (
        "zswap_config's bf16.enabled is true (given, or filled from the TrainingArguments) but the model's "
        "params are torch.float32: Init decides the params' dtype, so build or load the model under "
        "zswap.Init(zswap.transformers.fill_config(config, args))"
    )
    filled = zt.fill_config(cfg, args)
    assert filled["bf16"] == {"enabled": True} and cfg["bf16"] == {"enabled": "auto"}
    model = _zswap_model(filled)
    assert {zswap.param_state(p).dtype for p in model.parameters()} == {torch.bfloat16}
    trainer = zt.Trainer(model=model, args=args, train_dataset=_data(), zswap_config=cfg)
    trainer.train()
    (loss, norm, _), *_ = _logged(trainer)
    assert torch.isfinite(torch.tensor([loss, norm])).all()
    trainer.close()


@pytest.mark.parametrize("kind", ["optimizer", "scheduler"])
def test_optimizers_beside_a_config_section_of_their_kind_are_refused(tmp_path, kind):
    """One of the two would go unused without a word (transformers' DeepSpeed integration drops the passed
    one; zswap once dropped the section)."""
    cfg = _config(tmp_path)
    if kind == "scheduler":
        del cfg["optimizer"]
        cfg["scheduler"] = {"type": "WarmupLR", "params": {"warmup_num_steps": 2}}
    model = _zswap_model(cfg)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    given = (opt, None if kind == "optimizer" else torch.optim.lr_scheduler.LambdaLR(opt, lambda step: 1.0))
    name = "SGD" if kind == "optimizer" else "LambdaLR"
    with pytest.raises(
        zswap.ConfigError,
        match=rf"optimizers= passes an? \w+ \({name}\) and zswap_config has a '{kind}' section",
    ):
        zt.Trainer(
            model=model, args=_args(tmp_path / "z"), train_dataset=_data(), optimizers=given, zswap_config=cfg
        )


def test_a_grad_accum_dtype_zswap_does_not_sum_in_is_refused(tmp_path):
    """float32 params' gradients are summed in float32 over the Trainer's windows: a config asking for bf16
    sums is refused where the engine is built, and the engine is closed (the model runs under another)."""
    cfg = {**_config(tmp_path), "data_types": {"grad_accum_dtype": "bf16"}}
    model = _zswap_model(cfg)
    with pytest.raises(
        zswap.ConfigError,
        match=r"grad_accum_dtype is 'bf16' but zswap sums .* torch.float32 over the 2 .* set it to fp32$",
    ):
        trainer = zt.Trainer(
            model=model, args=_args(tmp_path / "out"), train_dataset=_data(), zswap_config=cfg
        )
        trainer.train()
    zswap.initialize(model, {"zero_optimization": _config(tmp_path)["zero_optimization"]}).close()


def test_optimizer_cls_and_kwargs_beside_an_optimizer_section_is_refused(tmp_path):
    """As ``optim=`` and ``optimizers=`` beside the section are (before: an SGD asked for so was trained as
    the section's AdamW, without a word)."""
    cfg = _config(tmp_path)
    with pytest.raises(zswap.ConfigError) as info:
        zt.Trainer(
            model=_zswap_model(cfg), args=_args(tmp_path / "o"), train_dataset=_data(), zswap_config=cfg,
            optimizer_cls_and_kwargs=(torch.optim.SGD, {"lr": 0.05, "momentum": 0.9}),
        )  # fmt: skip
    assert str(info.value) == (
        "optimizer_cls_and_kwargs= asks for SGD and zswap_config has an 'optimizer' section, which builds "
        "the optimizer: keep one of them"
    )


def test_deepspeed_argument_is_refused(tmp_path):
    """``TrainingArguments(deepspeed=...)`` would send the partitioned model to DeepSpeed in ``train()``."""
    args = _args(tmp_path / "o")
    args.deepspeed = _config(tmp_path)  # set after construction: TrainingArguments would import deepspeed
    with pytest.raises(zswap.ConfigError, match=r"TrainingArguments\(deepspeed=\.\.\.\) hands the model"):
        zt.Trainer(model=_build(), args=args, zswap_config=_config(tmp_path))


@pytest.mark.parametrize(
    "change", [("learning_rate", 0.02), ("max_grad_norm", 0.5), ("weight_decay", 0.5), "unfreeze"]
)
def test_what_the_engine_was_built_from_must_not_change_before_train(change, tmp_path):
    """The plain Trainer builds its optimizer in ``train()``; zswap's, with the engine, in the constructor:
    an argument changed on ``trainer.args`` in between, or a param unfrozen, would go unused without a
    word (before: the old lr / clipping / decay trained on; an unfrozen param failed at the first step)."""
    cfg = _config(tmp_path)
    model = _zswap_model(cfg)
    if change == "unfreeze":
        model.transformer.h[0].requires_grad_(False)
    trainer = zt.Trainer(model=model, args=_args(tmp_path / "o"), train_dataset=_data(), zswap_config=cfg)
    if change == "unfreeze":
        model.transformer.h[0].requires_grad_(True)
        with pytest.raises(zswap.ZswapError, match=r"transformer\.h\.0\..* required no grad when this zswap"):
            trainer.train()
    else:
        name, value = change
        before = getattr(trainer.args, name)
        setattr(trainer.args, name, value)
        with pytest.raises(zswap.ConfigError) as info:
            trainer.train()
        assert (
            f"changed since this zswap.transformers.Trainer was built: {name} ({before!r} → {value!r})"
            in str(info.value)
        )
    trainer.close()


def test_logged_param_count_is_the_models(tmp_path):
    """The Trainer logs "Number of trainable parameters" through transformers' ``get_model_param_count``,
    which counts placeholders (0) unless DeepSpeed's own ZeRO-3 is live: zswap's params count in full."""
    cfg = _config(tmp_path)
    model = _zswap_model(cfg)
    want = sum(p.numel() for p in _build().parameters())
    assert sum(p.numel() for p in model.parameters()) < want  # partitioned: placeholders
    trainer = zt.Trainer(model=model, args=_args(tmp_path / "out"), train_dataset=_data(), zswap_config=cfg)
    assert transformers.trainer.get_model_param_count(model, trainable_only=True) == want
    next(model.parameters()).requires_grad_(False)
    assert transformers.trainer.get_model_param_count(model, trainable_only=False) == want
    plain = _build()
    assert transformers.trainer.get_model_param_count(plain) == want  # a plain model counts as before
    trainer.close()
