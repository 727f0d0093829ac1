"""`zswap.load_weights`: safetensors checkpoints streamed straight into partitions.

Every tensor of a model is a *target* (the module that holds it, the attribute name, the tensor); every
tensor of a checkpoint a *source* (a range-readable file entry, or an in-memory tensor). `plan` pairs them by
name, checks every name and shape before anything is written, and `write` then moves each source into its
target:

- a managed param: this rank reads elements ``[r·n/w, (r+1)·n/w)`` of the flattened source — only those
  bytes — into a fresh buffer (an engine buffer on NVMe, so it is written without a bounce copy), casts it to
  the param's dtype where they differ, zero-fills the padding and stores it under the param's key. If the
  param is gathered at the time (kept gathered by a running engine, or touched inside `zswap.Init`), its full
  data is updated too;
- a meta param (a model built on the meta device, as transformers does): a new param is created and managed
  the same way, with the placement of the `zswap.Init` that loads it, and set on every module attribute that
  held the meta one (tied weights stay one param);
- anything else (unmanaged params, persistent buffers): read whole and copied, as ``load_state_dict`` does.

Tied weights are one tensor under several names: a tensor is loaded from the first of its names the
checkpoint has, and is missing only when the checkpoint has none of them.
"""

from __future__ import annotations

import contextlib
import os
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass, field
from typing import Any, Protocol

import torch
from torch import nn
from torch.nn.modules.module import _IncompatibleKeys

from .. import _stfile
from .._progress import progress
from ..errors import ZswapError
from ..parts.gather import Placement, no_torch_function
from ..parts.params import (
    NvmeStore,
    ParamState,
    Status,
    Store,
    local_slice,
    param_state,
    partition_numel,
    register,
)
from ..parts.placing import PLACING
from ..parts.runners import open_runners, runners_of

# While loading, writes queued to NVMe are bounded tighter than during Init: sources are read at disk speed,
# so a deep queue only adds to the peak memory of the load, not to its speed.
LOAD_INFLIGHT_BYTES = 64 << 20


class LoadWeightsError(ZswapError, ValueError):
    """A checkpoint does not fit the model: every missing key, unexpected key and shape mismatch, at once."""

    def __init__(
        self,
        message: str,
        missing: list[str],
        unexpected: list[str],
        mismatched: list[tuple[str, torch.Size, torch.Size]],
    ) -> None:
        super().__init__(message)
        self.missing_keys = missing
        self.unexpected_keys = unexpected
        self.mismatched = mismatched


class Source(Protocol):
    @property
    def shape(self) -> torch.Size: ...

    @property
    def dtype(self) -> torch.dtype: ...

    def read(self, start: int, out: torch.Tensor) -> None:
        """Fill ``out`` (1-D, this source's dtype) with flattened elements ``[start, start + numel)``."""


@dataclass(frozen=True)
class FileSource:
    entry: _stfile.TensorEntry

    @property
    def shape(self) -> torch.Size:
        return self.entry.shape

    @property
    def dtype(self) -> torch.dtype:
        return self.entry.dtype

    def read(self, start: int, out: torch.Tensor) -> None:
        _stfile.read_range(self.entry, start, out)


@dataclass(frozen=True)
class TensorSource:
    tensor: torch.Tensor

    @property
    def shape(self) -> torch.Size:
        return self.tensor.shape

    @property
    def dtype(self) -> torch.dtype:
        return self.tensor.dtype

    def read(self, start: int, out: torch.Tensor) -> None:
        with no_torch_function(), torch.no_grad():
            flat = self.tensor.detach().reshape(-1)
            out.copy_(flat[start : start + out.numel()])


@dataclass(eq=False)
class Target:
    """One tensor of the model and every (module, attribute) that holds it."""

    tensor: torch.Tensor
    names: list[str]
    slots: list[tuple[nn.Module, str, bool]] = field(default_factory=list)
    """(module, attribute, is a param)."""
    dtype: torch.dtype | None = None
    """For a meta tensor: the dtype to materialise it in (default: the meta tensor's)."""

    @property
    def shape(self) -> torch.Size:
        st = param_state(self.tensor)
        return st.shape if st is not None else self.tensor.shape


