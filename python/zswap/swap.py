"""`SwapEngine`: tensors in, bytes on disk — the Python face of the Rust engine.

Torch knowledge stops here: the engine below sees an address, a byte count and an object to keep alive.
"""

from __future__ import annotations

import logging
import math
import os
import warnings
from collections.abc import Iterator, Sequence
from typing import TYPE_CHECKING, Any, Literal

import torch

from . import _zswap
from ._memview import tensor_over
from .errors import ConfigError, EngineClosedError, InvalidTensorError, ZswapWarning

if TYPE_CHECKING:
    from ._zswap import Handle

PathArg = str | os.PathLike[str]
Backend = Literal["auto", "io_uring", "psync"]

_BACKENDS = ("auto", "io_uring", "psync")
_CHECKSUMS = ("off", "crc32c")


class _WarnOnce:
    """Each distinct fallback note is warned about once per process, not once per engine."""

    def __init__(self) -> None:
        self._seen: set[str] = set()

    def __call__(self, note: str, stacklevel: int) -> None:
        if note not in self._seen:
            self._seen.add(note)
            warnings.warn(note, ZswapWarning, stacklevel=stacklevel + 1)


_warn_once = _WarnOnce()
_log = logging.getLogger(__name__)


def _normalize_paths(paths: PathArg | Sequence[PathArg]) -> list[str]:
    if isinstance(paths, str | os.PathLike):
        return [os.fspath(paths)]
    if isinstance(paths, Sequence) and not isinstance(paths, bytes):
        out = [os.fspath(p) for p in paths]
        if out:
            return out
        raise ConfigError("SwapEngine needs at least one path")
    raise TypeError(f"paths must be a path or a sequence of paths, got {type(paths).__name__}")


def _check_int(name: str, value: int | None) -> int | None:
    if value is not None and (isinstance(value, bool) or not isinstance(value, int) or value <= 0):
        raise ConfigError(f"{name} must be a positive integer, got {value!r}")
    return value


