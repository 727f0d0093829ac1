"""`zswap env`: what this machine lets zswap do, and what zswap will do about what it does not.

Each check runs the probe the engine itself runs (an io_uring setup, an O_DIRECT swap file proved by one
aligned write and read, the Adam kernel's CPU dispatch) or reads the kernel's own answer under /proc and
/sys, and reports `ok`, a `reason` for every "no", the figures it is based on, and an `action`: what
zswap does here because of it. `collect()` returns plain data; `render()` the text; `--json` the data.
"""

from __future__ import annotations

import errno as errno_mod
import json
import os
import platform
import resource
import stat
import sys
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from . import _zswap

CHECKS = ("torch", "io_uring", "memlock", "direct_io", "hugetlb", "thp", "block_device", "cpu_adam", "cuda")
"""Every check `collect()` reports, in report order."""

# The engine's defaults where no drive tells it more (EngineConfig::default in src/engine/mod.rs): its
# bounce buffers, about queue_depth × block_size bytes, are registered as io_uring fixed buffers, which the
# kernel charges to RLIMIT_MEMLOCK unless the process has CAP_IPC_LOCK. `collect` asks an engine on the
# directory for what it picks there instead.
DEFAULT_BLOCK_SIZE = 1 << 20
DEFAULT_QUEUE_DEPTH = 16
_CAP_IPC_LOCK, _CAP_SYS_ADMIN = 14, 21
_MIN_TORCH = (2, 4)


@dataclass
class Check:
    """One line of the report. `reason` is set exactly when `ok` is false."""

    ok: bool
    summary: str
    action: str
    reason: str | None = None
    details: dict[str, Any] = field(default_factory=dict)

    def __post_init__(self) -> None:
        if self.ok == (self.reason is not None):
            raise AssertionError(f"a check says why exactly when it says no: ok={self.ok}, {self.reason!r}")

    def to_dict(self) -> dict[str, Any]:
        return {"ok": self.ok, "reason": self.reason, "action": self.action, **self.details}


# -- small readers: None when the kernel does not expose the file (old kernel, container) ----------------


def _read(path: str | Path) -> str | None:
    try:
        return Path(path).read_text().strip()
    except OSError:
        return None


def _read_int(path: str | Path) -> int | None:
    text = _read(path)
    try:
        return int(text) if text is not None else None
    except ValueError:
        return None


def _status_field(name: str) -> str | None:
    for line in (_read("/proc/self/status") or "").splitlines():
        key, _, value = line.partition(":")
        if key == name:
            return value.strip()
    return None


def _has_cap(bit: int) -> bool:
    eff = _status_field("CapEff")
    return eff is not None and bool(int(eff, 16) >> bit & 1)


def _kernel_version(release: str) -> tuple[int, int]:
    parts = release.split("-")[0].split(".")
    try:
        return int(parts[0]), int(parts[1])
    except (IndexError, ValueError):
        return (0, 0)


def _mib(n: int) -> str:
    return f"{n / 2**20:g} MiB"


def _memlock_text(v: int | None) -> str:
    return "unlimited" if v is None else _mib(v) if v >= 1 << 20 else f"{v >> 10} KiB"


def _memlock() -> tuple[int | None, int | None]:
    soft, hard = resource.getrlimit(resource.RLIMIT_MEMLOCK)
    inf = resource.RLIM_INFINITY
    return (None if soft == inf else soft), (None if hard == inf else hard)


def _meminfo() -> dict[str, int]:
    out: dict[str, int] = {}
    for line in (_read("/proc/meminfo") or "").splitlines():
        key, _, value = line.partition(":")
        words = value.split()
        if words and words[0].isdigit():
            out[key] = int(words[0]) * (1024 if words[-1] == "kB" else 1)
    return out


# -- the checks ------------------------------------------------------------------------------------------


def check_torch() -> Check:
    try:
        import torch
    except Exception as e:
        return Check(
            False, "not importable", "zswap cannot run: install torch>=2.4", f"import torch failed: {e}",
            {"version": None},
        )  # fmt: skip
    v = torch.__version__
    parsed = _kernel_version(v.replace("+", "-"))
    if parsed < _MIN_TORCH:
        return Check(
            False, v, "zswap needs torch>=2.4; upgrade torch", f"torch {v} is older than 2.4", {"version": v}
        )
    return Check(True, v, f"zswap runs on torch {v}", details={"version": v})


