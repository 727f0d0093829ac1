"""The optimizer bridge: building the optimizer an `Engine` steps (zswap's `OffloadedAdamW` from the config,
or the user's), and stepping an ordinary torch optimizer over partitions (`step_partitions`), one
transaction per step so a failure leaves params and states as they were."""

from __future__ import annotations

import contextlib
import inspect
from collections.abc import Collection, Mapping, Sequence
from typing import Any, cast

import torch
from torch import nn

from ..config import ZswapConfig, load_config
from ..errors import ConfigError
from ..fetch.nextpass import Seed
from ..gradients import grads, gradstore
from ..gradients.gradstore import store_of
from ..parts.gather import no_torch_function
from ..parts.params import Item, NvmeStore, param_state
from ..step.early_commit import as_seeds
from ..step.optim import OffloadedAdamW, adopt
from ..store.storage import step_transaction
from . import resident


def step_partitions(
    optimizer: Any,
    items: list[Item],
    others: Sequence[torch.Tensor],
    chunk: int,
    grad_scale: float = 1.0,
    held: dict[int, resident.Held] | None = None,
    seeding: Collection[int] = (),
) -> list[Seed]:
    """Step a param-based optimizer on the local partitions of ``items``; returns the seeds of the next
    pass (`zswap.fetch.prefetch.Scheduler.seed`): the updated partitions on NVMe of the params in
    ``seeding`` (ids: `Scheduler.seed_plan`), as they were written — its first params, gathered with no read.

    While it steps, each managed param with a gradient holds its partition as ``.data`` (1-D, so the
    optimizer's state has the partition's shape, step after step) and its partition gradient as ``.grad``;
    the updated partitions are then stored back. Params go through in chunks of about ``chunk`` elements,
    one ``optimizer.step()`` each, so at most that much is loaded at once: optimizers skip params without a
    gradient and count steps per param, so the result is that of one step over all of them. Unmanaged
    params (``others``) step with the first chunk only. ``grad_scale`` (clipping) multiplies every gradient:
    inside the kernel for an optimizer whose ``step`` takes ``grad_scale`` (`zswap.optim.OffloadedAdamW`),
    else in place before the step, as ``clip_grad_norm_`` does.

    All or nothing: the whole call is one `zswap.storage` step transaction. Partitions written back to
    NVMe are staged copy-on-write and made live only once every one of them (and every optimizer record)
    landed. When any I/O takes part, what the step changes in memory is saved to the transaction's undo
    log before it changes: in-memory partitions and gradients, the unmanaged params and their gradients,
    and — for an optimizer that does not keep its own (``transactional``) — each stepped param's
    ``optimizer.state[p]`` (tensors by value, other entries by identity; a param without state loses the
    state its failed first step created). So a failure leaves params, gradients and that state as they
    were. Not covered: state an optimizer keeps outside ``optimizer.state[p]`` (LBFGS-style globals).

    ``held`` (`zswap.train.resident.take`): resident params whose gathered copy is their partition. Theirs
    is stepped in place, not read, and written to the store like the others; the copies are gathered
    again when the call returns or raises (new values after a commit, the old ones after an abort).
    """
    held, kept = held or {}, Kept(seeding)
    try:
        _step_all(optimizer, items, others, chunk, grad_scale, held, kept)
    except BaseException:
        resident.reinstall(held)
        raise
    resident.reinstall(held, committed=True)
    resident.regather(held)
    return as_seeds(kept.copies)  # committed: the stored values now


def step_indices(
    optimizer: Any,
    items: list[Item],
    chunk: int,
    held: dict[int, resident.Held],
    indices: list[int],
    grad_scale: float,
    seeding: Collection[int] = (),
) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """`step_partitions` over the params ``indices`` of ``optimizer`` (an `OffloadedAdamW`: its
    ``records.params``) only: the ordinary part of a deferred early step (`zswap.step.early_commit.commit`),
    in its transaction. Resident params among them are stepped in their ``held`` copies, which the caller
    gives back after the commit (`resident.refresh`, the same on every rank) or its abort. Returns
    ``(param, updated partition)`` of those in ``seeding`` on NVMe: seeds once the transaction commits."""
    wanted = {id(optimizer.records.params[i]) for i in indices}
    mine = [(p, st) for p, st in items if id(p) in wanted]
    kept = Kept(seeding)
    _step_all(optimizer, mine, (), chunk, grad_scale, {k: h for k, h in held.items() if k in wanted}, kept)
    return kept.copies