@dataclass
class Plan:
    items: list[tuple[Target, str, Source]]
    missing: list[str]
    unexpected: list[str]
    mismatched: list[tuple[str, torch.Size, torch.Size]]
    """(name, checkpoint shape, model shape)."""


def targets(model: nn.Module) -> dict[str, Target]:
    """``name -> Target`` for every param and persistent buffer, tied ones sharing one `Target`."""
    by_id: dict[int, Target] = {}
    out: dict[str, Target] = {}
    for mname, mod in model.named_modules(remove_duplicate=False):
        prefix = f"{mname}." if mname else ""
        entries = [(n, t, True) for n, t in mod._parameters.items()]
        entries += [
            (n, t, False) for n, t in mod._buffers.items() if n not in mod._non_persistent_buffers_set
        ]
        for n, t, is_param in entries:
            if t is None:
                continue
            key = prefix + n
            target = by_id.get(id(t))
            if target is None:
                target = by_id[id(t)] = Target(t, [])
            if key not in out:
                target.names.append(key)
                out[key] = target
            if (mod, n, is_param) not in target.slots:
                target.slots.append((mod, n, is_param))
    return out


def plan(model_targets: Mapping[str, Target], sources: Mapping[str, Source]) -> Plan:
    """Pair targets with sources by name; collect every missing, unexpected and mismatched name."""
    items: list[tuple[Target, str, Source]] = []
    missing: list[str] = []
    mismatched: list[tuple[str, torch.Size, torch.Size]] = []
    seen: set[int] = set()
    for target in model_targets.values():
        if id(target) in seen:
            continue
        seen.add(id(target))
        name = next((n for n in target.names if n in sources), None)
        if name is None:
            missing.extend(target.names)
            continue
        src = sources[name]
        if src.shape != target.shape:
            mismatched.append((name, src.shape, target.shape))
            continue
        items.append((target, name, src))
    unexpected = [k for k in sources if k not in model_targets]
    return Plan(items, missing, unexpected, mismatched)


def describe(p: Plan, what: str) -> str:
    lines = [f"{what} does not fit the model:"]
    for title, keys in (("missing key", p.missing), ("unexpected key", p.unexpected)):
        if keys:
            lines.append(f"  {len(keys)} {title}{'s' * (len(keys) > 1)}: {', '.join(keys)}")
    if p.mismatched:
        lines.append(
            f"  {len(p.mismatched)} shape mismatch{'es' * (len(p.mismatched) > 1)}: "
            + "; ".join(
                f"{k} is {list(a)} in the checkpoint, {list(b)} in the model" for k, a, b in p.mismatched
            )
        )
    return "\n".join(lines)


def write(
    items: Iterable[tuple[Target, str, Source]],
    placement: Placement | None = None,
    on_new: Callable[[torch.Tensor], None] | None = None,
) -> None:
    """Move each source into its target (see the module docstring). ``placement``: where meta params go;
    ``on_new`` is told of each param created for one."""
    items = list(items)
    for target, name, _ in items:
        st = param_state(target.tensor)
        if st is not None and st.gathered_by is not None:
            raise ZswapError(f"{name}: cannot load weights into a param held by a GatheredParameters block")
        if target.tensor.device.type == "meta" and placement is None:
            raise ZswapError(
                f"{name} is on the meta device: load it under zswap.Init, which says where it goes"
            )
    quiesce([t.tensor for t, _, _ in items])
    for _, _, src in items:  # a converted source (zswap._hfconv) keeps its result until these are written
        expect = getattr(src, "expect", None)
        if expect is not None:
            expect()
    stores: dict[int, Store] = {}
    ahead = _stfile.Readahead(_span(t, src, placement) for t, _, src in items)
    with contextlib.closing(ahead), _load_buffers(items, placement), no_torch_function(), torch.no_grad():
        for i, (target, _, src) in enumerate(progress(items, "loading weights", unit="tensor")):
            st = param_state(target.tensor)
            if st is not None:
                fill(target.tensor, st, src)
                stores[id(st.store)] = st.store
            elif _adopts(target):
                assert placement is not None
                p = _adopt_meta(target, src, placement)
                stores[id(placement.store)] = placement.store
                if on_new is not None:
                    on_new(p)
            elif target.tensor.device.type == "meta":  # a buffer: materialised whole, never partitioned
                dtype = target.dtype or target.tensor.dtype
                buf = _read_all(src).to(dtype).view(src.shape)
                for mod, attr, _ in target.slots:
                    mod._buffers[attr] = buf
                target.tensor = buf
            else:
                full = _read_all(src)
                target.tensor.copy_(full.view(src.shape))
            ahead.done(i)
            release = getattr(src, "release", None)  # a converted source frees its conversion's result
            if release is not None:
                release()
        for store in stores.values():
            store.wait_all()


