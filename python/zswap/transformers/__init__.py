"""zswap for the Hugging Face Trainer: ``zswap.transformers.Trainer(model, args, zswap_config=…)``.

Build or load the model under ``zswap.Init`` (it then never exists in full in memory), and hand it to this
Trainer instead of ``transformers.Trainer``, with the same arguments and a zswap / DeepSpeed config::

    args = TrainingArguments(...)
    cfg = zswap.transformers.fill_config("ds_config.json", args)   # "auto" values from the arguments
    with zswap.Init(cfg):
        model = AutoModelForCausalLM.from_pretrained(name)
    trainer = zswap.transformers.Trainer(model=model, args=args, zswap_config=cfg, train_dataset=ds)
    trainer.train()                             # or train(resume_from_checkpoint=True)
    trainer.save_model("out")                   # plain from_pretrained("out") loads it

It trains as the plain Trainer does with the same arguments and seed (its param groups and weight-decay
exclusions, learning-rate schedule, clipping and gradient accumulation); checkpoints hold a zswap engine
checkpoint and resume exactly. Modules: ``_trainer`` (the Trainer), ``_optim`` (its optimizer made zswap's,
and what its loop steps), ``_fill`` (the ``"auto"`` values, as transformers fills a DeepSpeed config).

**Accelerate.** Accelerate knows nothing of zswap: ``accelerator.prepare(model, optimizer)`` and then
``optimizer.step()`` over a zswap model would step params whose data and gradients live in zswap's stores,
and change nothing. That step raises a `zswap.ZswapError` naming ``engine.step()``, at the first step
(``torch.nn.utils.clip_grad_norm_`` over such params raises too; ``accelerator.clip_grad_norm_`` reads
``p.grad`` itself, finds none and returns 0, and the step after it refuses). In an Accelerate loop, let
zswap step::

    engine = zswap.initialize(model, cfg)       # after prepare(); optimizer from the config (or optimizer=)
    for batch in loader:
        loss = model(**batch).loss
        accelerator.backward(loss)              # or loss.backward()
        engine.step()                           # clipping: the config's gradient_clipping

and leave the optimizer out of ``prepare`` (one process; zswap partitions across ranks itself).
"""

from __future__ import annotations

from typing import Any

try:
    import transformers
except ImportError as exc:  # pragma: no cover - depends on the environment
    raise ImportError(
        "zswap.transformers needs the 'transformers' package: pip install transformers"
    ) from exc

if not hasattr(transformers.Trainer, "_clip_grad_norm"):  # pragma: no cover - depends on the environment
    raise ImportError(
        f"zswap.transformers needs a transformers whose Trainer has _clip_grad_norm (5.x; found "
        f"{transformers.__version__}): pip install -U transformers"
    )

from ._fill import process as _process
from ._trainer import Seq2SeqTrainer, Trainer


def fill_config(config: Any, args: Any) -> dict[str, Any]:
    """``config`` (a path, a mapping, a `zswap.ZswapConfig` or ``None``) as a new dict with its ``"auto"``
    values filled from ``args`` (``TrainingArguments``), as `Trainer` fills it (the schedule's step counts
    excepted: they are known at ``train``). Hand it to ``zswap.Init`` when the arguments decide something
    Init needs — ``bf16.enabled: "auto"`` with ``bf16=True`` builds the params in bf16 — as transformers
    hands its filled DeepSpeed config to ``zero.Init``. The caller's mapping is not modified."""
    return _process(config, args)


__all__ = ["Seq2SeqTrainer", "Trainer", "fill_config"]
