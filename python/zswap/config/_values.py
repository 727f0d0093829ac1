"""Value checks for config keys: one function per kind of value, each returning the canonical value.

Each check raises `invalid(...)` whose message says what the value must be ("must be a positive integer");
the caller that knows the dotted key and the offending value adds them, so every message reads
``<key> <requirement>, got <value>``. The checks run inside pydantic (through the annotated types at the
bottom) and also directly in the loader for keys that never become a model field (``bf16.enabled``,
``optimizer.params.amsgrad``).

They are stricter than pydantic's lax mode on purpose: a JSON boolean written as a string is rejected, never
taken as truthy; ``True`` is not an integer; a float is an integer only when it has no fraction (DeepSpeed
configs write sizes as ``5e8``).
"""

from __future__ import annotations

import functools
import math
import numbers
import os
import pathlib
import re
from collections.abc import Callable
from fractions import Fraction
from typing import Annotated, Any, Literal

from pydantic import BeforeValidator, Field, TypeAdapter, ValidationError
from pydantic_core import PydanticCustomError

INVALID = "zswap_invalid"
"""pydantic error type of a failed check; the loader turns these into `ConfigError` messages."""

INT_MAX = 2**63 - 1
"""Upper bound of every integer key: the Rust engine stores counts and sizes as 64-bit integers."""

BLOCK_SIZE_MIN = 4096
BLOCK_SIZE_MAX = 64 << 20  # the engine's limit (src/engine/mod.rs)

_BOOL_WORDS = frozenset({"true", "false", "yes", "no", "on", "off", "0", "1", "t", "f", "y", "n"})

# dd(1)'s convention: a bare or "iB" suffix is binary, "B" after the prefix is decimal ("4M" = 4 MiB).
_SIZE_RE = re.compile(r"^\s*(\d+(?:\.\d*)?|\.\d+)\s*([kmgt]?)(i?)(b?)\s*$", re.IGNORECASE)
_SIZE_POWER = {"": 0, "k": 1, "m": 2, "g": 3, "t": 4}


def invalid(requirement: str) -> PydanticCustomError:
    """An error saying what the value must be; the key and the value are added by whoever reports it."""
    return PydanticCustomError(INVALID, requirement)  # no context: the text is never str.format-ted


def show(value: Any, limit: int = 80) -> str:
    """``value`` as printed after "got" in a message: its repr, cut short if long."""
    if isinstance(value, int) and value.bit_length() > 14_000:  # near int -> str's 4300-digit limit
        return f"an integer of about {int(value.bit_length() * 0.30103) + 1} digits"
    try:
        text = repr(value)
    except (ValueError, RecursionError):  # a huge int deep inside, or nesting past the recursion limit
        return f"a {type(value).__name__} too large or too deeply nested to print"
    return text if len(text) <= limit else text[: limit - 3] + "..."


def to_bool(value: Any) -> bool:
    """A JSON boolean. Strings such as ``"false"`` and the integers 0 and 1 are refused."""
    if isinstance(value, bool):
        return value
    if isinstance(value, str) and value.strip().lower() in _BOOL_WORDS:
        raise invalid("must be true or false (a JSON boolean, not a string)")
    raise invalid("must be true or false")


def to_int(value: Any, *, minimum: int = 0, maximum: int = INT_MAX) -> int:
    """An integer in ``[minimum, maximum]``; an integral float (``5e8``) counts, 1.5 and True do not."""
    if minimum == 1:
        requirement = "must be a positive integer"
    elif minimum <= -INT_MAX:
        requirement = "must be an integer"
    elif minimum == 0:
        requirement = "must be a non-negative integer"
    else:
        requirement = f"must be an integer ≥ {minimum}"
    if isinstance(value, bool) or not isinstance(value, numbers.Real):
        raise invalid(requirement)
    try:
        if isinstance(value, numbers.Rational):  # int, numpy integers, Fraction: exact
            exact = Fraction(int(value.numerator), int(value.denominator))
        else:
            exact = Fraction(float(value))
    except (ValueError, OverflowError, TypeError):  # nan, inf, exotic Real subclasses
        raise invalid(requirement) from None
    if exact.denominator != 1 or exact < minimum:
        raise invalid(requirement)
    if exact > maximum:
        raise invalid(f"must be at most {maximum}")
    return int(exact)


def to_float(value: Any, *, minimum: float = 0.0, strict_minimum: bool = False) -> float:
    """A finite number ≥ ``minimum`` (> when ``strict_minimum``); integers are accepted, booleans are not."""
    if strict_minimum:
        requirement = "must be a positive number" if minimum == 0 else f"must be a number > {minimum}"
    elif minimum == -math.inf:
        requirement = "must be a number"
    else:
        requirement = "must be a non-negative number" if minimum == 0 else f"must be a number ≥ {minimum}"
    if isinstance(value, bool) or not isinstance(value, numbers.Real):
        raise invalid(requirement)
    try:
        number = float(value)
    except (OverflowError, TypeError, ValueError):
        raise invalid(requirement) from None
    if not math.isfinite(number) or number < minimum or (strict_minimum and number == minimum):
        raise invalid(requirement)
    return number


