"""`Trainer`: the Hugging Face Trainer's hooks mapped onto a zswap engine.

=====================================  =================================================================
Trainer                                zswap
=====================================  =================================================================
``__init__``                           ``"auto"`` keys of ``zswap_config`` filled from the arguments
                                       (`_fill`); the optimizer built as the Trainer builds it (param
                                       groups, weight-decay exclusions), made an `OffloadedAdamW`; the
                                       engine started: ``zswap.initialize(model, config, optimizer=…)``
``create_scheduler``                   the Trainer's own schedule (``lr_scheduler_type``, warmup) over the
                                       engine's optimizer; or the config's ``scheduler`` section
                                       (`zswap.schedules`) with its step counts filled
backward                               the Trainer's own (``loss.backward()``): gradients accumulate in
                                       zswap's gradient store across the window as they would in ``.grad``;
                                       the update runs in the window's last backward (``sync_gradients``)
                                       and is kept at the step unless clipping bit (then redone)
``_clip_grad_norm``, ``optimizer.step``  ``engine.step()``: the global norm, clipping to
                                       ``max_grad_norm``, the update; the logged ``grad_norm`` is that norm
``save_model``                         `zswap.save_weights` (plain ``from_pretrained`` loads it); a PEFT
                                       model's own ``save_pretrained`` (its adapters)
checkpoints (``save_strategy``)        ``engine.save_checkpoint`` into the checkpoint folder, plus the
                                       Trainer's own files (state, schedule, RNG)
``resume_from_checkpoint``             ``engine.load_checkpoint``: params, optimizer state, counters; a
                                       ``save_only_model`` checkpoint: its weights through
                                       ``load_state_dict``, the optimizer afresh (as the plain Trainer);
                                       a plain Trainer's: its weights, ``optimizer.pt`` and
                                       ``scheduler.pt`` (`EngineStepper.load_state_dict`)
``load_best_model_at_end``             ``engine.load_checkpoint`` of the best checkpoint (float32 masters
                                       included), as transformers' DeepSpeed integration
a subclass's ``create_optimizer``      the optimizer it builds, taken as one in ``optimizers=``
=====================================  =================================================================

The engine steps once per accumulation window (its own ``gradient_accumulation_steps`` is 1): the Trainer
decides the windows, scales the loss for them and calls ``optimizer.step()`` at their ends, exactly as it
does without zswap, so the same arguments and seed give the same losses and weights.
"""

from __future__ import annotations

import os
import weakref
from typing import Any

import torch
import transformers
from transformers.trainer import SCHEDULER_NAME, TRAINING_ARGS_NAME, _is_peft_model
from transformers.utils import (
    ADAPTER_SAFE_WEIGHTS_NAME,
    ADAPTER_WEIGHTS_NAME,
    SAFE_WEIGHTS_INDEX_NAME,
    SAFE_WEIGHTS_NAME,
    WEIGHTS_INDEX_NAME,
    WEIGHTS_NAME,
)

from ..checkpoint import save_weights
from ..checkpoint.fp32 import write_script
from ..config import load_config
from ..errors import ConfigError, EngineClosedError, ZswapError
from ..parts.params import param_state
from ..parts.runners import open_runners
from ..step import schedules
from ..step.stepping import few
from ..train import dtypes
from ..train.runtime import Engine, initialize
from . import _fill
from ._optim import EngineStepper, check_elementwise, to_zswap

ENGINE_KEYS_DROPPED = (
    "optimizer",
    "scheduler",
    "gradient_clipping",
    "gradient_accumulation_steps",
    "train_batch_size",
    "train_micro_batch_size_per_gpu",
)
"""Keys the Trainer honours itself (checked against the arguments by `_fill`), kept from the engine so
that it does not apply them a second time."""


logger = transformers.utils.logging.get_logger(__name__)

_WEIGHT_FILES = (SAFE_WEIGHTS_NAME, SAFE_WEIGHTS_INDEX_NAME, WEIGHTS_NAME, WEIGHTS_INDEX_NAME)
_ADAPTER_FILES = (ADAPTER_SAFE_WEIGHTS_NAME, ADAPTER_WEIGHTS_NAME)
"""A PEFT model's weights in a checkpoint: its adapters alone, as both Trainers save them."""


