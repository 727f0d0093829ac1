"""DeepSpeed's call shapes on zswap: a script ported by changing ``import deepspeed`` to
``import zswap.deepspeed as deepspeed`` runs unchanged.

zswap's own API (`zswap.initialize`, `zswap.Init`, `zswap.GatheredParameters`) keeps one spelling for each
thing; this module maps DeepSpeed's signatures onto it and nothing more:

- `initialize` returns DeepSpeed's 4-tuple ``(engine, optimizer, training_dataloader, lr_scheduler)``;
- `zero.Init`, `zero.GatheredParameters`, `zero.register_external_parameter`,
  `zero.unwrap_model_for_generation`;
- `checkpointing.checkpoint` / `non_reentrant_checkpoint` / `configure` (activation checkpointing);
- `utils.safe_get_full_fp32_param` and the rest of the tensor-fragment API (a param's float32 value,
  optimizer state and gradient);
- `utils.zero_to_fp32`: a checkpoint's float32 weights, offline (`get_fp32_state_dict_from_zero_checkpoint`
  and its kin);
- `init_distributed` and `add_config_arguments`, which DeepSpeed scripts call around them;
- `comm` (``deepspeed.comm``: its collectives and rank queries on torch.distributed) and
  `accelerator.get_accelerator` (the device zswap computes on, with DeepSpeed's accelerator methods).

A DeepSpeed keyword zswap has no equivalent for (``mpu``, ``mesh_param``, quantized weights…) is a
`TypeError` naming it when given a value other than its default — never dropped silently.
"""

from __future__ import annotations

import argparse
from collections.abc import Callable, Iterable, Mapping
from typing import Any

import torch
from torch import nn

from ..build.init import partition_rest
from ..config import raw_dict
from ..step.optim import OffloadedAdamW
from ..step.optim.adopt import refuse_without_masters
from ..train import runtime as _runtime
from ..train.bridge import one_optimizer
from . import accelerator, checkpointing, comm, ops, utils, zero
from ._args import not_here, refuse, resolve_config
from ._backward import LossScalingRequiredError
from ._data import training_dataloader
from ._engine import DeepSpeedEngine
from ._launch import TORCH_DISTRIBUTED_DEFAULT_PORT, init_distributed, init_for_initialize

OPTIMIZER_LR_DEFAULT = 1e-3
"""The learning rate of the config's Adam / AdamW where its section gives none (no ``lr`` key): DeepSpeed's
own (its FusedAdam's and DeepSpeedCPUAdam's default). ``"auto"`` stays an error, as in `zswap.initialize`."""

GRADIENT_CLIPPING_DEFAULT = 1.0
"""The clip norm `initialize` uses when the config has no ``gradient_clipping``: DeepSpeed's own default
since 0.19.3 (its ``GRADIENT_CLIPPING_DEFAULT``), so a script ported here keeps clipping as it did."""


def initialize(
    args: Any = None,
    model: nn.Module | None = None,
    optimizer: Any = None,
    model_parameters: Iterable[Any] | None = None,
    training_data: Any = None,
    lr_scheduler: Any = None,
    distributed_port: int = TORCH_DISTRIBUTED_DEFAULT_PORT,
    mpu: Any = None,
    dist_init_required: bool | None = None,
    collate_fn: Callable[..., Any] | None = None,
    config: Any = None,
    mesh_param: Any = None,
    config_params: Any = None,
) -> tuple[DeepSpeedEngine, Any, Any, Any]:
    """DeepSpeed's ``deepspeed.initialize``: a `DeepSpeedEngine` (a `zswap.Engine` with DeepSpeed's
    checkpoint signatures) over ``model`` and DeepSpeed's 4-tuple
    ``(engine, engine.optimizer, dataloader or None, engine.lr_scheduler)``.

    - The config: ``config`` (a path or a dict), or ``config_params`` (its old name), or
      ``args.deepspeed_config`` (``args.deepscale_config``, older still); exactly one of them.
    - ``optimizer``: an optimizer, or a callable taking ``model_parameters`` (default: the model's params)
      and returning one (a plain torch Adam / AdamW becomes an `OffloadedAdamW` over its groups, as in
      `zswap.initialize`); else built from the config's ``optimizer`` section over ``model_parameters``
      (an `OffloadedAdamW`, closed by ``engine.close()``). Both at once is a `ConfigError` (DeepSpeed
      steps the passed one and ignores the section).
    - ``lr_scheduler``: a scheduler or a callable taking the optimizer; else the config's ``scheduler``.
    - ``training_data``: a dataset, returned as a `torch.utils.data.DataLoader` with the config's micro
      batch size (``train_micro_batch_size_per_gpu``, or derived from ``train_batch_size``), shuffled by a
      `RandomSampler` (a `DistributedSampler` over several ranks), with ``collate_fn`` — as DeepSpeed's
      loader does.
    - ``dist_init_required``: ``None`` initialises torch.distributed when a launcher set ``WORLD_SIZE``
      and it is not initialised yet; ``True`` always (a single process on ``distributed_port`` when no
      launcher did); ``False`` never (a `ZswapError` where a launcher set ``WORLD_SIZE`` > 1 and nothing
      initialised it: each rank would train a model of its own).
    - Clipping: the config's ``gradient_clipping``; without that key (or with ``"auto"``) the global
      gradient norm is clipped to `GRADIENT_CLIPPING_DEFAULT` (1.0), as DeepSpeed >= 0.19.3 does;
      ``gradient_clipping: 0`` turns clipping off. (`zswap.initialize` keeps PyTorch's behaviour: no
      clipping unless asked.)
    - The config's optimizer without an ``lr`` runs at `OPTIMIZER_LR_DEFAULT` (1e-3), DeepSpeed's default.
    - ``mpu`` and ``mesh_param`` (model / sequence parallelism) are not supported: a `TypeError`.
    """
    refuse("initialize", mpu=(mpu, None), mesh_param=(mesh_param, None))
    if model is None:
        raise TypeError("zswap.deepspeed.initialize requires a model")
    cfg = one_optimizer(_deepspeed_lr(raw_dict(resolve_config(args, config, config_params))), optimizer)
    init_for_initialize(distributed_port, dist_init_required)
    partition_rest(cfg, model)  # before an optimizer is built over its params
    owned = False
    params = list(model.parameters()) if model_parameters is None else list(model_parameters)
    if optimizer is None and cfg.optimizer is not None:
        # Over model_parameters (param groups allowed), as DeepSpeed builds its config optimizer.
        optimizer, owned = OffloadedAdamW.from_config(params, cfg), True
    elif callable(optimizer) and not isinstance(optimizer, torch.optim.Optimizer):
        optimizer = optimizer(params)
    way = "Pass a torch Adam / AdamW or use the config's optimizer section"
    refuse_without_masters(optimizer, cfg.dtype, "the client optimizer", way)
    if cfg.gradient_clipping is None:  # absent (or "auto"): DeepSpeed's default; an explicit 0 stays off
        cfg = cfg.replace(gradient_clipping=GRADIENT_CLIPPING_DEFAULT, gradient_clipping_auto=False)
    engine = _runtime.build(DeepSpeedEngine, model, cfg, optimizer, lr_scheduler, None, None)
    if owned:
        engine.adopt_optimizer()
    engine.collate_fn = collate_fn  # deepspeed_io's default, as DeepSpeed's engine keeps it
    loader = None
    if training_data is not None:
        loader = training_dataloader(training_data, cfg, engine, collate_fn)
    return engine, engine.optimizer, loader, engine.lr_scheduler


