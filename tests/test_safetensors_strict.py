"""The one safetensors reader refuses what the ``safetensors`` package refuses, before reading any data.

A hypothesis property over byte-level and JSON-level mutations of valid files compares zswap's verdict
(`zswap._stfile.read_header` + `read_range`, what ``load_weights`` and ``from_pretrained`` under ``Init``
use; `zswap.checkpoint._safetensors.TensorFile`, what checkpoints and ``zswap export`` use) with
``safetensors.torch.load_file``'s. zswap is stricter in three ways, on purpose, and the property allows
only those: a name given twice, a tensor entry written as a JSON array, a dtype torch has no tensor for.
"""

from __future__ import annotations

import json
import os
import struct
from pathlib import Path
from typing import Any

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from safetensors.torch import load_file

import zswap
from zswap import _stfile
from zswap._stheader import DTYPES, MAX_DEPTH, MAX_HEADER_BYTES
from zswap.checkpoint._safetensors import TensorFile
from zswap.checkpoint.errors import CheckpointCorruptError, CheckpointError, SafetensorsError

CODES = {"F32": 4, "F16": 2, "BF16": 2, "I64": 8, "U8": 1, "BOOL": 1, "F64": 8, "I32": 4}


class Raw:
    """JSON text put verbatim into a header (``NaN``, ``-0``, ``1e3``, deep nesting)."""

    def __init__(self, text: str) -> None:
        self.text = text


def dumps(v: Any) -> str:
    """JSON text of ``v``, where a list of pairs tagged ``("__pairs__", [...])`` is an object that may repeat
    a key, and `Raw` is copied as is."""
    if isinstance(v, Raw):
        return v.text
    if isinstance(v, tuple) and len(v) == 2 and v[0] == "__pairs__":
        return "{" + ",".join(f"{json.dumps(k)}:{dumps(x)}" for k, x in v[1]) + "}"
    if isinstance(v, list):
        return "[" + ",".join(dumps(x) for x in v) + "]"
    return json.dumps(v)


def obj(pairs: list[tuple[str, Any]]) -> tuple[str, list[tuple[str, Any]]]:
    return ("__pairs__", pairs)


def build(tensors: list[tuple[str, str, list[int]]], meta: dict[str, str] | None) -> tuple[list, bytes]:
    """(header pairs, data) of a valid file holding ``tensors`` (name, dtype code, shape), in order."""
    pairs: list[tuple[str, Any]] = []
    if meta is not None:
        pairs.append(("__metadata__", obj(list(meta.items()))))
    data = bytearray()
    for i, (name, code, shape) in enumerate(tensors):
        n = CODES[code]
        for d in shape:
            n *= d
        begin = len(data)
        data += bytes((i * 37 + j) % 256 for j in range(n))
        info = [("dtype", code), ("shape", list(shape)), ("data_offsets", [begin, len(data)])]
        pairs.append((name, obj(info)))
    return pairs, bytes(data)


def file_bytes(pairs: list, data: bytes, pad: int = 0) -> bytes:
    text = (dumps(obj(pairs)) + " " * pad).encode()
    return struct.pack("<Q", len(text)) + text + data


names = st.sampled_from(["a", "b", "w.weight", "é", "__x", ""])
shapes = st.lists(st.integers(0, 4), max_size=3)
tensors_st = st.lists(
    st.tuples(names, st.sampled_from(sorted(CODES)), shapes), max_size=4, unique_by=lambda t: t[0]
)
metas = st.one_of(st.none(), st.dictionaries(st.sampled_from(["format", "k"]), st.sampled_from(["pt", ""])))
odd_values = st.sampled_from(
    [
        1.0, 2.5, True, False, None, "2", "F32", -1, Raw("-0"), Raw("1e1"), Raw("NaN"), Raw("Infinity"),
        2**63, 2**64, 2**64 - 1, 2**70, [], [0], [0, 1, 2], {}, Raw("[" * 130 + "]" * 130),
        Raw("[" * 120 + "]" * 120), "\ud800", "C64", "F4", "f32",
    ]
)  # fmt: skip