class SwapEngine:
    """Moves tensor bytes between memory and unlinked swap files in `paths` (several: striped).

    Args:
        paths: a directory, or a list of directories on different drives to stripe over.
        block_size: bytes per transfer, a power of two from 4 KiB to 64 MiB (default: the largest
            request the drive takes whole, from its sysfs limits, 64 KiB to 4 MiB; 1 MiB without a block
            device). `info["block_size_reason"]` says why.
        queue_depth: transfers in flight across the engine (default: 16 MiB in flight, at least 4).
        threads: io_uring rings (default 2, at least one per path); psync uses `queue_depth` threads.
        backend: "io_uring", "psync", or "auto" (io_uring, else psync with a `ZswapWarning`).
        direct: True for O_DIRECT, False for buffered, "auto" (direct, else buffered with a warning).
        checksum: "crc32c" records a CRC per block and checks it on read, so a flipped bit or a lost
            write raises `ChecksumError` instead of returning wrong bytes; "off" (default: README,
            "Checksums", gives the measured cost) skips it.
        pinned_memory_budget: bytes of bounce buffers (default one block per slot, plus one spare per
            io_uring ring so a block is copied while every slot is in flight).
        lock_memory: mlock engine buffers where RLIMIT_MEMLOCK allows.
        zero_copy_reads: whether direct reads land straight in engine buffers (True) or pass through the
            bounce buffers (False). Default None: the engine decides for the drive, bounced on a virtio
            disk, where the host's DMA into a large destination measured slower than the copy;
            `info["zero_copy_reads_reason"]` says why.

    `write`/`read` return at once with a `Handle`; the engine keeps the tensor alive until the transfer
    is done, and the caller must not modify a written tensor (or touch a read one) before `wait()`.
    Every tensor is checked before any byte moves (`InvalidTensorError`: not a dense CPU tensor, meta or
    fake, storage smaller than its size, unmapped or — for `read` — read-only memory, a lazily
    conjugated/negated view as a destination). An overwrite is copy-on-write: the key reads its previous
    value until the new write has completed, and keeps it if the write fails. After `close()` every call
    but `stats()`/`close()` raises `EngineClosedError`.
    """

    def __init__(
        self,
        paths: PathArg | Sequence[PathArg],
        *,
        block_size: int | None = None,
        queue_depth: int | None = None,
        threads: int | None = None,
        backend: Backend = "auto",
        direct: bool | Literal["auto"] = "auto",
        checksum: Literal["off", "crc32c"] = "off",
        pinned_memory_budget: int | None = None,
        lock_memory: bool = False,
        zero_copy_reads: bool | None = None,
    ) -> None:
        if backend not in _BACKENDS:
            raise ConfigError(f"backend must be one of {_BACKENDS}, got {backend!r}")
        if direct != "auto" and not isinstance(direct, bool):
            raise ConfigError(f"direct must be True, False or 'auto', got {direct!r}")
        if checksum not in _CHECKSUMS:
            raise ConfigError(f"checksum must be one of {_CHECKSUMS}, got {checksum!r}")
        self._engine = _zswap.Engine(
            _normalize_paths(paths),
            block_size=_check_int("block_size", block_size),
            queue_depth=_check_int("queue_depth", queue_depth),
            threads=_check_int("threads", threads),
            backend=backend,
            direct=None if direct == "auto" else direct,
            checksum=checksum == "crc32c",
            pinned_memory_budget=_check_int("pinned_memory_budget", pinned_memory_budget),
            lock_memory=bool(lock_memory),
            zero_copy_reads=None if zero_copy_reads is None else bool(zero_copy_reads),
        )
        self.info: dict[str, Any] = dict(self._engine.info())
        _log.info(
            "swap engine on %s: backend %s, direct I/O %s (alignment %d B), block %d KiB, queue depth %d, "
            "%d thread(s), bounce buffers %d MiB", ", ".join(self.info["paths"]), self.info["backend"],
            self.info["direct"], self.info["io_align"], self.info["block_size"] >> 10,
            self.info["queue_depth"], self.info["threads"], self.info["bounce_bytes"] >> 20,
        )  # fmt: skip
        for note in self.info["notes"]:
            _warn_once(note, stacklevel=2)

    @classmethod
    def from_config(cls, aio: Any, paths: PathArg | Sequence[PathArg]) -> SwapEngine:
        """An engine with the settings of a config's `aio` section (`ZswapConfig.aio`)."""
        return cls(paths, **aio.engine_kwargs())

    # -- transfers -------------------------------------------------------------------------------

    def write(self, key: str, tensor: torch.Tensor) -> Handle:
        """Starts writing `tensor`'s values under `key`; the key reads its previous value until this
        write has completed successfully (copy-on-write), and keeps it if the write fails."""
        _check_key(key)
        t = _checked_tensor(tensor, "write").detach()
        if t.is_conj() or t.is_neg():
            t = t.resolve_conj().resolve_neg()  # store the values, not the lazy view's raw bytes
        if not t.is_contiguous():
            t = t.contiguous()  # the copy is what the Handle keeps alive
        return self._engine.write(key, t.data_ptr(), _nbytes(t), t)

    def read(self, key: str, out: torch.Tensor) -> Handle:
        """Starts reading `key` into `out`, which must be contiguous and hold exactly the bytes written."""
        _check_key(key)
        t = _checked_tensor(out, "read")
        if t.is_conj() or t.is_neg():
            raise InvalidTensorError(
                f"read of key {key!r}: out is a lazily {'conjugated' if t.is_conj() else 'negated'} view; "
                "raw bytes read into it would come back with other values (read into a plain tensor, "
                "then copy_ into the view)"
            )
        if not t.is_contiguous():
            raise InvalidTensorError(f"read of key {key!r} needs a contiguous output tensor")
        want = self._engine.nbytes(key)
        if _nbytes(t) != want:
            raise InvalidTensorError(
                f"key {key!r} holds {want} bytes but out holds {_nbytes(t)} "
                f"({t.dtype}, shape {tuple(t.shape)})"
            )
        return self._engine.read(key, t.data_ptr(), want, t)

    def free(self, key: str) -> None:
        """Forgets `key` and returns its space (after transfers still using it finish)."""
        _check_key(key)
        self._engine.free(key)

    def trim(self) -> None:
        """Gives the swap files' free space back to the file system now. A freed key's space is otherwise
        kept for reuse (and given back only once more than 128 MiB and twice the live bytes lie idle),
        since a rewrite to it costs no new allocation."""
        self._engine.trim()

    def empty(self, shape: int | Sequence[int], dtype: torch.dtype = torch.float32) -> torch.Tensor:
        """An uninitialised-looking (zero-filled) tensor living in an engine buffer: page-aligned, on huge
        pages when large, so `write`/`read` on it copy nothing."""
        size = torch.Size([shape] if isinstance(shape, int) else shape)
        nbytes = math.prod(size) * dtype.itemsize
        if self.closed:
            raise EngineClosedError("the swap engine is closed")
        if nbytes == 0:
            return torch.empty(size, dtype=dtype)
        buf = self._engine.alloc(nbytes)
        return tensor_over(buf, nbytes).view(dtype).view(size)

    # -- bookkeeping -----------------------------------------------------------------------------

    def __contains__(self, key: object) -> bool:
        return isinstance(key, str) and self._engine.contains(key)

    def nbytes(self, key: str) -> int:
        return int(self._engine.nbytes(key))

    def keys(self) -> Iterator[str]:
        return iter(self._engine.keys())

    def stats(self) -> dict[str, Any]:
        """Bytes and operations so far, seconds with I/O outstanding, and the settings in force."""
        s: dict[str, Any] = dict(self._engine.stats())
        for k in ("backend", "direct", "block_size", "queue_depth", "threads", "fixed_buffers", "checksum"):
            s[k] = self.info[k]
        return s

    @property
    def closed(self) -> bool:
        return bool(self._engine.closed())

    def close(self) -> None:
        """Finishes queued transfers and deletes the swap space. Idempotent."""
        self._engine.close()

    def __enter__(self) -> SwapEngine:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def __repr__(self) -> str:
        state = "closed" if self.closed else f"{self.info['backend']}, direct={self.info['direct']}"
        return f"SwapEngine({self.info['paths']!r}, {state})"


