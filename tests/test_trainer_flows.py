"""`zswap.transformers.Trainer` in the flows around training that transformers' own DeepSpeed tests run: a
plain Trainer's checkpoint resumed with its optimizer and schedule, ``load_best_model_at_end`` (bf16 params
and their float32 masters included), a PEFT model's ``save_model``, a subclass's ``create_optimizer``, and
the arguments refused before training (full-precision-eval casts, best-model reloads without masters, a
missing checkpoint folder). Each against the plain Trainer with the same arguments and seed."""

from __future__ import annotations

import re
from typing import Any

import pytest
import torch

import zswap

transformers = pytest.importorskip("transformers")
pytest.importorskip("accelerate")

import zswap.transformers as zt  # noqa: E402
from tests.test_transformers_trainer import (  # noqa: E402
    _args,
    _build,
    _config,
    _data,
    _logged,
    _weights,
)
from tests.test_transformers_trainer import _zswap_model as _model  # noqa: E402
from zswap.deepspeed.utils import safe_get_full_fp32_param  # noqa: E402

pytestmark = pytest.mark.usefixtures("quiet_transformers")

# The plain run and the resumed one must not differ by a rounding: the default optim (fused AdamW) is
# what zswap's kernel computes.
PLAIN_ARGS = {"gradient_accumulation_steps": 1, "max_steps": 6, "warmup_steps": 2, "max_grad_norm": 1.0}


def _sgd(model: Any) -> tuple[torch.optim.Optimizer, None]:
    return torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9), None


@pytest.mark.parametrize("optim", ["adamw", "sgd-momentum"])
def test_a_plain_trainers_checkpoint_resumes_with_its_optimizer_and_schedule(tmp_path, optim):
    """A checkpoint the plain Trainer saved (weights, ``optimizer.pt``, ``scheduler.pt``): its state goes
    into the engine's optimizer (AdamW's moments into zswap's records; an SGD's momentum, saved in each
    param's shape, flattened as the engine shows params to it) and its schedule goes on, as the plain
    Trainer resumes it — the weights of the uninterrupted run. Before, both files were skipped without a
    word: warmup started again and the moments afresh (weights 1e-2 off)."""
    torch.manual_seed(0)
    plain_model = _build()
    given = {"optimizers": _sgd(plain_model)} if optim == "sgd-momentum" else {}
    args = _args(tmp_path / "plain", save_strategy="steps", save_steps=3, **PLAIN_ARGS)
    plain = transformers.Trainer(model=plain_model, args=args, train_dataset=_data(), **given)
    plain.train()
    ckpt = tmp_path / "plain" / "checkpoint-3"
    assert (ckpt / "optimizer.pt").is_file() and not (ckpt / "latest").exists()

    cfg = _config(tmp_path)
    model = _model(cfg)
    if optim == "sgd-momentum":
        del cfg["optimizer"]
        given = {"optimizers": _sgd(model)}
    trainer = zt.Trainer(model=model, args=_args(tmp_path / "z", **PLAIN_ARGS), train_dataset=_data(),
                         zswap_config=cfg, **given)  # fmt: skip
    trainer.train(resume_from_checkpoint=str(ckpt))
    assert trainer.state.global_step == 6
    assert _logged(trainer) == _logged(plain)  # steps 1-3 from the checkpoint's state, then 4-6 run here
    want = dict(plain_model.named_parameters())
    got = _weights(model)
    assert [n for n, w in got.items() if not torch.equal(w, want[n].detach())] == []
    trainer.close()


def test_a_missing_checkpoint_folder_is_transformers_error(tmp_path):
    cfg = _config(tmp_path)
    trainer = zt.Trainer(
        model=_model(cfg), args=_args(tmp_path / "z"), train_dataset=_data(), zswap_config=cfg
    )
    with pytest.raises(ValueError, match=re.escape(f"Can't find a valid checkpoint at {tmp_path / 'nope'}")):
        trainer.train(resume_from_checkpoint=str(tmp_path / "nope"))
    trainer.close()


class _AtSave(transformers.TrainerCallback):
    """Each checkpoint's params and float32 masters, as the engine held them when it was saved."""

    def __init__(self) -> None:
        self.saved: dict[int, tuple[dict[str, torch.Tensor], dict[str, torch.Tensor]]] = {}

    def on_save(self, args: Any, state: Any, control: Any, model: Any = None, **kw: Any) -> None:
        masters = {n: safe_get_full_fp32_param(p) for n, p in model.named_parameters()}
        self.saved[state.global_step] = (_weights(model), masters)