def _deepspeed_lr(raw: dict[str, Any]) -> dict[str, Any]:
    """``raw`` with `OPTIMIZER_LR_DEFAULT` as its optimizer's ``lr`` where the section has no such key."""
    section = raw.get("optimizer")
    if not isinstance(section, Mapping):
        return raw
    params = section.get("params")
    if params is None:
        params = {}
    if not isinstance(params, Mapping) or "lr" in params:
        return raw  # (not a mapping: the loader names it)
    return {**raw, "optimizer": {**section, "params": {**params, "lr": OPTIMIZER_LR_DEFAULT}}}


def add_config_arguments(parser: argparse.ArgumentParser) -> argparse.ArgumentParser:
    """DeepSpeed's ``--deepspeed`` / ``--deepspeed_config`` (and the old ``--deepscale_config``)
    arguments, read by `initialize` from ``args``."""
    group = parser.add_argument_group("DeepSpeed", "DeepSpeed configurations")
    group.add_argument("--deepspeed", default=False, action="store_true", help="enable DeepSpeed (zswap)")
    group.add_argument("--deepspeed_config", default=None, type=str, help="DeepSpeed json configuration file")
    group.add_argument("--deepscale", default=False, action="store_true", help=argparse.SUPPRESS)
    group.add_argument("--deepscale_config", default=None, type=str, help=argparse.SUPPRESS)
    return parser


__version__ = "0.19.8"
"""The DeepSpeed release whose call shapes this module follows (what ``deepspeed.__version__`` says; scripts
gate features on it). zswap's own version: ``zswap.__version__``."""

_NOT_HERE = {
    "moe": "DeepSpeed's MoE layer and expert parallelism (expert_parallel is refused in the config): build "
    "the model's own mixture-of-experts module; zswap runs it as any other (mark it a leaf module, "
    "zswap.deepspeed.utils.set_z3_leaf_modules, where ranks route tokens differently)",
    "runtime": "DeepSpeed's internals: its LR schedules are the config's 'scheduler' section (WarmupLR, "
    "WarmupDecayLR, WarmupCosineLR, OneCycle, LRRangeTest); its engine is zswap.deepspeed.DeepSpeedEngine",
    "pipe": "pipeline parallelism (PipelineModule): zswap trains one model per data-parallel rank",
    "inference": "DeepSpeed's inference engine (init_inference): run the model under zswap.Init, gathered by "
    "its hooks (zswap.GatheredParameters for a generation loop)",
    "init_inference": "DeepSpeed's inference engine: run the model under zswap.Init, gathered by its hooks",
}
"""Top-level ``deepspeed`` names zswap does not mirror, with what to use instead."""


__getattr__ = not_here(__name__, _NOT_HERE)


__all__ = [
    "GRADIENT_CLIPPING_DEFAULT",
    "OPTIMIZER_LR_DEFAULT",
    "DeepSpeedEngine",
    "LossScalingRequiredError",
    "accelerator",
    "add_config_arguments",
    "checkpointing",
    "comm",
    "init_distributed",
    "initialize",
    "ops",
    "utils",
    "zero",
]
