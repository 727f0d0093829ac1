"""`zswap.transformers.Trainer` on real Hugging Face architectures against the plain ``transformers.Trainer``
(same arguments and seed): a Llama with tied embeddings built with ``AutoModelForCausalLM.from_config`` and
loaded with ``from_pretrained`` under ``Init``, a DistilBERT classifier evaluated every 2 steps under a
cosine schedule, a Llama with gradient checkpointing and ``bf16=True`` (autocast), one fed ragged rows with
an extra column through ``DataCollatorForLanguageModeling``, a T5 whose ``save_model`` output plain
``from_pretrained`` loads with the plain Trainer's weights; a ``save_only_model`` checkpoint resumes as the
plain Trainer resumes it (weights, a fresh optimizer); a closed Trainer refuses to train or evaluate."""

from __future__ import annotations

import warnings
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
import torch

import zswap

transformers = pytest.importorskip("transformers")
pytest.importorskip("accelerate")

import zswap.transformers as zt  # noqa: E402

pytestmark = pytest.mark.usefixtures("quiet_transformers")

V = 128


def _llama() -> Any:
    config = transformers.LlamaConfig(
        vocab_size=V,
        hidden_size=32,
        intermediate_size=64,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=64,
        tie_word_embeddings=True,
    )
    return transformers.AutoModelForCausalLM.from_config(config)


def _distilbert() -> Any:
    config = transformers.DistilBertConfig(
        vocab_size=V, dim=32, hidden_dim=64, n_layers=2, n_heads=4, dropout=0, attention_dropout=0,
        seq_classif_dropout=0, num_labels=3, max_position_embeddings=64,
    )  # fmt: skip
    return transformers.DistilBertForSequenceClassification(config)


def _t5() -> Any:
    config = transformers.T5Config(
        vocab_size=V, d_model=32, d_kv=8, d_ff=64, num_layers=2, num_heads=4, dropout_rate=0,
        decoder_start_token_id=0,
    )  # fmt: skip
    return transformers.T5ForConditionalGeneration(config)


def _collator() -> Any:
    from tokenizers import Tokenizer, models

    vocab = {f"t{i}": i for i in range(V)}
    tok = Tokenizer(models.WordLevel(vocab, unk_token="t1"))
    fast = transformers.PreTrainedTokenizerFast(tokenizer_object=tok, pad_token="t0", unk_token="t1")
    return transformers.DataCollatorForLanguageModeling(tokenizer=fast, mlm=False)


def _data(kind: str, n: int = 16, seed: int = 1) -> list[dict[str, torch.Tensor]]:
    g = torch.Generator().manual_seed(seed)
    out = []
    for _ in range(n):
        ids = torch.randint(3, V, (12,), generator=g)
        if kind == "cls":
            out.append({"input_ids": ids, "labels": torch.randint(0, 3, (), generator=g)})
        elif kind == "raw":  # ragged, with a column the model does not take: for the collator to pad / drop
            out.append({"input_ids": ids[: 12 - 2 * (len(out) % 2)], "text": "unused"})
        elif kind == "s2s":
            out.append({"input_ids": ids, "labels": torch.randint(3, V, (6,), generator=g)})
        else:
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
    nvme = {"device": "nvme", "nvme_path": str(tmp_path)}
    zero = {"stage": 3, "offload_param": nvme, "offload_optimizer": nvme}
    params = {"lr": "auto", "betas": "auto", "eps": "auto", "weight_decay": "auto"}
    return {
        "zero_optimization": {**zero, "stage3_param_persistence_threshold": 0},
        "optimizer": {"type": "AdamW", "params": params},
        "gradient_clipping": "auto",
        "gradient_accumulation_steps": "auto",
        "train_micro_batch_size_per_gpu": "auto",
    }


def _under_init(cfg: Any, make: Callable[[], Any]) -> Any:
    torch.manual_seed(0)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", zswap.ZswapWarning)
        with zswap.Init(cfg):
            return make()


def _weights(model: Any) -> dict[str, torch.Tensor]:
    with zswap.GatheredParameters(list(model.parameters())):
        return {n: p.detach().clone() for n, p in model.named_parameters()}


def _history(trainer: Any) -> list[tuple[float, ...]]:
    keys = ("loss", "grad_norm", "learning_rate", "eval_loss")
    return [tuple(h[k] for k in keys if k in h) for h in trainer.state.log_history if set(keys) & set(h)]


def _assert_same(got: Any, want: Any) -> None:
    assert len(got) == len(want)
    for g, w in zip(got, want, strict=True):
        assert g == pytest.approx(w, rel=1e-4, abs=1e-6)


def _assert_weights(got: dict[str, torch.Tensor], want: dict[str, torch.Tensor]) -> None:
    assert got.keys() == want.keys()
    for name in want:
        assert torch.allclose(got[name], want[name], rtol=1e-4, atol=1e-6), name


