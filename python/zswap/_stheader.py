"""The one safetensors header parser of zswap, as strict as the ``safetensors`` package.

Every entry point that reads a safetensors file (``load_weights``, ``from_pretrained`` under ``Init``,
checkpoints, ``zswap export``) parses its header here, and nothing of the data is read before the whole
header passed. The rules are those the ``safetensors`` package (0.8, Rust) enforces, so that zswap never
loads a file it refuses:

- ``u64`` little-endian header length ``N``, at most `MAX_HEADER_BYTES`, ``8 + N`` within the file;
- the ``N`` bytes are UTF-8 JSON (no BOM, no ``NaN``/``Infinity``, no lone surrogate, at most
  `MAX_DEPTH` nested arrays/objects: serde_json's recursion limit), an object;
- ``__metadata__`` absent, ``null`` or an object of strings;
- every other member an object with ``dtype`` (a known name), ``shape`` (a list of non-negative integers:
  no floats, ``-0``, booleans or strings) and ``data_offsets`` (two such integers, begin <= end), where
  ``end - begin`` is exactly ``numel * itemsize`` (computed without overflow of 64 bits);
- sorted by offsets, the tensors cover the data section exactly: the first begins at 0, each begins where
  the one before ended (no gap, no overlap), the last ends at the end of the file (no trailing bytes).

Stricter than the package, on purpose: a name given twice (it keeps the last one silently), a tensor
entry written as a JSON array (serde accepts a struct as a sequence), and dtypes outside `DTYPES` (``F4``,
``F6_*``, which torch has no tensor for; ``C64``, ``F8_E8M0``, which no weights loader of zswap casts) are
refused. Every refusal is a `SafetensorsError` naming the file and the tensor or
field.
"""

from __future__ import annotations

import json
import math
import re
import struct
from dataclasses import dataclass
from typing import Any, NoReturn

import torch

from ._fileerrors import SafetensorsError
from ._stread import NotRegularFileError as NotRegularFileError  # its old home
from ._stread import open_regular as open_regular
from ._stread import pread_into

MAX_HEADER_BYTES = 100_000_000
"""The ``safetensors`` package refuses longer headers (``HeaderTooLarge``)."""

MAX_DEPTH = 127
"""Most nested arrays/objects a header may hold: serde_json refuses the 128th level."""

U64_MAX = 2**64 - 1
INT64_MAX = 2**63 - 1  # the largest dim a torch.Size holds

DTYPES: dict[str, torch.dtype] = {
    "BOOL": torch.bool,
    "U8": torch.uint8,
    "I8": torch.int8,
    "I16": torch.int16,
    "U16": torch.uint16,
    "I32": torch.int32,
    "U32": torch.uint32,
    "I64": torch.int64,
    "U64": torch.uint64,
    "F16": torch.float16,
    "BF16": torch.bfloat16,
    "F32": torch.float32,
    "F64": torch.float64,
    "F8_E4M3": torch.float8_e4m3fn,
    "F8_E5M2": torch.float8_e5m2,
}


@dataclass(frozen=True)
class Header:
    """A parsed, validated header: each tensor's ``(dtype, shape, absolute begin)`` in file order,
    ``__metadata__``, and the byte offset where the data section starts."""

    tensors: dict[str, tuple[torch.dtype, torch.Size, int]]
    metadata: dict[str, str]
    data_start: int


def parse(fd: int, size: int, path: str) -> Header:
    """The validated header of the safetensors file open as ``fd`` (``size`` bytes); reads only the
    header's bytes."""
    head = _pread_header(fd, 8, 0, path)
    if len(head) < 8:
        _refuse(path, f"truncated or not a safetensors file ({size} bytes, no header)")
    (n,) = struct.unpack("<Q", head)
    if n > MAX_HEADER_BYTES:
        _refuse(path, f"header length {n} is over the {MAX_HEADER_BYTES}-byte limit")
    if 8 + n > size:
        _refuse(path, f"truncated or not safetensors: header length {n} does not fit {size} bytes")
    raw = _pread_header(fd, n, 8, path)
    if len(raw) < n:
        _refuse(path, f"truncated: header of {n} bytes, {len(raw)} read")
    members = _decode(raw, path)
    base = 8 + n
    meta: dict[str, str] = {}
    found: list[tuple[int, int, str, torch.dtype, torch.Size]] = []
    for name, info in members.items():
        if name == "__metadata__":
            meta = _metadata(info, path)
            continue
        found.append(_entry(name, info, path))
    found.sort(key=lambda e: (e[0], e[1]))
    pos = 0
    for begin, end, name, _, _ in found:
        if begin != pos:
            what = "leave a gap before it" if begin > pos else "overlap the tensor before it"
            _refuse(path, f"tensor {name!r} has data_offsets [{begin}, {end}] that {what} (expected {pos})")
        pos = end
    if base + pos > size:
        last = found[-1]
        _refuse(
            path,
            f"truncated: tensor {last[2]!r} has data_offsets [{last[0]}, {last[1]}] that lie past the end "
            f"of the file ({size} bytes, data from byte {base})",
        )
    if base + pos != size:
        _refuse(path, f"{size - base - pos} trailing bytes after the last tensor's data (byte {base + pos})")
    tensors = {name: (dtype, shape, base + begin) for begin, _, name, dtype, shape in found}
    return Header(tensors, meta, base)


def _refuse(path: str, why: str) -> NoReturn:
    raise SafetensorsError(f"{path}: {why}")


