"""From a raw config mapping, in the DeepSpeed or the trimmed layout, to the input of `ZswapConfig`.

This is where section placement, aliases and unknown keys are settled; values are checked by the models.
Only zswap's sections are read, and each is copied into fresh dicts and tuples: nothing of the caller's
mapping is modified, and nothing of it is kept beyond immutable leaf values. Everything outside those
sections is left alone, but for `_foreign`'s check of DeepSpeed's features that are switched on.

Layouts (each section may be nested as DeepSpeed has it, or stand at top level, but not both)::

    zero_optimization.offload_param      | offload_param
    zero_optimization.offload_optimizer  | offload_optimizer
    zero_optimization.stage3_*, sub_group_size | the same keys at top level
    aio, optimizer, scheduler, bf16 (old name: bfloat16), fp16, gradient_clipping, torch_autocast, data_types,
    communication_data_type,
    train_batch_size, train_micro_batch_size_per_gpu, gradient_accumulation_steps,
    dataloader_drop_last                                                              (top level in both)

DeepSpeed's other top-level sections are checked by `_foreign` only: refused where switched on and
changing results, named in the "ignored" warning where switched on and feeding DeepSpeed's tooling.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

from pydantic_core import PydanticCustomError

from ..errors import ConfigError
from . import _foreign, _toplevel
from . import _keys as k
from . import _values as v


@dataclass
class Assembled:
    """Input for `ZswapConfig.model_validate`, with where each value came from."""

    data: dict[str, Any] = field(default_factory=dict)
    origins: dict[tuple[str, ...], str] = field(default_factory=dict)
    """Model location (``("aio", "thread_count")``) → dotted key as written (``"aio.num_threads"``)."""
    skipped: list[str] = field(default_factory=list)
    """Dotted DeepSpeed keys present that zswap ignores with a warning (`_keys.Section.warned`)."""
    stage: Any = None
    """``zero_optimization.stage`` where it names a stage below 3, which zswap runs as 3 (a warning)."""

    def put(self, section: str, given: Mapping[str, tuple[str, Any]]) -> None:
        values = self.data.setdefault(section, {})
        for name, (key, value) in given.items():
            values[name] = value
            self.origins[(section, name)] = key


def assemble(raw: Mapping[Any, Any]) -> Assembled:
    """Collect zswap's sections from ``raw``; `ConfigError` for unknown keys, conflicts and misplacements."""
    _toplevel.check(raw)  # a misspelled section would be ignored like any foreign key
    out = Assembled()
    out.skipped.extend(_foreign.check(raw))
    zero = _section(raw, "zero_optimization", "zero_optimization")
    switches = _cpu_offload_switches(zero)
    for name, spec in (("offload_param", k.OFFLOAD_PARAM), ("offload_optimizer", k.OFFLOAD_OPTIMIZER)):
        nested = _section(zero, name, spec.path)
        top = _section(raw, name, name)
        if nested is not None and top is not None:
            raise ConfigError(f"{name} is given both as {spec.path} and at top level; keep one")
        switch = switches.get(name)
        if switch is not None and (nested is not None or top is not None):
            raise ConfigError(
                f"{switch} (DeepSpeed's deprecated switch) and {spec.path if nested is not None else name} "
                f"are both given; keep {name}"
            )
        if nested is not None:
            out.put(name, _read(nested, spec, spec.path, out))
        elif top is not None:
            out.put(name, _read(top, spec, name, out))
        elif switch is not None:  # "cpu_offload": true is offload_optimizer on the CPU, as in DeepSpeed
            out.put(name, {"device": (switch, "cpu")})
    _read_zero(raw, zero, out)
    aio = _section(raw, "aio", "aio")
    if aio is not None:
        out.put("aio", _read(aio, k.AIO, "aio", out))
    optimizer = _section(raw, "optimizer", "optimizer")
    if optimizer is not None:
        out.put("optimizer", _read_optimizer(optimizer, out))
    flags = _read_precision(raw, out)
    # The params' dtype the sections fix; with neither section on, fp32 (DeepSpeed's); "auto": left open.
    params = out.data.get("dtype") or (None if "auto" in flags else "fp32")
    if raw.get("communication_data_type") is not None:  # the dtype ranks reduce gradients in
        out.data["communication_data_type"] = _detach(raw["communication_data_type"])
        out.origins[("communication_data_type",)] = "communication_data_type"
    types = _section(raw, "data_types", "data_types")
    if types is not None:
        given = _read(types, k.DATA_TYPES, "data_types", out)
        _foreign.check_param_dtype(given.get("param_dtype", (None, None))[1], params)
        out.put("data_types", given)
    _read_batch(raw, out)
    autocast = _section(raw, "torch_autocast", "torch_autocast")
    if autocast is not None:
        out.put("torch_autocast", _read(autocast, k.TORCH_AUTOCAST, "torch_autocast", out))
    scheduler = _section(raw, "scheduler", "scheduler")
    if scheduler is not None:
        given = _read(scheduler, k.SCHEDULER, "scheduler", out)
        params = _section(scheduler, "params", "scheduler.params") or {}
        if any(not isinstance(key, str) for key in params):
            raise ConfigError("scheduler.params has a key that is not a string")
        given["params"] = ("scheduler.params", dict(params))
        out.put("scheduler", given)
    clip = raw.get("gradient_clipping")  # DeepSpeed keeps it at top level
    if v.is_auto(clip):
        out.data["gradient_clipping_auto"] = True  # each front end's own default (`own_clipping`)
    elif clip is not None:
        out.data["gradient_clipping"] = _detach(clip)
        out.origins[("gradient_clipping",)] = "gradient_clipping"
    return out


