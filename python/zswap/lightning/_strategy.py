"""`ZswapStrategy`: Lightning's hooks mapped onto zswap's `Init` and `Engine`.

=========================================  =============================================================
Lightning                                  zswap
=========================================  =============================================================
``configure_model`` (under                 runs inside ``zswap.Init(config)``: every module is
``model_sharded_context``)                 partitioned and offloaded as it is built
``strategy.setup``                         ``zswap.initialize(module, config, optimizer=…)``; the
                                           client Adam/AdamW becomes an `OffloadedAdamW` (same groups
                                           and hyperparameters), lr schedulers re-pointed at it
``backward``                               the engine's backward (``ZswapPrecision.backward``)
``optimizer_step``                         closure, ``on_before_optimizer_step``,
                                           ``configure_gradient_clipping``, then ``engine.step()``
``accumulate_grad_batches``                Lightning's own: the loss divided by it, ``optimizer_step``
                                           at its boundaries only; the engine sees one micro-step each
                                           and is told which backward ends a window (its update runs
                                           in that backward: ``Engine.window_ends``)
``gradient_clip_val``                      the engine's ``max_grad_norm`` for that step (global norm);
                                           the update in backward is kept if clipping did not bite,
                                           else redone from the kept gradients
``trainer.save_checkpoint`` / ``ckpt_path``  ``engine.save_checkpoint`` / ``engine.load_checkpoint``
``ModelSummary`` callbacks                 `ZswapSummary`: partitioned params counted by their full size
several processes                          Lightning's launcher (DDP's), gloo/NCCL process group, each
                                           rank holding 1/world of every param; no DDP wrapper
=========================================  =============================================================

An engine stays open after ``fit`` / ``validate`` / ``test`` / ``predict`` returns, so the model keeps working
on its partitioned params and ``trainer.save_checkpoint`` after ``fit`` saves the trained state; it is
closed when the strategy sets up its next run or when another `ZswapStrategy` sets up the same module, and
freed with the strategy, the trainer and the module once none of them is reachable any more.
"""

from __future__ import annotations

import copy
import os
import warnings
import weakref
from collections.abc import Generator, Mapping
from contextlib import contextmanager
from datetime import timedelta
from typing import TYPE_CHECKING, Any

import torch
from lightning.fabric.plugins.collectives.torch_collective import default_pg_timeout
from lightning.pytorch.callbacks import GradientAccumulationScheduler
from lightning.pytorch.core.optimizer import _init_optimizers_and_lr_schedulers, _MockOptimizer
from lightning.pytorch.plugins.precision import HalfPrecision, Precision
from lightning.pytorch.trainer.states import TrainerFn
from lightning.pytorch.utilities import GradClipAlgorithmType

from ..build.init import Init
from ..checkpoint import save_checkpoint
from ..checkpoint.manifest import read_manifest, resolve
from ..config import ZswapConfig, load_config, raw_dict
from ..config._foreign import CHECKPOINTING_SWITCHES
from ..device import resolve as resolve_device
from ..errors import ConfigError, ZswapError
from ..parts.params import param_state
from ..step.optim import OffloadedAdamW
from ..step.optim.adopt import hand_over, is_convertible, rebind_schedulers, to_offloaded
from ..train import dtypes
from ..train.runtime import Engine, initialize
from ._hooks import warn_gradient_hooks
from ._parallel import ProcessGroupStrategy
from ._precision import DTYPES, VALUE_CLIPPING, ZswapPrecision, may_clip
from ._summary import use_real_sizes

if TYPE_CHECKING:
    import lightning.pytorch as pl
    from lightning.fabric.plugins import CheckpointIO, ClusterEnvironment
    from lightning.pytorch.accelerators import Accelerator
    from torch import nn


_OPEN: weakref.WeakKeyDictionary[nn.Module, weakref.ref[_Run]] = weakref.WeakKeyDictionary()
"""The open run of each module, so that a second strategy over the same module closes the first one's."""


