"""Budget sizing: how many elements stay gathered, are prefetched and are reused, from the model and the
config (``stage3_*`` keys, with zswap's defaults where the config leaves a knob to it)."""

from __future__ import annotations

import logging
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import torch
from torch import nn

from ..config import ZswapConfig
from ..errors import ZswapError
from ..fetch import buffers
from ..fetch.prefetch import Budget
from ..memory import Allowances
from ..parts.params import Item, param_state
from ..step import earlystep
from .dtypes import sums_in_fp32

if TYPE_CHECKING:
    from .runtime import Engine

# Defaults, in elements, where the config leaves a knob to zswap (DeepSpeed's own defaults in brackets).
PERSISTENCE_MAX = 100_000  # [1e5]; and at most 1/1000 of the model, so tiny models still stream


PREFETCH_MIN = 50_000_000  # [5e7]; at least two of the largest module's params


@dataclass(frozen=True)
class Sizing:
    """Element counts chosen for one engine (see `zswap.prefetch`)."""

    total: int
    persistence_threshold: int
    persistent: int
    largest_chain: int
    """Most non-persistent elements one module's forward holds together with its ancestors'."""
    budget: Budget
    allowances: Allowances
    """What each holder of memory beside the gathered params may keep (`zswap.memory.Allowances`)."""
    resident: frozenset[int] = frozenset()
    """ids of the params ``offload_param.max_in_cpu`` keeps gathered (`zswap.buffers`)."""

    @property
    def live_elements(self) -> int:
        """Elements the memory of the live budget is sized for: ``max_live``, or one module's chain where
        that is more (its params are gathered whatever the budget, as in DeepSpeed)."""
        return live_elements(self.budget.max_live, self.largest_chain)


def live_elements(max_live: int, chain: int) -> int:
    """`Sizing.live_elements` from the budget and the largest module chain (before the `Sizing` exists)."""
    return max(max_live, chain)


def unique(params: Any) -> list[torch.Tensor]:
    seen: dict[int, torch.Tensor] = {}
    for p in params:
        seen.setdefault(id(p), p)
    return list(seen.values())


def size(module: nn.Module, items: list[Item], cfg: ZswapConfig) -> Sizing:
    z = cfg.zero
    total = sum(st.numel for _, st in items)
    threshold = z.stage3_param_persistence_threshold
    if threshold is None:
        threshold = min(PERSISTENCE_MAX, total // 1000)
    resident = buffers.resident(items, cfg, threshold)  # offload_param.max_in_cpu
    numel = {id(p): st.numel for p, st in items if st.numel > threshold and id(p) not in resident}
    chain, where = _largest_chain(module, numel)
    own = max(
        (sum(numel.get(id(p), 0) for p in m.parameters(recurse=False)) for m in module.modules()), default=0
    )
    streamed = sum(numel.values())
    bucket = z.stage3_prefetch_bucket_size
    if bucket is None:
        bucket = min(streamed, max(2 * own, PREFETCH_MIN))
    max_live = z.stage3_max_live_parameters
    if max_live is None:
        max_live = min(streamed, chain + bucket)
    elif max_live < chain:
        # DeepSpeed's meaning: the params of the module running (and its parents') are gathered whatever
        # the budget; it bounds what is prefetched and kept beside them, here nothing. The memory sized
        # from the budget must still hold that module.
        logging.getLogger(__name__).info(
            "stage3_max_live_parameters=%d is below the %d elements module %r and its parents hold during "
            "its forward: one module's params at a time, none prefetched", max_live, chain, where
        )  # fmt: skip
    reuse = z.stage3_max_reuse_distance
    if reuse is None:
        reuse = bucket
    logging.getLogger(__name__).info(
        "budgets: %d elements, %d streamed; live %d, prefetch bucket %d, reuse distance %d; persistent "
        "below %d elements (%d kept gathered)", total, streamed, max_live, bucket, reuse, threshold,
        total - streamed,
    )  # fmt: skip
    persistent = total - streamed
    held = live_elements(max_live, chain)
    itemsize = max((st.dtype.itemsize for _, st in items), default=4)
    live = (held + persistent) * itemsize
    names = {id(p): name for name, p in module.named_parameters()}
    allowances = Allowances(
        live=live,
        fetch_pool=buffers.fetch_pool_bytes(items, cfg, names, live),  # offload_param.buffer_count/size
        early_step=live + earlystep.CAP_EXTRA,  # read at each sizing, not once at import
        seeds=held,  # the next-pass cache keeps them within it with the next pass's first read
    )
    budget = Budget(bucket, max_live, reuse)
    return Sizing(total, threshold, persistent, chain, budget, allowances, resident)


def _largest_chain(module: nn.Module, numel: dict[int, int]) -> tuple[int, str]:
    best = (0, "")

    def walk(m: nn.Module, name: str, held: dict[int, int]) -> None:
        nonlocal best
        held = {**held, **{id(p): numel[id(p)] for p in m.parameters(recurse=False) if id(p) in numel}}
        if sum(held.values()) > best[0]:
            best = (sum(held.values()), name)
        for child_name, child in m.named_children():
            walk(child, f"{name}.{child_name}" if name else child_name, held)

    walk(module, "", {})
    return best


def refuse_meta(model: nn.Module) -> None:
    """A model built on the meta device has no values to offload or train: refuse it before anything is
    partitioned (it would come back as meta tensors)."""
    for kind, named in (("param", model.named_parameters()), ("buffer", model.named_buffers())):
        for name, t in named:
            st = param_state(t)
            if (st.device.type if st is not None else t.device.type) == "meta":
                raise ZswapError(
                    f"{kind} {name!r} of the model is on the meta device (no values): build the model under "
                    "zswap.Init(config) — or load it with from_pretrained under zswap.Init — instead of on "
                    "the meta device, then call zswap.initialize"
                )


def grad_room(engine: Engine) -> int:
    """Bytes of gradients the early step keeps in memory past the stash where the step may need them
    (clipping, accumulation: `zswap.step.speculation.Guess.keep`): the live budget's elements at the width
    they are kept in — float32 where low-precision gradients are summed in it over micro-batches
    (`zswap.train.dtypes.sums_in_fp32`: from a compute device, or asked for on the CPU), so that such a
    sum stays in memory where the gradient it adds to was —, or none where `grad_stash_bytes` was set (it
    then bounds every gradient kept in memory)."""
    if engine._grad_stash is not None:
        return 0
    live = engine.sizing.allowances.live
    accumulating = engine._gas > 1 or engine.window_ends is not None
    if accumulating and sums_in_fp32(engine):
        itemsize = min((st.dtype.itemsize for _, st in engine._items), default=4)
        return live * 4 // itemsize if itemsize < 4 else live
    return live