class Kept:
    """The updated partitions an ordinary step keeps for the next pass: those of the params ``seeding``
    names (its first ones, within the live budget: `Scheduler.seed_plan`) whose partitions are on NVMe —
    the buffers their writes read from, handed over unchanged (a partition in memory needs no seed) — in
    the step's last chunk only: a buffer kept from an earlier one would be a new one mapped for each later
    chunk (measured: +104 MiB of fetch buffers at 1 GiB, a live budget's worth), one of the last costs
    nothing the step did not hold anyway. `order` puts the next forward's first params there."""

    def __init__(self, seeding: Collection[int]) -> None:
        self.seeding = seeding
        self.copies: list[tuple[torch.Tensor, torch.Tensor]] = []
        self.taking = False
        """Whether the chunk being stepped is the last (set by `_step_all`)."""

    def order(self, optimizer: Any, chunks: list[list[Item]]) -> list[list[Item]]:
        """``chunks`` last to first where seeds are wanted: the next forward's first params, usually the
        model's first, are then stepped in the last chunk. The same chunks, so an `OffloadedAdamW` walks
        the same records; not where it still places some: it lays them out in the order it meets them."""
        if not self.seeding:
            return chunks
        if isinstance(optimizer, OffloadedAdamW):
            index = {id(q): i for i, q in enumerate(optimizer.records.params)}
            placed = optimizer.records.placed
            if not all(placed(index[id(p)]) for batch in chunks for p, _ in batch if id(p) in index):
                return chunks
        return chunks[::-1]

    def offer(self, p: torch.Tensor, st: Any, part: torch.Tensor) -> None:
        if self.taking and id(p) in self.seeding and isinstance(st.store, NvmeStore):
            self.copies.append((p, part))


def _step_all(
    optimizer: Any,
    items: list[Item],
    others: Sequence[torch.Tensor],
    chunk: int,
    grad_scale: float,
    held: dict[int, resident.Held],
    kept: Kept,
) -> None:
    takes_scale = "grad_scale" in inspect.signature(optimizer.step).parameters
    own_undo = bool(getattr(optimizer, "transactional", False))
    with step_transaction() as txn, contextlib.ExitStack() as pooled:
        for _, st in items:
            if isinstance(st.store, NvmeStore):
                txn.uses(st.store.storage)
            gs = store_of(st)
            if isinstance(gs, gradstore.NvmeGrads):
                txn.uses(gs.storage)
                if not gs.pooling:
                    pooled.enter_context(gs.step_loads())  # later chunks' gradients: into reused buffers
        with no_torch_function():
            if txn.fallible:
                for p in others:
                    if p.grad is not None:
                        txn.save(p.data)
                        txn.save(p.grad)
                        if not own_undo:
                            _save_state(txn, optimizer, p)
                grads_before = [(p, p.grad) for p in others]
                txn.on_abort(lambda: _put_grads(grads_before))
            if grad_scale != 1.0 and not takes_scale:
                for p in others:
                    if p.grad is not None:
                        p.grad.mul_(grad_scale)
        todo = [(p, st) for p, st in items if store_of(st).has(st)]
        batches = kept.order(optimizer, grads.chunks(todo, chunk)) or [[]]  # one step even with none
        for i, batch in enumerate(batches):
            kept.taking = i == len(batches) - 1
            _step_batch(optimizer, batch, grad_scale, takes_scale, txn, own_undo, held, kept)
            if i == 0:
                for p in others:
                    p.grad = None


def _put_grads(saved: list[tuple[torch.Tensor, torch.Tensor | None]]) -> None:
    for p, g in saved:
        p.grad = g


def _save_state(txn: Any, optimizer: Any, p: torch.Tensor) -> None:
    """Save ``optimizer.state[p]`` so that an abort puts it back as it was (or drops it if it is new)."""
    state = getattr(optimizer, "state", None)
    if state is None:
        return
    if p not in state:
        txn.on_abort(lambda: state.pop(p, None))
        return
    entry = state[p]
    saved = dict(entry)
    for v in saved.values():
        if isinstance(v, torch.Tensor):
            txn.save(v)

    def restore() -> None:
        entry.clear()
        entry.update(saved)

    txn.on_abort(restore)