CASES: dict[str, tuple[Callable[[], Any], str, dict[str, Any]]] = {
    "llama-tied-from-config": (_llama, "lm", {}),
    "llama-tied-from-pretrained": (_llama, "lm", {}),
    "distilbert-cls-eval-cosine": (
        _distilbert,
        "cls",
        {"lr_scheduler_type": "cosine", "warmup_steps": 2, "eval_strategy": "steps", "eval_steps": 2},
    ),
    "t5-save-model": (_t5, "s2s", {"max_grad_norm": 0.5}),
    # bf16=True with no bf16 section: the params stay float32 and the forward runs under autocast, as in
    # the plain Trainer (a bf16 section instead makes Init build bf16 params: not the plain Trainer's run)
    "llama-checkpointing-bf16-autocast": (_llama, "lm", {"gradient_checkpointing": True, "bf16": True}),
    "llama-lm-collator-remove-columns": (_llama, "raw", {}),
}  # fmt: skip


@pytest.mark.parametrize("case", list(CASES))
def test_trains_like_the_plain_trainer(case, tmp_path):
    build, kind, extra = CASES[case]
    train, evals = _data(kind), _data(kind, 6, seed=7)
    torch.manual_seed(0)
    plain_model = build()
    if case.endswith("from-pretrained"):
        plain_model.save_pretrained(tmp_path / "src")
        make: Callable[[], Any] = lambda: type(plain_model).from_pretrained(tmp_path / "src")  # noqa: E731
    else:
        make = build
    more = {"data_collator": _collator()} if kind == "raw" else {}
    plain = transformers.Trainer(
        model=plain_model,
        args=_args(tmp_path / "p", **extra),
        train_dataset=train,
        eval_dataset=evals,
        **more,
    )
    plain.train()

    cfg = _config(tmp_path)
    model = _under_init(cfg, make)
    trainer = zt.Trainer(
        model=model,
        args=_args(tmp_path / "z", **extra),
        train_dataset=train,
        eval_dataset=evals,
        zswap_config=cfg,
        **more,
    )
    trainer.train()
    _assert_same(_history(trainer), _history(plain))
    want = {n: p.detach() for n, p in plain_model.named_parameters()}
    _assert_weights(_weights(model), want)
    if "eval_strategy" in extra:
        assert sum("eval_loss" in h for h in trainer.state.log_history) == 2
    if case.startswith("t5"):
        trainer.save_model(str(tmp_path / "saved"))
        plain.save_model(str(tmp_path / "plain-saved"))
        got = type(plain_model).from_pretrained(tmp_path / "saved").state_dict()
        ref = type(plain_model).from_pretrained(tmp_path / "plain-saved").state_dict()
        _assert_weights(got, ref)
    trainer.close()


def test_save_only_model_checkpoint_resumes_as_the_plain_trainer(tmp_path):
    """A checkpoint with weights alone: resumed, the weights are read back and the optimizer starts afresh,
    as the plain Trainer does; before, resuming from it raised."""
    ckpt_args = {"save_strategy": "steps", "save_steps": 2, "save_only_model": True}

    def run(out: Path, trainer_cls: Any, make: Callable[[], Any], **kw: Any) -> Any:
        first = trainer_cls(model=make(), args=_args(out, **ckpt_args), train_dataset=_data("lm"), **kw)
        first.train()
        if hasattr(first, "close"):
            first.close()
        model = make()  # other weights: the checkpoint brings back the trained ones
        second = trainer_cls(model=model, args=_args(out, **ckpt_args), train_dataset=_data("lm"), **kw)
        second.train(resume_from_checkpoint=str(out / "checkpoint-2"))
        return model, second

    torch.manual_seed(0)
    plain_model, plain = run(tmp_path / "p", transformers.Trainer, _llama)
    cfg = _config(tmp_path)
    model, trainer = run(tmp_path / "z", zt.Trainer, lambda: _under_init(cfg, _llama), zswap_config=cfg)
    assert not (tmp_path / "z" / "checkpoint-2" / "latest").exists()  # no engine checkpoint in it
    assert trainer.state.global_step == plain.state.global_step == 4
    _assert_same(_history(trainer), _history(plain))
    _assert_weights(_weights(model), {n: p.detach() for n, p in plain_model.named_parameters()})
    trainer.close()


def test_resume_from_a_folder_without_weights_is_refused(tmp_path):
    cfg = _config(tmp_path)
    trainer = zt.Trainer(
        model=_under_init(cfg, _llama),
        args=_args(tmp_path / "z"),
        train_dataset=_data("lm"),
        zswap_config=cfg,
    )
    (tmp_path / "empty").mkdir()
    with pytest.raises(
        zswap.ZswapError, match=r"holds neither a zswap engine checkpoint .* nor model weights"
    ):
        trainer.train(resume_from_checkpoint=str(tmp_path / "empty"))
    trainer.close()