def _adopts(target: Target) -> bool:
    """Whether `write` makes ``target`` a new managed param (a meta param; a meta buffer is materialised)."""
    return target.tensor.device.type == "meta" and target.slots[0][2]


def _span(target: Target, src: Source, placement: Placement | None) -> tuple[str, int, int] | None:
    """The file range `write` reads for ``target`` (for `zswap._stfile.Readahead`): this rank's slice of a
    param it partitions, the whole tensor otherwise."""
    if not isinstance(src, FileSource):
        return None
    e = src.entry
    st = param_state(target.tensor)
    if st is not None and st.status is not Status.AVAILABLE:
        start, end = st.bounds()
    elif st is None and placement is not None and _adopts(target):
        part = partition_numel(e.numel, placement.world_size)
        start, end = placement.rank * part, (placement.rank + 1) * part
    else:
        start, end = 0, e.numel
    return e.span(start, end)


def quiesce(params: list[torch.Tensor]) -> None:
    """Before params are overwritten: an open engine drops every copy it gathered or is prefetching (as its
    own step does), so none goes stale; it gathers them again at their next use."""
    live = [p for p in params if (st := param_state(p)) is not None and st.status is not Status.NOT_AVAILABLE]
    for runner in runners_of(live) if live else ():
        runner.drop_gathered()


def fill(p: torch.Tensor, st: ParamState, src: Source) -> None:
    """Store this rank's slice of ``src`` (cast to ``st.dtype``) as ``p``'s partition."""
    if st.status is Status.INFLIGHT:
        raise ZswapError(f"a param of shape {tuple(st.shape)} is being gathered; cannot load into it now")
    if st.status is Status.AVAILABLE:  # gathered (touched inside Init): its full data must change too
        full = _read_all(src).to(st.dtype)
        p.data.copy_(full.view(st.shape))
        st.store.put(st.key, local_slice(full, st.rank, st.partition_numel).clone())
        return
    start, end = st.bounds()
    valid = max(0, min(end, st.numel) - start)
    buf = _buffer(st.store, st.partition_numel, st.dtype)
    if src.dtype == st.dtype:
        src.read(start, buf[:valid])
    elif valid:
        tmp = torch.empty(valid, dtype=src.dtype)
        src.read(start, tmp)
        buf[:valid].copy_(tmp)  # the rounding of .to(dtype)
    if valid < st.partition_numel:
        buf[valid:].zero_()
    if st.store.tier == "none" and st.device.type != "cpu":
        buf = buf.to(st.device)
    st.store.put(st.key, buf)


