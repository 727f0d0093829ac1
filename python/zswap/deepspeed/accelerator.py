"""DeepSpeed's ``deepspeed.accelerator.get_accelerator()`` for scripts ported to `zswap.deepspeed`.

zswap computes where `zswap.initialize` does by default: the current CUDA device when torch sees one, else the
CPU. `get_accelerator` answers for that same device, with the methods DeepSpeed scripts and tests call
(device names, seeds, memory figures, streams, dtypes, the communication backend). Two answers differ
from DeepSpeed's CPU accelerator on purpose: `communication_backend_name` is ``"gloo"`` (the CPU backend
torch ships and zswap runs on; DeepSpeed's CPU accelerator names oneCCL's ``"ccl"``), and `current_device`
is an int. DeepSpeed's compiled-op builders (``create_op_builder``, ``get_op_builder``…) are not part of
zswap: asking for one is an `AttributeError` naming `zswap.optim.OffloadedAdamW`, zswap's CPU Adam.
"""

from __future__ import annotations

import contextlib
import functools
import os
from typing import Any

import torch

from .. import memory

__all__ = ["Accelerator", "get_accelerator", "is_current_accelerator_supported"]


class Accelerator:
    """One compute device kind, ``"cuda"`` or ``"cpu"``, with DeepSpeed's accelerator methods."""

    def __init__(self, name: str) -> None:
        if name not in ("cuda", "cpu"):
            raise ValueError(f"zswap computes on 'cuda' or 'cpu', not {name!r}")
        self._name = name
        self._communication_backend_name = "nccl" if name == "cuda" else "gloo"
        self._cuda = name == "cuda"

    # -- devices ---------------------------------------------------------------------------------------

    def device_name(self, device_index: int | None = None) -> str:
        return self._name if device_index is None or not self._cuda else f"cuda:{device_index}"

    def device(self, device_index: int | None = None) -> Any:
        """A context manager making ``device_index`` current (CUDA); ``None`` on the CPU, as DeepSpeed's."""
        return torch.cuda.device(device_index) if self._cuda else None

    def set_device(self, device_index: int) -> None:
        if self._cuda:
            torch.cuda.set_device(device_index)

    def current_device(self) -> int:
        """The current CUDA device; on the CPU this process's local rank (DeepSpeed's CPU answer)."""
        return torch.cuda.current_device() if self._cuda else int(os.environ.get("LOCAL_RANK", "0"))

    def current_device_name(self) -> str:
        return f"cuda:{torch.cuda.current_device()}" if self._cuda else "cpu"

    def device_count(self) -> int:
        """CUDA devices; on the CPU the processes on this node (``LOCAL_SIZE``, ``LOCAL_WORLD_SIZE``; 1)."""
        if self._cuda:
            return torch.cuda.device_count()
        return int(os.environ.get("LOCAL_SIZE", os.environ.get("LOCAL_WORLD_SIZE", "1")))

    def is_available(self) -> bool:
        return torch.cuda.is_available() if self._cuda else True

    def is_synchronized_device(self) -> bool:
        """Whether work runs in program order on the host (the CPU) rather than on device streams."""
        return not self._cuda

    def use_host_timers(self) -> bool:
        return self.is_synchronized_device()

    def resolves_data_dependency(self) -> bool:
        return self.is_synchronized_device()

    def handles_memory_backpressure(self) -> bool:
        return self.is_synchronized_device()

    def synchronize(self, device_index: int | None = None) -> None:
        if self._cuda:
            torch.cuda.synchronize(device_index)

    def communication_backend_name(self) -> str:
        return self._communication_backend_name

    def is_triton_supported(self) -> bool:
        return self._cuda and torch.cuda.get_device_capability()[0] >= 8

    def lazy_call(self, callback: Any) -> Any:
        return torch.cuda._lazy_call(callback) if self._cuda else callback()

    # -- random numbers --------------------------------------------------------------------------------

    def random(self) -> Any:
        return torch.random

    def manual_seed(self, seed: int) -> Any:
        return torch.cuda.manual_seed(seed) if self._cuda else torch.manual_seed(seed)

    def manual_seed_all(self, seed: int) -> Any:
        return torch.cuda.manual_seed_all(seed) if self._cuda else torch.manual_seed(seed)

    def initial_seed(self) -> int:
        return torch.cuda.initial_seed() if self._cuda else torch.initial_seed()

    def get_rng_state(self, device_index: int | None = None) -> torch.Tensor:
        if self._cuda:
            return torch.cuda.get_rng_state("cuda" if device_index is None else device_index)
        return torch.get_rng_state()

    def set_rng_state(self, new_state: torch.Tensor, device_index: int | None = None) -> None:
        if self._cuda:
            torch.cuda.set_rng_state(new_state, "cuda" if device_index is None else device_index)
        else:
            torch.set_rng_state(new_state)

    def default_generator(self, device_index: int) -> torch.Generator:
        return torch.cuda.default_generators[device_index] if self._cuda else torch.default_generator

    # -- streams and events (the CPU has none: DeepSpeed's CPU answers) ------------------------------

    @property
    def Stream(self) -> Any:
        return torch.cuda.Stream if self._cuda else None

    @property
    def Event(self) -> Any:
        return torch.cuda.Event if self._cuda else None

    def stream(self, stream: Any) -> Any:
        return torch.cuda.stream(stream) if self._cuda else contextlib.nullcontext()

    def current_stream(self, device_index: int | None = None) -> Any:
        return torch.cuda.current_stream(device_index) if self._cuda else None

    def default_stream(self, device_index: int | None = None) -> Any:
        return torch.cuda.default_stream(device_index) if self._cuda else None

    def range_push(self, msg: str, domain: Any = None, category: Any = None) -> None:
        if self._cuda:
            torch.cuda.nvtx.range_push(msg)

    def range_pop(self, domain: Any = None) -> None:
        if self._cuda:
            torch.cuda.nvtx.range_pop()

    # -- memory ----------------------------------------------------------------------------------------

    def empty_cache(self) -> None:
        if self._cuda:
            torch.cuda.empty_cache()

    def memory_allocated(self, device_index: int | None = None) -> int:
        return torch.cuda.memory_allocated(device_index) if self._cuda else memory.rss()

    def max_memory_allocated(self, device_index: int | None = None) -> int:
        return torch.cuda.max_memory_allocated(device_index) if self._cuda else _peak_rss()

    def memory_reserved(self, device_index: int | None = None) -> int:
        return torch.cuda.memory_reserved(device_index) if self._cuda else memory.rss()

    def max_memory_reserved(self, device_index: int | None = None) -> int:
        return torch.cuda.max_memory_reserved(device_index) if self._cuda else _peak_rss()

    def reset_peak_memory_stats(self, device_index: int | None = None) -> None:
        if self._cuda:
            torch.cuda.reset_peak_memory_stats(device_index)
        else:
            _reset_peak_rss()

    def reset_max_memory_allocated(self, device_index: int | None = None) -> None:
        self.reset_peak_memory_stats(device_index)

    def total_memory(self, device_index: int | None = None) -> int:
        if self._cuda:
            return int(torch.cuda.get_device_properties(device_index or 0).total_memory)
        return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")

    def available_memory(self, device_index: int | None = None) -> int:
        if self._cuda:
            return int(torch.cuda.mem_get_info(device_index)[0])
        return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_AVPHYS_PAGES")

    def pin_memory(self, tensor: torch.Tensor, align_bytes: int = 1) -> torch.Tensor:
        return tensor.pin_memory() if self._cuda else tensor

    def is_pinned(self, tensor: torch.Tensor) -> bool:
        return bool(tensor.is_pinned()) if self._cuda else False

    def on_accelerator(self, tensor: torch.Tensor) -> bool:
        return tensor.device.type == self._name

    # -- dtypes ----------------------------------------------------------------------------------------

    def is_bf16_supported(self) -> bool:
        return bool(torch.cuda.is_bf16_supported()) if self._cuda else True

    def is_fp16_supported(self) -> bool:
        """fp16 trains with loss scaling on either device (zswap's fp32 master weights on the host)."""
        return True

    def supported_dtypes(self) -> list[torch.dtype]:
        half = [torch.bfloat16] if self.is_bf16_supported() else []
        return [torch.float32, *half, torch.float16]

    def __getattr__(self, name: str) -> Any:
        if name.startswith("__"):
            raise AttributeError(name)
        if name in _TENSOR_TYPES:  # DeepSpeed's legacy tensor-type names: a tensor maker on this device
            return functools.partial(torch.tensor, dtype=_TENSOR_TYPES[name], device=self._name)
        why = (
            "DeepSpeed's compiled ops are not part of zswap (its CPU Adam is zswap.optim.OffloadedAdamW, "
            "built by zswap.deepspeed.initialize from the config's optimizer section)"
            if "op_builder" in name
            else f"it answers DeepSpeed's device, seed, stream, memory and dtype calls for {self._name!r}"
        )
        raise AttributeError(f"zswap's accelerator has no {name!r}: {why}")

    def __repr__(self) -> str:
        return f"zswap.deepspeed.accelerator.Accelerator({self._name!r})"


_TENSOR_TYPES = {
    "FloatTensor": torch.float32, "HalfTensor": torch.float16, "BFloat16Tensor": torch.bfloat16,
    "DoubleTensor": torch.float64, "ByteTensor": torch.uint8, "IntTensor": torch.int32,
    "LongTensor": torch.int64, "BoolTensor": torch.bool,
}  # fmt: skip


def _peak_rss() -> int:
    """Peak resident memory since the process started or `_reset_peak_rss` (the kernel's high-water mark)."""
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith("VmHWM:"):
                return int(line.split()[1]) * 1024
    raise OSError("/proc/self/status has no VmHWM")


def _reset_peak_rss() -> None:
    # Writing 5 to clear_refs resets the process's VmHWM to its current RSS (Linux >= 4.0, proc(5)).
    with open("/proc/self/clear_refs", "w") as f:
        f.write("5")


@functools.cache
def _for(name: str) -> Accelerator:
    return Accelerator(name)


def get_accelerator() -> Accelerator:
    """The accelerator zswap computes on by default: CUDA where torch sees a device, else the CPU."""
    return _for("cuda" if torch.cuda.is_available() else "cpu")


def is_current_accelerator_supported() -> bool:
    return True