def _pread_header(fd: int, n: int, offset: int, path: str) -> bytearray:
    buf = bytearray(n)
    got = pread_into(fd, memoryview(buf), offset, path, "the header", eof_ok=True)
    del buf[got:]
    return buf


class _Duplicate(Exception):
    pass


class _Constant(Exception):
    pass


_STRINGS = re.compile(r'"(?:[^"\\]|\\.)*"', re.DOTALL)
_BRACKETS = re.compile(r"[\[\]{}]")
_LONE_SURROGATE = re.compile(r"[\ud800-\udfff]")


def _decode(raw: bytes | bytearray, path: str) -> dict[str, Any]:
    try:
        text = raw.decode("utf-8")
    except UnicodeDecodeError as e:
        _refuse(path, f"header is not valid UTF-8 (byte {e.start})")
    if not text.lstrip(" \t\n\r").startswith("{"):
        _refuse(path, "header is not valid JSON: not a JSON object")
    depth = deepest = 0
    for m in _BRACKETS.finditer(_STRINGS.sub('""', text)):
        depth += 1 if m.group() in "[{" else -1
        deepest = max(deepest, depth)
    if deepest > MAX_DEPTH:
        _refuse(path, f"header is not valid JSON: nested {deepest} levels deep (at most {MAX_DEPTH})")
    try:
        value = json.loads(
            text, object_pairs_hook=_pairs, parse_constant=_constant, parse_int=_int, parse_float=_float
        )
        _no_lone_surrogate(value)
    except _Duplicate as e:
        _refuse(path, f"header names {e.args[0]!r} twice")
    except _Constant as e:
        _refuse(path, f"header is not valid JSON: {e.args[0]} is not a JSON number")
    except (ValueError, RecursionError) as e:
        _refuse(path, f"header is not valid JSON ({e})")
    if not isinstance(value, dict):
        _refuse(path, "header is not valid JSON: not a JSON object")
    return value


def _pairs(pairs: list[tuple[str, Any]]) -> dict[str, Any]:
    out: dict[str, Any] = {}
    for k, v in pairs:
        if k in out:
            raise _Duplicate(k)
        out[k] = v
    return out


def _no_lone_surrogate(value: Any) -> None:
    """serde_json refuses an unpaired \\uD800-\\uDFFF escape in any string: a key, a value, a list's item."""
    stack = [value]
    while stack:
        v = stack.pop()
        if isinstance(v, str):
            if _LONE_SURROGATE.search(v):
                raise ValueError(f"lone surrogate escape in {v!r}")
        elif isinstance(v, dict):
            stack.extend(v)
            stack.extend(v.values())
        elif isinstance(v, list):
            stack.extend(v)


def _float(text: str) -> float:
    # serde_json refuses a number past f64's range ("number out of range"); Python's json makes it inf.
    value = float(text)
    if not math.isfinite(value):
        raise ValueError(f"number out of range: {text}")
    return value


def _constant(name: str) -> NoReturn:
    raise _Constant(name)


def _int(text: str) -> int | float:
    # serde_json reads "-0" as the float -0.0, which no shape or offset accepts; Python's json an int 0.
    return -0.0 if text == "-0" else int(text)


def _metadata(info: Any, path: str) -> dict[str, str]:
    if info is None:
        return {}
    if not isinstance(info, dict):
        _refuse(path, f"__metadata__ is {type(info).__name__}, not a JSON object of strings")
    for k, v in info.items():
        if not isinstance(v, str):
            _refuse(path, f"__metadata__[{k!r}] is {type(v).__name__} {v!r}, not a string")
    return info


def _entry(name: str, info: Any, path: str) -> tuple[int, int, str, torch.dtype, torch.Size]:
    where = f"tensor {name!r}"
    if not isinstance(info, dict):
        _refuse(path, f"{where}: entry is {type(info).__name__}, not a JSON object")
    for field in ("dtype", "shape", "data_offsets"):
        if field not in info:
            _refuse(path, f"{where}: entry has no {field!r}")
    code, shape, offsets = info["dtype"], info["shape"], info["data_offsets"]
    if not isinstance(code, str) or code not in DTYPES:
        _refuse(path, f"{where}: dtype {code!r} is not one of {', '.join(DTYPES)}")
    dtype = DTYPES[code]
    if not isinstance(shape, list):
        _refuse(path, f"{where}: shape {shape!r} is not a list of integers")
    for i, d in enumerate(shape):
        if type(d) is not int or d < 0 or d > U64_MAX:
            _refuse(path, f"{where}: shape[{i}] is {d!r}, not a non-negative integer")
    if not isinstance(offsets, list) or len(offsets) != 2:
        _refuse(path, f"{where}: data_offsets {offsets!r} is not a list of two integers")
    for i, x in enumerate(offsets):
        if type(x) is not int or x < 0 or x > U64_MAX:
            _refuse(path, f"{where}: data_offsets[{i}] is {x!r}, not a non-negative integer")
    begin, end = offsets
    nbytes = dtype.itemsize
    for d in shape:
        nbytes *= d
    if nbytes > U64_MAX:
        _refuse(path, f"{where}: shape {shape} of {code} overflows 64 bits of bytes")
    if end < begin or end - begin != nbytes:
        _refuse(
            path, f"{where} ({code} {shape}) has data_offsets [{begin}, {end}] that do not match its size"
        )
    if any(d > INT64_MAX for d in shape):  # only with another dim 0: no torch tensor has such a dim
        _refuse(path, f"{where}: shape {shape} has a dim over {INT64_MAX}, which torch cannot hold")
    return begin, end, name, dtype, torch.Size(shape)