def _read_batch(raw: Mapping[Any, Any], out: Assembled) -> None:
    given = {key: (key, _detach(raw[key])) for key in k.BATCH_KEYS if raw.get(key) is not None}
    out.put("batch", given)


def _read_zero(raw: Mapping[Any, Any], zero: Mapping[Any, Any] | None, out: Assembled) -> None:
    given = _read(zero, k.ZERO, "zero_optimization", out) if zero is not None else {}
    stage = zero.get("stage") if zero is not None else None  # ignored (always 3), but one DeepSpeed knows
    if stage is not None and not _a_stage(stage):
        raise ConfigError(
            f"zero_optimization.stage must be 0, 1, 2 or 3 (zswap partitions as stage 3 whichever), got "
            f"{stage!r}"
        )
    if stage is not None and stage != "auto" and int(stage) < 3:
        out.stage = stage
    for knob in k.STAGE3_KNOBS:
        if raw.get(knob) is None:
            continue
        if knob in given:
            raise ConfigError(f"{knob} is given both as {given[knob][0]} and at top level; keep one")
        given[knob] = (knob, _detach(raw[knob]))
    out.put("zero", given)


def _a_stage(value: Any) -> bool:
    """Whether DeepSpeed's schema takes ``value`` as a ZeRO stage: 0–3 as a number (``True`` is 1) or a
    string of digits, or "auto"."""
    if isinstance(value, str):
        text = value.strip()
        return value == "auto" or (text.isdigit() and int(text) <= 3)
    return isinstance(value, int | float) and value in (0, 1, 2, 3)


def _cpu_offload_switches(zero: Mapping[Any, Any] | None) -> dict[str, str]:
    """Section → dotted key, for each of DeepSpeed's deprecated ``cpu_offload*`` switches set to true."""
    if zero is None:
        return {}
    out: dict[str, str] = {}
    for old, new in k.CPU_OFFLOAD_OLD.items():
        if zero.get(old) is not None and zero.get(new) is not None:
            raise ConfigError(
                f"zero_optimization.{old} and zero_optimization.{new} are both given; keep {new}"
            )
    for key in (*k.CPU_OFFLOAD, *k.CPU_OFFLOAD_OLD):
        value = zero.get(key)
        if value is None:
            continue
        where = f"zero_optimization.{key}"
        try:
            on = v.to_bool(value)
        except PydanticCustomError as exc:
            raise ConfigError(f"{where} {exc.message()}, got {v.show(value)}") from None
        if on:
            out[k.CPU_OFFLOAD[k.CPU_OFFLOAD_OLD.get(key, key)]] = where
    return out