def _step_batch(
    optimizer: Any,
    batch: list[Item],
    grad_scale: float,
    takes_scale: bool,
    txn: Any,
    own_undo: bool,
    held: dict[int, resident.Held],
    kept: Kept,
) -> None:
    # A param the optimizer only writes (`OffloadedAdamW.overwrites`: stepped from its master) gets a
    # buffer nothing is read into (a bf16 param's ordinary step read its 2 bytes beside its gradient and
    # 12 of record), and is not written back if the optimizer skipped the step: the buffer holds no value.
    unread: set[int] = set()
    if isinstance(optimizer, OffloadedAdamW):
        nvme = [p for p, st in batch if id(p) not in held and isinstance(st.store, NvmeStore)]
        unread = optimizer.overwrites(nvme)
    skipped = getattr(optimizer, "skipped_steps", 0)
    with no_torch_function():
        loads: list[tuple[torch.Tensor, Any]] = []
        try:
            # Param and gradient partitions: reads issued together, waited together. A resident param's
            # partition is its gathered copy (no read; changed in place, so saved below like a memory
            # store's partition).
            for p, st in batch:
                h = held.get(id(p))
                if h is not None:
                    loads.append((h.host(), None))
                elif id(p) in unread:
                    loads.append((cast(NvmeStore, st.store).fresh(st.partition_numel, st.dtype), None))
                else:
                    loads.append(st.store.load(st.key, st.partition_numel, st.dtype))
                loads.append(store_of(st).load(st))
            for _, handle in loads:
                if handle is not None:
                    handle.wait()
            for i, (p, _) in enumerate(batch):
                p.data = loads[2 * i][0]
                p.grad = grads.step_grad(p, loads[2 * i + 1][0], isinstance(optimizer, OffloadedAdamW))
                if loads[2 * i][1] is not None or id(p) in unread:  # read into a scratch buffer, or
                    txn.scratch(p.data)  # not read at all: free to change
                elif not own_undo:
                    txn.save(p.data)  # the stored partition itself: changed in place
                if loads[2 * i + 1][1] is not None:
                    txn.scratch(p.grad)
                elif grad_scale != 1.0 and not takes_scale:
                    txn.save(p.grad)
                if not own_undo and txn.fallible:
                    _save_state(txn, optimizer, p)
                if grad_scale != 1.0 and not takes_scale:
                    p.grad.mul_(grad_scale)  # in place, as clip_grad_norm_ does
            if takes_scale:
                optimizer.step(grad_scale=grad_scale)
            else:
                optimizer.step()
            ran = getattr(optimizer, "skipped_steps", 0) == skipped
            for p, st in batch:
                if id(p) in unread and not ran:
                    continue  # never read, not stepped: the stored value stands
                h = held.get(id(p))
                if h is not None and p.data.data_ptr() != h.host().data_ptr():
                    h.host().copy_(p.data.reshape(-1))  # an optimizer that replaced .data: the copy follows
                st.store.put(st.key, p.data)  # staged in the transaction (in place for memory stores)
                if h is None:
                    kept.offer(p, st, p.data)  # the write's buffer, read-only from here
        finally:
            for _, handle in loads:
                if handle is not None:
                    with contextlib.suppress(Exception):
                        handle.wait()  # engine buffers must not be dropped under a running read
            for p, st in batch:
                grads.clear_step_grad(p, st.dtype)
                p.data = torch.empty(0, dtype=st.dtype, device=st.device)


SHAPE_DEPENDENT = frozenset(
    {"Adafactor", "LBFGS", "SparseAdam", "Muon", "Shampoo", "DistributedShampoo", "SOAP"}
)
"""Optimizers (by class name: torch's, transformers', and common third-party ones) whose update of a param
depends on its shape or its whole tensor (factored moments, matrix preconditioners, line searches): the
engine steps each param as its flat partition, so they would compute something else, and say nothing."""


def one_optimizer(config: Any, given: Any) -> ZswapConfig:
    """``config`` loaded (`load_config`), refused where it has an ``optimizer`` section and an optimizer
    was ``given`` too: one of them would be dropped without a word (DeepSpeed keeps the given one)."""
    cfg = load_config(config)
    if given is not None and cfg.optimizer is not None:
        raise ConfigError(
            f"the config has an optimizer section ({cfg.optimizer.type}) and optimizer= was passed too; "
            "keep one of them"
        )
    return cfg