def _param_count(model: Any, trainable_only: bool = False) -> int:
    """transformers' ``get_model_param_count``, counting each param by its ``ds_numel`` where it has one
    (a partitioned param's tensor is its empty placeholder): transformers does so only while DeepSpeed's
    own ZeRO-3 config is live, so the Trainer's "Number of trainable parameters" log said 0 for a zswap
    model. A param without ``ds_numel`` counts as before."""
    counted = (p for p in model.parameters() if p.requires_grad or not trainable_only)
    return sum(getattr(p, "ds_numel", p.numel()) for p in counted)


transformers.trainer.get_model_param_count = _param_count  # the name the Trainer's log looks up


def _with_adapters(model: Any) -> bool:
    """Whether the plain Trainer saves ``model``'s adapters alone (``save_pretrained`` of a PeftModel, or of a
    transformers model whose adapters ``add_adapter`` / ``load_adapter`` added)."""
    return _is_peft_model(model) or bool(getattr(model, "_hf_peft_config_loaded", False))


def _has_engine_checkpoint(folder: str) -> bool:
    return os.path.isfile(os.path.join(folder, "latest"))


class Trainer(transformers.Trainer):
    """A ``transformers.Trainer`` for a model built or loaded under ``zswap.Init``.

    Args:
        zswap_config: a zswap / DeepSpeed config (a path to a JSON file, a mapping, a `zswap.ZswapConfig`
            or ``None``), in the layout Hugging Face's DeepSpeed integration takes: ``"auto"`` values are
            filled from ``args`` as transformers fills a DeepSpeed config, and a value given explicitly
            must agree with ``args`` (a `ConfigError` lists those that do not). The caller's mapping is
            never modified.
        everything else: as ``transformers.Trainer``. ``optimizers=(optimizer, scheduler)`` may pass a
            torch optimizer over the model's params: an Adam / AdamW becomes zswap's offloaded AdamW over
            its groups (the scheduler drives it), another is stepped as given (its state in memory).

    One process, one device: several ranks (``torchrun``) and ``n_gpu > 1`` are refused, as is ``fp16``
    mixed precision (a gradient scaler cannot see zswap's gradients: build the model in fp16 under
    ``Init`` with the config's ``fp16`` section instead). ``engine`` is the `zswap.Engine` (open from
    construction on, so ``evaluate`` works before ``train``); ``close()`` closes it.
    """

    def __init__(
        self, model: Any = None, args: Any = None, *rest: Any, zswap_config: Any = None, **kwargs: Any
    ):
        if model is None:
            raise ZswapError(
                "zswap.transformers.Trainer needs model= (built or loaded under zswap.Init); model_init is "
                "not supported"
            )
        if args is None:
            args = transformers.TrainingArguments(output_dir="trainer_output")
        _refuse(args)
        self.zswap_config: dict[str, Any] = _fill.process(zswap_config, args)
        """The config with the arguments' values filled in (a private copy)."""
        cfg = load_config(self.zswap_config)
        _check_dtype(model, cfg)  # every check, before anything is built
        _check_best(cfg, args)
        _check_schedule(self.zswap_config, args)
        _check_optim(self.zswap_config, args)
        if kwargs.get("optimizer_cls_and_kwargs") is not None and self.zswap_config.get("optimizer"):
            cls = kwargs["optimizer_cls_and_kwargs"][0]
            raise ConfigError(
                f"optimizer_cls_and_kwargs= asks for {getattr(cls, '__name__', cls)} and zswap_config has an "
                "'optimizer' section, which builds the optimizer: keep one of them"
            )
        self.engine: Engine | None = None
        self._grad_norm: torch.Tensor | None = None
        super().__init__(model, args, *rest, **kwargs)
        # zswap places params and buffers on the compute device itself; a model.to() from Accelerate would
        # move the empty tensors standing for partitioned params. Inputs are moved by the Trainer.
        self.accelerator.device_placement = False
        _check_given(self.zswap_config, self.optimizer, self.lr_scheduler, "optimizers= passes")
        built = self.create_optimizer()
        if self.engine is None:
            # A subclass's create_optimizer (transformers' documented way to customise the optimizer) built
            # its own without calling this one: it is taken as an optimizer passed in optimizers= is.
            own = self.optimizer if self.optimizer is not None else built
            if own is None:
                raise ZswapError(
                    f"{type(self).__name__}.create_optimizer() returned no optimizer: return the optimizer "
                    "it builds (or pass one in optimizers=)"
                )
            _check_given(self.zswap_config, own, None, f"{type(self).__name__}.create_optimizer() builds")
            self.optimizer = own
            Trainer.create_optimizer(self)
        self._built_with = _built_from(self.args)
        model_: Any = self.model
        self._trained = {id(p) for p in model_.parameters() if p.requires_grad}

    # -- optimizer, engine, schedule ---------------------------------------------------------------------

    def create_optimizer(self, model: Any = None) -> Any:
        if self.engine is not None:
            return self.optimizer
        _refuse_running(self.model)
        given = self.optimizer
        if given is None:
            client = super().create_optimizer(model)
            self.optimizer = None
        cfg = load_config(self.zswap_config)
        if given is not None:
            check_elementwise(given, "the optimizer passed in optimizers=")
        optimizer = given if given is not None else to_zswap(client, cfg)
        engine_cfg = {k: v for k, v in self.zswap_config.items() if k not in ENGINE_KEYS_DROPPED}
        # Clipping at infinity computes the global norm (logged as grad_norm) and never scales.
        clip = self.args.max_grad_norm if self.args.max_grad_norm and self.args.max_grad_norm > 0 else None
        model_: Any = self.model
        self.engine = initialize(
            model_,
            engine_cfg,
            optimizer=optimizer,
            max_grad_norm=clip if clip is not None else float("inf"),
            device=self.args.device,
        )
        try:
            dtypes.check_accumulation(self.engine, self.args.gradient_accumulation_steps)
        except BaseException:
            self.engine.close()
            raise
        if self.args.gradient_accumulation_steps > 1:
            # The Trainer sums several backwards per engine step and marks the last one of each window
            # (an epoch's last window may be shorter) with sync_gradients before it runs: the early step
            # sums the earlier ones and runs in that one (`zswap.step.speculation`).
            me = weakref.ref(self)
            self.engine.window_ends = lambda: (t := me()) is None or t.accelerator.sync_gradients
        if given is None:
            self.engine.adopt_optimizer()  # built here: closed with the engine
        self.optimizer = EngineStepper(self.engine, self._stepped)
        return self.optimizer

    def create_scheduler(self, num_training_steps: int, optimizer: Any = None) -> Any:
        if self.lr_scheduler is None:
            assert self.engine is not None  # started in __init__
            filled = _fill.finalize(self.zswap_config, self.args, num_training_steps)
            cfg = load_config(filled)
            if cfg.scheduler is not None:
                self.lr_scheduler = schedules.build(cfg.scheduler, self.engine.optimizer)  # type: ignore[assignment]
                self._created_lr_scheduler = True
            else:
                super().create_scheduler(num_training_steps, optimizer=self.engine.optimizer)
        return self.lr_scheduler

    # -- the step ------------------------------------------------------------------------------------------

    def training_step(self, *args: Any, **kwargs: Any) -> Any:
        loss = super().training_step(*args, **kwargs)
        if self.engine is not None:
            self.engine.end_micro_batch()  # before a window's last batch: the next forward's first params
        return loss

    def _clip_grad_norm(self, model: Any) -> torch.Tensor:
        # Called before optimizer.step(); the engine takes the norm (and clips) inside that step. The
        # tensor returned is what the Trainer logs later as grad_norm: `_stepped` fills it in.
        self._grad_norm = torch.tensor(float("nan"))
        return self._grad_norm

    def _get_grad_norm(self, model: Any, grad_norm: Any = None) -> Any:
        return self._clip_grad_norm(model) if grad_norm is None else grad_norm

    def _stepped(self, norm: float | None) -> None:
        if self._grad_norm is not None and norm is not None:
            self._grad_norm.fill_(norm)

    def _move_model_to_device(self, model: Any, device: Any) -> None:
        pass  # the engine computes on args.device; partitions stay on their offload tier

    # -- saving and resuming -----------------------------------------------------------------------------

    def save_model(self, output_dir: str | None = None, _internal_call: bool = False) -> None:
        """Consolidated weights in the Hugging Face layout (`zswap.save_weights`, one param in memory at a
        time; ``config.json`` and the generation config included), plus the processing class and the
        arguments, as the Trainer saves them."""
        out: str = str(self.args.output_dir if output_dir is None else output_dir)
        os.makedirs(out, exist_ok=True)
        model: Any = self.model
        if _with_adapters(model):
            # PEFT's own layout (adapter_config.json + the adapters' weights), as the plain Trainer saves
            # it (a PeftModel's, or a transformers model's adapters from add_adapter): PeftModel's
            # from_pretrained and load_adapter (load_best_model_at_end) read it.
            model.save_pretrained(out, is_main_process=self.args.should_save)
        else:
            save_weights(model, out)
        if self.args.should_save:  # (save_weights wrote the generation config; PEFT's save writes none)
            if self.processing_class is not None:
                self.processing_class.save_pretrained(out)
            torch.save(self.args, os.path.join(out, TRAINING_ARGS_NAME))
        if self.args.push_to_hub and not _internal_call:
            self.push_to_hub(commit_message="Model save", revision=self.args.hub_revision)

    def _save_optimizer_and_scheduler(self, output_dir: str) -> None:
        assert self.engine is not None
        self.engine.save_checkpoint(output_dir)  # params, optimizer state, counters: streamed
        if self.args.should_save:
            write_script(output_dir)  # where DeepSpeed leaves its own zero_to_fp32.py (its docs run it)
            schedule: Any = self.lr_scheduler
            torch.save(schedule.state_dict(), os.path.join(output_dir, SCHEDULER_NAME))

    def _load_from_checkpoint(self, resume_from_checkpoint: str, model: Any = None) -> None:
        if not os.path.isdir(resume_from_checkpoint):
            raise ValueError(
                f"Can't find a valid checkpoint at {resume_from_checkpoint}"
            )  # transformers' own
        if _has_engine_checkpoint(resume_from_checkpoint):
            return  # the weights come back with the engine checkpoint (`_load_optimizer_and_scheduler`)
        names = _WEIGHT_FILES + (
            _ADAPTER_FILES if _with_adapters(self.model if model is None else model) else ()
        )
        if not any(os.path.isfile(os.path.join(resume_from_checkpoint, n)) for n in names):
            raise ZswapError(
                f"{resume_from_checkpoint} holds neither a zswap engine checkpoint (no 'latest' file) nor "
                "model weights: resume_from_checkpoint takes a checkpoint folder this Trainer saved"
            )
        # save_only_model=True: weights alone (a PEFT model's: its adapters, through PEFT's load_adapter),
        # read through load_state_dict into the partitioned params; the optimizer and schedule start afresh,
        # as the plain Trainer does with such a checkpoint — or, from a plain Trainer's, come from its files.
        super()._load_from_checkpoint(resume_from_checkpoint, model)

    def _load_optimizer_and_scheduler(self, checkpoint: str | None) -> None:
        if checkpoint is None:
            return
        if not _has_engine_checkpoint(checkpoint):
            # A plain Trainer's checkpoint: its optimizer.pt and scheduler.pt (both, as the plain Trainer
            # takes them) into the engine's optimizer (torch's state-dict layout) and the schedule;
            # save_only_model's (weights alone): neither, the optimizer starts afresh.
            super()._load_optimizer_and_scheduler(checkpoint)
            return
        assert self.engine is not None
        self.engine.load_checkpoint(checkpoint)
        path = os.path.join(checkpoint, SCHEDULER_NAME)
        if os.path.isfile(path):
            schedule: Any = self.lr_scheduler
            schedule.load_state_dict(torch.load(path, weights_only=True))

    def _load_best_model(self) -> None:
        best = self.state.best_model_checkpoint
        if self.engine is None or best is None or not _has_engine_checkpoint(best):
            super()._load_best_model()  # save_only_model's checkpoints: the weights (refused at __init__
            return  # where the optimizer holds float32 masters, which they would leave stale)
        # As transformers' DeepSpeed integration does: the whole engine checkpoint, so that bf16 / fp16
        # params come back with their float32 masters (loading the weights alone would be refused).
        logger.info(f"Loading best model from {best} (score: {self.state.best_metric}).")
        self.engine.load_checkpoint(best)

    # -- lifetime ------------------------------------------------------------------------------------------

    def close(self) -> None:
        """Close the engine (hooks removed, the optimizer state freed); the model keeps its params. The
        Trainer cannot train, evaluate or predict after it (`EngineClosedError`)."""
        if self.engine is not None:
            self.engine.close()

    def _check_open(self, what: str) -> None:
        if self.engine is not None and self.engine.closed:
            raise EngineClosedError(
                f"{what}() after close(): this zswap.transformers.Trainer's engine is closed; build a new "
                "zswap.transformers.Trainer over the model"
            )

    def train(self, *args: Any, **kwargs: Any) -> Any:
        self._check_open("train")
        self._check_unchanged()
        return super().train(*args, **kwargs)

    def _check_unchanged(self) -> None:
        """The plain Trainer builds its optimizer in ``train()``; this one built it, and the engine, in its
        constructor: what they were built from and has changed since would go unused without a word."""
        changed = [f"{k} ({v!r} → {getattr(self.args, k)!r})" for k, v in self._built_with.items()
                   if getattr(self.args, k) != v]  # fmt: skip
        if changed:
            raise ConfigError(
                f"train(): TrainingArguments changed since this zswap.transformers.Trainer was built: "
                f"{', '.join(changed)}. It builds the optimizer and the engine in its constructor: set them "
                "before building the Trainer (or build a new one after close())"
            )
        model: Any = self.model
        unfrozen = [n for n, p in model.named_parameters() if p.requires_grad and id(p) not in self._trained]
        if unfrozen:
            raise ZswapError(
                f"train(): {few(unfrozen)} required no grad when this zswap.transformers.Trainer was built "
                "and do now; its constructor builds the engine, which trains the params that require grad "
                "then: unfreeze them before building the Trainer (or build a new one after close())"
            )

    def evaluate(self, *args: Any, **kwargs: Any) -> Any:
        self._check_open("evaluate")
        return super().evaluate(*args, **kwargs)

    def predict(self, *args: Any, **kwargs: Any) -> Any:
        self._check_open("predict")
        return super().predict(*args, **kwargs)