def check_io_uring() -> Check:
    release = platform.release()
    kernel = _kernel_version(release)
    disabled = _read_int("/proc/sys/kernel/io_uring_disabled")
    group = _read_int("/proc/sys/kernel/io_uring_group")
    seccomp_text = _status_field("Seccomp")
    seccomp = int(seccomp_text) if seccomp_text and seccomp_text.isdigit() else None
    soft, _ = _memlock()
    err = _zswap.io_uring_errno()
    details: dict[str, Any] = {
        "kernel": release,
        "io_uring_disabled": disabled,
        "io_uring_group": group,
        "seccomp": seccomp,
        "memlock": soft,
        "errno": err,
        "error": None if err is None else errno_mod.errorcode.get(err, str(err)),
    }
    facts = (
        f"kernel {kernel[0]}.{kernel[1]}, io_uring_disabled={'n/a' if disabled is None else disabled}, "
        f"seccomp {'n/a' if seccomp is None else ('off', 'strict', 'filter')[min(seccomp, 2)]}"
    )
    if err is None:
        return Check(True, facts, "io_uring backend (one ring per worker thread)", details=details)
    return Check(
        False, facts, "io_uring refused → psync fallback (pread/pwrite thread pool), with one ZswapWarning",
        _io_uring_reason(err, kernel, disabled, group, seccomp, soft), details,
    )  # fmt: skip


def _io_uring_reason(
    err: int, kernel: tuple[int, int], disabled: int | None, group: int | None, seccomp: int | None,
    memlock: int | None,
) -> str:  # fmt: skip
    """The likeliest cause of an io_uring_setup refusal, from the errno and what the kernel exposes."""
    name = errno_mod.errorcode.get(err, str(err))
    if os.environ.get("ZSWAP_DISABLE_IO_URING", "") not in ("", "0"):
        return "ZSWAP_DISABLE_IO_URING is set (zswap's own switch; unset it to use io_uring)"
    if disabled == 2:
        return "kernel.io_uring_disabled = 2: io_uring is off for every process (sysctl)"
    if disabled == 1 and not _has_cap(_CAP_SYS_ADMIN) and (group is None or group < 0 or group not in (
        os.getegid(), *os.getgroups()
    )):  # fmt: skip
        return f"kernel.io_uring_disabled = 1 and this process is not in kernel.io_uring_group ({group})"
    if err == errno_mod.ENOSYS:
        if kernel < (5, 1):
            return f"{name}: kernel {kernel[0]}.{kernel[1]} predates io_uring (5.1)"
        if kernel < (5, 6):
            return f"{name}: kernel {kernel[0]}.{kernel[1]} lacks io_uring READ/WRITE (5.6)"
        return f"{name}: the kernel is built without io_uring (CONFIG_IO_URING), or a sandbox hides it"
    if err == errno_mod.EPERM and seccomp == 2:
        return f"{name}: a seccomp filter refuses io_uring_setup (a container's default profile, gVisor...)"
    if err == errno_mod.ENOMEM and kernel < (5, 12):
        return f"{name}: RLIMIT_MEMLOCK ({_memlock_text(memlock)}) too small for a ring (charged before 5.12)"
    return f"{name}: io_uring_setup failed: {os.strerror(err)}"


def bounce_bytes(path: Path | None) -> int:
    """Bytes of bounce buffers an engine on ``path`` holds with its own picks (the defaults' where none
    can be opened there)."""
    if path is not None:
        try:
            engine = _zswap.Engine([str(path)])
        except OSError:
            pass
        else:
            try:
                return int(engine.info()["bounce_bytes"])
            finally:
                engine.close()
    return DEFAULT_BLOCK_SIZE * DEFAULT_QUEUE_DEPTH


def check_memlock(need: int = DEFAULT_BLOCK_SIZE * DEFAULT_QUEUE_DEPTH) -> Check:
    """Whether ``need`` bytes of bounce buffers can be registered (pinned) with io_uring."""
    soft, hard = _memlock()
    cap = _has_cap(_CAP_IPC_LOCK)
    details = {"soft": soft, "hard": hard, "cap_ipc_lock": cap, "fixed_buffer_bytes": need}
    summary = f"RLIMIT_MEMLOCK {_memlock_text(soft)} (hard {_memlock_text(hard)})" + (
        ", CAP_IPC_LOCK" if cap else ""
    )
    if soft is None or cap or soft >= need:
        return Check(
            True, summary, f"the engine's {_mib(need)} of bounce buffers register as io_uring fixed buffers",
            details=details,
        )  # fmt: skip
    return Check(
        False, summary,
        "fixed-buffer registration refused → plain io_uring READ/WRITE (same data path, a little more CPU "
        "per request); lock_memory=True leaves buffers unlocked",
        f"RLIMIT_MEMLOCK {_memlock_text(soft)} < the {_mib(need)} of bounce buffers the kernel would pin "
        "(raise it: ulimit -l unlimited, or LimitMEMLOCK= / docker --ulimit memlock=-1)",
        details,
    )  # fmt: skip


