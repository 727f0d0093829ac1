"""The distribution files `make wheel` leaves in dist/: one abi3 manylinux wheel, and an sdist that builds
from source. Skipped when dist/ has none (run `make wheel`); CI builds them first and sets
ZSWAP_REQUIRE_WHEEL=1, which turns the skip into a failure."""

from __future__ import annotations

import email.parser
import os
import platform
import re
import shutil
import subprocess
import tarfile
import zipfile
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
DIST = ROOT / "dist"
MAX_GLIBC = (2, 28)
"""The newest glibc the wheel may need (manylinux_2_28: RHEL 8, Debian 10, Ubuntu 18.10 and later)."""
ALLOWED_LIBS = {"libc.so.6", "libm.so.6", "libpthread.so.0", "libdl.so.2", "librt.so.1", "libgcc_s.so.1"}
"""Shared libraries every manylinux system has; nothing else (no liburing, no libaio, no libpython)."""


def _one(pattern: str) -> Path:
    found = sorted(DIST.glob(pattern))
    if not found:
        if os.environ.get("ZSWAP_REQUIRE_WHEEL") == "1":
            pytest.fail(f"no {pattern} in {DIST} although ZSWAP_REQUIRE_WHEEL=1 (run `make wheel` first)")
        pytest.skip(f"no {pattern} in {DIST}: `make wheel` builds it")
    assert len(found) == 1, f"several {pattern} in {DIST}: {[p.name for p in found]}"
    return found[0]


def _cargo_version() -> str:
    m = re.search(r'^version = "([^"]+)"', (ROOT / "Cargo.toml").read_text(), re.M)
    assert m is not None
    return m.group(1)


def _manylinux_glibc(tag: str) -> tuple[int, int]:
    legacy = {"manylinux1": (2, 5), "manylinux2010": (2, 12), "manylinux2014": (2, 17)}
    arch = platform.machine()
    assert tag.endswith("_" + arch), f"platform tag {tag} is not for {arch}"
    base = tag.removesuffix("_" + arch)
    if base in legacy:
        return legacy[base]
    m = re.fullmatch(r"manylinux_(\d+)_(\d+)", base)
    assert m, f"platform tag {tag} is not a manylinux tag"
    return int(m.group(1)), int(m.group(2))


def test_wheel_is_one_abi3_manylinux_wheel() -> None:
    whl = _one("zswap-*.whl")
    name, version, python_tag, abi_tag, platform_tags = whl.name.removesuffix(".whl").split("-")
    assert (name, version) == ("zswap", _cargo_version())
    assert (python_tag, abi_tag) == ("cp310", "abi3")
    for tag in platform_tags.split("."):
        assert _manylinux_glibc(tag) <= MAX_GLIBC, tag
    with zipfile.ZipFile(whl) as z:
        names = z.namelist()
        info = next(n for n in names if n.endswith(".dist-info/WHEEL"))
        wheel_tags = {
            line.split(": ", 1)[1] for line in z.read(info).decode().splitlines() if line.startswith("Tag: ")
        }
        meta = email.parser.Parser().parsestr(z.read(info.replace("WHEEL", "METADATA")).decode())
        so = [n for n in names if n.endswith(".so")]
    assert wheel_tags == {f"cp310-abi3-{t}" for t in platform_tags.split(".")}
    assert meta["Version"] == _cargo_version() and meta["Requires-Python"] == ">=3.10"
    assert so == ["zswap/_zswap.abi3.so"]
    assert {"zswap/__main__.py", "zswap/envreport.py", "zswap/_zswap.pyi", "zswap/py.typed"} <= set(names)


def test_wheel_extension_needs_only_old_glibc(tmp_path: Path) -> None:
    whl = _one("zswap-*.whl")
    readelf = shutil.which("readelf")
    if readelf is None:
        pytest.skip("readelf (binutils) not installed")
    with zipfile.ZipFile(whl) as z:
        so = Path(z.extract("zswap/_zswap.abi3.so", tmp_path))
    dyn = subprocess.run([readelf, "-dW", so], capture_output=True, text=True, check=True).stdout
    needed = set(re.findall(r"\(NEEDED\)\s+Shared library: \[([^\]]+)\]", dyn))
    needed.discard("ld-linux-x86-64.so.2")
    assert needed and needed <= ALLOWED_LIBS, needed
    syms = subprocess.run([readelf, "-VW", so], capture_output=True, text=True, check=True).stdout
    versions = {
        tuple(int(x) for x in v.split(".")[:2]) for v in re.findall(r"GLIBC_(\d+\.\d+(?:\.\d+)?)", syms)
    }
    assert versions and max(versions) <= MAX_GLIBC, sorted(versions)[-3:]


def test_sdist_carries_what_a_source_build_needs() -> None:
    sdist = _one("zswap-*.tar.gz")
    top = sdist.name.removesuffix(".tar.gz")
    assert top == f"zswap-{_cargo_version()}"
    with tarfile.open(sdist) as t:
        names = set(t.getnames())
        pkg_info = t.extractfile(f"{top}/PKG-INFO")
        assert pkg_info is not None
        meta = email.parser.Parser().parsestr(pkg_info.read().decode())
    need = [
        "Cargo.toml",
        "Cargo.lock",
        "pyproject.toml",
        "src/lib.rs",
        "src/py/env.rs",
        "python/zswap/__init__.py",
    ]
    assert {f"{top}/{n}" for n in need} <= names
    assert meta["Version"] == _cargo_version()


_LOAD_AND_ROUND_TRIP = """
import ctypes, importlib.util, sys, tempfile
spec = importlib.util.spec_from_file_location("_zswap", sys.argv[1])
z = importlib.util.module_from_spec(spec)
spec.loader.exec_module(z)
with tempfile.TemporaryDirectory() as d:
    e = z.Engine([d])
    src, dst = e.alloc(1 << 20), e.alloc(1 << 20)
    pattern = bytes(range(256)) * 4096
    ctypes.memmove(src.address, pattern, len(pattern))
    e.write("k", src.address, len(src), src).wait()
    e.read("k", dst.address, len(dst), dst).wait()
    assert ctypes.string_at(dst.address, len(dst)) == pattern
    e.close()
print(z.__version__, sys.version_info[0], sys.version_info[1])
"""


def _interpreter(minor: int) -> str | None:
    """A runnable CPython 3.minor: on PATH, or under pyenv's versions folder."""
    candidates = [shutil.which(f"python3.{minor}")]
    candidates += [
        str(p) for p in sorted(Path.home().glob(f".pyenv/versions/3.{minor}.*/bin/python3.{minor}"))
    ]
    for c in candidates:
        if c and subprocess.run([c, "-c", "pass"], capture_output=True).returncode == 0:
            return c
    return None


@pytest.mark.parametrize("minor", [10, 11, 12, 13])
def test_the_one_extension_loads_and_round_trips_on_cpython_3_x(minor: int, tmp_path: Path) -> None:
    whl = _one("zswap-*.whl")
    py = _interpreter(minor)
    if py is None:
        pytest.skip(f"no CPython 3.{minor} on this machine (PATH or ~/.pyenv/versions)")
    with zipfile.ZipFile(whl) as z:
        so = z.extract("zswap/_zswap.abi3.so", tmp_path)
    out = subprocess.run(
        [py, "-I", "-c", _LOAD_AND_ROUND_TRIP, so], capture_output=True, text=True, cwd=tmp_path
    )
    assert out.returncode == 0, out.stderr
    assert out.stdout.split() == [_cargo_version(), "3", str(minor)]