class Seq2SeqTrainer(Trainer, transformers.Seq2SeqTrainer):
    """`Trainer` with ``transformers.Seq2SeqTrainer``'s evaluation: ``Seq2SeqTrainingArguments``,
    ``predict_with_generate`` (``generate`` runs on the partitioned model), ``generation_config``."""


_BUILT_FROM = (
    "learning_rate", "weight_decay", "adam_beta1", "adam_beta2", "adam_epsilon", "max_grad_norm", "optim"
)  # fmt: skip
"""The arguments the optimizer and the engine are built from in `Trainer.__init__` (the schedule and the
accumulation are read again in ``train()``)."""


def _built_from(args: Any) -> dict[str, Any]:
    return {k: getattr(args, k) for k in _BUILT_FROM}


def _check_dtype(model: Any, cfg: Any) -> None:
    """The dtype the filled config asks for (``bf16.enabled: "auto"`` and ``bf16=True``) is the params'
    dtype only if ``Init`` saw it: the model was built before this Trainer, so say so rather than train in
    another dtype than the config says."""
    want = cfg.torch_dtype()
    if want is None:
        return
    have = {st.dtype for p in model.parameters() if (st := param_state(p)) is not None}
    if have and have != {want}:
        section = "bf16" if want == torch.bfloat16 else "fp16"
        raise ConfigError(
            f"zswap_config's {section}.enabled is true (given, or filled from the TrainingArguments) but the "
            f"model's params are {', '.join(sorted(str(d) for d in have))}: Init decides the params' dtype, "
            "so build or load the model under zswap.Init(zswap.transformers.fill_config(config, args))"
        )


