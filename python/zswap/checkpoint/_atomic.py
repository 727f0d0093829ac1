"""Making a checkpoint appear all at once: written into a temp folder inside ``save_dir``, every file and
folder fsynced, renamed into place, and ``latest`` replaced last (temp file + rename), so a crash at any
point leaves either the previous state or the new one, never a half-written tag under its name.

Names starting with ``.`` are never tags: a killed save leaves at most a ``.tmp-*`` folder, which the next
save into the same folder removes.
"""

from __future__ import annotations

import contextlib
import ctypes
import ctypes.util
import os
import shutil
import uuid
from pathlib import Path

LATEST = "latest"
TMP_PREFIX = ".tmp-"
_RENAME_EXCHANGE = 2  # renameat2 flag, Linux 3.15+


def fsync_path(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY | os.O_CLOEXEC)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def new_temp_dir(save_dir: Path, tag: str) -> Path:
    tmp = save_dir / f"{TMP_PREFIX}{tag}-{uuid.uuid4().hex[:12]}"
    tmp.mkdir()
    return tmp


def remove_stale(save_dir: Path) -> None:
    """Remove the temp folders of saves that were killed (one saver per folder at a time)."""
    for entry in save_dir.iterdir():
        if entry.name.startswith(TMP_PREFIX) and entry.is_dir():
            shutil.rmtree(entry, ignore_errors=True)


def commit(tmp: Path, final: Path) -> None:
    """Move the finished folder ``tmp`` to ``final``. An existing ``final`` is swapped out atomically
    (renameat2 RENAME_EXCHANGE) where the kernel and file system allow, else moved aside first."""
    for f in tmp.iterdir():
        fsync_path(f)
    fsync_path(tmp)
    if final.exists():
        if not _exchange(tmp, final):
            aside = final.with_name(f"{TMP_PREFIX}old-{final.name}-{uuid.uuid4().hex[:8]}")
            os.rename(final, aside)
            os.rename(tmp, final)
            tmp = aside
        fsync_path(final.parent)
        shutil.rmtree(tmp, ignore_errors=True)  # now holds the old checkpoint
    else:
        os.rename(tmp, final)
    fsync_path(final.parent)


def write_latest(save_dir: Path, tag: str) -> None:
    tmp = save_dir / f"{TMP_PREFIX}{LATEST}-{uuid.uuid4().hex[:12]}"
    fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_CLOEXEC, 0o644)
    try:
        os.write(fd, f"{tag}\n".encode())
        os.fsync(fd)
    finally:
        os.close(fd)
    os.replace(tmp, save_dir / LATEST)
    fsync_path(save_dir)


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