class _Run:
    """One ``initialize`` and what this strategy built for it (closed together)."""

    def __init__(self, engine: Engine, owned_optimizer: Any) -> None:
        self.engine = engine
        self.owned_optimizer = owned_optimizer

    def close(self) -> None:
        try:
            self.engine.close()
        finally:
            if self.owned_optimizer is not None:
                self.owned_optimizer.close()
                self.owned_optimizer = None


class ZswapStrategy(ProcessGroupStrategy):
    """Train, validate, test and predict with a LightningModule whose params and optimizer states zswap
    offloads (to CPU memory or NVMe, as the config says).

    Args:
        config: a zswap / DeepSpeed config: a path to a JSON file or a mapping (copied; the strategy keeps
            it as a dict, as Lightning's DeepSpeed strategy does, and hands that dict to ``zswap.Init``), or
            ``None`` for the defaults. Validated here, so a bad key fails when the Trainer is built.
        accelerator, parallel_devices, cluster_environment, process_group_backend, timeout: as for
            Lightning's ``DDPStrategy``. Several processes (``Trainer(devices=N)``, ``num_nodes``) are
            started by Lightning's launcher, which re-runs the script for each further rank.
        precision_plugin: a `ZswapPrecision` (``Trainer(precision=…)`` sets it: ``"32-true"``,
            ``"bf16-true"``, ``"16-true"``).

    Build the model in ``LightningModule.configure_model`` (it then never exists in full in RAM) and
    return a ``torch.optim.AdamW`` / ``Adam`` from ``configure_optimizers`` — or ``None`` when the config
    has an ``optimizer`` section, which is then used. Any other torch optimizer is used as given (its state
    in RAM), which a config putting the optimizer state on NVMe refuses.
    """

    strategy_name = "zswap"

    @classmethod
    def register_strategies(cls, strategy_registry: Any) -> None:
        """Lightning's hook for a strategy's names: ``"zswap"`` builds ``ZswapStrategy()`` (the default
        config: everything in memory; pass ``ZswapStrategy(config)`` to offload). Registered when
        `zswap.lightning` is imported; a name already taken is left to its owner."""
        if cls.strategy_name not in strategy_registry:
            strategy_registry.register(
                cls.strategy_name, cls, description="zswap: params and optimizer states offloaded (defaults)"
            )

    def __init__(
        self,
        config: str | os.PathLike[str] | Mapping[str, Any] | None = None,
        *,
        accelerator: Accelerator | None = None,
        parallel_devices: list[torch.device] | None = None,
        cluster_environment: ClusterEnvironment | None = None,
        precision_plugin: Precision | None = None,
        process_group_backend: str | None = None,
        timeout: timedelta | None = default_pg_timeout,
    ) -> None:
        self.config: dict[str, Any] = raw_dict(config, "ZswapStrategy config")
        """The config as a plain dict (a private copy)."""
        _refuse_checkpointing_extras(self.config)  # before the loader, which only names them (ignored)
        self.zswap_config: ZswapConfig = load_config(self.config)
        super().__init__(
            accelerator=accelerator,
            parallel_devices=parallel_devices,
            cluster_environment=cluster_environment,
            precision_plugin=precision_plugin,
            process_group_backend=process_group_backend,
            timeout=timeout,
        )
        self._run: _Run | None = None

    # -- what Lightning asks of a strategy -------------------------------------------------------------

    @property
    def precision_plugin(self) -> ZswapPrecision:
        plugin = self._precision_plugin
        if plugin is None:
            plugin = self._precision_plugin = ZswapPrecision()
        return plugin  # type: ignore[return-value]

    @precision_plugin.setter
    def precision_plugin(self, plugin: Precision | None) -> None:
        self._precision_plugin = None if plugin is None else _as_zswap_precision(plugin)

    @property
    def checkpoint_io(self) -> CheckpointIO:
        return super().checkpoint_io  # Lightning's default, used only to remove checkpoint folders

    @checkpoint_io.setter
    def checkpoint_io(self, io: CheckpointIO) -> None:
        raise TypeError(
            f"ZswapStrategy writes checkpoints through the zswap Engine, so a CheckpointIO plugin "
            f"({type(io).__name__}) would not be used; drop it from Trainer(plugins=...)"
        )

    @property
    def engine(self) -> Engine:
        """The zswap `Engine` of the current (or last) run."""
        if self._run is None:
            raise ZswapError(
                "ZswapStrategy has no engine yet: it is built when fit/validate/test/predict starts"
            )
        return self._run.engine

    @property
    def restore_checkpoint_after_setup(self) -> bool:
        return True  # the engine loads the checkpoint into the partitions it manages

    @property
    def lightning_restore_optimizer(self) -> bool:
        return False  # the engine checkpoint holds the optimizer state

    def setup_environment(self) -> None:
        resolve_device(self.root_device)  # the engine's own check: a device it cannot compute on is refused
        super().setup_environment()

    @contextmanager
    def model_sharded_context(self) -> Generator[None, None, None]:
        """``configure_model`` runs here: under ``zswap.Init`` with the strategy's config dict."""
        with Init(self._model_config()):
            yield

    @contextmanager
    def tensor_init_context(self, empty_init: bool | None = None) -> Generator[None, None, None]:
        """``trainer.init_module()``: under ``zswap.Init`` too (Lightning's DeepSpeed strategy runs
        ``zero.Init`` there at stage 3), so the model is partitioned as it is built."""
        with self.model_sharded_context():
            yield

    def setup(self, trainer: pl.Trainer) -> None:
        assert self.accelerator is not None and self.lightning_module is not None
        self.accelerator.setup(trainer)
        module = self.lightning_module
        fitting = trainer.state.fn == TrainerFn.FITTING
        self._check_trainer(trainer, fitting)
        if fitting:
            warn_gradient_hooks(trainer, module)
        use_real_sizes(trainer)  # Lightning's summary would count the empty partitioned params: 0
        client: Any = None  # what configure_optimizers returned (None: nothing, or the config's is used)
        owned: OffloadedAdamW | None = None  # the offloaded AdamW built here from the client optimizer
        schedulers: list[Any] = []
        use_section = False
        if fitting:
            client, schedulers, use_section = self._client_optimizer()
            if is_convertible(client):
                where = f"the {type(client).__name__} from configure_optimizers"
                owned = to_offloaded(client, self.zswap_config, where)
                rebind_schedulers([c.scheduler for c in schedulers], client, owned)
                hand_over(client, owned)  # a module keeping it (``self.opt``) sets what the engine steps
        self._close_open(module)
        if any(param_state(p) is None for p in module.parameters()):
            # Params made after `trainer.init_module()` / `configure_model` (adapters): cast, as Lightning's
            # precision casts the whole module, not kept in their dtype as `initialize` would keep some.
            Init(self._model_config(), module=module)
        given = owned if owned is not None else client
        try:
            engine = initialize(
                module,
                self._engine_config(fitting=fitting, use_section=use_section),
                optimizer=None if isinstance(given, _MockOptimizer) else given,
                device=self.root_device,
            )
        except BaseException:
            if owned is not None:
                owned.close()
            raise
        if fitting:
            try:
                dtypes.check_accumulation(engine, _most_accumulated(trainer))
            except BaseException:
                engine.close()
                raise
        self._open(module, _Run(engine, owned))
        if fitting and _most_accumulated(trainer) > 1:
            # Lightning's windows (its last batch of an epoch ends one early; a GradientAccumulationScheduler
            # changes their length between epochs): the early step sums the earlier backwards' gradients
            # and runs in the window's last (`zswap.step.speculation`).
            loop = trainer.fit_loop
            engine.window_ends = lambda: not loop._should_accumulate()
        self.model = module  # no wrapper: the engine's hooks are on the module itself
        if fitting:
            # Lightning's loop needs one optimizer: the engine's, or its stand-in when there is none.
            self.optimizers = [engine.optimizer if engine.optimizer is not None else given]
            self.lr_scheduler_configs = schedulers
        self.precision_plugin.attach(lambda: self.engine)
        engine.clipping_after_backward = fitting and module.automatic_optimization and may_clip(module)
        self.setup_precision_plugin()
        self.barrier()

    def lightning_module_state_dict(self) -> dict[str, Any]:
        """Empty: the weights go into the engine checkpoint (`save_checkpoint`), partition by partition."""
        return {}

    def optimizer_state(self, optimizer: Any) -> dict[str, Any]:
        return {}  # in the engine checkpoint, streamed record by record

    def save_checkpoint(
        self, checkpoint: dict[str, Any], filepath: Any, storage_options: Any | None = None
    ) -> None:
        """Writes ``filepath`` as an engine checkpoint directory (every rank its partitions); the Trainer's
        own state (loops, callbacks, lr schedulers, hyperparameters) goes in as ``client_state``. A
        ``weights_only`` save (``ModelCheckpoint(save_weights_only=True)``: Lightning's checkpoint then has
        no ``optimizer_states``) leaves the optimizer's records out too."""
        if storage_options is not None:
            raise TypeError(
                "ZswapStrategy.save_checkpoint takes no storage_options (no CheckpointIO is used)"
            )
        engine = self.engine
        engine._check_open()
        filepath = self.broadcast(filepath)
        # ``state_dict`` holds what hooks added (``on_save_checkpoint``: an EMA's weights…); the module's
        # own weights are the engine's (`lightning_module_state_dict`).
        client = {k: v for k, v in checkpoint.items() if k != "optimizer_states"}
        optimizer_state = "optimizer_states" in checkpoint
        save_checkpoint(engine, os.fspath(filepath), None, client, optimizer_state=optimizer_state)

    def load_checkpoint(self, checkpoint_path: Any, weights_only: bool | None = None) -> dict[str, Any]:
        """Loads an engine checkpoint written by `save_checkpoint` (optimizer state only when fitting) and
        returns the Trainer's state saved with it."""
        load = self.engine.load_checkpoint
        if os.path.isfile(checkpoint_path):
            raise ZswapError(
                f"{checkpoint_path} is a file: a plain Lightning checkpoint, not the engine checkpoint "
                "folder trainer.save_checkpoint writes under ZswapStrategy. Load its weights into the module "
                "with module.load_state_dict(torch.load(path)['state_dict']) inside configure_model, after "
                "building it (zswap writes them into the partitions), and fit without ckpt_path"
            )
        if weights_only:
            raise TypeError(
                "ZswapStrategy cannot load with weights_only=True: the Trainer's state saved in the engine "
                "checkpoint is a pickle (weights_only=None or False loads it)"
            )
        assert self.lightning_module is not None
        fitting = self.lightning_module.trainer.state.fn == TrainerFn.FITTING
        path = os.fspath(self.broadcast(checkpoint_path))
        if (
            fitting
            and self.engine.optimizer is not None
            and read_manifest(resolve(path, None)[0])["optimizer"] is None
        ):
            raise ZswapError(
                f"{checkpoint_path} holds no optimizer state (saved with weights_only=True, as "
                "ModelCheckpoint(save_weights_only=True) saves): fit cannot resume from it; validate, test "
                "and predict load it"
            )
        # The Trainer's state is needed whatever the run (loops, callbacks, datamodule): never module-only.
        client = load(path, load_optimizer_states=fitting)
        if not isinstance(client, dict):
            raise ZswapError(
                f"{checkpoint_path}: the engine checkpoint holds no Lightning state (was it written by "
                "trainer.save_checkpoint under ZswapStrategy?)"
            )
        client.setdefault("state_dict", {})  # what hooks added at save, for on_load_checkpoint
        return client

    def load_model_state_dict(self, checkpoint: Mapping[str, Any], strict: bool = True) -> None:
        pass  # the engine loaded the weights in load_checkpoint

    def load_optimizer_state_dict(self, checkpoint: Mapping[str, Any]) -> None:
        pass  # the engine loaded the optimizer state in load_checkpoint

    # -- internals -------------------------------------------------------------------------------------

    def _check_trainer(self, trainer: pl.Trainer, fitting: bool) -> None:
        if not fitting:
            return
        if getattr(self, "_layer_sync", None) is not None:
            raise ConfigError(
                "Trainer(sync_batchnorm=True): ZswapStrategy does not convert the model's BatchNorm layers "
                "to SyncBatchNorm, so each rank would normalise over its own batch as without the flag; "
                "drop sync_batchnorm=True"
            )
        if trainer.gradient_clip_algorithm == GradClipAlgorithmType.VALUE:
            raise ConfigError(VALUE_CLIPPING)
        clip, configured = trainer.gradient_clip_val, self.zswap_config.gradient_clipping
        if clip and configured and float(clip) != configured:
            raise ConfigError(
                f"Trainer(gradient_clip_val={clip}) and the config's gradient_clipping={configured} differ; "
                "set one of them"
            )
        batch = self.zswap_config.batch
        if batch.gradient_accumulation_steps is not None or None not in (
            batch.train_batch_size,
            batch.train_micro_batch_size_per_gpu,
        ):
            steps = batch.resolve(self.world)[2]  # given, or derived from the batch sizes (as DeepSpeed)
            if steps != trainer.accumulate_grad_batches:
                raise ConfigError(
                    f"the config's gradient_accumulation_steps={steps} (given or derived from its batch "
                    f"sizes) differs from Trainer(accumulate_grad_batches={trainer.accumulate_grad_batches})"
                    "; under Lightning the Trainer's argument sets the accumulation: make them agree"
                )

    def _client_optimizer(self) -> tuple[Any, list[Any], bool]:
        """(the optimizer configure_optimizers returned or None, its scheduler configs, whether the
        config's ``optimizer`` section is to be used instead)."""
        assert self.lightning_module is not None
        has_section = self.zswap_config.optimizer is not None
        with warnings.catch_warnings():
            if has_section:  # returning None is how a module asks for the config's optimizer
                warnings.filterwarnings(
                    "ignore", message=r"`LightningModule.configure_optimizers` returned `None`"
                )
            optimizers, schedulers = _init_optimizers_and_lr_schedulers(self.lightning_module)
        if len(optimizers) != 1:
            raise ZswapError(
                f"ZswapStrategy steps one optimizer (the zswap Engine's); configure_optimizers returned "
                f"{len(optimizers)}"
            )
        optimizer = optimizers[0]
        if isinstance(optimizer, _MockOptimizer):
            return (None, [], True) if has_section else (optimizer, [], False)
        if has_section:
            raise ConfigError(
                f"configure_optimizers returned a {type(optimizer).__name__} and the config has an "
                "'optimizer' section: keep one (return None from configure_optimizers to use the config's)"
            )
        if schedulers and self.zswap_config.scheduler is not None:
            raise ConfigError(
                f"configure_optimizers returned an lr scheduler and the config has a 'scheduler' section "
                f"({self.zswap_config.scheduler.type}): keep one"
            )
        if (
            not is_convertible(optimizer)
            and not isinstance(optimizer, OffloadedAdamW)
            and self.zswap_config.offload_optimizer.device == "nvme"
        ):
            raise ConfigError(
                f"offload_optimizer.device is 'nvme' but configure_optimizers returned a "
                f"{type(optimizer).__name__}, whose state zswap cannot offload; return a torch.optim.AdamW / "
                "Adam (it becomes zswap's offloaded AdamW) or drop offload_optimizer"
            )
        return optimizer, schedulers, False

    def _model_config(self) -> dict[str, Any]:
        """The config with the param dtype the Trainer's precision asks for (refused when the config says
        another); for ``"32-true"`` (Lightning's default) the config's own dtype stands, and the precision
        plugin follows it."""
        plugin = self.precision_plugin
        own = self.zswap_config.torch_dtype()
        if plugin.precision == "32-true":
            plugin.dtype = own if own is not None else torch.float32
            return self.config
        if own is not None and own != plugin.dtype:
            raise ConfigError(
                f"Trainer(precision={plugin.precision!r}) asks for {plugin.dtype} params but the config's "
                f"bf16/fp16 sections ask for {own}; make them agree"
            )
        cfg = copy.deepcopy(self.config)
        on, off = ("bf16", "fp16") if plugin.dtype == torch.bfloat16 else ("fp16", "bf16")
        cfg[on] = {**cfg.get(on, {}), "enabled": True}
        if off in cfg:
            cfg[off] = {**cfg[off], "enabled": False}
        return cfg

    def _engine_config(self, *, fitting: bool, use_section: bool) -> dict[str, Any]:
        """The config for ``initialize``. Lightning runs the accumulation (the loss divided by
        ``accumulate_grad_batches``, ``optimizer_step`` at its boundaries only; `_check_trainer` made
        sure the config agrees), so the engine sees one micro-step per step. The ``optimizer`` section
        is left out unless it is the one to use; the ``scheduler`` section (stepped by the engine at each
        optimizer step) too when nothing is trained."""
        cfg = copy.deepcopy(self._model_config())
        cfg["gradient_accumulation_steps"] = 1
        if self.zswap_config.gradient_clipping_auto:
            del cfg["gradient_clipping"]  # Hugging Face's "the front end's": the Trainer's gradient_clip_val
        if "train_batch_size" in cfg:
            cfg["train_batch_size"] = "auto"  # derived again from the micro batch, with one micro-step
        if not use_section:
            cfg.pop("optimizer", None)
        if not fitting:
            cfg.pop("scheduler", None)
        return cfg

    def _close_open(self, module: nn.Module) -> None:
        if self._run is not None:
            self._run.close()
            self._run = None
        previous = _OPEN.get(module)
        run = previous() if previous is not None else None
        if run is not None:
            run.close()

    def _open(self, module: nn.Module, run: _Run) -> None:
        self._run = run
        _OPEN[module] = weakref.ref(run)
        # No `weakref.finalize(self, run.close)`: the engine reaches the module, the module its trainer and
        # the trainer this strategy, so a finalizer holding the run kept all of them (the engine's fetch
        # pool and optimizer ring, its files) alive until the process exited, one engine per fit. Without
        # it they are one cycle that the collector frees whole once nothing outside reaches it.