def _mount_of(path: Path) -> tuple[str, str, str] | None:
    """(mount point, fs type, source) of the mount holding `path`, from /proc/self/mountinfo."""
    best: tuple[str, str, str] | None = None
    real = str(path.resolve())
    for line in (_read("/proc/self/mountinfo") or "").splitlines():
        pre, _, post = line.partition(" - ")
        fields, rest = pre.split(), post.split()
        if len(fields) < 5 or len(rest) < 2:
            continue
        point = fields[4].replace("\\040", " ")
        inside = real == point or real.startswith(point.rstrip("/") + "/")
        if inside and (best is None or len(point) >= len(best[0])):
            best = (point, rest[0], rest[1])
    return best


def check_direct_io(path: Path) -> Check:
    mount = _mount_of(path)
    fs = mount[1] if mount else None
    try:
        p = _zswap.probe_direct_io(path)
    except OSError as e:
        # The directory exists (the CLI checked) yet no swap file can be made in it: a pseudo file system
        # such as /proc answers ENOENT to a create, a read-only mount EROFS, a foreign one EACCES.
        why = os.strerror(e.errno) if e.errno else str(e)
        return Check(
            False, f"{path} ({fs or 'unknown fs'})",
            "no swap file can be created here: pick a writable directory on a local disk as nvme_path",
            f"{path} exists but is not usable as a swap directory: creating a file there fails ({why})",
            {"path": str(path), "filesystem": fs, "direct": False, "offset_align": None, "mem_align": None,
             "align_source": None},
        )  # fmt: skip
    details = {
        "path": str(path), "filesystem": fs, "direct": p["direct"], "offset_align": p["offset_align"],
        "mem_align": p["mem_align"], "align_source": "statx" if p["statx_dioalign"] else "logical_block_size",
    }  # fmt: skip
    where = f"{path} ({fs or 'unknown fs'})"
    if p["direct"]:
        src = "statx DIOALIGN" if p["statx_dioalign"] else "the device's logical block size"
        return Check(
            True, f"{where}: offsets {p['offset_align']} B, memory {p['mem_align']} B ({src})",
            f"O_DIRECT: transfers aligned to {p['offset_align']} B, page cache bypassed", details=details,
        )  # fmt: skip
    return Check(
        False, where,
        "O_DIRECT refused → buffered I/O through the page cache, with one ZswapWarning (slower; the page "
        "cache holds swapped bytes too)",
        p["reason"] or "O_DIRECT refused", details,
    )  # fmt: skip


def check_hugetlb(thp_mode: str | None) -> Check:
    m = _meminfo()
    total, free, size = m.get("HugePages_Total", 0), m.get("HugePages_Free", 0), m.get("Hugepagesize", 0)
    details = {"total": total, "free": free, "page_size": size, "reserved_bytes": total * size}
    summary = f"{total} reserved, {free} free, {size >> 10} KiB each"
    if free > 0:
        return Check(
            True, summary, "buffers of 2 MiB and more are mapped on reserved hugetlb pages (MAP_HUGETLB)",
            details=details,
        )  # fmt: skip
    why = "no hugetlb pages reserved (vm.nr_hugepages = 0)" if total == 0 else "all hugetlb pages in use"
    fallback = (
        f"transparent huge pages (MADV_HUGEPAGE, THP {thp_mode})"
        if thp_mode in ("always", "madvise")
        else "4 KiB pages (THP off too)"
    )
    return Check(
        False, summary,
        f"MAP_HUGETLB unavailable → {fallback}; to reserve pages: echo 64 > /proc/sys/vm/nr_hugepages",
        why, details,
    )  # fmt: skip


def check_thp() -> Check:
    text = _read("/sys/kernel/mm/transparent_hugepage/enabled")
    mode = None
    if text:
        mode = next((w.strip("[]") for w in text.split() if w.startswith("[")), None)
    details = {"mode": mode, "modes": text}
    if mode in ("always", "madvise"):
        return Check(True, f"mode {mode}", "large buffers advise MADV_HUGEPAGE: 2 MiB pages", details=details)
    reason = "THP is 'never'" if mode == "never" else "the kernel exposes no THP setting"
    return Check(
        False, f"mode {mode or 'n/a'}",
        "without hugetlb pages, buffers use 4 KiB pages: each request is cut at max_segments × 4 KiB",
        reason, details,
    )  # fmt: skip