@pytest.mark.parametrize("dtype", ["fp32", "bf16"])
def test_load_best_model_at_end_restores_the_best_checkpoint(tmp_path, dtype):
    """The best checkpoint (the lowest eval loss: the second of three) comes back whole, as
    transformers' DeepSpeed integration loads it: params and, for bf16 params, their float32 masters.
    Loading its weights alone was refused for bf16 (the optimizer's masters would go stale) — after the
    whole run."""
    cfg = _config(tmp_path)
    extra: dict[str, Any] = {}
    if dtype == "bf16":
        cfg["bf16"] = {"enabled": "auto"}
        extra["bf16"] = True
    args = _args(
        tmp_path / "z", eval_strategy="steps", eval_steps=1, save_strategy="steps", save_steps=1,
        load_best_model_at_end=True, metric_for_best_model="eval_loss", greater_is_better=False,
        gradient_accumulation_steps=1, max_steps=3, **extra,
    )  # fmt: skip
    model = _model(zt.fill_config(cfg, args))
    seen = _AtSave()
    trainer = zt.Trainer(model=model, args=args, train_dataset=_data(), eval_dataset=_data()[:4],
                         zswap_config=cfg, callbacks=[seen])  # fmt: skip
    trainer.train()
    best = trainer.state.best_model_checkpoint
    assert best is not None and best.endswith("checkpoint-2"), best
    weights, masters = seen.saved[2]
    assert not all(torch.equal(weights[n], w) for n, w in seen.saved[3][0].items())  # training moved them
    got = _weights(model)
    assert [n for n in weights if not torch.equal(got[n], weights[n])] == []
    now = {n: safe_get_full_fp32_param(p) for n, p in model.named_parameters()}
    assert [n for n in masters if not torch.equal(now[n], masters[n])] == []
    trainer.close()


def test_best_model_from_weights_alone_is_refused_for_bf16_before_training(tmp_path):
    cfg = _config(tmp_path)
    cfg["bf16"] = {"enabled": "auto"}
    args = _args(
        tmp_path / "z", bf16=True, eval_strategy="steps", save_strategy="steps", load_best_model_at_end=True,
        save_only_model=True,
    )  # fmt: skip
    with pytest.raises(zswap.ConfigError) as info:
        zt.Trainer(
            model=_model(zt.fill_config(cfg, args)), args=args, train_dataset=_data(), zswap_config=cfg
        )
    assert str(info.value).startswith(
        "load_best_model_at_end=True with save_only_model=True would reload the best weights without their "
        "float32 master copies"
    )


@pytest.mark.parametrize("flag", ["fp16_full_eval", "bf16_full_eval"])
def test_full_eval_casts_are_refused(tmp_path, flag):
    """Evaluation after training would cast the whole model (`evaluation_loop`), converting its offloaded
    params for good: refused where the Trainer is built, naming the config section that gives that dtype."""
    dtype = flag[:4]
    cfg = _config(tmp_path)
    with pytest.raises(zswap.ConfigError) as info:
        zt.Trainer(model=_model(cfg), args=_args(tmp_path / "z", **{flag: True}), zswap_config=cfg)
    assert str(info.value) == (
        f"TrainingArguments({flag}=True) casts the whole model to {dtype} (and moves it to the device) "
        "before evaluating, which would convert its offloaded params for good: build or load the model in "
        f"{dtype} under zswap.Init (the config's '{dtype}' section) to evaluate in {dtype}"
    )


def _grouped(model: Any) -> torch.optim.Optimizer:
    """A per-block learning rate: what a custom ``create_optimizer`` is written for."""
    late = [p for n, p in model.named_parameters() if ".h.1." in n]
    rest = [p for n, p in model.named_parameters() if ".h.1." not in n]
    return torch.optim.AdamW([{"params": rest}, {"params": late, "lr": 2e-2}], lr=5e-3, fused=True)


class _PlainCustom(transformers.Trainer):
    def create_optimizer(self, model: Any = None) -> Any:
        if self.optimizer is None:
            self.optimizer = _grouped(self.model)
        return self.optimizer


class _ZswapCustom(zt.Trainer):
    def create_optimizer(self, model: Any = None) -> Any:
        if self.optimizer is None:
            self.optimizer = _grouped(self.model)
        return self.optimizer