def _refuse_checkpointing_extras(config: Mapping[str, Any]) -> None:
    """Lightning's DeepSpeed strategy hands the ``activation_checkpointing`` section to
    ``deepspeed.checkpointing.configure``; zswap's checkpoint does none of its extras, so one switched on
    is refused here rather than dropped (as `zswap.deepspeed.checkpointing.configure` refuses it)."""
    section = config.get("activation_checkpointing") or {}
    on = [k for k in CHECKPOINTING_SWITCHES if isinstance(section, Mapping) and section.get(k)]
    if on:
        raise ConfigError(
            f"activation_checkpointing.{on[0]} is on: zswap's activation checkpointing is torch's "
            "(torch.utils.checkpoint, or zswap.deepspeed.checkpointing.checkpoint), without DeepSpeed's "
            "partitioned, contiguous, CPU-held or profiled checkpoints; set it false"
        )


def _most_accumulated(trainer: pl.Trainer) -> int:
    """The most batches a window of this fit accumulates: ``accumulate_grad_batches``, or what a
    ``GradientAccumulationScheduler`` sets it to in a later epoch."""
    most = trainer.accumulate_grad_batches
    for callback in trainer.callbacks:  # type: ignore[attr-defined]
        if isinstance(callback, GradientAccumulationScheduler):
            most = max(most, *callback.scheduling.values())
    return int(most)


def _as_zswap_precision(plugin: Precision) -> ZswapPrecision:
    if isinstance(plugin, ZswapPrecision):
        return plugin
    if type(plugin) is Precision:
        return ZswapPrecision("32-true")
    if isinstance(plugin, HalfPrecision) and plugin.precision in DTYPES:
        return ZswapPrecision(plugin.precision)
    raise ConfigError(
        f"ZswapStrategy supports Trainer(precision='32-true' | 'bf16-true' | '16-true'), got "
        f"{getattr(plugin, 'precision', type(plugin).__name__)!r} ({type(plugin).__name__}): zswap keeps "
        "params in one dtype (mixed precision / autocast is not supported)"
    )