def to_byte_size(value: Any, *, minimum: int = 1) -> int:
    """Bytes, as an integer or a string such as ``"512MiB"``, ``"4M"`` (binary) or ``"1GB"`` (decimal)."""
    if not isinstance(value, str):
        return to_int(value, minimum=minimum)
    requirement = 'must be a size in bytes (an integer, or a string such as "512MiB" or "4M")'
    match = _SIZE_RE.match(value)
    if match is None:
        raise invalid(requirement)
    number, prefix, binary, byte = match.groups()
    if binary and not prefix:
        raise invalid(requirement)  # "4iB"
    base = 1000 if (byte and not binary and prefix) else 1024
    exact = Fraction(number) * base ** _SIZE_POWER[prefix.lower()]
    if exact.denominator != 1:
        raise invalid(f"must be a whole number of bytes ({value!r} is {float(exact)} bytes)")
    return to_int(int(exact), minimum=minimum)


def to_block_size(value: Any) -> int:
    """An I/O block size in bytes: a power of two from 4 KiB to 64 MiB."""
    size = to_byte_size(value)
    if size < BLOCK_SIZE_MIN or size > BLOCK_SIZE_MAX or size & (size - 1):
        raise invalid(f"must be a power of two from {BLOCK_SIZE_MIN} to {BLOCK_SIZE_MAX} (4 KiB to 64 MiB)")
    return size


def to_choice(value: Any, *, choices: tuple[str, ...]) -> str:
    """One of ``choices``, matched without regard to case and returned as spelled in ``choices``."""
    if isinstance(value, str):
        for choice in choices:
            if value.casefold() == choice.casefold():
                return choice
    raise invalid("must be one of " + ", ".join(repr(c) for c in choices))


def to_auto_or_bool(value: Any) -> Literal["auto"] | bool:
    """``"auto"`` (zswap probes and decides) or a JSON boolean."""
    if isinstance(value, bool):
        return value
    if isinstance(value, str) and value.casefold() == "auto":
        return "auto"
    if isinstance(value, str) and value.strip().lower() in _BOOL_WORDS:
        raise invalid('must be "auto", true or false (a JSON boolean, not a string)')
    raise invalid('must be "auto", true or false')


def to_paths(value: Any) -> tuple[pathlib.Path, ...]:
    """A directory or a non-empty list of distinct directories (striping); `Init` checks they exist."""
    requirement = "must be a directory path or a non-empty list of distinct directory paths"
    items = list(value) if isinstance(value, list | tuple) else [value]
    if not items:
        raise invalid(requirement)
    paths: list[pathlib.Path] = []
    for item in items:
        if isinstance(item, os.PathLike):
            item = os.fspath(item)
        if isinstance(item, bytes):
            item = os.fsdecode(item)
        if not isinstance(item, str) or not item.strip() or "\0" in item:
            raise invalid(requirement)
        path = pathlib.Path(item)
        if path in paths:
            raise invalid(f"{requirement} ({item!r} is listed twice)")
        paths.append(path)
    return tuple(paths)


def to_names(value: Any) -> tuple[str, ...]:
    """A non-empty string or a list of them (DeepSpeed takes one string for a list of one)."""
    items = [value] if isinstance(value, str) else value
    if not isinstance(items, list | tuple) or not all(isinstance(i, str) and i.strip() for i in items):
        raise invalid("must be a name or a list of names (non-empty strings)")
    return tuple(dict.fromkeys(items))


_DTYPE_SPELLINGS = {
    # DeepSpeed's DtypeEnum (deepspeed/runtime/config.py): every spelling it takes, torch's str() included
    "fp16": ("fp16", "float16", "half", "torch.float16"),
    "bf16": ("bf16", "bfloat16", "torch.bfloat16"),
    "fp32": ("fp32", "float32", "float", "torch.float32"),
}


def to_dtype_name(value: Any) -> str:
    """``"fp16"``, ``"bf16"`` or ``"fp32"`` from any of DeepSpeed's spellings of a floating-point dtype, or
    a `torch.dtype` (a config dict built in Python)."""
    text = str(value) if type(value).__name__ == "dtype" else value
    if isinstance(text, str):
        for name, spellings in _DTYPE_SPELLINGS.items():
            if text.strip().lower() in spellings:
                return name
    raise invalid("must be a floating-point dtype: one of " + ", ".join(sum(_DTYPE_SPELLINGS.values(), ())))


def to_betas(value: Any) -> tuple[float, float]:
    """Adam's two moment decay rates, each in [0, 1)."""
    requirement = "must be a list of two numbers in [0, 1)"
    if not isinstance(value, list | tuple) or len(value) != 2:
        raise invalid(requirement)
    betas = []
    for beta in value:
        try:
            number = to_float(beta)
        except PydanticCustomError:
            raise invalid(requirement) from None
        if number >= 1.0:
            raise invalid(requirement)
        betas.append(number)
    return betas[0], betas[1]