def test_a_subclass_create_optimizer_is_the_engines(tmp_path):
    """transformers' documented way to customise the optimizer: the override's AdamW and its groups become
    the engine's (as one passed in ``optimizers=``), bitwise the plain subclass. Before, the engine never
    started and ``train()`` failed on a bare assertion."""
    torch.manual_seed(0)
    ref = _build()
    plain = _PlainCustom(model=ref, args=_args(tmp_path / "p", **PLAIN_ARGS), train_dataset=_data())
    plain.train()
    cfg = _config(tmp_path)
    del cfg["optimizer"]
    model = _model(cfg)
    trainer = _ZswapCustom(model=model, args=_args(tmp_path / "z", **PLAIN_ARGS), train_dataset=_data(),
                           zswap_config=cfg)  # fmt: skip
    assert [g["lr"] for g in trainer.engine.optimizer.param_groups] == [5e-3, 2e-2]
    trainer.train()
    assert _logged(trainer) == _logged(plain)
    got = _weights(model)
    assert [n for n, p in ref.named_parameters() if not torch.equal(got[n], p.detach())] == []
    trainer.close()


def test_a_subclass_optimizer_beside_a_config_section_is_refused(tmp_path):
    cfg = _config(tmp_path)
    with pytest.raises(zswap.ConfigError) as info:
        _ZswapCustom(model=_model(cfg), args=_args(tmp_path / "z"), train_dataset=_data(), zswap_config=cfg)
    assert str(info.value) == (
        "_ZswapCustom.create_optimizer() builds an optimizer (AdamW) and zswap_config has a 'optimizer' "
        "section, which would build another: keep one of them"
    )


def test_save_model_of_a_peft_model_writes_its_adapters(tmp_path):
    """PEFT's layout, as the plain Trainer saves a ``PeftModel``: ``adapter_config.json`` and the trained
    adapters, which ``PeftModel.from_pretrained`` loads over the base model. Before, the whole model was
    written under PEFT's wrapped names, which neither PEFT nor ``from_pretrained`` reads back."""
    peft = pytest.importorskip("peft")
    cfg = _config(tmp_path)
    lora = peft.LoraConfig(r=4, target_modules=["c_attn"], fan_in_fan_out=True, init_lora_weights="gaussian")
    model = peft.get_peft_model(_model(cfg), lora)
    trainer = zt.Trainer(model=model, args=_args(tmp_path / "z"), train_dataset=_data(), zswap_config=cfg)
    trainer.train()
    trainer.save_model(str(tmp_path / "saved"))
    saved = {p.name for p in (tmp_path / "saved").iterdir()}
    assert {"adapter_config.json", "adapter_model.safetensors"} <= saved
    plain_model = peft.get_peft_model(_build(), lora)
    plain = transformers.Trainer(model=plain_model, args=_args(tmp_path / "p"), train_dataset=_data())
    plain.save_model(str(tmp_path / "plain"))
    assert saved == {p.name for p in (tmp_path / "plain").iterdir()}  # (no generation_config.json)
    trained = {n: w for n, w in _weights(model).items() if "lora_" in n}
    torch.manual_seed(0)
    loaded = peft.PeftModel.from_pretrained(_build(), str(tmp_path / "saved"))
    got = {n: p.detach() for n, p in loaded.named_parameters() if "lora_" in n}
    assert got.keys() == trained.keys() and len(got) == 4
    assert [n for n in got if not torch.equal(got[n], trained[n])] == []
    trainer.close()


def test_save_model_of_a_model_with_add_adapter_writes_its_adapters(tmp_path):
    """transformers' own adapters (``model.add_adapter``): the plain Trainer's ``save_pretrained`` writes the
    adapter alone, and so does this one (before: the whole model under PEFT's names, config.json beside it,
    which plain ``from_pretrained`` loaded as a model with random attention weights)."""
    peft = pytest.importorskip("peft")
    cfg = _config(tmp_path)
    lora = peft.LoraConfig(r=4, target_modules=["c_attn"], fan_in_fan_out=True, init_lora_weights="gaussian")
    model = _model(cfg)
    model.add_adapter(lora)
    trainer = zt.Trainer(model=model, args=_args(tmp_path / "z"), train_dataset=_data(), zswap_config=cfg)
    trainer.train()
    trainer.save_model(str(tmp_path / "saved"))
    plain_model = _build()
    plain_model.add_adapter(lora)
    plain = transformers.Trainer(model=plain_model, args=_args(tmp_path / "p"), train_dataset=_data())
    plain.save_model(str(tmp_path / "plain"))
    saved = {p.name for p in (tmp_path / "saved").iterdir()}
    assert saved == {p.name for p in (tmp_path / "plain").iterdir()}
    assert "adapter_model.safetensors" in saved and "model.safetensors" not in saved
    trained = {n: w for n, w in _weights(model).items() if "lora_" in n}
    loaded = _build()
    loaded.load_adapter(str(tmp_path / "saved"))
    got = {n: p.detach() for n, p in loaded.named_parameters() if "lora_" in n}
    assert got.keys() == trained.keys() and len(got) == 4
    assert [n for n in got if not torch.equal(got[n], trained[n])] == []
    trainer.close()


