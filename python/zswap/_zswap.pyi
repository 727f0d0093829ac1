"""Type stubs for the Rust extension. Use `zswap.SwapEngine`; these are its internals."""

import os
from collections.abc import Sequence
from typing import Any, final

__all__ = [
    "Buffer",
    "Engine",
    "Handle",
    "__version__",
    "cpu_adam_isa",
    "cpu_adam_redo",
    "cpu_adam_step",
    "crc32c",
    "io_uring_available",
    "io_uring_errno",
    "probe_direct_io",
    "raw_io_uring_baseline",
    "version",
]

__version__: str
"""The package version (Cargo.toml's, the one place it is set)."""

@final
class Handle:
    """The completion of one write or read."""

    @property
    def key(self) -> str: ...
    def wait(self) -> None:
        """Blocks (without the GIL) until done; raises the transfer's error, every time it is called."""
    def done(self) -> bool: ...

@final
class Buffer:
    """Page-aligned engine memory; `zswap._memview.tensor_over` wraps it as a tensor (no buffer protocol:
    the abi3-py310 build has none)."""

    @property
    def address(self) -> int: ...
    @property
    def capacity(self) -> int: ...
    @property
    def page_kind(self) -> str: ...
    def __len__(self) -> int: ...

@final
class Engine:
    def __new__(
        cls,
        paths: Sequence[str | os.PathLike[str]],
        *,
        block_size: int | None = None,
        queue_depth: int | None = None,
        threads: int | None = None,
        backend: str = "auto",
        direct: bool | None = None,
        checksum: bool = False,
        pinned_memory_budget: int | None = None,
        lock_memory: bool = False,
        zero_copy_reads: bool | None = None,
    ) -> Engine: ...
    def write(self, key: str, ptr: int, nbytes: int, keep: object) -> Handle:
        """Copy-on-write: the key reads its previous value until this write completes. `ptr..ptr+nbytes`
        must be mapped and readable (checked: `InvalidTensorError`)."""
    def read(self, key: str, ptr: int, nbytes: int, keep: object) -> Handle:
        """`ptr..ptr+nbytes` must be mapped and writable (checked: `InvalidTensorError`)."""
    def free(self, key: str) -> None: ...
    def trim(self) -> None: ...
    def contains(self, key: str) -> bool: ...
    def nbytes(self, key: str) -> int: ...
    def keys(self) -> list[str]: ...
    def alloc(self, nbytes: int) -> Buffer: ...
    def stats(self) -> dict[str, Any]: ...
    def info(self) -> dict[str, Any]: ...
    def closed(self) -> bool: ...
    def close(self) -> None: ...
    def inject_fault(self, op: str, kind: str, value: int = 0, skip: int = 0, count: int = 1) -> None:
        """Test hook. `op`: "read", "write" or "submit" (an io_uring worker's io_uring_enter); `kind`:
        "errno" (`value`), "short" (`value` bytes), "corrupt" (reads), "lost" (writes)."""
    def clear_faults(self) -> None: ...

def io_uring_available() -> str | None:
    """None when io_uring can be set up here, else the reason it was refused."""

def raw_io_uring_baseline(
    path: str | os.PathLike[str], size: int, block_size: int, queue_depth: int
) -> tuple[float, float]:
    """Seconds to write then read `size` bytes with a bare io_uring O_DIRECT loop (the raw-disk baseline)."""

def cpu_adam_step(
    numel: int,
    param: int,
    param_dtype: str,
    grad: int,
    grad_dtype: str,
    master: int | None,
    exp_avg: int,
    exp_avg_sq: int,
    *,
    step: int,
    lr: float,
    beta1: float,
    beta2: float,
    eps: float,
    weight_decay: float,
    decoupled: bool,
    grad_scale: float = 1.0,
    tail_from: int | None = None,
) -> None:
    """One Adam/AdamW step over `numel` elements at the given addresses (use `zswap.optim.cpu_adam_step`,
    which validates the tensors). `master=None`: the float32 param is its own master. `tail_from`: the
    elements from that index on are updated as torch's fused AdamW updates a tensor's scalar tail. Runs
    without the GIL."""

def cpu_adam_redo(
    numel: int,
    param: int,
    param_dtype: str,
    master: int | None,
    exp_avg: int,
    exp_avg_sq: int,
    *,
    step: int,
    lr: float,
    beta1: float,
    beta2: float,
    eps: float,
    weight_decay: float,
    decoupled: bool,
) -> None:
    """One Adam/AdamW step run again from moments that already hold its gradient: the master (the float32
    param itself with `master=None`) from its value before the step, cast into `param` (use
    `zswap.step.optim._kernel.cpu_adam_redo`, which validates the tensors). Runs without the GIL."""

def cpu_adam_isa() -> str:
    """The instruction set the Adam kernel runs on here: "avx512", "avx2" or "portable"."""

def version() -> str:
    """The package version; the same as `__version__`."""

def io_uring_errno() -> int | None:
    """The errno with which io_uring setup is refused here; None when it works. Honours
    ZSWAP_DISABLE_IO_URING like the engine."""

def probe_direct_io(path: str | os.PathLike[str]) -> dict[str, Any]:
    """Opens a swap file in `path` as the engine does (O_DIRECT tried and proved, else buffered): keys
    `direct`, `reason`, `offset_align`, `mem_align`, `statx_dioalign`."""

def crc32c(address: int, nbytes: int, seed: int = 0) -> int:
    """CRC-32C of `nbytes` bytes at `address` (memory the caller keeps alive), continuing from `seed`."""