def build_optimizer(
    module: nn.Module, cfg: ZswapConfig, given: Any, schedule: Any = None
) -> tuple[Any, bool, str]:
    """(optimizer, built here, why there is none). A given torch Adam / AdamW becomes an `OffloadedAdamW`
    over its groups (`zswap.step.optim.adopt`), ``schedule`` (an lr scheduler built on it) pointed at that."""
    if given is not None:
        name = type(given).__name__
        if name in SHAPE_DEPENDENT:
            raise ConfigError(
                f"optimizer= is {name}, whose update depends on each param's shape; zswap steps every "
                "param as its flat partition, so it would compute something else: use an element-wise "
                "optimizer (Adam/AdamW, SGD, RMSprop, …) or add an 'optimizer' section to the config"
            )
        _refuse_placeholder_split(module, given)
        if adopt.is_convertible(given):  # zswap's kernel computes its fused=True bits, state offloaded
            owned = adopt.to_offloaded(given, cfg, f"the {name} passed as optimizer=")
            adopt.hand_over(given, owned)
            adopt.rebind_schedulers([schedule] if hasattr(schedule, "step") else [], given, owned)
            return owned, True, ""
        _rebuild_eager_state(given)
        return given, False, ""
    if cfg.optimizer is None:
        return None, False, "no optimizer: pass optimizer= or add an 'optimizer' section to the config"
    return OffloadedAdamW.from_config(list(module.parameters()), cfg), True, ""


def _refuse_placeholder_split(module: nn.Module, optimizer: Any) -> None:
    """Refuses the groups of a weight-decay split made by ``p.dim()`` (nanoGPT's ``configure_optimizers``) on
    partitioned params: outside forward a partitioned param's data is an empty placeholder of one dimension,
    so the decayed group comes out empty and every matrix lands among the params without decay. The mark of
    it: a group with weight decay and no params beside a group without weight decay that holds params of
    two or more dimensions. Trained as given, weight decay would silently never apply."""
    groups = [g for g in getattr(optimizer, "param_groups", None) or [] if "params" in g]  # (duck-typed ones)
    if not any(not g["params"] and float(g.get("weight_decay", 0.0)) > 0 for g in groups):
        return
    for i, g in enumerate(groups):
        if float(g.get("weight_decay", 0.0)) != 0.0:
            continue
        matrices = [p for p in g["params"] if (st := param_state(p)) is not None and len(st.shape) >= 2]
        if matrices:
            names = {id(p): n for n, p in module.named_parameters()}
            first = matrices[0]
            shape = tuple(cast(Any, param_state(first)).shape)
            raise ConfigError(
                "the optimizer's param groups look split by p.dim() or p.shape on partitioned params: a "
                f"group with weight decay is empty, and group {i}, without weight decay, holds "
                f"{len(matrices)} params of two or more dimensions ({names.get(id(first), 'a param')!r}, "
                f"shape {shape}). "
                "Outside forward a partitioned param's data is an empty placeholder (torch.Size([0])); "
                "split by len(zswap.param_state(p).shape) or by name (as the Hugging Face Trainer does)"
            )


def _rebuild_eager_state(optimizer: Any) -> None:
    """State a torch optimizer makes when it is built (Adagrad's ``sum``) was made over the partitioned
    params' empty placeholders; the step shows the optimizer each param as its flat partition, so it must
    have the partition's shape (it failed with "The size of tensor a (0) must match…"). Rebuilt as the
    optimizer builds it — its class over its own groups and defaults, each such param holding a zero
    partition meanwhile — before its first step; a `ConfigError` where that cannot be done."""
    state = getattr(optimizer, "state", None) or {}
    stale: list[tuple[torch.Tensor, Any]] = []
    for p, entry in state.items():
        st = param_state(p)
        if st is not None and isinstance(entry, Mapping):
            shaped = (v for v in entry.values() if isinstance(v, torch.Tensor) and v.dim() > 0)
            if any(v.shape != (st.partition_numel,) for v in shaped):  # (one rank: the full shape)
                stale.append((p, st))
    if not stale:
        return
    name = type(optimizer).__name__
    try:
        if any(float(state[p].get("step", 0)) != 0 for p, _ in stale):
            raise ValueError("it has stepped already")
        with no_torch_function():
            placeholders = [p.data for p, _ in stale]
            for p, st in stale:
                where = st.device if st.tier == "none" else torch.device("cpu")
                p.data = torch.zeros(st.partition_numel, dtype=st.dtype, device=where)
            try:
                groups = [{**g, "params": list(g["params"])} for g in optimizer.param_groups]
                fresh = type(optimizer)(groups, **optimizer.defaults)
            finally:
                for (p, _), data in zip(stale, placeholders, strict=True):
                    p.data = data
    except Exception as exc:
        raise ConfigError(
            f"optimizer= ({name}) made its state when it was built, over the partitioned params' empty "
            f"placeholders, and zswap cannot make it again over their partitions ({exc}): hand it over "
            "before its first step, or use an optimizer that makes its state at its first step"
        ) from None
    for p, _ in stale:
        state[p] = fresh.state[p]