def _check_key(key: object) -> None:
    if not isinstance(key, str):
        raise TypeError(f"keys are str, got {type(key).__name__}")


def _is_fake(t: torch.Tensor) -> bool:
    try:
        from torch._subclasses.fake_tensor import FakeTensor
    except ImportError:  # pragma: no cover - a torch without fake tensors
        return False
    return isinstance(t, FakeTensor)


def _checked_tensor(t: object, what: str) -> torch.Tensor:
    """`t` if the engine can move its bytes, else `InvalidTensorError` naming why — checked before any
    byte moves, since the engine trusts the address and length it is given (the Rust binding checks
    the mapping again: unmapped or, for a read, read-only memory)."""
    if not isinstance(t, torch.Tensor):
        raise TypeError(f"{what} needs a torch.Tensor, got {type(t).__name__}")
    if t.device.type != "cpu" or t.layout != torch.strided:
        raise InvalidTensorError(f"{what} needs a dense CPU tensor, got layout {t.layout} on {t.device}")
    if t.is_meta or _is_fake(t):
        raise InvalidTensorError(
            f"{what} needs a tensor with memory, got a {'meta' if t.is_meta else 'fake'} tensor"
        )
    if t.numel() == 0:
        return t
    if t.data_ptr() == 0:
        raise InvalidTensorError(f"{what}: the tensor has no memory (data_ptr() is 0)")
    # The furthest element the view reaches must lie inside its storage (a storage shrunk with
    # `untyped_storage().resize_()` would otherwise let the engine touch memory past it).
    last = t.storage_offset() + sum((n - 1) * st for n, st in zip(t.shape, t.stride(), strict=True))
    need = (last + 1) * t.element_size()
    have = t.untyped_storage().nbytes()
    if min(t.stride(), default=0) < 0 or need > have:
        raise InvalidTensorError(
            f"{what}: the tensor ({t.dtype}, shape {tuple(t.shape)}, offset {t.storage_offset()}) reaches "
            f"byte {need} of its storage, which holds {have} bytes"
        )
    return t


def _nbytes(t: torch.Tensor) -> int:
    return t.numel() * t.element_size()


__all__ = ["SwapEngine"]
