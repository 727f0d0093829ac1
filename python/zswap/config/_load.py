"""`load_config`: the one function that tells a path from a mapping."""

from __future__ import annotations

import copy
import errno
import json
import os
import stat
import warnings
from collections.abc import Mapping
from typing import Any, TypeAlias

from pydantic import ValidationError

from ..errors import ConfigError, ZswapWarning
from ._layout import assemble
from .models import ZswapConfig, describe

MAX_DEPTH = 100
"""Arrays and objects nested deeper than this in a config file are refused (a `ConfigError` naming where),
before the JSON parser's own recursion could fail: no DeepSpeed or zswap key is nested more than 4 deep."""

_INT_DIGITS = 4300
"""Python's default limit on the digits of an integer parsed from text (``sys.get_int_max_str_digits``)."""

ConfigSource: TypeAlias = "str | os.PathLike[str] | Mapping[str, Any] | ZswapConfig | None"
"""What every zswap entry point accepts as its config."""

_ACCEPTED = "a path (str or os.PathLike) to a JSON file, a mapping, a zswap.ZswapConfig, or None"


def load_config(config: ConfigSource = None) -> ZswapConfig:
    """Read and validate a zswap / DeepSpeed config.

    ``config`` is a path (``str`` or ``os.PathLike``) to a JSON file, a mapping in the same shape, an
    already loaded `ZswapConfig` (returned as is), or ``None`` for the defaults. A mapping is copied as it
    is read (only zswap's sections are read): later changes to it change nothing, and it is never modified.

    ``"auto"`` (or null) in one of zswap's keys selects its default; where the field is typed ``X | None``
    that is ``None`` = zswap picks. So ``optimizer.params.lr: "auto"`` loads as ``lr is None`` (an error only
    where the optimizer is built without an ``lr``), ``weight_decay: "auto"`` as ``None`` (0.0 unless a
    keyword supplies it), ``betas``/``eps: "auto"`` as the defaults, and ``bf16.enabled: "auto"`` leaves
    ``dtype`` ``None`` (keep the dtype the params were built with). ``"auto"`` is refused only where zswap
    cannot choose and nothing downstream could: an offload ``device`` and ``optimizer.type``.

    Raises:
        TypeError: ``config`` is none of the accepted types.
        FileNotFoundError: the file does not exist (``errno`` ENOENT, ``filename`` set).
        ConfigError: (a ``ValueError``) a path to something other than a regular file of at most
            `MAX_FILE_BYTES`, malformed JSON (file, line, column), a duplicate key, a top level
            that is not an object, or a key in zswap's sections that is unknown, misplaced, given twice
            under two names, or has a wrong type or range; the message names the dotted key and the value.
    """
    if config is None:
        return ZswapConfig()
    if isinstance(config, ZswapConfig):
        return config
    if isinstance(config, str | os.PathLike):
        path = os.fsdecode(os.fspath(config))
        try:
            return _validate(_read_json(path))
        except ConfigError as exc:
            raise ConfigError(f"{path}: {exc}") from None
    if isinstance(config, Mapping):
        return _validate(config)
    raise TypeError(f"config must be {_ACCEPTED}; got {type(config).__name__}")


def raw_dict(config: ConfigSource, what: str = "config") -> dict[str, Any]:
    """``config`` as a private plain dict in its own layout, for a front end that fills values in before it
    is loaded (Lightning's strategy, the Hugging Face Trainer): a file is read once and checked as
    `load_config` checks it (errors name the file), a mapping is deep-copied, a `ZswapConfig` is written
    out. ``what`` names the argument in the `TypeError` for any other type."""
    if config is None:
        return {}
    if isinstance(config, ZswapConfig):
        return config.to_dict()
    if isinstance(config, str | os.PathLike):
        path = os.fsdecode(os.fspath(config))
        try:
            raw = _read_json(path)
            _validate(raw)
        except ConfigError as exc:
            raise ConfigError(f"{path}: {exc}") from None
        return dict(raw)  # freshly parsed: nobody else holds it
    if isinstance(config, Mapping):
        return copy.deepcopy(dict(config))
    raise TypeError(f"{what} must be {_ACCEPTED}; got {type(config).__name__}")


