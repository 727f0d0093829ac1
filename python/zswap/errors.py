"""zswap's exception and warning types.

Every exception zswap raises on purpose derives from `ZswapError`, and also from the built-in type a caller
would already catch for the same fault, so existing ``except`` blocks keep working::

    ZswapError
    ├── ConfigError (ValueError)                      bad configuration value
    │   └── NvmePathError                             a swap directory is unusable
    │       ├── NvmePathMissing (FileNotFoundError)
    │       ├── NvmePathNotADirectory (NotADirectoryError)
    │       └── NvmePathNotWritable (PermissionError)
    ├── InvalidTensorError (ValueError)               a tensor the engine cannot move bytes of
    ├── SwapIOError (OSError)                         I/O failed: errno, path, offset, length, key, block
    │   └── ChecksumError                             data read back does not match its crc32c
    ├── UnavailableError (OSError)                    a kernel facility the caller required was refused
    │   ├── BackendUnavailable                        backend="io_uring"
    │   └── DirectIOUnavailable                       direct=True
    ├── SwapMemoryError (MemoryError)                 the kernel refused memory (ENOMEM)
    ├── ThreadStartError (RuntimeError)               an engine thread could not be started
    ├── EngineClosedError (RuntimeError)              a SwapEngine or Engine used after close()
    ├── GradientsNotKeptError (RuntimeError)          gradients the early step applied were not kept
    ├── RanksDivergedError (RuntimeError)             ranks gathered different params since the last step
    ├── FunctionalTransformError (RuntimeError)       a forward inside a torch.func transform
    ├── SparseGradientError (RuntimeError)            a sparse gradient (an Embedding with sparse=True)
    ├── UnsupportedDtypeError (TypeError)             a param of a dtype zswap's AdamW does not step
    └── UnknownKeyError (KeyError)                    a key never written, or freed
    ZswapWarning (RuntimeWarning)                     a fallback was taken

The Rust engine's errors become these in one place (``src/py/convert.rs``).
"""

from __future__ import annotations

from typing import Any


class ZswapError(Exception):
    """Root of zswap's exceptions."""


class ConfigError(ZswapError, ValueError):
    """A configuration value is missing, unknown, of the wrong type or out of range."""


class _OSErrorArgs:
    """Gives a class that mixes a `ValueError` with an `OSError` subclass the `OSError` constructor, so
    ``errno``, ``strerror`` and ``filename`` are set (`ValueError` comes first in the MRO otherwise)."""

    __new__ = OSError.__new__  # type: ignore[assignment]
    __init__ = OSError.__init__


class NvmePathError(ConfigError):
    """A swap directory (``nvme_path``, `SwapEngine` paths) is missing, not a directory or not
    writable. Raised before anything is built; carries ``errno`` and ``filename`` (the path)."""


class NvmePathMissing(_OSErrorArgs, NvmePathError, FileNotFoundError):
    """The directory does not exist (zswap never creates it: a typo must not fill the wrong disk)."""


class NvmePathNotADirectory(_OSErrorArgs, NvmePathError, NotADirectoryError):
    """The path exists but is not a directory."""


class NvmePathNotWritable(_OSErrorArgs, NvmePathError, PermissionError):
    """The directory is not writable (permissions, or a read-only file system: ``errno`` EROFS)."""


class InvalidTensorError(ZswapError, ValueError):
    """A tensor handed to the engine is refused before any byte moves: not a dense CPU tensor, a meta or
    fake tensor, storage smaller than its size, a lazily conjugated/negated view as a read destination,
    read-only memory as a read destination, or the wrong size for the key."""


class SwapIOError(ZswapError, OSError):
    """An I/O operation on a swap file failed.

    Carries the ``errno``, the ``path`` of the swap file (or its directory), and the byte ``offset`` and
    ``length`` of the failed transfer; ``key`` and ``block`` name the swapped tensor where known.
    """

    def __init__(
        self,
        errno: int,
        message: str,
        path: str | None = None,
        offset: int | None = None,
        length: int | None = None,
        key: str | None = None,
        block: int | None = None,
    ) -> None:
        super().__init__(errno, message, path)
        self.path = path
        self.offset = offset
        self.length = length
        self.key = key
        self.block = block

    def __str__(self) -> str:
        parts = [f"[Errno {self.errno}] {self.strerror}"]
        if self.key is not None:
            parts.append(f"key={self.key!r}")
        if self.block is not None:
            parts.append(f"block={self.block}")
        if self.path is not None:
            parts.append(f"path={self.path!r}")
        if self.offset is not None:
            parts.append(f"offset={self.offset}")
        if self.length is not None:
            parts.append(f"length={self.length}")
        return ", ".join(parts)

    def __reduce__(self) -> tuple[Any, ...]:  # keep every field across pickling (multiprocessing)
        return (
            type(self),
            (self.errno, self.strerror, self.path, self.offset, self.length, self.key, self.block),
        )