def _adopt_meta(target: Target, src: Source, where: Placement) -> torch.Tensor:
    meta = target.tensor
    dtype = target.dtype or meta.dtype
    p = nn.Parameter(torch.empty(0, dtype=dtype), requires_grad=meta.requires_grad)
    for attr, value in vars(meta).items():  # flags others set on it (transformers' _is_hf_initialized)
        with contextlib.suppress(AttributeError, TypeError):
            setattr(p, attr, value)
    st = ParamState(
        shape=src.shape,
        dtype=dtype,
        status=Status.NOT_AVAILABLE,
        tier=where.store.tier,
        partition_numel=partition_numel(src.shape.numel(), where.world_size),
        rank=where.rank,
        world_size=where.world_size,
        group=where.group,
        device=torch.device("cpu"),
        store=where.store,
        key=where.store.new_key(),
    )
    register(p, st)
    fill(p, st, src)
    for mod, attr, is_param in target.slots:
        if is_param:
            mod._parameters[attr] = p
        else:
            mod._buffers[attr] = p
    target.tensor = p
    return p


def _buffer(store: Store, numel: int, dtype: torch.dtype) -> torch.Tensor:
    if isinstance(store, NvmeStore) and numel:
        return store._buffer(numel, dtype)  # page-aligned (no bounce copy), pooled while loading
    return torch.empty(numel, dtype=dtype)


def _read_all(src: Source) -> torch.Tensor:
    out = torch.empty(src.shape.numel(), dtype=src.dtype)
    src.read(0, out)
    return out


@contextlib.contextmanager
def _load_buffers(items: list[tuple[Target, str, Source]], placement: Placement | None) -> Any:
    """While loading: writes queued to NVMe bounded by `LOAD_INFLIGHT_BYTES`, and each NVMe store pools
    that much, plus two largest partitions (the one being filled and the one the queue may hold beyond its
    bound), of its written-out buffers for the next partitions of the same size. A load of repeated layers
    then populates its buffers' pages once, not once per tensor: zeroing and mapping fresh pages costs
    about as much CPU as copying the bytes in."""
    stores = [placement.store] if placement is not None else []
    stores += [st.store for t, _, _ in items if (st := param_state(t.tensor)) is not None]
    nvme = {id(s): s for s in stores if isinstance(s, NvmeStore)}
    queues = {id(q): q for s in nvme.values() if (q := _queue_of(s)) is not None}
    limits = [(q, q.limit) for q in queues.values()]
    for q, b in limits:
        q.limit = min(b, LOAD_INFLIGHT_BYTES)
    largest = max((_part_bytes(t, src, placement) for t, _, src in items), default=0)
    with contextlib.ExitStack() as widened:
        for s in nvme.values():
            widened.enter_context(s.pool_widened(LOAD_INFLIGHT_BYTES + 2 * largest))
        try:
            yield
        finally:
            for q, b in limits:
                q.limit = b


def _part_bytes(target: Target, src: Source, placement: Placement | None) -> int:
    """Bytes of the partition `write` fills for ``target`` (0: none)."""
    st = param_state(target.tensor)
    if st is not None:
        return st.partition_numel * st.dtype.itemsize
    if placement is None or not _adopts(target):
        return 0
    dtype = target.dtype or target.tensor.dtype
    return partition_numel(src.shape.numel(), placement.world_size) * dtype.itemsize


def _queue_of(store: NvmeStore) -> Any:
    """The write queue bounding ``store``'s writes in flight (the storage layer's), if it has one."""
    return getattr(getattr(store, "storage", None), "queue", None)


def check_optimizer(items: Iterable[tuple[Target, str, Source]]) -> None:
    """Refuse to change params whose float32 master copy an open engine's optimizer already holds: its next
    step would overwrite the loaded values with the stale master."""
    for runner in open_runners():
        mastered = runner.mastered()
        for target, name, _ in items:
            if id(target.tensor) in mastered:
                raise ZswapError(
                    f"{name}: the optimizer of an open zswap Engine holds a float32 master copy of this "
                    "param, which its next step would write over the loaded weights; load weights before the "
                    "first step, or restore a whole training state with engine.load_checkpoint"
                )