def _block_dir(path: Path) -> tuple[Path | None, str | None]:
    """The sysfs folder (with queue/) of the disk under `path`, or None and why."""
    dev = os.stat(path).st_dev
    if os.major(dev) == 0:
        # An anonymous device (tmpfs, overlay, btrfs subvolumes, network file systems): follow the mount's
        # source when it names a block device node.
        mount = _mount_of(path)
        src = mount[2] if mount else ""
        try:
            st = os.stat(src) if src.startswith("/dev/") else None
        except OSError:
            st = None
        if st is None or not stat.S_ISBLK(st.st_mode):
            fs = mount[1] if mount else "an unknown file system"
            return None, f"{path} is on {fs} (source {src or '?'}), which has no block device behind it"
        dev = st.st_rdev
    base = Path(f"/sys/dev/block/{os.major(dev)}:{os.minor(dev)}")
    if not base.exists():
        return None, f"{base} does not exist (sysfs not mounted or hidden in this container)"
    real = base.resolve()
    # A partition's folder has a `partition` file and no queue/; its parent is the disk. Device mapper
    # and md devices have their own queue/ with the stacked limits.
    if (real / "partition").exists() or not (real / "queue").is_dir():
        real = real.parent
    if not (real / "queue").is_dir():
        return None, f"no queue/ under {real}"
    return real, None


NO_LIMITS = (
    "no request-size limits to report; zswap uses 1 MiB blocks × 16 unless the aio section says otherwise"
)


def check_block_device(path: Path) -> Check:
    disk, why = _block_dir(path)
    if disk is None:
        return Check(
            False, "n/a", NO_LIMITS, why,
            {"device": None, "max_segments": None, "max_sectors_kb": None, "max_hw_sectors_kb": None,
             "logical_block_size": None, "rotational": None},
        )  # fmt: skip
    q = disk / "queue"
    seg, sectors = _read_int(q / "max_segments"), _read_int(q / "max_sectors_kb")
    details = {
        "device": disk.name, "max_segments": seg, "max_sectors_kb": sectors,
        "max_hw_sectors_kb": _read_int(q / "max_hw_sectors_kb"),
        "logical_block_size": _read_int(q / "logical_block_size"), "rotational": _read_int(q / "rotational"),
    }  # fmt: skip
    small = min(x for x in (sectors, (seg or 0) * 4) if x) if (seg or sectors) else None
    action = (
        f"zswap sizes its blocks from these limits: up to {sectors} KiB per request from huge-page buffers, "
        f"≤ {small} KiB from 4 KiB pages (`zswap bench` prints the block size and queue depth it picks, why)"
        if sectors
        else NO_LIMITS
    )
    return Check(True, f"{disk.name}: max_segments {seg}, max_sectors_kb {sectors}", action, details=details)


def check_cpu_adam() -> Check:
    isa = _zswap.cpu_adam_isa()
    details = {"isa": isa}
    if isa != "portable":
        return Check(True, isa, f"the CPU Adam kernel runs its {isa} loop", details=details)
    return Check(
        False, isa, "the CPU Adam kernel runs its portable loop (correct, several times slower)",
        "this CPU has neither AVX-512 (F, BW, VL + FMA) nor AVX2 + FMA", details,
    )  # fmt: skip


def check_cuda() -> Check:
    try:
        import torch
    except Exception as e:
        return Check(
            False, "n/a", "CPU only", f"import torch failed: {e}", {"available": False, "devices": []}
        )
    built = torch.version.cuda
    details: dict[str, Any] = {"available": False, "cuda_version": built, "devices": []}
    if built is None:
        return Check(False, "n/a", "compute on the CPU", "this torch is a CPU-only build", details)
    if not torch.cuda.is_available():
        visible = os.environ.get("CUDA_VISIBLE_DEVICES")
        why = "no CUDA device or driver visible" + (f" (CUDA_VISIBLE_DEVICES={visible!r})" if visible else "")
        return Check(False, f"torch built for CUDA {built}", "compute on the CPU", why, details)
    names = [torch.cuda.get_device_name(i) for i in range(torch.cuda.device_count())]
    details.update(available=True, devices=names)
    return Check(
        True, f"CUDA {built}: {', '.join(names)}",
        "params stream NVMe → pinned host buffers → GPU; initialize(device='cuda')", details=details,
    )  # fmt: skip


LIBRARIES = ("torch", "transformers", "accelerate", "lightning", "safetensors", "pydantic", "numpy", "tqdm")
"""Packages whose version `collect()` reports (from their installed metadata; none is imported)."""


