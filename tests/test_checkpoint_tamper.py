"""Tamper-evident checkpoints: any change to a manifest or file is a `CheckpointCorruptError` naming the file
and the field, from ``load_checkpoint`` (which then changed nothing) and ``zswap export`` (which then wrote
nothing) alike; no malformed value escapes as a raw built-in error, and no special file hangs a load."""

from __future__ import annotations

import json
import os
import pickle
import re
import signal
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest
import torch

from zswap.checkpoint import CheckpointArgumentError, CheckpointCorruptError, export
from zswap.checkpoint._validate import CHECKSUM, canonical_checksum
from zswap.checkpoint.save import _file_info

from .test_checkpoint import _fails_cleanly, build, cfg, train

TAG = "global_step2"
STATE = "rank00000-of-00001.state.pt"
PARAMS = "rank00000-of-00001.params.safetensors"


@pytest.fixture(scope="module")
def good(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, dict[str, Any]]:
    tmp = tmp_path_factory.mktemp("tamper")
    config = cfg(tmp)
    m, engine = build(config)
    with engine:
        train(m, engine)
        engine.save_checkpoint(tmp / "ckpt", client_state={"epoch": 3})
    return tmp / "ckpt", config


@pytest.fixture
def ckpt(good: tuple[Path, dict[str, Any]], tmp_path: Path) -> Iterator[tuple[Path, dict[str, Any]]]:
    """A fresh copy of the good checkpoint, to damage."""
    src, config = good
    dst = tmp_path / "ckpt"
    (dst / TAG).mkdir(parents=True)
    for f in (src / TAG).iterdir():
        (dst / TAG / f.name).write_bytes(f.read_bytes())
    (dst / "latest").write_text(TAG + "\n")
    yield dst, config


def manifest(ckpt: Path) -> dict[str, Any]:
    return json.loads((ckpt / TAG / "manifest.json").read_text())


def rewrite(ckpt: Path, change: Callable[[dict[str, Any]], None], reseal: bool) -> None:
    """Apply ``change`` to the manifest; with ``reseal`` its checksum is recomputed (an edit that knows the
    scheme reaches the field checks)."""
    m = manifest(ckpt)
    change(m)
    if reseal:
        m[CHECKSUM] = {"crc32c": canonical_checksum(m)}
    (ckpt / TAG / "manifest.json").write_text(json.dumps(m))


def refused_by_both(ckpt: Path, config: dict[str, Any], match: str, tmp_path: Path) -> None:
    _fails_cleanly(config, lambda e: e.load_checkpoint(ckpt), CheckpointCorruptError, match)
    out = tmp_path / "out"
    with pytest.raises(CheckpointCorruptError, match=match):
        export(ckpt, out)
    assert not out.exists(), "export wrote output for a checkpoint load refuses"


def _set(path: str, value: Any) -> Callable[[dict[str, Any]], None]:
    def change(m: dict[str, Any]) -> None:
        *keys, last = path.split("/")
        obj: Any = m
        for k in keys:
            obj = obj[int(k)] if isinstance(obj, list) else obj[k]
        obj[int(last) if isinstance(obj, list) else last] = value

    return change


EDITS = [
    ("params/0/partition/partition_numel", 383),
    ("params/0/shape", [32, 13]),
    ("global_steps", 7),
    ("files/0/block_bytes", 0),
    ("weights/0/0", "other.weight"),
    ("total_parameters", 1),
]


@pytest.mark.parametrize(("field", "value"), EDITS)
def test_any_edit_breaks_the_manifest_checksum(ckpt, tmp_path, field, value):
    root, config = ckpt
    rewrite(root, _set(field, value), reseal=False)
    refused_by_both(root, config, r"manifest\.json: checksum mismatch", tmp_path)


