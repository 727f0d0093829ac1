"""Making a checkpoint appear all at once: written into a temp folder inside ``save_dir``, every file and
folder fsynced, renamed into place, and ``latest`` replaced last (temp file + rename), so a crash at any
point leaves either the previous state or the new one, never a half-written tag under its name.

Names starting with ``.`` are never tags. Every temp name a save makes ends with its owner record,
``.<pid>.<boot>.<host>`` (boot: the first 8 hex digits of the kernel's boot id; host: of a hash of the host
name), set in the same ``mkdir``/``open`` that creates it, so no moment exists where another process could
see the folder without its owner. A save removes its own temp folder, and the temp leftovers of savers that
are provably dead: same host and boot with no such process, or same host and an earlier boot. Anything else
(a live process, another host sharing the folder over NFS, a name without an owner record) is left alone,
so several processes may save different tags into one folder at once. ``latest`` is replaced by a rename:
a reader sees the old tag or the new one, never a partial line, and the save that renames last wins.
"""

from __future__ import annotations

import contextlib
import ctypes
import ctypes.util
import errno
import hashlib
import os
import shutil
import socket
import uuid
from collections.abc import Iterator
from pathlib import Path

from ..errors import SwapIOError

LATEST = "latest"
TMP_PREFIX = ".tmp-"
_RENAME_EXCHANGE = 2  # renameat2 flag, Linux 3.15+


def fsync_path(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY | os.O_CLOEXEC)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def _boot_id() -> str:
    try:
        with open("/proc/sys/kernel/random/boot_id") as f:
            return f.read().strip().replace("-", "")[:8] or "0"
    except OSError:
        return "0"


def _host() -> str:
    return hashlib.sha256(socket.gethostname().encode()).hexdigest()[:8]


def owner_suffix() -> str:
    """``.<pid>.<boot>.<host>``: who made a temp name (see the module doc)."""
    return f".{os.getpid()}.{_boot_id()}.{_host()}"


def temp_name(what: str) -> str:
    """A new temp name for ``what`` (a tag, cut to 64 characters: the temp name must fit NAME_MAX where the
    tag does), unique, with the owner record."""
    return f"{TMP_PREFIX}{what[:64]}-{uuid.uuid4().hex[:12]}{owner_suffix()}"


def new_temp_dir(save_dir: Path, tag: str) -> Path:
    tmp = save_dir / temp_name(tag)
    tmp.mkdir()
    return tmp


def is_stale(name: str) -> bool:
    """Whether the temp name ``name`` was made by a saver that can no longer be running."""
    parts = name.rsplit(".", 3)
    if len(parts) != 4 or not parts[1].isdigit():
        return False  # no owner record: cannot tell, leave it
    _, pid, boot, host = parts
    if host != _host():
        return False  # another machine sharing the folder: its processes cannot be checked from here
    if boot != _boot_id():
        return True  # made before this machine last booted
    try:
        os.kill(int(pid), 0)
    except ProcessLookupError:
        return True
    except (PermissionError, OverflowError, ValueError):
        return False  # exists (someone else's), or not a pid at all
    return False


def remove_stale(save_dir: Path) -> None:
    """Remove the temp folders and files of saves whose process is gone (see the module doc)."""
    for entry in save_dir.iterdir():
        if not entry.name.startswith(TMP_PREFIX) or not is_stale(entry.name):
            continue
        if entry.is_dir() and not entry.is_symlink():
            shutil.rmtree(entry, ignore_errors=True)
        else:
            with contextlib.suppress(OSError):
                entry.unlink()


