"""Safetensors checkpoints read by byte range: a header parser, ranged reads, and checkpoint resolution.

A safetensors file is ``u64 little-endian N`` + ``N`` bytes of JSON (``name -> {dtype, shape,
data_offsets}``, offsets relative to the end of the header) + the tensor bytes, each tensor row-major and
contiguous. So element ``i`` of a tensor's flattened form lies at a known byte offset, and a rank reads
exactly the bytes of its partition with ``pread`` into the destination buffer: nothing else of the file is
read, and no page of the file is mapped into the process (page-cache pages read by ``pread`` are not counted
in its RSS, pages of a mapping are).

`parse_header` is zswap's one safetensors header parser (`zswap._stheader`: as strict as the ``safetensors``
package), and every byte of data is read through `zswap._stread.RangedFile` (regular files only, the file
checked unchanged since its header was read, short reads continued, errors naming file and tensor):
`read_range` opens it per read, buffered, for the weights loader; `TensorFile` holds one open, O_DIRECT, for
checkpoints and ``zswap export``.
`resolve` turns a path — one ``.safetensors`` file, a sharded index (``*.safetensors.index.json``, the
``weight_map`` layout `save_pretrained` writes), or a folder holding either — into ``name -> TensorEntry``.
"""

from __future__ import annotations

import contextlib
import json
import os
import threading
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass
from pathlib import Path

import torch

from ._fileerrors import (
    CheckpointArgumentError,
    CheckpointCorruptError,
    CheckpointError,
    CheckpointNotFoundError,
)
from ._stheader import DTYPES, MAX_HEADER_BYTES, parse
from ._stread import Identity, RangedFile, identity, open_regular, pread_into

__all__ = [
    "DTYPES",
    "MAX_HEADER_BYTES",
    "CheckpointError",
    "TensorEntry",
    "TensorFile",
    "parse_header",
    "read_range",
    "resolve",
]


@dataclass(frozen=True)
class TensorEntry:
    """One tensor of a safetensors file: where its bytes are."""

    name: str
    path: str
    dtype: torch.dtype
    shape: torch.Size
    offset: int
    """Absolute byte offset of element 0 in the file."""
    ident: Identity | None = None
    """(device, inode, size, mtime) of the file when its header was parsed: `read_range` refuses another."""

    @property
    def numel(self) -> int:
        return self.shape.numel()

    def span(self, start: int, end: int) -> tuple[str, int, int] | None:
        """``(path, offset, length)`` of flattened elements ``[start, end)`` (``end`` clipped to the tensor;
        None when nothing is left): the bytes a ranged read of them touches."""
        end = min(end, self.numel)
        if end <= start:
            return None
        size = self.dtype.itemsize
        return self.path, self.offset + start * size, (end - start) * size


def read_header(path: str) -> dict[str, TensorEntry]:
    """The tensors of one safetensors file, its header validated (`zswap._stheader`); no data is read."""
    fd = open_regular(path)
    try:
        return parse_header(fd, os.fstat(fd).st_size, path)[0]
    finally:
        os.close(fd)


def parse_header(fd: int, size: int, path: str) -> tuple[dict[str, TensorEntry], dict[str, str], int]:
    """(tensors, ``__metadata__``, byte offset of the data) of the safetensors file open as ``fd`` (``size``
    bytes), validated as strictly as the ``safetensors`` package does (`zswap._stheader.parse`); a refusal
    is a `SafetensorsError` naming ``path`` and the tensor."""
    h = parse(fd, size, path)
    ident = identity(fd)
    entries = {
        name: TensorEntry(name, path, dt, shape, at, ident) for name, (dt, shape, at) in h.tensors.items()
    }
    return entries, h.metadata, h.data_start


