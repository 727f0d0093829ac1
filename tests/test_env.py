"""`zswap env`: every field, a reason for each "no", and agreement with what the engine really does."""

from __future__ import annotations

import importlib.metadata
import json
import os
import re
import subprocess
import sys
import warnings
from pathlib import Path
from typing import Any

import pytest

import zswap
from zswap import _zswap, envreport
from zswap.cli import main

ROOT = Path(__file__).resolve().parents[1]

FIELDS: dict[str, set[str]] = {
    "torch": {"version"},
    "io_uring": {"kernel", "io_uring_disabled", "io_uring_group", "seccomp", "memlock", "errno", "error"},
    "memlock": {"soft", "hard", "cap_ipc_lock", "fixed_buffer_bytes"},
    "direct_io": {"path", "filesystem", "direct", "offset_align", "mem_align", "align_source"},
    "hugetlb": {"total", "free", "page_size", "reserved_bytes"},
    "thp": {"mode", "modes"},
    "block_device": {
        "device",
        "max_segments",
        "max_sectors_kb",
        "max_hw_sectors_kb",
        "logical_block_size",
        "rotational",
    },
    "cpu_adam": {"isa"},
    "cuda": {"available", "cuda_version", "devices"},
}


def _env_json(capsys: pytest.CaptureFixture[str], *args: str) -> dict[str, Any]:
    assert main(["env", "--json", *args]) == 0
    report: dict[str, Any] = json.loads(capsys.readouterr().out)
    return report