def commit(tmp: Path, final: Path, carry: list[str] | tuple[str, ...] = ()) -> None:
    """Move the finished folder ``tmp`` to ``final``. An existing ``final`` is swapped out atomically
    (renameat2 RENAME_EXCHANGE) where the kernel and file system allow, else moved aside first. The
    entries of ``final`` named in ``carry`` (not the save's: `manifest.foreign_entries`) are hard-linked
    into ``tmp`` first (copied where links cannot be made), one it also has excepted (the save's own
    wins), so they live on in the new folder and, until the swap, in the old one: at no moment do they
    exist only in a temp folder a later save would remove."""
    carried = set()
    for name in carry:
        if not os.path.lexists(tmp / name):
            _link_tree(final / name, tmp / name)
            carried.add(name)
    for f in tmp.iterdir():
        if f.name not in carried:  # (theirs: a link or a FIFO is not opened; the folder's fsync keeps them)
            fsync_path(f)
    fsync_path(tmp)
    if final.exists():
        if not _exchange(tmp, final):
            aside = final.with_name(temp_name(f"old-{final.name}"))
            os.rename(final, aside)
            os.rename(tmp, final)
            tmp = aside
        fsync_path(final.parent)
        shutil.rmtree(tmp, ignore_errors=True)  # now holds the old checkpoint
    else:
        os.rename(tmp, final)
    fsync_path(final.parent)


def _link_tree(src: Path, dst: Path) -> None:
    """``src`` (a file, a symlink or a folder, recursively) made again at ``dst`` from hard links."""
    if src.is_symlink():
        os.symlink(os.readlink(src), dst)
    elif src.is_dir():
        dst.mkdir()
        for entry in src.iterdir():
            _link_tree(entry, dst / entry.name)
        fsync_path(dst)
    else:
        try:
            os.link(src, dst)
        except OSError:  # a file system without hard links, or a mount inside the folder
            shutil.copy2(src, dst)


def write_file(path: Path, data: bytes) -> None:
    """Create ``path`` (it must not exist) holding ``data``, fsynced. A failure (a full disk) is a
    `SwapIOError` naming the path, and leaves no file behind."""
    try:
        fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_CLOEXEC, 0o644)
    except OSError as e:
        raise io_error(e, path, "cannot create") from None
    try:
        view = memoryview(data)
        while view:
            view = view[os.write(fd, view) :]
        os.fsync(fd)
    except OSError as e:
        os.close(fd)
        with contextlib.suppress(OSError):
            os.unlink(path)
        raise io_error(e, path, "cannot write") from None
    os.close(fd)


def io_error(e: OSError, path: object, what: str) -> SwapIOError:
    """``e`` as a `SwapIOError` naming ``path`` (kept as is when it already is one)."""
    if isinstance(e, SwapIOError):
        return e
    where = str(e.filename or path)
    return SwapIOError(e.errno or errno.EIO, f"{what} {where}: {e.strerror or e}", where)


@contextlib.contextmanager
def naming_write_errors(path: object) -> Iterator[None]:
    """A write that fails inside (a full disk) raises the `SwapIOError` naming ``path`` where an `OSError`
    is behind it: torch's archive writer turns a Python file's failed write into a ``RuntimeError``
    ("unexpected pos") raised while handling the ``OSError``."""
    try:
        yield
    except (OSError, RuntimeError) as e:
        seen: set[int] = set()
        cur: BaseException | None = e
        while cur is not None and id(cur) not in seen:
            if isinstance(cur, OSError):
                raise io_error(cur, path, "cannot write") from e
            seen.add(id(cur))
            cur = cur.__cause__ or cur.__context__
        raise


def write_latest(save_dir: Path, tag: str) -> None:
    """Point ``save_dir/latest`` at ``tag``: a temp file renamed over it (see the module doc)."""
    tmp = save_dir / temp_name(LATEST)
    write_file(tmp, f"{tag}\n".encode())
    try:
        os.replace(tmp, save_dir / LATEST)
        fsync_path(save_dir)
    except OSError as e:
        with contextlib.suppress(OSError):
            os.unlink(tmp)
        raise io_error(e, save_dir / LATEST, "cannot replace") from None


def _exchange(a: Path, b: Path) -> bool:
    name = ctypes.util.find_library("c")
    if name is None:
        return False
    libc = ctypes.CDLL(name, use_errno=True)
    fn = getattr(libc, "renameat2", None)
    if fn is None:
        return False
    at_fdcwd = -100
    with contextlib.suppress(Exception):
        return fn(at_fdcwd, os.fsencode(a), at_fdcwd, os.fsencode(b), _RENAME_EXCHANGE) == 0
    return False
