"""What ``offload_param.buffer_count``, ``buffer_size`` and ``max_in_cpu`` do to a running engine.

These are DeepSpeed's keys for the NVMe tier of params (they mean nothing for the ``cpu`` or ``none`` tiers,
in DeepSpeed as here):

- ``buffer_size`` (elements): the size of one fetch buffer — the largest param partition that can be read
  from NVMe. A partition larger than it is a `ConfigError` at `zswap.initialize` naming the param (as
  DeepSpeed refuses a param larger than its swap buffers), so a size chosen for one model is not silently
  outgrown by another.
- ``buffer_count``: how many fetch buffers are kept for reuse (page-aligned engine memory that later
  fetches read into without faulting in fresh pages): ``buffer_count × buffer_size`` elements (``×`` the
  largest NVMe partition when ``buffer_size`` is left out). Without it zswap keeps what its live budget
  can hold at once. Fetches beyond the pool still work: their buffers are allocated and freed.
- ``max_in_cpu`` (elements): params kept gathered in host memory between uses, on top of the small
  persistent ones, so they are read from NVMe once instead of at every forward and backward. Taken in
  ``model.parameters()`` order, each param that still fits; their NVMe copy stays the one the optimizer
  updates.
"""

from __future__ import annotations

from collections.abc import Mapping

from .config import ZswapConfig
from .errors import ConfigError
from .gather import Item


def resident(items: list[Item], cfg: ZswapConfig, threshold: int) -> frozenset[int]:
    """ids of the NVMe params ``max_in_cpu`` keeps gathered (those above the persistence ``threshold``)."""
    left = cfg.offload_param.max_in_cpu
    out: set[int] = set()
    for p, st in items:
        if st.tier == "nvme" and st.numel > threshold and st.numel <= left:
            out.add(id(p))
            left -= st.numel
    return frozenset(out)


def fetch_pool_bytes(items: list[Item], cfg: ZswapConfig, names: Mapping[int, str], default: int) -> int:
    """Bytes of fetch buffers an NVMe param store keeps for reuse: ``buffer_count × buffer_size`` elements
    when the config sets them, else ``default``. `ConfigError` for a partition larger than
    ``buffer_size``, naming it."""
    off = cfg.offload_param
    nvme = [(p, st) for p, st in items if st.tier == "nvme"]
    if not nvme:
        return default
    itemsize = max(st.dtype.itemsize for _, st in nvme)
    largest_p, largest = max(nvme, key=lambda item: item[1].partition_numel)
    if off.buffer_size is not None and largest.partition_numel > off.buffer_size:
        name = names.get(id(largest_p), "a param")
        raise ConfigError(
            f"zero_optimization.offload_param.buffer_size={off.buffer_size} elements is smaller than the "
            f"partition of {name!r} ({largest.partition_numel} elements); raise it to at least "
            f"{largest.partition_numel} or leave it out"
        )
    if off.buffer_count is None:
        return default
    per_buffer = off.buffer_size if off.buffer_size is not None else largest.partition_numel
    return off.buffer_count * per_buffer * itemsize
