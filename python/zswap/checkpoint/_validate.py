"""Reading a manifest so that no change to it passes unnoticed and no malformed value escapes as a raw error.

`read_json` opens only a regular file (a FIFO would block), caps its size, decodes strict UTF-8 and parses
JSON refusing duplicate keys, ``NaN``/``Infinity`` and deep nesting. `check_checksum` compares the
manifest's ``checksum`` (CRC-32C of its canonical JSON without that field, written by the save) with its
content, so an edit is caught even where it keeps the manifest well formed. `check_structure` then checks
every field a load or an export uses — types, ranges and the relations between them (a param's
``partition_numel`` is its shape's numel split over its ranks, the file list names exactly the files of the
world size, each file's block checksums cover its size) — so that every later read of the manifest is
safe. Each refusal is a `CheckpointCorruptError` naming the file and the field.

A CRC is not a signature: it catches damage and naive edits, not an adversary who recomputes it.
"""

from __future__ import annotations

import json
import os
import re
from typing import Any, NoReturn

from .._stread import open_regular
from ._crc import crc32c
from ._hf_layout import CONFIG_FILES
from .errors import CheckpointCorruptError, CheckpointError

MAX_MANIFEST_BYTES = 1 << 30
"""A manifest lists ~12 bytes per 8 MiB block of the checkpoint: 1 GiB is far beyond any real one."""

MAX_DEPTH = 64
CHECKSUM = "checksum"
_FILE = re.compile(
    r"rank(\d{5})-of-(\d{5})\.(params|exp_avg|exp_avg_sq|master|optim|state)\.(safetensors|pt)"
)


def refuse(path: object, why: str) -> NoReturn:
    raise CheckpointCorruptError(f"{path}: {why}")


def read_bytes(path: str, limit: int) -> bytes:
    """The bytes of the regular file ``path`` (at most ``limit``)."""
    try:
        fd = open_regular(path)
    except CheckpointError:
        raise
    except OSError as e:
        refuse(path, f"cannot be read ({e.strerror})")
    try:
        size = os.fstat(fd).st_size
        if size > limit:
            refuse(path, f"{size} bytes, more than the {limit} a file of this kind can be")
        chunks = []
        while data := os.read(fd, 1 << 20):
            chunks.append(data)
            if sum(map(len, chunks)) > limit:
                refuse(path, f"more than the {limit} bytes a file of this kind can be")
        return b"".join(chunks)
    except OSError as e:
        refuse(path, f"cannot be read ({e.strerror})")
    finally:
        os.close(fd)


def read_json(path: str, limit: int = MAX_MANIFEST_BYTES) -> Any:
    raw = read_bytes(path, limit)
    try:
        text = raw.decode("utf-8")
    except UnicodeDecodeError as e:
        refuse(path, f"not valid UTF-8 (byte {e.start})")
    depth = deepest = 0
    for ch in re.sub(r'"(?:[^"\\]|\\.)*"', '""', text, flags=re.DOTALL):
        if ch in "[{":
            depth += 1
            deepest = max(deepest, depth)
        elif ch in "]}":
            depth -= 1
    if deepest > MAX_DEPTH:
        refuse(path, f"not valid JSON: nested {deepest} levels deep (at most {MAX_DEPTH})")

    def pairs(items: list[tuple[str, Any]]) -> dict[str, Any]:
        out: dict[str, Any] = {}
        for k, v in items:
            if k in out:
                refuse(path, f"not valid JSON: key {k!r} given twice")
            out[k] = v
        return out

    def constant(name: str) -> NoReturn:
        refuse(path, f"not valid JSON: {name} is not a JSON number")

    try:
        return json.loads(text, object_pairs_hook=pairs, parse_constant=constant)
    except (ValueError, RecursionError) as e:
        if isinstance(e, CheckpointCorruptError):
            raise
        refuse(path, f"not valid JSON ({e})")


def canonical_checksum(manifest: dict[str, Any]) -> int:
    """CRC-32C of ``manifest`` without its ``checksum`` field, as sorted, compact JSON."""
    body = {k: v for k, v in manifest.items() if k != CHECKSUM}
    return crc32c(json.dumps(body, sort_keys=True, separators=(",", ":"), ensure_ascii=True).encode())


def check_checksum(m: dict[str, Any], path: object) -> None:
    want = m.get(CHECKSUM)
    if not isinstance(want, dict) or set(want) != {"crc32c"} or not _uint(want["crc32c"], 32):
        refuse(path, f"field {CHECKSUM!r} is {want!r}, not {{'crc32c': <32-bit int>}}")
    got = canonical_checksum(m)
    if got != want["crc32c"]:
        refuse(
            path,
            f"checksum mismatch (crc32c {got:#010x}, field {CHECKSUM!r} says {want['crc32c']:#010x}): "
            "the manifest was changed or damaged after it was saved",
        )