def _validate(raw: Mapping[Any, Any]) -> ZswapConfig:
    try:
        assembled = assemble(raw)
        try:
            config = ZswapConfig.model_validate(assembled.data)
        except ValidationError as exc:
            raise ConfigError(describe(exc, assembled.origins)) from None
    except RecursionError:
        # A mapping built in Python (a file is depth-checked before parsing) nested past the interpreter's
        # recursion limit inside one of zswap's sections.
        raise ConfigError(
            "a value in the config is nested too deeply to read (past Python's recursion limit); "
            f"zswap's keys are never nested more than {MAX_DEPTH} levels"
        ) from None
    if assembled.stage is not None:
        warnings.warn(
            f"zero_optimization.stage is {assembled.stage!r}; zswap partitions every param as ZeRO stage 3 "
            "whatever the stage says (it offloads partitions): outside a forward a param's data is an empty "
            "placeholder (read it inside zswap.GatheredParameters; p.ds_numel is its size), and "
            "zero_optimization_stage() says 3",
            ZswapWarning,
            stacklevel=1,
        )
    if assembled.skipped:
        # Once per distinct set: a config is read by Init and again by initialize (and by zswap.deepspeed's
        # wrappers of both), each from another line. The warnings registry drops a repeat only at the same
        # location, so the warning is attributed to this line, not to the caller's; the message names the
        # keys, which is what the reader needs.
        warnings.warn(
            "zswap ignores these DeepSpeed settings, which tune DeepSpeed's own machinery and change no "
            f"result: {', '.join(assembled.skipped)}",
            ZswapWarning,
            stacklevel=1,
        )
    return config


MAX_FILE_BYTES = 16 << 20
"""The largest config file read (DeepSpeed's are a few KiB): a path to something else (a log, a
checkpoint) is refused before it is read whole."""


def _read_json(path: str) -> Mapping[str, Any]:
    """The JSON object in ``path``. Errors name the path; JSON errors are `ConfigError` (the caller
    prefixes the path), a missing file is `FileNotFoundError`. Only a regular file is read (a FIFO would
    block forever, a device never end)."""
    try:
        info = os.stat(path)
    except FileNotFoundError:
        where = "" if os.path.isabs(path) else f" (relative to {os.getcwd()})"
        raise FileNotFoundError(errno.ENOENT, f"zswap config file not found{where}", path) from None
    if not stat.S_ISREG(info.st_mode):
        kind = "a directory" if stat.S_ISDIR(info.st_mode) else "not a regular file (a FIFO, a device…)"
        raise ConfigError(f"{kind}: a config is a JSON file")
    if info.st_size > MAX_FILE_BYTES:
        raise ConfigError(f"{info.st_size} bytes, more than a config file holds ({MAX_FILE_BYTES} at most)")
    try:
        with open(path, encoding="utf-8-sig") as file:  # -sig: tolerate a byte-order mark
            text = file.read(MAX_FILE_BYTES + 1)  # a file grown since its stat is cut here, and refused
    except UnicodeDecodeError as exc:
        raise ConfigError(f"not UTF-8 text: {exc}") from None
    if len(text) > MAX_FILE_BYTES:
        raise ConfigError(f"more than a config file holds ({MAX_FILE_BYTES} bytes at most)")
    return parse_json(text)


def from_argument(text: str) -> ConfigSource:
    """A command line's ``--config``: the JSON given in the argument itself (it starts with ``{``, or ``[``
    for `parse_json` to refuse as no object), else the path of a file."""
    return parse_json(text) if text.lstrip()[:1] in ("{", "[") else text