class ChecksumError(SwapIOError):
    """Bytes read back do not match the crc32c recorded when they were written (a flipped bit on the
    drive, a lost write). ``errno`` is EIO; ``key`` and ``block`` name the block."""


class UnavailableError(ZswapError, OSError):
    """A kernel facility the caller required was refused; the message says what and why, ``errno`` is the
    kernel's answer. With ``"auto"`` settings zswap falls back instead (and warns once)."""


class BackendUnavailable(UnavailableError):
    """``backend="io_uring"`` was asked for but io_uring cannot be set up here (ENOSYS, EPERM under
    seccomp or ``kernel.io_uring_disabled``, ENOMEM when a ring exceeds RLIMIT_MEMLOCK)."""


class DirectIOUnavailable(UnavailableError):
    """``direct=True`` was asked for but the file system refuses O_DIRECT."""


class SwapMemoryError(ZswapError, MemoryError):
    """The kernel refused memory (ENOMEM): an engine buffer mapping. ``errno`` is set."""

    def __init__(self, message: str, errno: int | None = None) -> None:
        super().__init__(message)
        self.errno = errno


class ThreadStartError(ZswapError, RuntimeError):
    """An engine worker thread could not be started (``errno``: usually EAGAIN, RLIMIT_NPROC)."""

    def __init__(self, message: str, errno: int | None = None) -> None:
        super().__init__(message)
        self.errno = errno


class EngineClosedError(ZswapError, RuntimeError):
    """An operation was attempted on a `SwapEngine`, or on a `zswap.Engine` (``step``, ``backward``,
    ``zero_grad``, checkpoints), after its ``close()``."""


class GradientsNotKeptError(ZswapError, RuntimeError):
    """A step's gradients were applied in backward by the early step (`zswap.earlystep`) and not kept
    (``Engine.keep_applied_grads`` false), and something now needs them: the early step cannot be made
    live (the message says why), a second backward would accumulate onto them, or `zswap.full_grad` reads
    one. Params and optimizer states are as before the step; ``engine.zero_grad()`` and another backward
    start over. Raising it marks those gradients wanted: with ``keep_applied_grads = "auto"`` (the default)
    they are kept from the next backward on; ``keep_applied_grads = True`` keeps them always."""


class RanksDivergedError(ZswapError, RuntimeError):
    """Over several ranks, the forwards and backwards since the last step did not gather (or reduce the
    gradients of) the same params in the same order on every rank: a collective paired one rank's
    partition of one param with another rank's partition of another, so those passes computed with mixed
    weights. `zswap.Engine.step` checks before it changes anything and raises this instead, as does the
    end of a forward that no backward follows (before its outputs are returned); the message names the
    cause and the fix (leaf modules)."""


class FunctionalTransformError(ZswapError, RuntimeError):
    """A forward of a zswap model inside a ``torch.func`` transform (``grad``, ``vmap``, ``jacrev`` …): its
    params are gathered and released by hooks inside the forward, and functorch sees them as tensors that
    escape its levels (torch's own failure is an internal assert, or a crash). Compute gradients with
    autograd (``loss.backward()``, ``engine.backward(loss)``), or run the transform on a plain model."""


class SparseGradientError(ZswapError, RuntimeError):
    """A managed param with a sparse gradient (``nn.Embedding(sparse=True)``): zswap partitions, reduces
    and offloads dense gradients only."""


class UnsupportedDtypeError(ZswapError, TypeError):
    """A param `zswap.optim.OffloadedAdamW` cannot step (float64, an integer dtype...): refused when the
    optimizer is built, before any step."""


class UnknownKeyError(ZswapError, KeyError):
    """A `SwapEngine` key that was never written, or was freed."""

    def __str__(self) -> str:  # KeyError's repr-quoting would hide the message
        return str(self.args[0]) if self.args else "unknown key"


class ZswapWarning(RuntimeWarning):
    """A fallback was taken (psync instead of io_uring, buffered instead of direct I/O, ...)."""


__all__ = [
    "BackendUnavailable",
    "ChecksumError",
    "ConfigError",
    "DirectIOUnavailable",
    "EngineClosedError",
    "FunctionalTransformError",
    "GradientsNotKeptError",
    "InvalidTensorError",
    "NvmePathError",
    "NvmePathMissing",
    "NvmePathNotADirectory",
    "NvmePathNotWritable",
    "RanksDivergedError",
    "SparseGradientError",
    "SwapIOError",
    "SwapMemoryError",
    "ThreadStartError",
    "UnavailableError",
    "UnknownKeyError",
    "UnsupportedDtypeError",
    "ZswapError",
    "ZswapWarning",
]