def _check_best(cfg: Any, args: Any) -> None:
    """``load_best_model_at_end`` over ``save_only_model`` checkpoints reloads weights alone; with bf16 / fp16
    params, whose float32 masters the optimizer holds, that load is refused — say so before training rather
    than after it."""
    if cfg.torch_dtype() is not None and args.load_best_model_at_end and args.save_only_model:
        raise ConfigError(
            "load_best_model_at_end=True with save_only_model=True would reload the best weights without "
            "their float32 master copies, which the optimizer of a bf16 / fp16 model holds: drop "
            "save_only_model (each checkpoint then holds the engine checkpoint the best model is restored "
            "from)"
        )


def _check_schedule(config: dict[str, Any], args: Any) -> None:
    """A ``scheduler`` section wins over the arguments' schedule (as under DeepSpeed); an argument that
    asks for another schedule would otherwise be dropped without a word."""
    if not config.get("scheduler"):
        return
    kind = getattr(args.lr_scheduler_type, "value", args.lr_scheduler_type)
    asked = [f"lr_scheduler_type={kind!r}"] if kind != "linear" else []
    asked += ["lr_scheduler_kwargs"] if args.lr_scheduler_kwargs else []
    if asked:
        raise ConfigError(
            "zswap_config has a 'scheduler' section, which sets the schedule, but TrainingArguments asks "
            f"for {' and '.join(asked)}: drop the section to use the arguments' schedule, or leave them at "
            "their defaults"
        )