@pytest.mark.parametrize(
    ("field", "value", "match"),
    [
        ("params/0/partition/partition_numel", 383, r"params\[0\]\.partition of 'net\.0\.weight'"),
        ("params/0/partition/ranks", 2, r"params\[0\]\.partition of 'net\.0\.weight'"),
        ("params/0/shape", [32, "12"], r"params\[0\]\.'shape' of 'net\.0\.weight'"),
        ("params/0/shape", [32, True], r"params\[0\]\.'shape'"),
        ("params/0/dtype", "float99", r"params\[0\]\.'dtype' of 'net\.0\.weight' is 'float99'"),
        ("params/0", None, r"params\[0\]\.'name' is missing"),
        ("params", {}, r"field 'params' is dict, not list"),
        ("global_steps", "2", r"field 'global_steps' is '2', not a non-negative integer"),
        ("skipped_steps", -1, r"field 'skipped_steps' is -1"),
        ("world_size", 0, r"field 'world_size' is 0"),
        ("files/0/block_bytes", 0, r"files\[0\]\.'block_bytes' of .* is 0"),
        ("files/0/block_crc32c", [], r"'block_crc32c' of .* holds 0 values"),
        ("files/0/name", "../../etc/passwd", r"files\[0\]\.'name' is '\.\./\.\./etc/passwd'"),
        ("files/0/bytes", 2**80, r"files\[0\]\.'bytes' is"),
        ("weights/0/2", "nope", r"field 'weights'\[0\]"),
        ("optimizer/layout", [], r"optimizer\.'layout' has 0 ranks' layouts"),
        ("optimizer/layout/0/0/1", 0, r"optimizer\.'layout'\[0\] holds"),
        ("total_parameters", 1, r"field 'total_parameters' is 1"),
        ("format_version", 1, r"'format_version' is 1; this zswap reads 2 \(written before checkpoints"),
    ],
)
def test_malformed_fields_are_named(ckpt, tmp_path, field, value, match):
    root, config = ckpt
    rewrite(root, _set(field, value), reseal=True)
    refused_by_both(root, config, match, tmp_path)


@pytest.mark.parametrize(
    ("text", "match"),
    [
        (b"\xff\xfe{}", "not valid UTF-8"),
        (b"[" * 10_000 + b"]" * 10_000, "not valid JSON: nested 10000 levels deep"),
        (b'{"format": "zswap-checkpoint", "format": "x"}', "not valid JSON: key 'format' given twice"),
        (b'{"format": NaN}', "not valid JSON: NaN is not a JSON number"),
        (b"[]", "not a zswap checkpoint manifest"),
    ],
)
def test_unparseable_manifests(ckpt, tmp_path, text, match):
    root, config = ckpt
    (root / TAG / "manifest.json").write_bytes(text)
    refused_by_both(root, config, rf"manifest\.json: {match}", tmp_path)


def _reseal_file(root: Path, name: str) -> None:
    info = _file_info(root / TAG / name).to_json()

    def change(m: dict[str, Any]) -> None:
        m["files"] = [info if f["name"] == name else f for f in m["files"]]

    rewrite(root, change, reseal=True)


class _RunsCode:
    def __reduce__(self) -> tuple[Any, ...]:
        return (os.system, ("echo pwned",))


def test_state_pt_is_loaded_weights_only_and_its_refusal_named(ckpt, tmp_path):
    root, config = ckpt
    state = root / TAG / STATE
    state.write_bytes(pickle.dumps({"rng": _RunsCode()}))
    _reseal_file(root, STATE)  # checksums that match: only the restricted unpickler stands in the way
    refused_by_both(root, config, r"state\.pt: refused by torch\.load\(weights_only=True\)", tmp_path)


def test_a_state_pt_that_is_not_a_state_is_refused_by_both(ckpt, tmp_path):
    root, config = ckpt
    torch.save([1, 2, 3], root / TAG / STATE)
    _reseal_file(root, STATE)
    refused_by_both(root, config, r"state\.pt: holds a list, not a dict", tmp_path)


def test_a_bad_rng_state_is_refused_before_anything_is_written(ckpt):
    root, config = ckpt
    state = root / TAG / STATE
    s = torch.load(state, weights_only=True)
    s["rng"]["python"] = (3, (1, 2), None)
    torch.save(s, state)
    _reseal_file(root, STATE)
    _fails_cleanly(config, lambda e: e.load_checkpoint(root), CheckpointCorruptError, r"field 'rng'")


def test_a_fifo_in_place_of_a_file_does_not_hang(ckpt, tmp_path):
    root, config = ckpt
    params = root / TAG / PARAMS
    params.unlink()
    os.mkfifo(params)  # opening it for reading would block until a writer came
    old = signal.signal(signal.SIGALRM, lambda *_: pytest.fail("the load hung on a FIFO"))
    signal.alarm(60)
    try:
        refused_by_both(root, config, r"params\.safetensors: is a FIFO", tmp_path)
    finally:
        signal.alarm(0)
        signal.signal(signal.SIGALRM, old)


def test_a_folder_in_place_of_state_pt(ckpt):
    root, config = ckpt
    state = root / TAG / STATE
    state.unlink()
    state.mkdir()
    _fails_cleanly(
        config, lambda e: e.load_checkpoint(root), CheckpointCorruptError, r"state\.pt: is a directory"
    )


