"""Bigger than memory, shown: `zswap demo --size 6GiB` inside a memory cgroup of 2 GiB (not run in CI).

Makes a child cgroup of this process's own memory cgroup — cgroup v2 (``memory.max``, ``memory.swap.max``
= 0, peak from ``memory.peak``, Linux 5.19+, else sampled ``memory.current``) where the memory controller
is available, else cgroup v1 (``memory.limit_in_bytes``, and ``memory.memsw.limit_in_bytes`` where swap
accounting exists, peak from ``memory.max_usage_in_bytes``) — starts the demo inside it (the child joins
the cgroup before it execs, so every byte it maps is charged), prints the demo's output, the cgroup's
peak usage, its limit-hit count and OOM kills, and removes the cgroup. Exit status: 0 when the demo
finished with the loss going down, 1 when it did not, 2 when no memory cgroup can be made here (the
message says what was refused: writing cgroups needs root, or a delegated subtree).

The cgroup's usage counts page cache as well as RSS; the demo reads and writes its swap files with
O_DIRECT, so the cache it adds is small, and the kernel reclaims cache before it would OOM-kill.

Usage: ``sudo nice python benches/cgroup_demo.py [--size 6GiB] [--limit 2GiB] [--steps 2] [--path DIR]``.
The 6 GiB run needs ~30 GiB free on DIR's disk (default: a temp dir under /tmp) and ~10 minutes here.
"""

from __future__ import annotations

import argparse
import contextlib
import os
import re
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

V2_ROOT = Path("/sys/fs/cgroup")


class NoCgroup(Exception):
    """No memory cgroup can be made here; the message says why."""


def _mounts() -> list[tuple[str, str, set[str]]]:
    out = []
    with open("/proc/self/mounts") as f:
        for line in f:
            _, where, fstype, opts, *_ = line.split()
            out.append((where, fstype, set(opts.split(","))))
    return out


def _own(hierarchy_match: str) -> str:
    """This process's path in the hierarchy whose /proc/self/cgroup controller list matches."""
    with open("/proc/self/cgroup") as f:
        for line in f:
            _, ctrls, path = line.rstrip("\n").split(":", 2)
            if ctrls == hierarchy_match or hierarchy_match in ctrls.split(","):
                return path
    return "/"


class Cgroup:
    """A memory cgroup made for one run: ``version``, ``path``, ``limit``."""

    def __init__(self, limit: int) -> None:
        self.limit = limit
        reasons: list[str] = []
        for make in (self._make_v2, self._make_v1):
            try:
                make()
                return
            except NoCgroup as exc:
                reasons.append(str(exc))
        raise NoCgroup("no memory cgroup can be made here: " + "; ".join(reasons))

    def _mkdir(self, parent: Path) -> Path:
        path = parent / f"zswap-demo-{os.getpid()}"
        try:
            path.mkdir()
        except OSError as exc:
            raise NoCgroup(f"mkdir {path}: {exc.strerror}") from exc
        return path

    def _make_v2(self) -> None:
        roots = [Path(w) for w, t, _ in _mounts() if t == "cgroup2"]
        if not roots:
            raise NoCgroup("cgroup v2: no cgroup2 file system is mounted")
        for root in roots:
            parent = root / _own("").lstrip("/")
            ctrl = parent / "cgroup.controllers"
            if ctrl.exists() and "memory" in ctrl.read_text().split():
                break
        else:
            raise NoCgroup(
                f"cgroup v2: the memory controller is not available in {', '.join(map(str, roots))} "
                "(it is bound to a v1 hierarchy, or not delegated to this cgroup)"
            )
        sub = parent / "cgroup.subtree_control"
        try:  # a v2 child gets the controller only if the parent enables it for its children
            if "memory" not in sub.read_text().split():
                sub.write_text("+memory")
        except OSError as exc:
            raise NoCgroup(f"cgroup v2: enabling memory in {sub}: {exc.strerror}") from exc
        self.path, self.version = self._mkdir(parent), 2
        self._write("memory.max", str(self.limit))
        if (self.path / "memory.swap.max").exists():
            self._write("memory.swap.max", "0")

    def _make_v1(self) -> None:
        roots = [Path(w) for w, t, o in _mounts() if t == "cgroup" and "memory" in o]
        if not roots:
            raise NoCgroup("cgroup v1: no hierarchy with the memory controller is mounted")
        parent = roots[0] / _own("memory").lstrip("/")
        self.path, self.version = self._mkdir(parent), 1
        self._write("memory.limit_in_bytes", str(self.limit))
        if (self.path / "memory.memsw.limit_in_bytes").exists():
            self._write("memory.memsw.limit_in_bytes", str(self.limit))  # no escape into swap

    def _write(self, name: str, value: str) -> None:
        try:
            (self.path / name).write_text(value)
        except OSError as exc:
            self.remove()
            raise NoCgroup(
                f"cgroup v{self.version}: writing {value} to {self.path / name}: {exc.strerror}"
            ) from exc

    def read(self, name: str) -> str:
        return (self.path / name).read_text()

    def join(self) -> None:
        """Move the calling process in (runs in the child between fork and exec)."""
        (self.path / "cgroup.procs").write_text(str(os.getpid()))

    def usage(self) -> int:
        return int(self.read("memory.current" if self.version == 2 else "memory.usage_in_bytes"))

    def peak(self, sampled: int) -> int:
        name = "memory.peak" if self.version == 2 else "memory.max_usage_in_bytes"
        return int(self.read(name)) if (self.path / name).exists() else sampled

    def events(self) -> str:
        if self.version == 2:
            ev = dict(line.split() for line in self.read("memory.events").splitlines())
            return f"limit reached {ev.get('max', '?')} times, OOM kills {ev.get('oom_kill', '?')}"
        oom = dict(line.split() for line in self.read("memory.oom_control").splitlines())
        return (
            f"limit reached {self.read('memory.failcnt').strip()} times, OOM kills {oom.get('oom_kill', '?')}"
        )

    def remove(self) -> None:
        with contextlib.suppress(OSError):
            self.path.rmdir()