def test_json_has_every_field_and_a_reason_for_each_no(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    report = _env_json(capsys, "--path", str(tmp_path))
    assert report["zswap_version"] == zswap.__version__
    assert report["path"] == str(tmp_path)
    assert {"extension", "python", "platform"} <= set(report)
    assert list(report["checks"]) == list(envreport.CHECKS) == list(FIELDS)
    for name, check in report["checks"].items():
        assert FIELDS[name] | {"ok", "reason", "action", "summary"} <= set(check), name
        assert isinstance(check["ok"], bool), name
        assert isinstance(check["action"], str) and check["action"], name
        if check["ok"]:
            assert check["reason"] is None, name
        else:
            assert isinstance(check["reason"], str) and check["reason"], name
    assert report["checks"]["torch"]["version"] == __import__("torch").__version__
    assert report["checks"]["cpu_adam"]["isa"] == _zswap.cpu_adam_isa()
    assert list(tmp_path.iterdir()) == []  # the probe's swap file is unlinked


def test_default_path_is_a_temp_dir_that_is_removed(capsys: pytest.CaptureFixture[str]) -> None:
    report = _env_json(capsys)
    assert not Path(report["path"]).exists()
    assert Path(report["path"]).name.startswith("zswap-")


def test_io_uring_and_direct_io_agree_with_the_engine(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    checks = _env_json(capsys, "--path", str(tmp_path))["checks"]
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", zswap.ZswapWarning)  # a fallback, if any, is what is compared
        with zswap.SwapEngine(tmp_path) as eng:
            info = eng.info
    assert (info["backend"] == "io_uring") == checks["io_uring"]["ok"]
    assert info["direct"] == checks["direct_io"]["ok"] == checks["direct_io"]["direct"]
    assert info["io_align"] == checks["direct_io"]["offset_align"]
    assert info["mem_align"] == checks["direct_io"]["mem_align"]
    # The bounce buffers memlock must cover are the engine's own on this drive (once a fixed 16 MiB).
    assert checks["memlock"]["fixed_buffer_bytes"] == info["bounce_bytes"]
    assert info["fixed_buffers"] == (info["fixed_buffers_reason"] == "")


def test_disabled_io_uring_is_a_no_with_its_reason_and_the_fallback(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("ZSWAP_DISABLE_IO_URING", "1")
    c = _env_json(capsys, "--path", str(tmp_path))["checks"]["io_uring"]
    assert c["ok"] is False and c["errno"] == 1 and c["error"] == "EPERM"
    assert "ZSWAP_DISABLE_IO_URING is set" in c["reason"]
    assert c["action"].startswith("io_uring refused → psync fallback")
    with pytest.warns(zswap.ZswapWarning, match="io_uring"), zswap.SwapEngine(tmp_path) as eng:
        assert eng.info["backend"] == "psync"  # what the report said zswap would do


@pytest.mark.parametrize(
    ("errno", "kernel", "disabled", "seccomp", "expect"),
    [
        (38, (4, 19), 0, 0, "predates io_uring (5.1)"),
        (38, (5, 4), 0, 0, "lacks io_uring READ/WRITE (5.6)"),
        (1, (6, 8), 2, 0, "kernel.io_uring_disabled = 2"),
        (1, (6, 8), 0, 2, "a seccomp filter refuses io_uring_setup"),
        (12, (5, 10), 0, 0, "RLIMIT_MEMLOCK (64 KiB) too small for a ring"),
        (22, (6, 8), 0, 0, "EINVAL: io_uring_setup failed: Invalid argument"),
    ],
)
def test_io_uring_refusals_are_explained(
    errno: int, kernel: tuple[int, int], disabled: int, seccomp: int, expect: str,
    monkeypatch: pytest.MonkeyPatch,
) -> None:  # fmt: skip
    monkeypatch.delenv("ZSWAP_DISABLE_IO_URING", raising=False)
    assert expect in envreport._io_uring_reason(errno, kernel, disabled, -1, seccomp, 64 << 10)


def test_refused_direct_io_is_a_no_with_the_engine_reason(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    # No file system here refuses O_DIRECT, so feed the check what the probe returns on one that does.
    refused = {"direct": False, "reason": f"{tmp_path}: O_DIRECT refused (EINVAL)", "offset_align": 1,
               "mem_align": 1, "statx_dioalign": False}  # fmt: skip
    monkeypatch.setattr(envreport._zswap, "probe_direct_io", lambda _p: refused)
    c = envreport.check_direct_io(tmp_path).to_dict()
    assert c["ok"] is False and c["reason"] == refused["reason"]
    assert c["action"].startswith("O_DIRECT refused → buffered I/O")


def test_missing_path_is_refused(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit) as ei:
        main(["env", "--path", str(tmp_path / "typo")])
    assert ei.value.code == 2  # a usage error, one line naming the path (tests/test_cli.py)
    assert f"argument --path: '{tmp_path / 'typo'}' is not an existing directory" in capsys.readouterr().err


def test_block_device_limits_are_the_disks(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    c = _env_json(capsys, "--path", str(tmp_path))["checks"]["block_device"]
    if not c["ok"]:
        pytest.skip(f"no block device under {tmp_path}: {c['reason']}")
    queue = Path("/sys/block", c["device"], "queue")  # the whole disk, never a partition
    assert c["max_segments"] == int((queue / "max_segments").read_text())
    assert c["max_sectors_kb"] == int((queue / "max_sectors_kb").read_text())
    assert c["logical_block_size"] == int((queue / "logical_block_size").read_text())


def test_tmpfs_has_no_block_device_and_says_so() -> None:
    shm = Path("/dev/shm")
    mount = envreport._mount_of(shm) if shm.is_dir() else None
    if mount is None or mount[1] != "tmpfs" or not os.access(shm, os.W_OK):
        pytest.skip("no writable tmpfs at /dev/shm")
    c = envreport.check_block_device(shm).to_dict()
    assert c["ok"] is False and c["device"] is None
    assert "is on tmpfs" in c["reason"] and "no block device" in c["reason"]


def test_text_report_has_one_line_per_check_with_reasons(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("ZSWAP_DISABLE_IO_URING", "1")
    assert main(["env", "--path", str(tmp_path)]) == 0
    text = capsys.readouterr().out
    assert text.startswith(f"zswap {zswap.__version__} on Python ")
    line = next(x for x in text.splitlines() if x.split()[:1] == ["io_uring"])
    assert re.match(r" *io_uring +NO +kernel .*: ZSWAP_DISABLE_IO_URING is set", line)
    assert "→ io_uring refused → psync fallback" in text
    assert text.count("→ ") >= len(envreport.CHECKS)


def test_a_no_without_a_reason_cannot_be_built() -> None:
    with pytest.raises(AssertionError, match="says why exactly when it says no"):
        envreport.Check(False, "x", "y")
    with pytest.raises(AssertionError):
        envreport.Check(True, "x", "y", reason="z")


def _cargo_version() -> str:
    m = re.search(r'^version = "([^"]+)"', (ROOT / "Cargo.toml").read_text(), re.M)
    assert m is not None
    return m.group(1)


def test_one_version_everywhere() -> None:
    assert zswap.__version__ == _zswap.__version__ == _zswap.version() == _cargo_version()
    assert 'dynamic = ["version"]' in (ROOT / "pyproject.toml").read_text()
    try:
        installed = importlib.metadata.version("zswap")
    except importlib.metadata.PackageNotFoundError:
        return
    assert installed == zswap.__version__


def test_python_m_zswap_runs_the_cli() -> None:
    env = {**os.environ, "PYTHONPATH": str(Path(zswap.__file__).parents[1])}
    out = subprocess.run(
        [sys.executable, "-m", "zswap", "--version"], capture_output=True, text=True, env=env, check=True
    )
    assert out.stdout == f"zswap {zswap.__version__}\n"
    bad = subprocess.run([sys.executable, "-m", "zswap", "nope"], capture_output=True, text=True, env=env)
    assert bad.returncode == 2 and "invalid choice: 'nope'" in bad.stderr


def test_system_versions_and_the_issue_block(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    report = _env_json(capsys, "--path", str(tmp_path))
    st = os.statvfs(tmp_path)
    s = report["system"]
    assert s["disk_total"] == st.f_blocks * st.f_frsize and 0 < s["disk_free"] <= s["disk_total"]
    assert 0 < s["ram_available"] <= s["ram_total"] and s["cpus"] == os.cpu_count()
    v = report["versions"]
    assert v["zswap"] == zswap.__version__ and v["kernel"] == os.uname().release
    for name in ("torch", "pydantic", "safetensors"):
        assert v[name] == importlib.metadata.version(name)
    assert set(envreport.LIBRARIES) <= set(v)
    assert main(["env", "--path", str(tmp_path)]) == 0
    text = capsys.readouterr().out
    block = text[text.index("Paste into an issue:\n```\n") :]
    assert block.endswith("```\n") and f"zswap {zswap.__version__}, Python " in block
    assert f"torch {v['torch']}" in block and f"pydantic {v['pydantic']}" in block
    # heading, two fences, versions (3 lines), RAM and disk, one line per check
    assert block.count("\n") == 1 + 2 + 3 + 2 + len(envreport.CHECKS)