def parse_json(text: str) -> dict[str, Any]:
    """The JSON object in ``text`` (a config file's, or one given inline on the command line), read
    strictly: a key twice in one object, integers past 64 bits or nesting past `MAX_DEPTH` are
    `ConfigError`s, as is a top level that is not an object."""
    _check_depth(text)
    try:
        loaded = json.loads(text, object_pairs_hook=_refuse_duplicates, parse_int=_parse_int)
    except json.JSONDecodeError as exc:
        # DeepSpeed reads its config files with hjson, which also takes comments, unquoted keys and
        # trailing commas; zswap reads strict JSON only, and says so where a file is not.
        raise ConfigError(
            f"invalid JSON at line {exc.lineno}, column {exc.colno}: {exc.msg} (zswap reads strict JSON; "
            "DeepSpeed also accepts Hjson — comments, unquoted keys, trailing commas — which zswap does not)"
        ) from None
    except RecursionError:  # _check_depth makes this unreachable short of a tiny recursion limit
        raise ConfigError(f"values nested too deeply (more than {MAX_DEPTH} levels)") from None
    if not isinstance(loaded, dict):
        raise ConfigError(f"the top level must be a JSON object, got a JSON {_json_kind(loaded)}")
    _refuse_huge_ints(loaded)
    return loaded


def _check_depth(text: str) -> None:
    """`ConfigError` naming line, column and depth where arrays/objects nest deeper than `MAX_DEPTH`.
    One pass over the text, outside strings; the parser reports any other malformation."""
    depth = 0
    in_string = escaped = False
    for i, ch in enumerate(text):
        if in_string:
            if escaped:
                escaped = False
            elif ch == "\\":
                escaped = True
            elif ch == '"':
                in_string = False
        elif ch == '"':
            in_string = True
        elif ch in "[{":
            depth += 1
            if depth > MAX_DEPTH:
                line = text.count("\n", 0, i) + 1
                column = i - (text.rfind("\n", 0, i) + 1) + 1
                raise ConfigError(
                    f"values nested more than {MAX_DEPTH} levels deep at line {line}, column {column}"
                )
        elif ch in "]}":
            depth -= 1


class _HugeInt:
    """An integer literal longer than Python parses from text, kept as its digits until `_refuse_huge_ints`
    can name its key."""

    __slots__ = ("digits",)

    def __init__(self, digits: str) -> None:
        self.digits = digits

    def __repr__(self) -> str:
        return f"<an integer of {len(self.digits.lstrip('-'))} digits>"


def _parse_int(text: str) -> int | _HugeInt:
    if len(text) - text.startswith("-") > _INT_DIGITS:
        return _HugeInt(text)
    return int(text)


def _refuse_huge_ints(root: dict[str, Any]) -> None:
    """`ConfigError` naming the dotted key of the first integer too long to parse (an iterative walk: the
    depth is bounded by `_check_depth`)."""
    stack: list[tuple[str, Any]] = [("", root)]
    while stack:
        where, value = stack.pop()
        if isinstance(value, _HugeInt):
            raise ConfigError(
                f"{where or 'the config'}: an integer of {len(value.digits.lstrip('-'))} digits, more than "
                f"the {_INT_DIGITS} Python reads from text (no zswap or DeepSpeed value needs more than 20)"
            )
        if isinstance(value, dict):
            items = [(f"{where}.{k}" if where else str(k), v) for k, v in value.items()]
        elif isinstance(value, list):
            items = [(f"{where}[{i}]", v) for i, v in enumerate(value)]
        else:
            continue
        stack.extend(reversed(items))


def _refuse_duplicates(pairs: list[tuple[str, Any]]) -> dict[str, Any]:
    # json keeps the last of two equal keys without a word; DeepSpeed would silently take the last value too.
    out: dict[str, Any] = {}
    for key, value in pairs:
        if key in out:
            raise ConfigError(f"duplicate key {key!r} in a JSON object (keys must be unique at every depth)")
        out[key] = value
    return out


def _json_kind(value: Any) -> str:
    if isinstance(value, list):
        return "array"
    if isinstance(value, str):
        return "string"
    if isinstance(value, bool) or value is None:
        return json.dumps(value)
    return "number"