def resolve(path: str | os.PathLike[str]) -> dict[str, TensorEntry]:
    """``name -> TensorEntry`` of the checkpoint at ``path`` (a file, an index, or a folder of them). In a
    folder, ``model.safetensors`` is the checkpoint where it is there (as ``from_pretrained`` takes it, also
    beside an index or other files), else its one index, else every ``.safetensors`` file in it."""
    p = Path(path)
    if not p.exists():
        raise CheckpointNotFoundError(2, "no checkpoint at this path", str(p))
    if p.is_dir():
        if (p / "model.safetensors").is_file():  # transformers' order: the single file before any index
            return merge([str(p / "model.safetensors")])
        indexes = sorted(p.glob("*.safetensors.index.json"))
        files = sorted(p.glob("*.safetensors"))
        if len(indexes) > 1:
            raise CheckpointArgumentError(
                f"{p}: several index files ({', '.join(i.name for i in indexes)}); pass one"
            )
        if indexes:
            return _from_index(indexes[0])
        if not files:
            raise CheckpointNotFoundError(
                2, "no *.safetensors file and no *.safetensors.index.json in this folder", str(p)
            )
        return merge([str(f) for f in files])
    if p.name.endswith(".json"):
        return _from_index(p)
    return merge([str(p)])


MAX_INDEX_BYTES = 100_000_000
"""An index this long is not one (transformers' largest are a few MB)."""


def _from_index(index: Path) -> dict[str, TensorEntry]:
    with RangedFile(str(index)) as f:
        if f.size > MAX_INDEX_BYTES:
            raise CheckpointCorruptError(f"{index}: not a safetensors index: over {MAX_INDEX_BYTES} bytes")
        raw = bytearray(f.size)
        pread_into(f.fd, memoryview(raw), 0, f.path, "the index")
    try:
        doc = json.loads(raw.decode("utf-8"))
        weight_map = doc["weight_map"] if isinstance(doc, dict) else None
        if not isinstance(weight_map, Mapping):
            raise TypeError("weight_map is not an object")
        bad = next((f for f in weight_map.values() if not isinstance(f, str)), None)
        if bad is not None:
            raise TypeError(f"weight_map names a file as {bad!r}")
    except (ValueError, KeyError, TypeError, RecursionError) as e:
        raise CheckpointCorruptError(
            f"{index}: not a safetensors index (a JSON object with 'weight_map'): {e}"
        ) from None
    for name, file in weight_map.items():
        # As transformers: a shard is a file name next to the index, never a path out of its folder.
        if not file or os.path.isabs(file) or ".." in Path(file).parts or "\0" in file:
            raise CheckpointCorruptError(
                f"{index}: {name!r} is mapped to {file!r}, which is not a file in the index's folder"
            )
    shards = sorted({str(index.parent / f) for f in weight_map.values()})
    for shard in shards:
        if not os.path.exists(shard):
            raise CheckpointNotFoundError(2, f"shard named by {index.name} is missing", shard)
    entries = merge(shards)
    for name, file in weight_map.items():
        found = entries.get(name)
        if found is None or found.path != str(index.parent / file):
            raise CheckpointCorruptError(f"{index}: {name!r} is mapped to {file!r}, which does not hold it")
    return entries


def merge(paths: list[str]) -> dict[str, TensorEntry]:
    """The tensors of several files, each name in one file only."""
    out: dict[str, TensorEntry] = {}
    for path in paths:
        for name, entry in read_header(path).items():
            if name in out:
                raise CheckpointCorruptError(f"tensor {name!r} is in both {out[name].path} and {path}")
            out[name] = entry
    return out


def read_range(entry: TensorEntry, start: int, out: torch.Tensor) -> None:
    """Fill ``out`` (1-D, contiguous, CPU, ``entry.dtype``) with elements ``[start, start + out.numel())``
    of the flattened tensor, reading exactly those bytes (buffered: what `Readahead` put in the page cache),
    from the file whose header gave ``entry`` (a file replaced or resized since is refused)."""
    count = out.numel()
    if count == 0:
        return
    if out.dtype != entry.dtype or not out.is_contiguous() or out.device.type != "cpu":
        raise ValueError(f"read_range into {out.dtype} {out.device} for {entry.name!r} ({entry.dtype})")
    if start < 0 or start + count > entry.numel:
        raise ValueError(f"{entry.name!r}: elements [{start}, {start + count}) outside its {entry.numel}")
    what = repr(entry.name)
    with RangedFile(entry.path, expect=entry.ident, what=what) as f:
        f.read(entry.offset + start * entry.dtype.itemsize, out.view(torch.uint8), what)