def _read_optimizer(optimizer: Mapping[Any, Any], out: Assembled) -> dict[str, tuple[str, Any]]:
    params = _section(optimizer, "params", "optimizer.params") or {}
    given = _read(optimizer, k.OPTIMIZER, "optimizer", out)
    _check_type(given.get("type", ("", None))[1])  # before its params: SGD's momentum is no typo
    if "max_grad_norm" in params:
        raise ConfigError(
            "unknown key 'max_grad_norm' in optimizer.params; clipping is the top-level gradient_clipping "
            "(as DeepSpeed says)"
        )
    given.update(_read(params, k.OPTIMIZER_PARAMS, "optimizer.params", out))
    _require_flag(params, "amsgrad", False, "AMSGrad is not supported by zswap")
    _require_flag(params, "bias_correction", True, "Adam without bias correction is not supported by zswap")
    kind = given.get("type", ("", None))[1]
    decoupled = given.get("decoupled_weight_decay", ("", None))[1]
    if isinstance(kind, str) and kind.casefold() == "adamw" and decoupled is False:
        raise ConfigError(
            "optimizer.params.adam_w_mode is false, but optimizer.type 'AdamW' always decouples weight "
            "decay; remove adam_w_mode or use type 'Adam'"
        )
    if _flag(params, "torch_adam") and decoupled is not False and "weight_decay" not in given:
        # DeepSpeed builds torch.optim.AdamW(**params) then, so an absent weight_decay is torch's default.
        given["weight_decay"] = ("optimizer.params.torch_adam", TORCH_ADAMW_WEIGHT_DECAY)
    return given


def _check_type(kind: Any) -> None:
    """`ConfigError` for an ``optimizer.type`` zswap builds no optimizer for, naming the way it offers."""
    if not isinstance(kind, str) or kind.strip().casefold() in ("adam", "adamw", "auto"):
        return  # the model's own check words the rest (a non-string, "auto")
    name = _ELEMENTWISE.get(kind.strip().casefold())
    raise ConfigError(
        f"optimizer.type must be one of 'Adam', 'AdamW', got {v.show(kind)}: zswap's offloaded optimizer is "
        "Adam / AdamW (its state on NVMe or in CPU memory). "
        + (
            f"torch's {name} runs with its state in CPU memory: remove the optimizer section and pass it, "
            f"initialize(..., optimizer=torch.optim.{name}(model.parameters(), ...))"
            if name is not None
            else "DeepSpeed's own others (Lamb, OneBitAdam...) are not implemented; an element-wise torch "
            "optimizer can be passed instead: initialize(..., optimizer=torch.optim.SGD(...))"
        )
    )


_ELEMENTWISE = {
    n.casefold(): n
    for n in ("SGD", "Adagrad", "RMSprop", "Adadelta", "Adamax", "NAdam", "RAdam", "ASGD", "Rprop")
}
"""The element-wise torch optimizers `initialize(optimizer=...)` steps as given, by config spelling."""


TORCH_ADAMW_WEIGHT_DECAY = 0.01
"""``torch.optim.AdamW``'s default ``weight_decay``: what DeepSpeed's ``torch_adam: true`` trains with when
``optimizer.params`` gives none (DeepSpeed's own Adams default to 0, as zswap does otherwise)."""


def _flag(params: Mapping[Any, Any], name: str) -> bool:
    """``optimizer.params.<name>`` as a bool (absent or null: false)."""
    value = params.get(name)
    if value is None:
        return False
    try:
        return v.to_bool(value)
    except PydanticCustomError as exc:
        raise ConfigError(f"optimizer.params.{name} {exc.message()}, got {v.show(value)}") from None