def load_weights(model: nn.Module, path: str | os.PathLike[str], *, strict: bool = True) -> _IncompatibleKeys:
    """Load a safetensors checkpoint into ``model``, streamed: each managed param gets this rank's slice,
    read from the file straight into its partition; other params and persistent buffers are copied.

    ``path``: a ``.safetensors`` file, a sharded index (``model.safetensors.index.json``), or a folder with
    either (what ``save_pretrained`` and `zswap.save_weights` write). Names are the model's
    ``state_dict`` names; for a transformers model, the checkpoint's names are first resolved as its
    ``from_pretrained`` resolves them (legacy renamings, base-model prefix, weight conversions such as MoE
    experts saved one tensor each: `zswap._hfconv`). Every name and shape is checked before anything is
    written: with ``strict`` (default) missing keys, unexpected keys and shape mismatches are one
    `LoadWeightsError` (a `ZswapError` and `ValueError`) listing them all; without it, missing and
    unexpected keys are returned as ``(missing_keys, unexpected_keys)``, as
    ``torch.nn.Module.load_state_dict`` returns them, and shape mismatches still raise (as torch's do).
    Values are cast to each param's dtype. Params that an open engine's optimizer already keeps a float32
    master of are refused (its next step would undo the load).
    """
    if not isinstance(model, nn.Module):
        raise TypeError(f"load_weights takes an nn.Module, not {type(model).__name__}")
    sources: dict[str, Source] = {k: FileSource(e) for k, e in _stfile.resolve(path).items()}
    model_targets = targets(model)
    sources, converted_away = _hf_names(model, sources, model_targets)
    p = plan(model_targets, sources)
    p.unexpected += converted_away
    _hf_ignored(model, p)
    if p.mismatched or (strict and (p.missing or p.unexpected)):
        raise LoadWeightsError(
            describe(p, f"checkpoint {os.fspath(path)}"), p.missing, p.unexpected, p.mismatched
        )
    check_optimizer(p.items)
    write(p.items, _placement_of(model))
    return _IncompatibleKeys(p.missing, p.unexpected)


def _hf_names(
    model: nn.Module, sources: dict[str, Source], model_targets: dict[str, Target]
) -> tuple[dict[str, Source], list[str]]:
    """For a transformers model, the checkpoint's names as ``from_pretrained`` resolves them (legacy
    renamings, the base-model prefix, weight conversions such as MoE experts saved one per tensor; see
    `zswap._hfconv`), and the names a conversion would make that the model lacks. Other models: as given."""
    from . import _hfconv

    mapping = _hfconv.model_mapping(model)
    if mapping is None:
        return sources, []
    resolved = _hfconv.resolve(model, sources, mapping, model_targets)
    return resolved.sources, resolved.unexpected


def _hf_ignored(model: nn.Module, p: Plan) -> None:
    """Drop from ``p`` the missing and unexpected names a transformers model tells ``from_pretrained`` to
    pass over (``_keys_to_ignore_on_load_missing`` / ``_unexpected``, regular expressions searched in each
    name; a rotary ``inv_freq`` or ``position_ids`` buffer older checkpoints saved): Marian's sinusoidal
    position tables, which ``save_pretrained`` leaves out, are not missing."""
    import re

    if not hasattr(model, "_keys_to_ignore_on_load_missing"):
        return
    missing = set(getattr(model, "_keys_to_ignore_on_load_missing", None) or ())
    unexpected = set(getattr(model, "_keys_to_ignore_on_load_unexpected", None) or ())
    buffers = [n for n, _ in model.named_buffers()]
    if any(n.endswith("rotary_emb.inv_freq") for n in buffers):
        unexpected.add(r"rotary_emb\.inv_freq")
    if any(n.endswith("position_ids") for n in buffers):
        unexpected.add(r"(^|\.)position_ids$")
    for keys, patterns in ((p.missing, missing), (p.unexpected, unexpected)):
        if patterns:
            regex = re.compile("|".join(f"({pattern})" for pattern in patterns))
            keys[:] = [k for k in keys if regex.search(k) is None]


def _placement_of(model: nn.Module) -> Placement | None:
    """Where meta params of ``model`` go: the active Init's placement, else that of a managed param."""
    current = PLACING.current()
    if current is not None:
        return current
    for t in model.parameters():
        st = param_state(t)
        if st is not None:
            return Placement(st.store, st.group, st.rank, st.world_size, None)
    return None