@st.composite
def json_mutation(draw: st.DrawFn, pairs: list, data: bytes) -> tuple[list, bytes]:
    """A change at the JSON level: a field, an offset, an entry, the metadata, duplicates, extra data."""
    pairs = [(k, v) for k, v in pairs]
    kind = draw(
        st.sampled_from(["field", "offset", "shift", "dim", "drop", "dup", "extra", "meta", "entry", "data"])
    )
    tensor_at = [
        i
        for i, (k, v) in enumerate(pairs)
        if k != "__metadata__" and isinstance(v, tuple) and v[0] == "__pairs__"
    ]
    if kind == "data":
        cut = draw(st.integers(-3, 3))
        return pairs, (data[:cut] if cut < 0 else data + b"\0" * cut)
    if kind == "meta":
        value = draw(st.one_of(odd_values, st.just(obj([("a", "b"), ("a", "c")]))))
        return [*pairs, ("__metadata__", value)] if draw(st.booleans()) else [
            ("__metadata__", value),
            *pairs,
        ], data
    if not tensor_at:
        return [*pairs, (draw(names), draw(odd_values))], data
    i = draw(st.sampled_from(tensor_at))
    name, (_, info) = pairs[i]
    info = [(k, v) for k, v in info]
    fields = dict(info)
    offsets, shape = fields.get("data_offsets"), fields.get("shape")
    if kind in ("offset", "shift") and isinstance(offsets, list) and len(offsets) == 2:
        offsets = list(offsets)
        delta = draw(st.integers(-9, 9))
        for at in (0, 1) if kind == "shift" else (draw(st.integers(0, 1)),):  # shift: a gap or an overlap
            offsets[at] = offsets[at] + delta if type(offsets[at]) is int else delta
        info = [(k, offsets if k == "data_offsets" else v) for k, v in info]
    elif kind == "dim" and isinstance(shape, list):
        shape = list(shape) or [1]
        shape[draw(st.integers(0, len(shape) - 1))] = draw(st.one_of(st.integers(0, 9), odd_values))
        info = [(k, shape if k == "shape" else v) for k, v in info]
    elif kind in ("field", "offset", "shift", "dim") and info:
        j = draw(st.integers(0, len(info) - 1))
        info[j] = (info[j][0], draw(odd_values))
    elif kind == "drop" and info:
        del info[draw(st.integers(0, len(info) - 1))]
    elif kind == "extra":
        info.append((draw(st.sampled_from(["z", "dtype"])), draw(odd_values)))
    elif kind == "dup":
        pairs.insert(draw(st.integers(0, len(pairs))), (name, obj(info)))
        return pairs, data
    elif kind == "entry":
        pairs[i] = (name, draw(odd_values))
        return pairs, data
    pairs[i] = (name, obj(info))
    return pairs, data


@st.composite
def mutated(draw: st.DrawFn) -> bytes:
    pairs, data = build(draw(tensors_st), draw(metas))
    if draw(st.booleans()):
        pairs, data = draw(json_mutation(pairs, data))
        if draw(st.booleans()):
            pairs, data = draw(json_mutation(pairs, data))
    raw = bytearray(file_bytes(pairs, data, pad=draw(st.integers(0, 3))))
    for _ in range(draw(st.integers(0, 2))):  # byte-level changes, the length prefix included
        op = draw(st.sampled_from(["set", "insert", "delete", "length"]))
        if not raw:
            break
        at = draw(st.integers(0, len(raw) - 1))
        if op == "set":
            raw[at] = draw(st.integers(0, 255))
        elif op == "insert":
            raw.insert(at, draw(st.integers(0, 255)))
        elif op == "delete":
            del raw[at]
        else:
            (n,) = struct.unpack("<Q", raw[:8]) if len(raw) >= 8 else (0,)
            raw[:8] = struct.pack("<Q", max(0, n + draw(st.integers(-2, 2))))
    return bytes(raw)


def has_duplicates(raw: bytes) -> bool:
    """Whether the header is JSON with a repeated key in some object (safetensors keeps the last)."""
    found = False

    def pairs(p: list[tuple[str, Any]]) -> dict[str, Any]:
        nonlocal found
        found |= len({k for k, _ in p}) != len(p)
        return dict(p)

    try:
        (n,) = struct.unpack("<Q", raw[:8])
        json.loads(raw[8 : 8 + n].decode(), object_pairs_hook=pairs)
    except Exception:
        return False
    return found


def stricter_on_purpose(raw: bytes) -> bool:
    (n,) = struct.unpack("<Q", raw[:8])
    header = json.loads(raw[8 : 8 + n].decode())
    entries = [v for k, v in header.items() if k != "__metadata__"]
    return has_duplicates(raw) or any(
        isinstance(v, list) or (isinstance(v, dict) and v.get("dtype") not in DTYPES) for v in entries
    )