def _size(text: str) -> int:
    m = re.fullmatch(r"(\d+(?:\.\d+)?)\s*(GiB|MiB)?", text)
    if not m:
        raise argparse.ArgumentTypeError(f"{text!r}: expected a size such as 2GiB or 512MiB")
    return int(float(m[1]) * {"GiB": 1 << 30, "MiB": 1 << 20, None: 1}[m[2]])


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--size", type=_size, default=_size("6GiB"), help="model size (default 6GiB)")
    ap.add_argument(
        "--limit", type=_size, default=_size("2GiB"), help="the cgroup's memory limit (default 2GiB)"
    )
    ap.add_argument("--steps", type=int, default=2, help="AdamW steps (default 2)")
    ap.add_argument("--path", default=None, help="swap directory (default: a temp dir under /tmp)")
    a = ap.parse_args()
    try:
        cg = Cgroup(a.limit)
    except NoCgroup as exc:
        print(f"cgroup_demo: {exc}", file=sys.stderr)
        return 2
    print(f"cgroup v{cg.version} {cg.path}: limit {a.limit / 2**30:.2f} GiB")
    sampled = [0]
    done = threading.Event()

    def sample() -> None:
        while not done.wait(0.2):
            sampled[0] = max(sampled[0], cg.usage())

    try:
        with tempfile.TemporaryDirectory(dir=a.path or "/tmp") as d:
            size = f"{a.size >> 20}MiB"
            cmd = [
                sys.executable,
                "-m",
                "zswap",
                "demo",
                "--size",
                size,
                "--steps",
                str(a.steps),
                "--path",
                d,
            ]
            threading.Thread(target=sample, daemon=True).start()
            t0 = time.perf_counter()
            proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, text=True, preexec_fn=cg.join)
            assert proc.stdout is not None
            lines = []
            for line in proc.stdout:
                sys.stdout.write(line)
                sys.stdout.flush()
                lines.append(line)
            rc = proc.wait()
            wall = time.perf_counter() - t0
            done.set()
        peak = cg.peak(sampled[0])
        print(
            f"cgroup v{cg.version}: peak usage {peak / 2**20:,.0f} MiB of the {a.limit / 2**20:,.0f} MiB "
            f"limit ({peak / a.limit:.2f}×); {cg.events()}; demo exit status {rc} after {wall:.0f} s"
        )
    finally:
        done.set()
        cg.remove()
    down = any(": down" in line for line in lines)
    if rc != 0 or not down:
        print("cgroup_demo: the demo did not finish with the loss going down", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
