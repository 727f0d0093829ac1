"""The work of `DeepSpeedEngine`'s calls beyond checkpoints and queries that scripts and DeepSpeed's own
tests make: resizing the batch between steps, loading a module state dict, moving states off the device
around a phase that needs its memory (the engine's methods' docstrings say what each does)."""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from typing import TYPE_CHECKING, Any

from ..errors import ConfigError, ZswapError
from ..train import dtypes
from ._args import refuse

if TYPE_CHECKING:
    from ._engine import DeepSpeedEngine

STATE_KINDS = frozenset({"optim_states", "hp_params", "lp_params", "lp_grads", "contiguous_grad_buffer"})
"""DeepSpeed's ``OffloadStateTypeEnum`` values: what ``offload_states(include=...)`` may name."""


def _positive(where: str, name: str, value: Any) -> int:
    if isinstance(value, bool) or not isinstance(value, int):
        raise TypeError(f"engine.{where}: {name} must be an int, got {type(value).__name__}")
    if value <= 0:
        raise ValueError(f"engine.{where}: {name} must be positive, got {value}")
    return value


def _value(x: Any) -> str:
    """A DeepSpeed enum member (a ``str`` Enum) or its plain string, as the string."""
    return str(getattr(x, "value", x))


def set_train_batch_size(engine: DeepSpeedEngine, train_batch_size: int) -> None:
    _positive("set_train_batch_size", "train_batch_size", train_batch_size)
    micro, world = _micro_batch(engine, "set_train_batch_size"), engine._world()
    if train_batch_size % (micro * world):
        raise ValueError(
            f"engine.set_train_batch_size({train_batch_size}): the batch must be a multiple of "
            f"train_micro_batch_size_per_gpu ({micro}) × world size ({world}) = {micro * world}"
        )
    if engine.micro_steps != engine._window_from or engine._backwards:
        raise ZswapError(
            f"engine.set_train_batch_size({train_batch_size}): called inside an accumulation window (its "
            f"gradients summed over {engine.gradient_accumulation_steps()} micro-batches, the loss divided "
            f"by that): call it right after the engine.step() that applies the optimizer"
        )
    gas = train_batch_size // (micro * world)
    dtypes.check_accumulation(engine, gas)
    _resize(engine, train_batch_size, micro, gas)


def set_train_micro_batch_size(engine: DeepSpeedEngine, micro_batch_size: int) -> None:
    _positive("set_train_micro_batch_size", "micro_batch_size", micro_batch_size)
    gas = engine.gradient_accumulation_steps()
    _resize(engine, micro_batch_size * gas * engine._world(), micro_batch_size, gas)


def _micro_batch(engine: DeepSpeedEngine, where: str) -> int:
    micro = engine.train_micro_batch_size_per_gpu()
    if micro is None:
        raise ConfigError(
            f"engine.{where}: the config gives no batch size (train_batch_size or "
            f"train_micro_batch_size_per_gpu), so there is no micro batch to keep"
        )
    return micro


def _resize(engine: DeepSpeedEngine, train: int, micro: int, gas: int) -> None:
    batch = engine.config.batch.model_copy(
        update={
            "train_batch_size": train,
            "train_micro_batch_size_per_gpu": micro,
            "gradient_accumulation_steps": gas,
        }
    )
    engine.config = engine.config.model_copy(update={"batch": batch})
    engine._gas = gas


def load_module_state_dict(
    engine: DeepSpeedEngine,
    checkpoint: Mapping[str, Any],
    strict: bool,
    custom_load_fn: Any,
    allowed_missing_keys: Iterable[str] | None,
) -> None:
    refuse("DeepSpeedEngine.load_module_state_dict", custom_load_fn=(custom_load_fn, None))
    engine._check_open()
    if not isinstance(checkpoint, Mapping) or "module" not in checkpoint:
        raise KeyError(
            "engine.load_module_state_dict(checkpoint): checkpoint must be a dict with the module's "
            "state dict under 'module' (as DeepSpeed's checkpoint files hold it)"
        )
    allowed = None if allowed_missing_keys is None else set(allowed_missing_keys)
    result = engine.module.load_state_dict(checkpoint["module"], strict=bool(strict) and allowed is None)
    if strict and allowed is not None:
        missing = sorted(set(result.missing_keys) - allowed)
        if missing or result.unexpected_keys:
            raise RuntimeError(
                f"engine.load_module_state_dict: the state dict does not match the model outside "
                f"allowed_missing_keys: missing={missing}, unexpected={sorted(result.unexpected_keys)}"
            )


def offload_states(
    engine: DeepSpeedEngine,
    include: Iterable[Any] | None,
    device: Any,
) -> None:
    kinds = STATE_KINDS if include is None else {_value(x) for x in include}
    unknown = sorted(kinds - STATE_KINDS)
    if unknown:
        raise ValueError(
            f"engine.offload_states: include names {unknown}, not states DeepSpeed offloads "
            f"({', '.join(sorted(STATE_KINDS))})"
        )
    where = _value(device)
    if where == "nvme":
        raise ValueError(
            "engine.offload_states: NVMe is not supported for offloading states (as in DeepSpeed)"
        )
    if where != "cpu":
        raise ValueError(f"engine.offload_states: device must be 'cpu', got {where!r}")
    engine._check_open()
    if "lp_params" in kinds:
        engine._sched.drop_all()