@dataclass(frozen=True)
class Stored:
    """One tensor of a `TensorFile`: dtype, shape and absolute byte range."""

    dtype: torch.dtype
    shape: tuple[int, ...]
    begin: int
    end: int


class TensorFile:
    """A safetensors file opened once for many ranged reads (checkpoints, ``zswap export``): its header
    parsed strictly, its data read through one `RangedFile` (``direct``: O_DIRECT staging, as checkpoints
    are read). Errors name the file and the tensor."""

    def __init__(self, path: str | os.PathLike[str], direct: bool = True) -> None:
        self.path = os.fspath(path)
        try:
            self._file = RangedFile(self.path, direct=direct)
        except CheckpointNotFoundError:
            raise CheckpointNotFoundError(2, "checkpoint file does not exist", self.path) from None
        self.size = self._file.size
        try:
            found, self.metadata, self.data_start = parse_header(self._file.fd, self.size, self.path)
        except BaseException:
            self.close()
            raise
        self.entries = {
            name: Stored(e.dtype, tuple(e.shape), e.offset, e.offset + e.numel * e.dtype.itemsize)
            for name, e in found.items()
        }

    def entry(self, name: str) -> Stored:
        try:
            return self.entries[name]
        except KeyError:
            raise CheckpointCorruptError(f"{self.path}: has no entry {name!r}") from None

    def read_at(self, offset: int, out: torch.Tensor, what: str = "data") -> None:
        """Fill ``out`` (contiguous CPU) with the file's bytes from ``offset``."""
        self._file.read(offset, out.detach().reshape(-1).view(torch.uint8), what)

    def scan(self, offset: int, nbytes: int, take: Callable[[int, torch.Tensor], None]) -> None:
        """Hand ``take(pos, bytes)`` the file's bytes ``[offset, offset + nbytes)`` in order, in windows of
        the staging buffers (`RangedFile.scan`): a checksum of a range without a copy of it."""
        self._file.scan(offset, nbytes, take, f"bytes {offset}..{offset + nbytes}")

    def read_elements(self, name: str, start: int, out: torch.Tensor) -> None:
        """Fill ``out`` with ``out.numel()`` elements of entry ``name`` from flat element ``start``."""
        e = self.entry(name)
        size = e.dtype.itemsize
        begin = e.begin + start * size
        if out.dtype != e.dtype or start < 0 or begin + out.numel() * size > e.end:
            raise CheckpointCorruptError(
                f"{self.path}: entry {name!r} ({e.dtype}, {(e.end - e.begin) // size} elements) cannot give "
                f"{out.numel()} {out.dtype} elements from {start}"
            )
        self.read_at(begin, out, repr(name))

    def close(self) -> None:
        if hasattr(self, "_file"):
            self._file.close()

    def __enter__(self) -> TensorFile:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


READAHEAD_BYTES = 512 << 20
"""How far `Readahead` keeps the kernel reading ahead of the loader: enough for the disk to stay busy through
transformers' set-up before the first weight is read (about a second of CPU work) and through the loader's
own work between reads (allocating each partition, queueing its write), little enough to leave the page
cache to others. Page cache, not RSS: the kernel reclaims it under pressure (a page it reclaims before the
loader gets to it is simply read again)."""


