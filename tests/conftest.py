"""Shared fixtures: every storage test runs over each backend and each directory under test.

Directories: pytest's `tmp_path`, plus each entry of `$ZSWAP_TEST_DIRS` (colon-separated) — point it at a
real NVMe mount or a tmpfs to run the same suite there.

Every test not marked ``gpu`` runs as on a machine without CUDA (`cpu_unless_gpu`), so that the CPU suite
passes unchanged on a GPU machine: ``zswap.initialize`` without ``device=`` would otherwise compute on the
current CUDA device there, ``init_distributed`` pick NCCL and Lightning's "auto" accelerator the GPU.
"""

from __future__ import annotations

import contextlib
import logging
import os
import subprocess
import sys
import tempfile
import uuid
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import torch

from zswap import _zswap

# Asked once, before any test hides the GPU: the CUDA driver reads CUDA_VISIBLE_DEVICES when it first
# initialises, and it must see the real one (the gpu tests of the same session need the device).
HAS_CUDA = torch.cuda.is_available()

BACKENDS = ["io_uring", "psync"]


def _extra_dirs() -> list[str]:
    return [d for d in os.environ.get("ZSWAP_TEST_DIRS", "").split(":") if d]


@pytest.fixture(autouse=True)
def cpu_unless_gpu(request: pytest.FixtureRequest, monkeypatch: pytest.MonkeyPatch) -> None:
    """Tests not marked ``gpu`` see no CUDA device: in this process (``torch.cuda.is_available`` and
    ``device_count``, which zswap's device choice, its NCCL/pinned-memory decisions and Lightning's
    accelerator detection read) and in every subprocess they start (``CUDA_VISIBLE_DEVICES=""``)."""
    if request.node.get_closest_marker("gpu") is not None:
        return
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "")
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 0)


@pytest.fixture(params=BACKENDS)
def backend(request: pytest.FixtureRequest) -> str:
    if request.param == "io_uring" and (why := _zswap.io_uring_available()) is not None:
        pytest.skip(f"io_uring refused on this machine: {why}")
    return str(request.param)


@pytest.fixture(params=["tmp_path", *_extra_dirs()])
def swap_dir(request: pytest.FixtureRequest, tmp_path: Path) -> Iterator[Path]:
    if request.param == "tmp_path":
        yield tmp_path
        return
    d = Path(request.param) / f"zswap-test-{uuid.uuid4().hex[:8]}"
    d.mkdir()
    try:
        yield d
    finally:
        with contextlib.suppress(OSError):
            d.rmdir()


@contextlib.contextmanager
def mounted(fstype: str, options: str | None = None) -> Iterator[Path]:
    """Mounts a fresh `fstype` file system on a temp dir, or skips the test saying why it cannot."""
    with tempfile.TemporaryDirectory() as d:
        cmd = ["mount", "-t", fstype, *(["-o", options] if options else []), fstype, d]
        try:
            r = subprocess.run(cmd, capture_output=True, text=True, timeout=30)
        except (OSError, subprocess.TimeoutExpired) as e:
            pytest.skip(f"cannot mount {fstype}: {e}")
        if r.returncode != 0:
            pytest.skip(f"cannot mount {fstype} here: {r.stderr.strip() or r.returncode}")
        try:
            yield Path(d)
        finally:
            subprocess.run(["umount", "-l", d], capture_output=True, timeout=30)


def run_ranks(worker: Path, tmp_path: Path, world: int = 2, timeout: float = 300) -> None:
    """Runs ``worker rank world rendezvous_file tmp_path`` as `world` processes (env ``RANK`` and
    ``WORLD_SIZE`` set, cwd `tmp_path`) and fails the test with a rank's output if any rank fails."""
    env = {**os.environ, "WORLD_SIZE": str(world), "PYTHONDONTWRITEBYTECODE": "1"}
    procs = [
        subprocess.Popen(
            [sys.executable, str(worker), str(rank), str(world), str(tmp_path / "rendezvous"), str(tmp_path)],
            cwd=tmp_path,
            env={**env, "RANK": str(rank)},
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
            text=True,
        )
        for rank in range(world)
    ]
    outputs = []
    try:
        for p in procs:
            outputs.append(p.communicate(timeout=timeout)[0])
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
                p.wait()
    for rank, (p, out) in enumerate(zip(procs, outputs, strict=True)):
        assert p.returncode == 0, f"rank {rank} failed:\n{out}"


@pytest.fixture
def quiet_transformers() -> Iterator[None]:
    """Silences transformers' notices (the tiny test vocabularies trip irrelevant token-id ones)."""
    transformers = pytest.importorskip("transformers")
    level = logging.getLogger("transformers").level
    transformers.logging.set_verbosity_error()
    yield
    logging.getLogger("transformers").setLevel(level)


def swap_fds(e: Any) -> list[str]:
    """This process's descriptors of a `SwapEngine`'s swap files (unlinked at creation: reachable only
    through ``/proc/self/fd``)."""
    prefix = str(e.info["paths"][0]) + "/"
    out = []
    for name in os.listdir("/proc/self/fd"):
        try:
            target = os.readlink(f"/proc/self/fd/{name}")
        except OSError:
            continue
        if target.startswith(prefix) and target.endswith("(deleted)"):
            out.append(f"/proc/self/fd/{name}")
    return out


@pytest.fixture(autouse=True)
def matmul_outputs_pooled(monkeypatch: pytest.MonkeyPatch) -> None:
    """Every engine reuses backward's matmul outputs (`zswap.Engine.reuse_backward_outputs`, off by
    default) and every backward matmul of a hooked module goes through `zswap.outputs`' pool, however
    small: the suite's models are far below its 256 KiB threshold, and this way every bitwise comparison
    with a plain model also checks the pool (subprocess workers run with the defaults)."""
    from zswap import outputs

    monkeypatch.setattr(outputs, "MIN_BYTES", 0)
    monkeypatch.setattr(outputs, "DEFAULT", True)