def test_latest_naming_no_tag_is_corrupt(ckpt):
    root, config = ckpt
    (root / "latest").write_bytes(b"../../etc\n")
    _fails_cleanly(config, lambda e: e.load_checkpoint(root), CheckpointCorruptError, "latest: does not name")
    (root / "latest").write_bytes(b"\xff\xfe")
    _fails_cleanly(config, lambda e: e.load_checkpoint(root), CheckpointCorruptError, "latest: does not name")


def test_export_refuses_an_output_inside_the_checkpoint_before_writing(ckpt):
    root, _ = ckpt
    before = sorted(p.name for p in (root / TAG).iterdir())
    tags = sorted(p.name for p in root.iterdir())
    for out in (root / TAG, root / TAG / "hf", root, root / "hf"):  # the tag folder, and save_dir too
        with pytest.raises(CheckpointArgumentError, match="inside the checkpoint folder"):
            export(root, out)
    assert sorted(p.name for p in (root / TAG).iterdir()) == before
    assert sorted(p.name for p in root.iterdir()) == tags  # no new "tag" beside the real ones


def test_export_of_the_good_checkpoint_still_works(ckpt, tmp_path):
    root, _ = ckpt
    out = export(root, tmp_path / "hf")
    assert (out / "model.safetensors").is_file()


class Opaque:
    """Any object of a class: load_checkpoint unpickles with weights_only=True and cannot build it."""


def test_a_client_state_load_would_refuse_is_refused_at_save_and_nothing_is_written(tmp_path):
    m, engine = build(cfg(tmp_path, "nvme", "nvme"))
    with engine:
        train(m, engine, 1)
        # The message names the entry and its type (torch's own says only which types it takes).
        with pytest.raises(CheckpointArgumentError, match=r"client_state .* cannot read back") as info:
            engine.save_checkpoint(tmp_path / "ckpt", client_state={"epoch": 3, "obj": [1, Opaque()]})
        assert f"(['client_state']['obj'][1] is a {__name__}.Opaque)" in str(info.value)
        with pytest.raises(CheckpointArgumentError, match=r"client_state .* cannot read back") as info:
            engine.save_checkpoint(tmp_path / "ckpt", client_state={"fn": lambda: 0})  # not even picklable
        assert "(['client_state']['fn'] is a builtins.function)" in str(info.value)
        assert [p.name for p in (tmp_path / "ckpt").iterdir()] == []  # no tag, no latest, no temp folder
        engine.save_checkpoint(tmp_path / "ckpt", client_state={"epoch": 3, "name": "run"})  # plain: fine


@pytest.mark.parametrize("shape", ["longer", "2-d"])
def test_a_partition_entry_of_another_shape_is_refused_even_resealed(ckpt, tmp_path, shape):
    """A params-file entry must be exactly its flat partition: one holding more (trailing bytes that would
    go unread) or stored 2-D was accepted wherever the elements read fit in it."""
    from safetensors.torch import load_file, save_file

    root, config = ckpt
    tensors = load_file(root / TAG / PARAMS)
    name = max(tensors, key=lambda k: tensors[k].numel())
    t = tensors[name]
    tensors[name] = torch.cat([t, t]) if shape == "longer" else t.reshape(2, -1)
    (root / TAG / PARAMS).unlink()
    save_file(tensors, root / TAG / PARAMS)
    _reseal_file(root, PARAMS)
    want = [2 * t.numel()] if shape == "longer" else [2, t.numel() // 2]
    match = rf"entry '{name}' is not the torch.float32 tensor of shape \[{t.numel()}\] it should be "
    refused_by_both(root, config, match + rf"\(it is torch.float32 {re.escape(str(want))}\)", tmp_path)


def test_export_in_a_dtype_checks_the_checkpoints_config_before_writing(ckpt, tmp_path):
    """The dtype goes into the checkpoint's ``config.json`` as it is staged: one that is no JSON object is
    refused before any weights land (a raw TypeError came after the commit). A config.json already in the
    output folder, which the checkpoint does not hold, is not rewritten."""
    root, _ = ckpt
    (root / TAG / "config.json").write_text("[]")
    info = _file_info(root / TAG / "config.json").to_json()
    rewrite(root, lambda m: m["files"].append(info), reseal=True)
    out = tmp_path / "out"
    with pytest.raises(CheckpointCorruptError, match=r"config\.json: holds a JSON list, not an object"):
        export(root, out, dtype=torch.bfloat16)
    assert not out.exists() or list(out.iterdir()) == []
    (root / TAG / "config.json").unlink()
    rewrite(root, lambda m: m.update(files=[f for f in m["files"] if f["name"] != "config.json"]), True)
    out.mkdir(exist_ok=True)
    (out / "config.json").write_text("not json, not ours")
    export(root, out, dtype=torch.bfloat16)
    assert (out / "config.json").read_text() == "not json, not ours"