def advice_bytes(fd: int) -> int:
    """The most one ``WILLNEED`` on ``fd`` makes the kernel read: it reads at most the larger of the device's
    readahead window and its largest request (``read_ahead_kb``, ``max_sectors_kb``) per call and silently
    drops the rest of a longer range, so longer ranges are advised in pieces of this size. 128 KiB (the
    kernel's default window) where the file is not on a block device sysfs describes."""
    try:
        dev = os.fstat(fd).st_dev
    except OSError:
        return 128 << 10
    base = f"/sys/dev/block/{os.major(dev)}:{os.minor(dev)}"
    for queue in (f"{base}/queue", f"{base}/../queue"):  # a disk, or the disk of a partition
        try:
            with open(f"{queue}/read_ahead_kb") as a, open(f"{queue}/max_sectors_kb") as b:
                kib = max(int(a.read()), int(b.read()))
        except (OSError, ValueError):
            continue
        return min(max(kib, 128), 8 << 10) << 10
    return 128 << 10


class Readahead:
    """Keeps the disk reading ahead of a sequence of ranged reads.

    ``ranges[i]`` is the ``(path, offset, length)`` the loader reads for its i-th item (None: nothing from a
    file). `done(i)` says item ``i`` was read; a thread of its own then asks the kernel
    (``POSIX_FADV_WILLNEED``) for the next items' bytes, up to ``window`` bytes ahead of the loader.

    Why: each ``pread`` of a cold range waits for the disk, and between two reads the loader does CPU work
    (allocating the partition buffer, queueing its write to swap) while the disk idles. A plain sequential
    reader gets the kernel's own readahead, but the loader reads only its rank's slice of each tensor, in
    model order, and a single ``pread`` of a whole tensor is read in readahead-sized pieces one after the
    other. ``WILLNEED`` queues the reads of a range, in pieces of `advice_bytes` (the kernel reads no more
    per call). The pages land in the page cache (reclaimable, not the process's RSS) and the ``pread`` that
    follows copies them. The advice is given off the loader's thread: the kernel allocates the pages and
    submits the reads inside the call, which blocks while the device queue is full (CPython releases the GIL
    around it).
    """

    def __init__(self, ranges: Iterable[tuple[str, int, int] | None], window: int = READAHEAD_BYTES) -> None:
        self._ranges = list(ranges)
        self._window = window
        self._consumed = 0  # bytes of the ranges of items done, or passed over
        self._done = -1
        self._wake = threading.Condition()
        self._stop = False
        self._thread: threading.Thread | None = None
        if window > 0 and any(r is not None and r[2] > 0 for r in self._ranges):
            self._thread = threading.Thread(target=self._run, name="zswap-readahead", daemon=True)
            self._thread.start()

    def done(self, i: int) -> None:
        with self._wake:
            if i > self._done:
                self._consumed += sum(r[2] for r in self._ranges[self._done + 1 : i + 1] if r is not None)
                self._done = i
                self._wake.notify()

    def close(self) -> None:
        with self._wake:
            self._stop = True
            self._wake.notify()
        if self._thread is not None:
            self._thread.join()

    def _run(self) -> None:
        fds: dict[str, tuple[int, int]] = {}  # path -> (fd, bytes per advice)
        advised = 0  # bytes of the ranges advised, or passed over because the loader was past them
        try:
            for nxt, r in enumerate(self._ranges):
                if r is None:
                    continue
                path, offset, length = r
                try:
                    if path not in fds:
                        fd = open_regular(path)
                        fds[path] = fd, advice_bytes(fd)
                except (
                    OSError,
                    CheckpointError,
                ):  # a hint only: the loader's own read reports what is wrong with the file
                    advised += length
                    continue
                fd, step = fds[path]
                for at in range(0, length, step):
                    piece = min(step, length - at)
                    with self._wake:
                        while not self._stop and advised - self._consumed >= self._window:
                            self._wake.wait()
                        if self._stop:
                            return
                        behind = nxt <= self._done  # the loader has read it already
                    advised += piece
                    if not behind:
                        with contextlib.suppress(OSError):
                            os.posix_fadvise(fd, offset + at, piece, os.POSIX_FADV_WILLNEED)
        finally:
            for fd, _ in fds.values():
                os.close(fd)