def _check_optim(config: dict[str, Any], args: Any) -> None:
    """An ``optimizer`` section builds zswap's AdamW (as DeepSpeed's section wins over the arguments); an
    ``optim`` naming another optimizer would otherwise be dropped without a word."""
    optim = str(getattr(args.optim, "value", args.optim))
    if config.get("optimizer") and not optim.startswith("adamw"):
        raise ConfigError(
            "zswap_config has an 'optimizer' section, which builds the optimizer, but TrainingArguments asks "
            f"for optim={optim!r}: drop the section to use the arguments' optimizer, or leave optim at an "
            "AdamW"
        )


def _check_given(config: dict[str, Any], optimizer: Any, scheduler: Any, source: str) -> None:
    """An optimizer or scheduler given (``source``: ``optimizers=``, a subclass's ``create_optimizer``)
    beside a config section of its kind: one of the two would go unused without a word (transformers'
    DeepSpeed integration drops the given one)."""
    for key, given, what in (
        ("optimizer", optimizer, "an optimizer"),
        ("scheduler", scheduler, "a scheduler"),
    ):
        if given is not None and config.get(key):
            raise ConfigError(
                f"{source} {what} ({type(given).__name__}) and zswap_config has a '{key}' section, which "
                "would build another: keep one of them"
            )


