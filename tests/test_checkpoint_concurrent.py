"""Saves that do not collide: two processes saving different tags into one folder both succeed, a save removes
only its own temp folder (and those of provably dead savers), ``latest`` is always a whole tag; a full disk
or a name too long is zswap's error naming the path, and a weights save never leaves a partial file under
its final name."""

from __future__ import annotations

import errno
import os
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
import torch

import zswap
from zswap.checkpoint import CheckpointArgumentError, _atomic
from zswap.checkpoint.manifest import read_latest

from .test_checkpoint import build, cfg, train

ROOT = Path(__file__).resolve().parents[1]

SAVER = textwrap.dedent(
    """
    import sys, time
    sys.path.insert(0, {root!r})
    from pathlib import Path
    from tests.test_checkpoint import build, cfg, train
    tmp, name, n = Path(sys.argv[1]), sys.argv[2], int(sys.argv[3])
    config = cfg(tmp / name)
    m, engine = build(config, seed=len(name))
    with engine:
        train(m, engine, 1)
        (tmp / f"ready-{{name}}").touch()  # start together, so that the saves overlap
        while len(list(tmp.glob("ready-*"))) < 2:
            time.sleep(0.01)
        for i in range(n):
            engine.save_checkpoint(tmp / "shared", tag=f"{{name}}-{{i}}")
    """
)


def test_two_processes_save_different_tags_into_one_folder(tmp_path):
    script = tmp_path / "saver.py"
    script.write_text(SAVER.format(root=str(ROOT)))
    for name in ("a", "b"):
        (tmp_path / name).mkdir()
    env = {
        **os.environ,
        "PYTHONPATH": os.pathsep.join([str(ROOT / "python"), os.environ.get("PYTHONPATH", "")]),
    }
    n = 20
    procs = [
        subprocess.Popen(
            [sys.executable, str(script), str(tmp_path), name, str(n)],
            env=env,
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
        )
        for name in ("a", "b")
    ]
    outs = [p.communicate(timeout=600)[0].decode() for p in procs]
    for p, out in zip(procs, outs, strict=True):
        assert p.returncode == 0, out
    shared = tmp_path / "shared"
    tags = sorted(e.name for e in shared.iterdir() if e.is_dir() and not e.name.startswith("."))
    assert tags == sorted(f"{x}-{i}" for x in "ab" for i in range(n))
    assert not [e.name for e in shared.iterdir() if e.name.startswith(".")], "temp names left behind"
    assert read_latest(shared) in {f"a-{n - 1}", f"b-{n - 1}"}
    (tmp_path / "load").mkdir()
    config = cfg(tmp_path / "load")
    for tag in (f"a-{n - 1}", f"b-{n - 1}"):
        _, engine = build(config)
        with engine:
            engine.load_checkpoint(shared, tag=tag)


def test_only_dead_savers_temp_folders_are_removed(tmp_path, monkeypatch):
    dead = subprocess.run(
        [sys.executable, "-c", "import os; print(os.getpid())"], capture_output=True, text=True
    )
    dead_pid = int(dead.stdout)
    suffix = _atomic.owner_suffix()
    _, _, boot, host = suffix.split(".")
    names = {
        "mine": _atomic.temp_name("x"),  # this process: alive
        "dead": f".tmp-y-0123456789ab.{dead_pid}.{boot}.{host}",
        "old_boot": f".tmp-z-0123456789ab.{os.getpid()}.00000000.{host}",
        "other_host": f".tmp-w-0123456789ab.{dead_pid}.{boot}.00000000",
        "legacy": ".tmp-v-0123456789ab",
    }
    for n in names.values():
        (tmp_path / n).mkdir()
    _atomic.remove_stale(tmp_path)
    left = {e.name for e in tmp_path.iterdir()}
    assert names["mine"] in left and names["other_host"] in left and names["legacy"] in left
    assert names["dead"] not in left and names["old_boot"] not in left


def test_latest_is_replaced_by_a_rename(tmp_path, monkeypatch):
    (tmp_path / "latest").write_text("old\n")
    seen = []
    real = os.replace

    def replace(a, b):  # a reader looking at the moment of the swap sees the old or the new, whole
        seen.append((tmp_path / "latest").read_text())
        real(a, b)
        seen.append((tmp_path / "latest").read_text())

    monkeypatch.setattr(os, "replace", replace)
    _atomic.write_latest(tmp_path, "new")
    assert seen == ["old\n", "new\n"]
    assert sorted(e.name for e in tmp_path.iterdir()) == ["latest"]


def test_a_tag_too_long_is_an_argument_error(tmp_path):
    config = cfg(tmp_path)
    _, engine = build(config)
    with engine, pytest.raises(CheckpointArgumentError, match="checkpoint tag of 300 bytes"):
        engine.save_checkpoint(tmp_path / "c", tag="t" * 300)


def test_a_full_disk_during_a_save_is_a_swap_io_error_naming_the_file(tmp_path, monkeypatch):
    config = cfg(tmp_path)
    m, engine = build(config)
    with engine:
        train(m, engine, 1)
        engine.save_checkpoint(tmp_path / "c", tag="good")
        real = os.pwrite

        def full(fd, data, offset):
            raise OSError(errno.ENOSPC, "No space left on device")

        monkeypatch.setattr(os, "pwrite", full)
        with pytest.raises(zswap.SwapIOError, match=r"params\.safetensors: No space left on device") as info:
            engine.save_checkpoint(tmp_path / "c", tag="next")
        monkeypatch.setattr(os, "pwrite", real)
        assert info.value.errno == errno.ENOSPC and "params.safetensors" in str(info.value.filename)
    assert read_latest(tmp_path / "c") == "good"
    assert sorted(e.name for e in (tmp_path / "c").iterdir()) == ["good", "latest"]


def test_save_weights_replaces_files_only_when_complete(tmp_path, monkeypatch):
    out = tmp_path / "w"
    model = torch.nn.Linear(4, 3)
    zswap.save_weights(model, out)
    before = (out / "model.safetensors").read_bytes()
    with torch.no_grad():
        model.weight.add_(1)

    def full(fd, data, offset):
        raise OSError(errno.ENOSPC, "No space left on device")

    monkeypatch.setattr(os, "pwrite", full)
    with pytest.raises(OSError, match="No space left on device"):
        zswap.save_weights(model, out)
    monkeypatch.undo()
    assert (out / "model.safetensors").read_bytes() == before, "the previous weights were damaged"
    assert sorted(e.name for e in out.iterdir()) == ["model.safetensors"], "a temp file was left behind"
    zswap.save_weights(model, out, max_shard_size=40)  # now sharded: the single file is replaced
    assert "model.safetensors" not in {e.name for e in out.iterdir()}
    assert (out / "model.safetensors.index.json").is_file()