def zswap_reads(path: Path) -> dict[str, torch.Tensor]:
    """Every tensor of ``path`` through both of zswap's ranged readers (they must agree)."""
    out = {}
    for name, e in _stfile.read_header(str(path)).items():
        t = torch.empty(e.numel, dtype=e.dtype)
        _stfile.read_range(e, 0, t)
        out[name] = t.view(e.shape)
    with TensorFile(path) as f:
        for name, t in out.items():
            again = torch.empty(t.numel(), dtype=t.dtype)
            f.read_elements(name, 0, again)
            assert torch.equal(again.view(torch.uint8), t.reshape(-1).view(torch.uint8)), name
    return out


def safetensors_reads(path: Path) -> dict[str, torch.Tensor] | Exception:
    try:
        return load_file(path)
    except Exception as e:  # SafetensorError, or torch refusing what the header describes
        return e


@settings(max_examples=400, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(raw=mutated())
def test_zswap_refuses_exactly_what_safetensors_refuses(raw, tmp_path):
    path = tmp_path / "m.safetensors"
    path.write_bytes(raw)
    theirs = safetensors_reads(path)
    try:
        ours: dict[str, torch.Tensor] | Exception = zswap_reads(path)
    except CheckpointError as e:
        assert isinstance(e, SafetensorsError | CheckpointCorruptError), e
        assert str(path) in str(e)
        ours = e
    if isinstance(theirs, Exception):
        assert isinstance(ours, Exception), f"zswap loads what safetensors refuses ({theirs})"
    elif isinstance(ours, Exception):
        assert stricter_on_purpose(raw), f"zswap refuses what safetensors loads: {ours}"
    else:
        assert ours.keys() == theirs.keys()
        for k, t in theirs.items():
            assert ours[k].shape == t.shape and ours[k].dtype == t.dtype, k
            assert torch.equal(ours[k].reshape(-1).view(torch.uint8), t.reshape(-1).view(torch.uint8)), k


# -- hand-made cases from the issue, each a SafetensorsError naming the file and the tensor or field -------

F32_2 = [("dtype", "F32"), ("shape", [2]), ("data_offsets", [0, 8])]


def _write(tmp_path: Path, raw: bytes) -> Path:
    path = tmp_path / "x.safetensors"
    path.write_bytes(raw)
    return path


def _refused(path: Path, match: str) -> None:
    with pytest.raises(SafetensorsError, match=match) as info:
        _stfile.read_header(str(path))
    assert str(path) in str(info.value)
    assert isinstance(info.value, zswap.ZswapError) and isinstance(info.value, ValueError)
    with pytest.raises(SafetensorsError, match=match):
        TensorFile(path)
    assert not isinstance(safetensors_reads(path), dict) or "twice" in match


def _header(pairs: list, data: bytes = b"\0" * 8, fix: int = 0) -> bytes:
    text = dumps(obj(pairs)).encode()
    return struct.pack("<Q", len(text) + fix) + text + data


@pytest.mark.parametrize(
    ("raw", "match"),
    [
        (_header([("a", obj(F32_2))], fix=-1), "not valid JSON"),  # length short by one byte
        (_header([("a", obj(F32_2))], b"\0" * 9), "1 trailing bytes after the last tensor's data"),
        (_header([("a", obj([*F32_2[:2], ("data_offsets", ["0", "8"])]))]), r"'a': data_offsets\[0\] is '0'"),
        (
            _header([("a", obj([*F32_2[:2], ("data_offsets", [0.0, 8.0])]))]),
            r"'a': data_offsets\[0\] is 0\.0",
        ),
        (
            _header(
                [
                    ("a", obj([("dtype", "F32"), ("shape", [1]), ("data_offsets", [0, 4])])),
                    ("b", obj([("dtype", "F32"), ("shape", [1]), ("data_offsets", [8, 12])])),
                ],
                b"\0" * 12,
            ),
            "'b' has data_offsets \\[8, 12\\] that leave a gap",
        ),
        (
            _header(
                [
                    ("a", obj([("dtype", "F32"), ("shape", [2]), ("data_offsets", [0, 8])])),
                    ("b", obj([("dtype", "F32"), ("shape", [1]), ("data_offsets", [4, 8])])),
                ]
            ),
            "that overlap the tensor before it",
        ),
        (_header([("a", obj(F32_2)), ("a", obj(F32_2))]), "names 'a' twice"),
        (
            _header([("a", obj([*F32_2[:1], ("shape", [Raw("Infinity")]), F32_2[2]]))]),
            "Infinity is not a JSON",
        ),
        # In a field safetensors ignores too, serde_json refuses a number past f64 and a lone surrogate
        # anywhere; Python's json read them as inf and as a str.
        (_header([("a", obj([*F32_2, ("x", Raw("1e999"))]))]), "number out of range: 1e999"),
        (_header([("a", obj([*F32_2, ("x", Raw("[-1e400]"))]))]), "number out of range: -1e400"),
        (_header([("a", obj([*F32_2, ("x", Raw('[["\\udc00"]]'))]))]), "lone surrogate escape"),
        (_header([("a", obj([("dtype", "U8"), ("shape", [2**63]), F32_2[2]]))]), "do not match its size"),
        (_header([("a", obj([*F32_2[:1], ("shape", [2**62, 8]), F32_2[2]]))]), "overflows 64 bits"),
        (_header([("a", obj([*F32_2[:1], ("shape", [True, 2]), F32_2[2]]))]), r"'a': shape\[0\] is True"),
        (_header([("a", obj(F32_2)), ("z", Raw("[" * 5000 + "]" * 5000))]), f"at most {MAX_DEPTH}"),
        (_header([("__metadata__", obj([("k", 1)])), ("a", obj(F32_2))]), r"__metadata__\['k'\] is int"),
        (_header([("a", obj([("dtype", "Q8"), *F32_2[1:]]))]), "'a': dtype 'Q8' is not one of"),
        (_header([("a", obj(F32_2[1:]))]), "'a': entry has no 'dtype'"),
        (b"\xff" * 8 + b"{}", f"over the {MAX_HEADER_BYTES}-byte limit"),
        (struct.pack("<Q", 4) + b"{\xff}\x00", "not valid UTF-8"),
        (struct.pack("<Q", 2) + b"[]", "not a JSON object"),
        (b"\x01\x00", "no header"),
    ],
)
def test_hand_made_cases(tmp_path, raw, match):
    _refused(_write(tmp_path, raw), match)


def test_deep_nesting_and_huge_numbers_never_escape_raw(tmp_path):
    for raw in (
        _header([("a", obj(F32_2)), ("z", Raw("[" * 100_000 + "]" * 100_000))]),
        _header([("a", obj([*F32_2[:1], ("shape", [Raw("9" * 5000)]), F32_2[2]]))]),
        _header([("a", obj([*F32_2[:1], ("shape", [Raw("1e999")]), F32_2[2]]))]),
    ):
        with pytest.raises(SafetensorsError):
            _stfile.read_header(str(_write(tmp_path, raw)))


def test_only_regular_files_are_opened(tmp_path):
    fifo = tmp_path / "p.safetensors"
    os.mkfifo(fifo)  # an open for reading would block until a writer came
    with pytest.raises(SafetensorsError, match="is a FIFO, not a regular file; only regular files are read"):
        _stfile.read_header(str(fifo))
    with pytest.raises(SafetensorsError, match="is a FIFO, not a regular file"):
        TensorFile(fifo)
    folder = tmp_path / "d.safetensors"
    folder.mkdir()
    with pytest.raises(SafetensorsError, match="directory"):
        _stfile.merge([str(folder)])


def test_a_file_changed_after_its_header_was_read_is_refused(tmp_path):
    path = _write(tmp_path, _header([("a", obj(F32_2))]))
    (e,) = _stfile.read_header(str(path)).values()
    path.write_bytes(_header([("a", obj(F32_2))], b"\1" * 8) + b"")
    os.utime(path, ns=(1, 1))
    with pytest.raises(CheckpointCorruptError, match="replaced or changed after its header was read"):
        _stfile.read_range(e, 0, torch.empty(2))


@pytest.mark.parametrize("shard", ["../outside.safetensors", "/etc/passwd", "sub/../../x.safetensors"])
def test_index_shard_paths_stay_in_the_index_folder(tmp_path, shard):
    index = tmp_path / "model.safetensors.index.json"
    index.write_text(json.dumps({"weight_map": {"a": shard}}))
    with pytest.raises(CheckpointCorruptError, match="not a file in the index's folder"):
        _stfile.resolve(index)


def test_load_weights_refuses_before_writing(tmp_path):
    m = torch.nn.Linear(2, 1, bias=False)
    before = m.weight.detach().clone()
    path = _write(
        tmp_path,
        _header(
            [("weight", obj([("dtype", "F32"), ("shape", [1, 2]), ("data_offsets", [0, 8])]))], b"\0" * 9
        ),
    )
    with pytest.raises(SafetensorsError, match="trailing bytes"):
        zswap.load_weights(m, path)
    assert torch.equal(m.weight.detach(), before)