def _refuse_running(model: Any) -> None:
    """A second Trainer over a model an open one still runs (a notebook cell run again): say which
    ``close()`` frees it, rather than the engine's generic refusal."""
    ids = {id(p) for p in model.parameters()}
    if any(runner.runs(ids) for runner in open_runners()):
        raise ZswapError(
            "the model's params are run by another open zswap Engine (an earlier zswap.transformers.Trainer "
            "over this model?): call that trainer's close() (or its engine's) before building a new Trainer"
        )


def _refuse(args: Any) -> None:
    for flag, dtype in (("fp16_full_eval", "fp16"), ("bf16_full_eval", "bf16")):
        if getattr(args, flag, False):
            raise ConfigError(
                f"TrainingArguments({flag}=True) casts the whole model to {dtype} (and moves it to the "
                "device) before evaluating, which would convert its offloaded params for good: build or load "
                f"the model in {dtype} under zswap.Init (the config's '{dtype}' section) to evaluate in "
                f"{dtype}"
            )
    if getattr(args, "deepspeed", None):
        raise ConfigError(
            "TrainingArguments(deepspeed=...) hands the model to DeepSpeed, over params zswap partitions: "
            "give the config as zswap.transformers.Trainer(..., zswap_config=...) instead"
        )
    if args.torch_compile:
        raise ConfigError(
            "TrainingArguments(torch_compile=True) compiles the model, whose partitioned params change "
            "state under zswap's hooks every call: dynamo recompiles until its limit and then runs the model "
            "eagerly (docs/troubleshooting.md); leave torch_compile off, or compile a part zswap does not "
            "partition"
        )
    if args.fp16:
        raise ConfigError(
            "TrainingArguments(fp16=True) uses a gradient scaler that cannot see zswap's gradients: build "
            "the model in fp16 under zswap.Init and set the config's 'fp16' section (the engine scales the "
            "loss)"
        )
    if args.world_size > 1 or args.n_gpu > 1:
        raise ZswapError(
            f"zswap.transformers.Trainer runs one process on one device (world_size={args.world_size}, "
            f"n_gpu={args.n_gpu}); for several ranks train with zswap.initialize and engine.step() (or "
            "zswap.lightning.ZswapStrategy)"
        )