def _uint(v: Any, bits: int = 64) -> bool:
    return type(v) is int and 0 <= v < 1 << bits


def _field(obj: Any, key: str, kind: Any, path: object, where: str) -> Any:
    if not isinstance(obj, dict) or key not in obj:
        refuse(path, f"field {where}{key!r} is missing")
    v = obj[key]
    if kind == "uint":
        if not _uint(v, 63):
            refuse(path, f"field {where}{key!r} is {v!r}, not a non-negative integer")
    elif kind == "str":
        if not isinstance(v, str):
            refuse(path, f"field {where}{key!r} is {v!r}, not a string")
    elif not isinstance(v, kind) or isinstance(v, bool):
        refuse(path, f"field {where}{key!r} is {type(v).__name__}, not {kind.__name__}")
    return v


def _shape(v: Any, path: object, where: str) -> list[int]:
    if not isinstance(v, list) or not all(_uint(d, 63) for d in v):
        refuse(path, f"field {where} is {v!r}, not a list of non-negative integers")
    return v


def _numel(shape: list[int]) -> int:
    n = 1
    for d in shape:
        n *= d
    return n


def check_structure(m: Any, path: object, dtype_of: Any) -> None:
    """Every field a load or an export reads, checked (see the module doc)."""
    if not isinstance(m, dict):
        refuse(path, "not a JSON object")
    world = _field(m, "world_size", "uint", path, "")
    if world < 1:
        refuse(path, f"field 'world_size' is {world}, not a positive integer")
    for key in ("global_steps", "skipped_steps", "micro_steps", "total_parameters"):
        _field(m, key, "uint", path, "")
    _field(m, "tag", "str", path, "")
    params = _field(m, "params", list, path, "")
    names: set[str] = set()
    spelled: dict[str, set[str]] = {}  # param -> the state_dict keys it can be saved under
    total = 0
    for i, p in enumerate(params):
        where = f"params[{i}]."
        name = _field(p, "name", "str", path, where)
        if name in names:
            refuse(path, f"field {where}'name': param {name!r} is listed twice")
        names.add(name)
        aliases = _field(p, "aliases", list, path, where)
        if not all(isinstance(a, str) for a in aliases):
            refuse(path, f"field {where}'aliases' of {name!r} is {aliases!r}, not a list of strings")
        spelled[name] = {name, *aliases}
        shape = _shape(_field(p, "shape", list, path, where), path, f"{where}'shape' of {name!r}")
        dtype = _field(p, "dtype", "str", path, where)
        try:
            dtype_of(dtype)
        except CheckpointCorruptError:
            refuse(path, f"field {where}'dtype' of {name!r} is {dtype!r}, not a torch dtype")
        if not isinstance(p.get("requires_grad", False), bool):  # absent from older checkpoints
            refuse(path, f"field {where}'requires_grad' of {name!r} is {p['requires_grad']!r}, not a bool")
        part = _field(p, "partition", dict, path, where)
        kind = part.get("kind")
        ranks = _field(part, "ranks", "uint", path, f"{where}partition.")
        n = _field(part, "partition_numel", "uint", path, f"{where}partition.")
        numel = _numel(shape)
        total += numel
        want = (1, numel) if kind == "replicated" else (world, -(-numel // world)) if kind == "flat" else None
        if want is None or (ranks, n) != want:
            refuse(
                path,
                f"field {where}partition of {name!r} is {part!r}: a {numel}-element param saved by "
                f"{world} ranks has kind 'flat' (ranks {world}, partition_numel {-(-numel // world)}) or "
                f"'replicated' (ranks 1, partition_numel {numel})",
            )
    if m["total_parameters"] != total:
        refuse(path, f"field 'total_parameters' is {m['total_parameters']}, the params hold {total}")
    buffers = _field(m, "buffers", list, path, "")
    bnames: set[str] = set()
    for i, b in enumerate(buffers):
        where = f"buffers[{i}]."
        name = _field(b, "name", "str", path, where)
        if name in bnames:
            refuse(path, f"field {where}'name': buffer {name!r} is listed twice")
        bnames.add(name)
        _shape(_field(b, "shape", list, path, where), path, f"{where}'shape' of {name!r}")
        try:
            dtype_of(_field(b, "dtype", "str", path, where))
        except CheckpointCorruptError:
            refuse(path, f"field {where}'dtype' of {name!r} is {b['dtype']!r}, not a torch dtype")
    if not isinstance(m.get("adapters"), (str, type(None))):  # absent from older checkpoints
        refuse(path, f"field 'adapters' is {m['adapters']!r}, not a string or null")
    if not isinstance(m.get("reverts", True), bool):  # absent from older checkpoints
        refuse(path, f"field 'reverts' is {m['reverts']!r}, not a bool")
    weights = _field(m, "weights", list, path, "")
    keys: set[str] = set()
    for i, w in enumerate(weights):
        if (
            not isinstance(w, list)
            or len(w) != 3
            or not all(isinstance(x, str) for x in w)
            or w[1] not in ("param", "buffer")
            or w[2] not in (names if w[1] == "param" else bnames)
            or (w[1] == "param" and w[0] not in spelled[w[2]])  # a param's key is its name or an alias
            or w[0] in keys
        ):
            refuse(
                path,
                f"field 'weights'[{i}] is {w!r}, not a new [key, 'param'|'buffer', saved name] (a param's "
                "key being its name or one of its aliases)",
            )
        keys.add(w[0])
    _check_files(m, path, world)
    _check_optimizer(m.get("optimizer", ...), path, world, names)


def _check_files(m: dict[str, Any], path: object, world: int) -> None:
    files = _field(m, "files", list, path, "")
    seen: set[str] = set()
    for i, f in enumerate(files):
        where = f"files[{i}]."
        name = _field(f, "name", "str", path, where)
        match = _FILE.fullmatch(name)
        if name in seen or not (
            name in CONFIG_FILES
            or (
                match
                and int(match[1]) < world
                and int(match[2]) == world
                and (match[4] == "pt") == (match[3] == "state")
            )
        ):
            refuse(path, f"field {where}'name' is {name!r}, not a file of this checkpoint (or listed twice)")
        seen.add(name)
        size = _field(f, "bytes", "uint", path, where)
        if not _uint(f.get("crc32c"), 32):
            refuse(path, f"field {where}'crc32c' of {name!r} is {f.get('crc32c')!r}, not a 32-bit CRC")
        bb = _field(f, "block_bytes", "uint", path, where)
        if bb < 4096:
            refuse(path, f"field {where}'block_bytes' of {name!r} is {bb}, not a block size (>= 4096)")
        crcs = _field(f, "block_crc32c", list, path, where)
        if len(crcs) != -(-size // bb) or not all(_uint(c, 32) for c in crcs):
            refuse(
                path,
                f"field {where}'block_crc32c' of {name!r} holds {len(crcs)} values; {size} bytes in blocks "
                f"of {bb} need {-(-size // bb)} 32-bit CRCs",
            )
    for r in range(world):
        for kind, ext in (("params", "safetensors"), ("state", "pt")):
            need = f"rank{r:05d}-of-{world:05d}.{kind}.{ext}"
            if need not in seen:
                refuse(path, f"field 'files' does not list {need!r}")


def _check_optimizer(opt: Any, path: object, world: int, names: set[str]) -> None:
    if opt is ...:
        refuse(path, "field 'optimizer' is missing")
    if opt is None:
        return
    where = "optimizer."
    kind = _field(opt, "kind", "str", path, where)
    if kind not in ("zswap", "torch"):
        refuse(path, f"field optimizer.'kind' is {kind!r}, not 'zswap' or 'torch'")
    _field(opt, "type", "str", path, where)
    groups = _field(opt, "groups", list, path, where)
    for g in groups:
        if not isinstance(g, list) or not all(isinstance(n, str) and n in names for n in g):
            refuse(path, f"field optimizer.'groups' holds {g!r}, not a list of saved param names")
    if kind != "zswap":
        return
    layout = _field(opt, "layout", list, path, where)
    if len(layout) != world:
        refuse(path, f"field optimizer.'layout' has {len(layout)} ranks' layouts, the world size is {world}")
    grouped = {n for g in groups for n in g}
    for r, entries in enumerate(layout):
        if not isinstance(entries, list):
            refuse(path, f"field optimizer.'layout'[{r}] is {entries!r}, not a list")
        for e in entries:
            if (
                not isinstance(e, list)
                or len(e) != 3
                or not isinstance(e[0], str)
                or e[0] not in grouped
                or not _uint(e[1], 63)
                or e[1] < 1
                or not _uint(e[2], 63)
            ):
                refuse(
                    path, f"field optimizer.'layout'[{r}] holds {e!r}, not [param name, steps >= 1, numel]"
                )