def test_arguments_for_adam_knobs_a_section_leaves_unset_are_a_mismatch(tmp_path):
    """An ``optimizer`` section without ``betas`` / ``eps`` steps with their defaults (as DeepSpeed's would):
    ``adam_beta1`` / ``adam_epsilon`` asking for others were dropped without a word. Left at their
    defaults, the arguments agree and the Trainer builds."""
    cfg = _config(tmp_path)
    cfg["optimizer"]["params"] = {"lr": "auto", "weight_decay": "auto"}
    args = _args(tmp_path / "z", adam_beta1=0.8, adam_epsilon=1e-6)
    with pytest.raises(zswap.ConfigError) as info:
        zt.Trainer(model=_model(cfg), args=args, train_dataset=_data(), zswap_config=cfg)
    assert str(info.value) == (
        "zswap_config disagrees with the TrainingArguments:\n"
        "- optimizer.params.betas unset (so [0.9, 0.999]) vs TrainingArguments "
        "adam_beta1+adam_beta2=[0.8, 0.999]\n"
        "- optimizer.params.eps unset (so 1e-08) vs TrainingArguments adam_epsilon=1e-06\n"
        'set these keys to "auto" (filled from the arguments) or make the two agree'
    )
    trainer = zt.Trainer(
        model=_model(cfg), args=_args(tmp_path / "y"), train_dataset=_data(), zswap_config=cfg
    )
    assert [g["betas"] for g in trainer.engine.optimizer.param_groups] == [(0.9, 0.999)] * 2
    trainer.close()


def _lora(model: Any) -> Any:
    peft = pytest.importorskip("peft")
    torch.manual_seed(1)  # the adapters' initial values
    return peft.get_peft_model(model, peft.LoraConfig(r=4, target_modules=["c_attn"], fan_in_fan_out=True))


def _adapters(model: Any) -> dict[str, torch.Tensor]:
    return {n: w for n, w in _weights(model).items() if "lora_" in n}


@pytest.mark.parametrize("saved_by", ["plain", "zswap"])
def test_a_peft_models_checkpoint_resumes(tmp_path, saved_by):
    """A PEFT model's checkpoint holds its adapters alone (``adapter_model.safetensors``), whichever Trainer
    saved it: the plain Trainer's (with ``optimizer.pt`` and ``scheduler.pt``) resumes as the plain Trainer
    resumes it, and one this Trainer saved with ``save_only_model`` (the optimizer afresh from there) as the
    plain Trainer resumes its own. Before, both were refused as holding no weights."""
    only = {"save_only_model": True} if saved_by == "zswap" else {}
    ckpt_args = {"save_strategy": "steps", "save_steps": 3, **only, **PLAIN_ARGS}
    torch.manual_seed(0)
    plain_model = _lora(_build())
    plain_args = _args(tmp_path / "plain", **ckpt_args)
    plain = transformers.Trainer(model=plain_model, args=plain_args, train_dataset=_data())
    plain.train()
    if saved_by == "zswap":  # the plain Trainer resumes its own weights-only checkpoint: the reference
        (tmp_path / "first").mkdir()
        cfg = _config(tmp_path / "first")
        first = zt.Trainer(model=_lora(_model(cfg)), args=_args(tmp_path / "z0", **ckpt_args),
                           train_dataset=_data(), zswap_config=cfg)  # fmt: skip
        first.train()
        first.close()
        ckpt = tmp_path / "z0" / "checkpoint-3"
        torch.manual_seed(0)
        plain_model = _lora(_build())
        plain = transformers.Trainer(model=plain_model, args=_args(tmp_path / "plain2", **PLAIN_ARGS),
                                     train_dataset=_data())  # fmt: skip
        plain.train(resume_from_checkpoint=str(tmp_path / "plain" / "checkpoint-3"))
    else:
        ckpt = tmp_path / "plain" / "checkpoint-3"
    assert (ckpt / "adapter_model.safetensors").is_file() and not (ckpt / "model.safetensors").exists()
    cfg = _config(tmp_path)
    model = _lora(_model(cfg))
    trainer = zt.Trainer(model=model, args=_args(tmp_path / "z", **PLAIN_ARGS), train_dataset=_data(),
                         zswap_config=cfg)  # fmt: skip
    trainer.train(resume_from_checkpoint=str(ckpt))
    assert trainer.state.global_step == 6
    want = {n: p.detach() for n, p in plain_model.named_parameters() if "lora_" in n}
    got = _adapters(model)
    assert got.keys() == want.keys() and len(got) == 4
    assert [n for n in got if not torch.equal(got[n], want[n])] == []
    trainer.close()