def _read_precision(raw: Mapping[Any, Any], out: Assembled) -> tuple[bool | str | None, bool | str | None]:
    """The bf16 / fp16 sections into ``out`` (``dtype`` where they fix it); their ``enabled`` flags."""
    bf16, bf16_where = _section(raw, "bf16", "bf16"), "bf16"
    old = _section(raw, k.BF16_OLD_NAME, k.BF16_OLD_NAME)
    if old is not None:
        if bf16 is not None:
            raise ConfigError(f"bf16 and {k.BF16_OLD_NAME} (its old name) are both given; keep bf16")
        bf16, bf16_where = old, k.BF16_OLD_NAME
    bf16_given = _read(bf16, k.BF16, bf16_where, out) if bf16 is not None else {}
    bf16_on = _enabled(bf16_given)
    bf16_given.pop("enabled", None)
    out.put("bf16", bf16_given)
    fp16 = _section(raw, "fp16", "fp16")
    fp16_given = _read(fp16, k.FP16, "fp16", out) if fp16 is not None else {}
    fp16_on = _enabled(fp16_given)
    fp16_given.pop("enabled", None)
    out.put("fp16", fp16_given)
    if bf16_on is True and fp16_on is True:
        raise ConfigError(f"{bf16_where}.enabled and fp16.enabled are both true; enable one of them")
    flags = (bf16_on, fp16_on)
    if bf16_on is True:
        out.data["dtype"] = "bf16"
    elif fp16_on is True:
        out.data["dtype"] = "fp16"
    elif False in flags and "auto" not in flags:
        out.data["dtype"] = "fp32"
    return flags


def _enabled(given: Mapping[str, tuple[str, Any]]) -> bool | str | None:
    """``enabled`` of a precision section: True / False, ``"auto"``, or ``None`` when not given."""
    if "enabled" not in given:
        return None
    key, value = given["enabled"]
    try:
        flag = v.to_auto_or_bool(value)
    except PydanticCustomError as exc:
        raise ConfigError(f"{key} {exc.message()}, got {v.show(value)}") from None
    return flag


def _require_flag(params: Mapping[Any, Any], name: str, required: bool, reason: str) -> None:
    value = params.get(name)
    if value is not None and _flag(params, name) is not required:
        raise ConfigError(
            f"optimizer.params.{name} must be {str(required).lower()}: {reason}, got {v.show(value)}"
        )


def _section(parent: Mapping[Any, Any] | None, key: str, where: str) -> Mapping[Any, Any] | None:
    """The mapping under ``key``, or None when absent or null. DeepSpeed's legacy
    ``"zero_optimization": true`` holds no zswap keys, so a boolean there counts as absent."""
    if parent is None:
        return None
    value = parent.get(key)
    if value is None or (key == "zero_optimization" and isinstance(value, bool)):
        return None
    if not isinstance(value, Mapping):
        raise ConfigError(f"{where} must be an object, got {v.show(value)}")
    return value


