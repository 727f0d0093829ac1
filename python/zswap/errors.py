"""zswap's exception and warning types.

Every exception zswap raises on purpose derives from `ZswapError`, and also from the built-in type a caller
would already catch for the same fault (`ValueError` for bad configuration, `OSError` for I/O), so existing
``except OSError`` blocks keep working.
"""

from __future__ import annotations


class ZswapError(Exception):
    """Root of zswap's exceptions."""


class ConfigError(ZswapError, ValueError):
    """A configuration value is missing, unknown, of the wrong type or out of range."""


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

    def __reduce__(self):  # keep every field across pickling (multiprocessing, torch.distributed)
        return (
            type(self),
            (self.errno, self.strerror, self.path, self.offset, self.length, self.key, self.block),
        )


class EngineClosedError(ZswapError, RuntimeError):
    """An operation was attempted on a `SwapEngine` after `close()`."""


class UnknownKeyError(ZswapError, KeyError):
    """A `SwapEngine` key that was never written, or was freed."""

    def __str__(self) -> str:  # KeyError's repr-quoting would hide the message
        return str(self.args[0]) if self.args else "unknown key"


class ZswapWarning(RuntimeWarning):
    """A fallback was taken (psync instead of io_uring, buffered instead of direct I/O, ...)."""


__all__ = [
    "ConfigError",
    "EngineClosedError",
    "SwapIOError",
    "UnknownKeyError",
    "ZswapError",
    "ZswapWarning",
]