def test_a_closed_trainer_refuses_to_train_evaluate_or_predict(tmp_path):
    cfg = _config(tmp_path)
    evals = _data("lm", 4)
    trainer = zt.Trainer(
        model=_under_init(cfg, _llama), args=_args(tmp_path / "z"), train_dataset=_data("lm"),
        eval_dataset=evals, zswap_config=cfg,
    )  # fmt: skip
    trainer.close()
    for call in (trainer.train, trainer.evaluate, lambda: trainer.predict(evals)):
        with pytest.raises(
            zswap.EngineClosedError, match=r"after close\(\).*build a new zswap.transformers.Trainer"
        ):
            call()


def test_a_second_trainer_over_a_model_an_open_one_runs_names_close(tmp_path):
    cfg = _config(tmp_path)
    model = _under_init(cfg, _llama)
    first = zt.Trainer(model=model, args=_args(tmp_path / "z"), train_dataset=_data("lm"), zswap_config=cfg)
    with pytest.raises(
        zswap.ZswapError, match=r"earlier zswap.transformers.Trainer .*call that trainer's close\(\)"
    ):
        zt.Trainer(model=model, args=_args(tmp_path / "z"), zswap_config=cfg)
    first.close()
    second = zt.Trainer(
        model=model, args=_args(tmp_path / "z"), eval_dataset=_data("lm", 4), zswap_config=cfg
    )
    assert second.evaluate()["eval_loss"] > 0  # the closed one freed the params
    second.close()


@pytest.mark.filterwarnings("ignore:Using the model-agnostic default `max_length`:UserWarning")
def test_seq2seq_trainer_generates_as_the_plain_one(tmp_path):
    """``predict_with_generate``: ``generate`` on the partitioned T5 gives the plain trainer's tokens."""

    def args(out: Path) -> Any:
        return transformers.Seq2SeqTrainingArguments(
            output_dir=str(out), per_device_train_batch_size=2, max_steps=3, learning_rate=5e-3, report_to=[],
            seed=0, use_cpu=True, disable_tqdm=True, predict_with_generate=True, generation_max_length=6,
            save_strategy="no",
        )  # fmt: skip

    train, evals = _data("s2s"), _data("s2s", 4, seed=7)
    torch.manual_seed(0)
    plain = transformers.Seq2SeqTrainer(model=_t5(), args=args(tmp_path / "p"), train_dataset=train)
    plain.train()
    want = plain.predict(evals)
    cfg = _config(tmp_path)
    trainer = zt.Seq2SeqTrainer(
        model=_under_init(cfg, _t5), args=args(tmp_path / "z"), train_dataset=train, zswap_config=cfg
    )
    trainer.train()
    got = trainer.predict(evals)
    assert got.predictions.shape == want.predictions.shape
    assert (got.predictions == want.predictions).all()
    assert got.metrics["test_loss"] == pytest.approx(want.metrics["test_loss"], rel=1e-4)
    trainer.close()


def test_classifier_head_new_on_a_pretrained_base(tmp_path):
    """Fine-tuning as users do: a base model's weights and a classification head transformers initialises
    (missing from the checkpoint) under ``Init`` — same head, same training as the plain Trainer."""
    torch.manual_seed(5)
    transformers.DistilBertModel(_distilbert().config).save_pretrained(tmp_path / "base")

    def make() -> Any:
        return transformers.AutoModelForSequenceClassification.from_pretrained(
            tmp_path / "base", num_labels=3
        )

    train = _data("cls")
    torch.manual_seed(0)
    plain_model = make()
    plain = transformers.Trainer(model=plain_model, args=_args(tmp_path / "p"), train_dataset=train)
    plain.train()
    cfg = _config(tmp_path)
    model = _under_init(cfg, make)
    trainer = zt.Trainer(model=model, args=_args(tmp_path / "z"), train_dataset=train, zswap_config=cfg)
    trainer.train()
    _assert_same(_history(trainer), _history(plain))
    _assert_weights(_weights(model), {n: p.detach() for n, p in plain_model.named_parameters()})
    trainer.close()


def test_a_scheduler_section_and_another_lr_scheduler_type_are_refused(tmp_path):
    cfg = {**_config(tmp_path), "scheduler": {"type": "WarmupLR", "params": {"warmup_num_steps": "auto"}}}
    model = _under_init(cfg, _llama)
    with pytest.raises(zswap.ConfigError, match=r"'scheduler' section.*lr_scheduler_type='cosine'"):
        zt.Trainer(model=model, args=_args(tmp_path / "z", lr_scheduler_type="cosine"), zswap_config=cfg)
    trainer = zt.Trainer(
        model=model, args=_args(tmp_path / "z"), zswap_config=cfg
    )  # the default: the section
    trainer.close()
