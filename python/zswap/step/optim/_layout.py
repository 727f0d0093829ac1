"""Where each param's optimizer state lives: sub-groups of at most `sub_group_size` elements.

The params of a param group are laid end to end and cut into sub-groups; a large param spans several, and
a sub-group packs several small ones. Each sub-group's state is one contiguous float32 record —
``[exp_avg | exp_avg_sq | master]``, each part `numel` long, ``master`` only where the params are not
float32 (a float32 param is its own master) — stored under one key, so the optimizer moves it with one
transfer and a checkpoint can stream it record by record.
"""

from __future__ import annotations

import math
from collections.abc import Iterable, Iterator
from dataclasses import dataclass

import torch

DEFAULT_MAX_SUB_GROUP = 100_000_000
"""Elements per sub-group at most, when zswap picks (DeepSpeed's default is 1e9; 1e8 bounds the swap
buffers to 1.2 GB per record at 12 bytes per element)."""
MIN_SUB_GROUP = 1 << 20
"""Elements per sub-group at least, when zswap picks: smaller transfers waste per-request overhead."""
TARGET_SUB_GROUPS = 32
"""Sub-groups zswap aims for when it picks the size: the pipeline's unhidden first read and last write add
about 1/this to an I/O-bound step, and its ring of three buffers holds 3/this of the state."""


def default_sub_group_size(total: int) -> int:
    """The sub-group size zswap picks for `total` elements of state: about 1/32 of it, between 1 Mi
    and 1e8 elements, rounded up to a multiple of 1024 (whole 4 KiB pages per float32 part)."""
    size = min(DEFAULT_MAX_SUB_GROUP, max(MIN_SUB_GROUP, math.ceil(total / TARGET_SUB_GROUPS)))
    return -(-size // 1024) * 1024


StateViews = tuple[torch.Tensor, torch.Tensor, "torch.Tensor | None"]
"""(exp_avg, exp_avg_sq, master or None) of one segment."""


@dataclass(frozen=True)
class Segment:
    """Elements ``start:stop`` of the flattened param `param` (its index in the optimizer) sit at
    ``offset`` within each part of a sub-group record."""

    param: int
    start: int
    stop: int
    offset: int

    @property
    def numel(self) -> int:
        return self.stop - self.start


@dataclass(frozen=True)
class SubGroup:
    """One record: `numel` elements of state for the `segments` of params from param group `group`."""

    key: str
    group: int
    numel: int
    has_master: bool
    segments: tuple[Segment, ...]

    @property
    def record_numel(self) -> int:
        """float32 elements in the record."""
        return self.numel * (3 if self.has_master else 2)

    def parts(self, record: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor | None]:
        """(exp_avg, exp_avg_sq, master or None) views of a record tensor."""
        n = self.numel
        return record[:n], record[n : 2 * n], record[2 * n : 3 * n] if self.has_master else None

    def slices(self, record: torch.Tensor) -> Iterator[tuple[Segment, StateViews]]:
        """Each segment with its (exp_avg, exp_avg_sq, master or None) views into `record`."""
        exp_avg, exp_avg_sq, master = self.parts(record)
        for seg in self.segments:
            part = slice(seg.offset, seg.offset + seg.numel)
            yield seg, (exp_avg[part], exp_avg_sq[part], None if master is None else master[part])


def needs_master(p: torch.Tensor) -> bool:
    """Whether `p` keeps a separate float32 master: every param not itself float32."""
    return p.dtype != torch.float32


def cut(
    prefix: str,
    first_index: int,
    group: int,
    params: Iterable[tuple[int, torch.Tensor, int]],
    size: int,
) -> Iterator[SubGroup]:
    """Sub-groups of at most `size` elements over `params` ((index, param, elements of state) of one param
    group, in order; a partitioned param's state is its local partition, not ``p.numel()``), keyed
    ``{prefix}/{n}`` from ``n = first_index``. A run of params with and without a master
    is split where that changes, so each record has one layout."""
    index = first_index
    segs: list[Segment] = []
    filled = 0
    master: bool | None = None

    def close() -> SubGroup:
        nonlocal index, segs, filled
        sg = SubGroup(f"{prefix}/{index}", group, filled, bool(master), tuple(segs))
        index, segs, filled = index + 1, [], 0
        return sg

    for i, p, n in params:
        if segs and needs_master(p) != master:
            yield close()
        master = needs_master(p)
        start = 0
        while start < n:
            take = min(n - start, size - filled)
            segs.append(Segment(i, start, start + take, filled))
            start += take
            filled += take
            if filled == size:
                yield close()
    if segs:
        yield close()