def versions() -> dict[str, str | None]:
    """zswap, Python, the kernel and each of `LIBRARIES` (``None``: not installed)."""
    import importlib.metadata as md

    out: dict[str, str | None] = {
        "zswap": _zswap.__version__, "python": sys.version.split()[0], "kernel": platform.release(),
    }  # fmt: skip
    for name in LIBRARIES:
        try:
            out[name] = md.version(name)
        except md.PackageNotFoundError:
            out[name] = None
    return out


def system(path: Path) -> dict[str, Any]:
    """RAM (total and available, /proc/meminfo), CPUs, and the free space of the file system at `path`."""
    m = _meminfo()
    st = os.statvfs(path)
    return {
        "ram_total": m.get("MemTotal"), "ram_available": m.get("MemAvailable"),
        "cpus": os.cpu_count(), "disk_free": st.f_bavail * st.f_frsize,
        "disk_total": st.f_blocks * st.f_frsize,
    }  # fmt: skip


def collect(path: Path) -> dict[str, Any]:
    """Every check for swap directory `path` (which must exist and be writable)."""
    thp = check_thp()
    checks: dict[str, Check] = {
        "torch": check_torch(),
        "io_uring": check_io_uring(),
        "memlock": check_memlock(bounce_bytes(path)),
        "direct_io": check_direct_io(path),
        "hugetlb": check_hugetlb(thp.details["mode"]),
        "thp": thp,
        "block_device": check_block_device(path),
        "cpu_adam": check_cpu_adam(),
        "cuda": check_cuda(),
    }
    assert tuple(checks) == CHECKS
    return {
        "zswap_version": _zswap.__version__,
        "extension": _zswap.__file__,
        "python": sys.version.split()[0],
        "platform": platform.platform(),
        "path": str(path),
        "system": system(path),
        "versions": versions(),
        "checks": {k: {"summary": c.summary, **c.to_dict()} for k, c in checks.items()},
    }


_LABELS = {
    "torch": "torch", "io_uring": "io_uring", "memlock": "memlock", "direct_io": "O_DIRECT",
    "hugetlb": "hugetlb", "thp": "THP", "block_device": "block dev", "cpu_adam": "Adam SIMD", "cuda": "CUDA",
}  # fmt: skip


def _gib(n: int | None) -> str:
    return "n/a" if n is None else f"{n / 2**30:.1f} GiB"


def _system_lines(report: dict[str, Any]) -> list[str]:
    s = report["system"]
    return [
        f"  RAM        {_gib(s['ram_available'])} available of {_gib(s['ram_total'])}, {s['cpus']} CPUs",
        f"  disk       {_gib(s['disk_free'])} free of {_gib(s['disk_total'])} at {report['path']}",
    ]


def issue_block(report: dict[str, Any]) -> str:
    """A short Markdown block to paste into a bug report: versions, machine, and every check's verdict."""
    v = report["versions"]
    libs = ", ".join(f"{k} {v[k]}" for k in ("torch", *LIBRARIES[1:]) if v.get(k))
    lines = [
        "```",
        f"zswap {v['zswap']}, Python {v['python']}, kernel {v['kernel']}",
        f"platform {report['platform']}",
        libs,
        *(line.strip() for line in _system_lines(report)),
        *(
            f"{_LABELS[n]}: {'yes' if c['ok'] else 'no'} ({c['summary']})"
            + ("" if c["ok"] else f": {c['reason']}")
            for n, c in report["checks"].items()
        ),
        "```",
    ]
    return "\n".join(lines) + "\n"


def render(report: dict[str, Any]) -> str:
    """The human-readable report: machine and versions, one line per check (yes/no, the facts, the reason
    for a no) and what zswap will do, then a block to paste into an issue."""
    v = report["versions"]
    lines = [
        f"zswap {report['zswap_version']} on Python {report['python']}, {report['platform']}",
        f"  extension {report['extension']}",
        "  versions   " + ", ".join(f"{k} {v[k] or 'not installed'}" for k in LIBRARIES),
        *_system_lines(report),
    ]
    for name in CHECKS:
        c = report["checks"][name]
        head = f"  {_LABELS[name]:<10} {'yes' if c['ok'] else 'NO ':<4} {c['summary']}"
        lines.append(head if c["ok"] else f"{head}: {c['reason']}")
        lines.append(f"  {'':<10} {'':<4} → {c['action']}")
    lines += ["", "Paste into an issue:", issue_block(report)]
    return "\n".join(lines)


def to_json(report: dict[str, Any]) -> str:
    return json.dumps(report, indent=2, sort_keys=False)