def _read(
    section: Mapping[Any, Any], spec: k.Section, where: str, out: Assembled | None = None
) -> dict[str, tuple[str, Any]]:
    """Field name → (dotted key as written, value) for the keys of ``section`` that zswap reads; the
    `_keys.Section.warned` keys present are added to ``out.skipped``, `defaults_only` ones are checked."""
    given: dict[str, tuple[str, Any]] = {}
    for key, value in section.items():
        if not isinstance(key, str):
            raise ConfigError(f"{where} has a key that is not a string: {v.show(key)}")
        off_default = key in spec.warned_unless and not _same(value, spec.warned_unless[key])
        if key in spec.deepspeed_types and value is not None:  # null: not set
            _deepspeed_accepts(f"{where}.{key}", spec.deepspeed_types[key], value)
        if out is not None and value is not None and off_default:  # only these keys: never a deep compare
            out.skipped.append(f"{where}.{key}")
        if key in spec.fields:
            targets: tuple[str, ...] = (key,)
        elif key in spec.aliases:
            targets = spec.aliases[key]
        elif key in spec.warned:
            if out is not None and value is not None:  # null: not set
                out.skipped.append(f"{where}.{key}")
            continue
        elif key in spec.defaults_only:
            _require_default(f"{where}.{key}", value, *spec.defaults_only[key])
            continue
        elif key in spec.ignored or key in spec.subsections or key in spec.checked:
            continue
        else:
            raise _unknown_key(key, spec, where)
        if value is None:  # null means "not set", so it cannot disagree with another spelling
            continue
        for target in targets:
            if target in given and not _same(given[target][1], value):
                first = given[target][0]
                raise ConfigError(
                    f"{first} and {where}.{key} disagree ({v.show(given[target][1])} vs {v.show(value)}); "
                    "give only one of them"
                )
            given.setdefault(target, (f"{where}.{key}", _detach(value)))
    return given


def _require_default(key: str, value: Any, default: object, reason: str) -> None:
    """`ConfigError` unless ``value`` is DeepSpeed's default for ``key`` (null and "auto" count as it)."""
    if value is None or v.is_auto(value):
        return
    if isinstance(default, bool):
        try:
            if v.to_bool(value) is default:
                return
        except PydanticCustomError as exc:
            raise ConfigError(f"{key} {exc.message()}, got {v.show(value)}") from None
        raise ConfigError(f"{key} must be {str(default).lower()}: {reason}, got {v.show(value)}")
    raise ConfigError(f"{key} is not supported: {reason}; remove it (got {v.show(value)})")


def _deepspeed_accepts(key: str, kind: str, value: Any) -> None:
    """`ConfigError` where DeepSpeed's schema would refuse ``value`` for ``key``, which zswap does not read:
    a config is not silently taken that DeepSpeed refuses."""
    try:
        v.deepspeed_accepts(kind, value)
    except PydanticCustomError as exc:
        raise ConfigError(f"{key} {exc.message()}, got {v.show(value)}") from None


def _known_in(path: str) -> tuple[str, ...]:
    inner = k.BY_PATH.get(path)
    return () if inner is None else inner.known()


def _unknown_key(key: str, spec: k.Section, where: str) -> ConfigError:
    # Misplaced one level up (DeepSpeed, which ignores it there, has tests doing so).
    homes = [f"{where}.{sub}" for sub in sorted(spec.subsections) if key in _known_in(f"{spec.path}.{sub}")]
    if homes:
        return ConfigError(f"unknown key {key!r} in {where}; it belongs in {' or '.join(homes)}")
    close = spec.closest(key)
    if close is not None:
        return ConfigError(f"unknown key {key!r} in {where}; did you mean {close!r}?")
    names = (*spec.fields, *spec.aliases, *sorted(spec.subsections), *sorted(spec.checked))
    readable = ", ".join(repr(name) for name in names)
    return ConfigError(f"unknown key {key!r} in {where}; zswap reads {readable}")


def _same(a: Any, b: Any) -> bool:
    """Equal as JSON values: ``4 == 4.0`` but ``True != 1``; anything but plain scalars must be identical."""
    scalars = (bool, int, float, str)
    if isinstance(a, scalars) and isinstance(b, scalars):
        same_kind = isinstance(a, bool) == isinstance(b, bool) and isinstance(a, str) == isinstance(b, str)
        return same_kind and a == b
    if isinstance(a, list) and isinstance(b, list | tuple):
        return len(a) == len(b) and all(_same(x, y) for x, y in zip(a, b, strict=True))
    return a is b


def _detach(value: Any) -> Any:
    # A fresh list of the same leaves: nothing the model is built from can be changed by the caller meanwhile,
    # and the models turn it into a tuple.
    return list(value) if isinstance(value, list | tuple) else value