def to_false(value: Any, *, reason: str) -> bool:
    """A boolean zswap accepts only as ``false`` (a feature it does not implement)."""
    if to_bool(value):
        raise invalid(f"must be false: {reason}")
    return False


SCHEDULE_INTS = {
    "warmup_num_steps": 1,  # DeepSpeed ≥ 0.19.6 refuses 0; its schedules warm up over max(2, it) steps
    "total_num_steps": 1,
    "cycle_first_step_size": 1,
    "cycle_second_step_size": 0,
    "cycle_first_stair_count": 0,
    "cycle_second_stair_count": 0,
    "decay_step_size": 0,
    "lr_range_test_step_size": 1,
    "last_batch_iteration": -1,
}
"""The least value of each integer ``scheduler.params`` key."""
SCHEDULE_BOOLS = {"lr_range_test_staircase", "cycle_momentum"}


def schedule_value(name: str, value: Any) -> Any:
    """One ``scheduler.params`` value checked for its name: the integers' least values, the booleans, the
    warmup type; any other a number, or a number per param group."""
    if name in SCHEDULE_INTS:
        return to_int(value, minimum=SCHEDULE_INTS[name])
    if name in SCHEDULE_BOOLS:
        return to_bool(value)
    if name == "warmup_type":
        return to_choice(value, choices=("log", "linear"))
    if isinstance(value, list | tuple):  # a value per param group
        return tuple(to_float(item) for item in value)
    return to_float(value)


DS_TYPES: dict[str, tuple[Any, str]] = {
    "bool": (bool, "must be true or false"),
    "int": (int, "must be an integer"),
    "int>0": (Annotated[int, Field(gt=0)], "must be a positive integer"),
    "int>=0": (Annotated[int, Field(ge=0)], "must be a non-negative integer"),
    "fraction": (Annotated[float, Field(ge=0.0, le=1.0)], "must be a number from 0 to 1"),
}
"""The types DeepSpeed's schema gives the keys zswap accepts and does not read, with what each requires."""


@functools.cache
def _deepspeed_adapter(kind: str) -> TypeAdapter[Any]:
    return TypeAdapter(DS_TYPES[kind][0])


def is_auto(value: Any) -> bool:
    """Whether a config value is ``"auto"`` (any case): Hugging Face's "filled in elsewhere"."""
    return isinstance(value, str) and value.casefold() == "auto"


def deepspeed_accepts(kind: str, value: Any) -> None:
    """`invalid` where DeepSpeed's schema refuses ``value`` for a key of type ``kind`` (pydantic's lax mode,
    as DeepSpeed validates: ``"true"`` is a boolean there, ``5e8`` an integer). ``"auto"`` passes: Hugging
    Face's config templates write it, and fill it in before DeepSpeed sees it."""
    if is_auto(value):
        return
    try:
        _deepspeed_adapter(kind).validate_python(value)
    except ValidationError:
        raise invalid(f"{DS_TYPES[kind][1]} (DeepSpeed's schema refuses it too)") from None


def _check(function: Callable[..., Any], **options: Any) -> BeforeValidator:
    return BeforeValidator(lambda value: function(value, **options))


# Annotated field types for the models. Each runs its check before pydantic's (strict) type check, so the
# model never sees a value the check did not produce.
StrictBool = Annotated[bool, _check(to_bool)]
PositiveInt = Annotated[int, _check(to_int, minimum=1)]
NonNegativeInt = Annotated[int, _check(to_int, minimum=0)]
PositiveFloat = Annotated[float, _check(to_float, strict_minimum=True)]
Integer = Annotated[int, _check(to_int, minimum=-INT_MAX)]
Number = Annotated[float, _check(to_float, minimum=-math.inf)]
NonNegativeFloat = Annotated[float, _check(to_float)]
ByteSize = Annotated[int, _check(to_byte_size)]
BlockSize = Annotated[int, _check(to_block_size)]
Paths = Annotated[tuple[pathlib.Path, ...], _check(to_paths)]
Betas = Annotated[tuple[float, float], _check(to_betas)]
Names = Annotated[tuple[str, ...], _check(to_names)]
AutoOrBool = Annotated[Literal["auto"] | bool, _check(to_auto_or_bool)]
DTypeName = Annotated[Literal["fp32", "bf16", "fp16"], _check(to_dtype_name)]


def int_between(minimum: int, maximum: int) -> BeforeValidator:
    """Field check for an integer in ``[minimum, maximum]``."""
    return _check(to_int, minimum=minimum, maximum=maximum)


def one_of(*choices: str) -> BeforeValidator:
    """Field check for a string among ``choices`` (case-insensitive)."""
    return _check(to_choice, choices=choices)


def only_false(reason: str) -> BeforeValidator:
    """Field check for a boolean that may only be false."""
    return _check(to_false, reason=reason)
