"""Laying an `Engine` over a model's managed params and taking it off again: sizing, placement on the
compute device, slots and scheduler, module and gradient hooks, gradient stores, the fetch pool's
allowance (`wire`); `unwire` undoes it, `rewired` does both around a change of params' shapes."""

from __future__ import annotations

import contextlib
import functools
import weakref
from collections.abc import Callable, Iterator
from typing import TYPE_CHECKING

import torch
from torch import nn

from .. import _dist
from .. import device as _device
from ..config import ZswapConfig
from ..errors import SparseGradientError, ZswapError
from ..fetch import leaves
from ..fetch.hooks import ModuleHooks, ModuleInfo
from ..fetch.prefetch import Counters, Scheduler, Slot
from ..gradients import grads, gradstore
from ..parts.params import Item, NvmeStore, managed_params
from ..parts.runners import open_runners
from ..step import early_build, stepping

if TYPE_CHECKING:
    from .runtime import Engine

from . import dtypes, generation
from .sizing import size, unique


def wire(engine: Engine, counters: Counters | None = None) -> None:
    """Lay the engine over the module's managed params as they are now: sizing, placement on the
    compute device, slots, scheduler (counting on from ``counters``), module and gradient hooks, gradient
    stores, persistent params fetched. `unwire` undoes it."""
    module, config = engine.module, engine.config
    items: list[Item] = list(managed_params(iter(unique(module.parameters()))))
    ids: set[int] = {id(p) for p, _ in items}
    for other in open_runners():
        if other is not engine and other.runs(ids):
            raise ZswapError(
                "these params are already run by another zswap Engine; close() it first (destroy() under "
                "zswap.deepspeed)"
            )
    engine._items, engine._ids = items, ids
    _dist.check_partitioned_for_this_world(items)
    for name, m in module.named_modules():  # refused before a backward could fail on one
        if isinstance(m, nn.Embedding | nn.EmbeddingBag) and m.sparse and id(m.weight) in ids:
            raise SparseGradientError(grads.sparse_message(f"{name}.weight"))
    if counters is None:  # built (not wired again): the config's leaf modules
        leaves.from_config(module, config.zero.leaf_module, any(st.world_size > 1 for _, st in items))
        dtypes.at_build(engine)  # data_types: buffers' dtypes, as DeepSpeed's engine sets them at its start
    engine.sizing = size(module, engine._items, config)
    engine._homes = _device.place(module, engine._items, engine.compute_device)
    engine._slots = {
        id(p): Slot(p, st, st.numel <= engine.sizing.persistence_threshold or id(p) in engine.sizing.resident)
        for p, st in engine._items
    }
    # A leaf module holds every param inside it; the modules inside hold none (`zswap.fetch.leaves`).
    under = leaves.inside(module)
    infos = {
        id(m): ModuleInfo(
            i,
            name,
            [] if id(m) in under else [engine._slots[id(p)] for p in _uses(m) if id(p) in ids],
        )
        for i, (name, m) in enumerate(module.named_modules(remove_duplicate=True))
    }
    for info in infos.values():
        info.ids.update(id(s.p) for s in info.slots)
    for inner, leaf in under.items():
        if inner in infos:  # what it uses of the leaf's params is not foreign to it
            infos[inner].ids.update(infos[id(leaf)].ids)
    for m in module.modules():
        if leaves.is_leaf(m) and id(m) not in under:
            infos[id(m)].leaf = True
    me = weakref.ref(engine)  # weakly: collaborators that ask the engine do not keep it alive
    engine._sched = Scheduler(
        engine._slots.values(),
        engine.sizing.budget,
        engine.compute_device,
        across_passes=lambda: (e := me()) is not None and e._across,
        order=[(info.index, info.slots) for info in infos.values()],  # the first iteration's guess
        itemsize=max((st.dtype.itemsize for _, st in engine._items), default=4),
        counters=counters,
    )
    engine._stores = {id(st.store): st.store for _, st in engine._items}
    pool = engine.sizing.allowances.fetch_pool
    for store in engine._stores.values():
        if isinstance(store, NvmeStore):  # reuse fetch buffers up to what may be live at once
            # Read buffers registered for one-hop DMA to the device.
            dev = engine.compute_device
            store.serve(pool, None if dev.passthrough else dev.register_alloc(store.engine.empty))
    if isinstance(engine.compute_device, _device.CudaDevice | _device.StandInDevice):
        engine.compute_device.pool.keep(pool)  # gathered params' device buffers, reused likewise
    engine._hooks = ModuleHooks(
        module,
        infos,
        engine._sched,
        engine._slot_for,
        reuse_outputs=lambda: (e := me()) is not None and e._reuse_outputs,
        leaf_done=functools.partial(_leaf_done, me),
        autocast=_autocast(config, engine.compute_device.torch_device.type),
        ledger=stepping.ForwardLedger(items) if any(st.world_size > 1 for _, st in items) else None,
    )
    engine._hooks.hold(generation.install(module, max((st.world_size for _, st in items), default=1)))
    leaf_items = {i.index: [(s.p, s.st) for s in i.slots] for i in infos.values() if i.leaf}
    engine._grads = grads.GradSink(engine._items, engine.compute_device, leaf_items)
    engine._grads.names = {id(p): n for n, p in module.named_parameters()}
    dtypes.set_reduction(engine)  # communication_data_type
    engine._grad_stores = []
    try:
        # Weakly (`me`): each param's state holds its gradient store for as long as the param lives (its
        # finalizer keeps the state), so a store holding this Engine kept the module and every buffer
        # alive for good once the engine was dropped without `close`.
        engine._grad_stores = gradstore.attach(
            engine._items,
            config,
            stash_cap=lambda: (e._grad_stash or 0) if (e := me()) is not None else 0,
            # the step's norm from backward: no gradient read for it (gradstore)
            norms_wanted=lambda: (
                (e := me()) is not None
                and (e.max_grad_norm is not None or getattr(e, "_check_finite", False))
            ),
            widen=dtypes.widens(engine),
        )
        engine._grads.land_in(
            grads.landing_alloc(engine.compute_device, engine._grad_stores, engine._stores.values()), pool
        )
        engine._sched.fetch_persistent([s for s in engine._slots.values() if s.persistent])
        # After the persistent params' fetches: a pool miss unpools idle buffers first, so theirs,
        # made later, unpooled the prefilled ones (and pass 1 and its reads ahead made them anew).
        engine._sched.prefill()  # the first pass's read buffers, faulted in now, not under its reads
    except BaseException:
        unwire(engine)
        raise


def unwire(engine: Engine) -> None:
    try:
        teardown(engine)
    finally:
        gradstore.detach(engine._items, engine._grad_stores)
        engine._grad_stores = []


def _leaf_done(engine: weakref.ref[Engine], leaf: int | None) -> None:
    e = engine()
    if e is not None:
        e._grads.leaf_done(leaf)


def _autocast(config: ZswapConfig, device_type: str) -> Callable[[], torch.autocast] | None:
    """The config's ``torch_autocast`` for the module hooks to run each forward in (as DeepSpeed's engine
    runs its forward): on every call of the module, the engine's, a loop's or a front end's alike."""
    section = config.torch_autocast
    if not section.enabled:
        return None
    return functools.partial(torch.autocast, device_type, dtype=section.torch_dtype())


@contextlib.contextmanager
def rewired(engine: Engine) -> Iterator[None]:
    """Unwire, let the caller change the shapes of managed params (``resize_token_embeddings``,
    `zswap.module_api`), wire again over them as they are then: budgets, hooks and gradient stores are
    sized anew; the optimizer, schedule, loss scaler and counters are kept. The caller has made sure
    no gradient is accumulated and no optimizer state exists for a param whose shape changes. If the
    wiring fails the engine is closed."""
    engine._check_open()
    engine._grads.flush()
    grads.wait(engine._items)
    counters = engine._sched.counters
    if engine._early is not None:
        engine._early.abort()
    unwire(engine)
    try:
        yield
    finally:
        try:
            wire(engine, counters)
            engine._early = early_build.for_engine(engine)  # built over the new items
            engine._grads.hand_first_to(engine._early)
        except BaseException:
            engine.closed = True
            if engine._owns_optimizer and hasattr(engine.optimizer, "close"):
                engine.optimizer.close()
            engine.optimizer = None
            engine._no_optimizer = "this zswap Engine is closed: wiring it after a change of params failed"
            raise


def teardown(engine: Engine) -> None:
    try:
        engine._hooks.remove()
        engine._grads.remove()
    finally:
        engine._sched.drop_all()
        for store in engine._stores.values():
            if isinstance(store, NvmeStore):
                store.unserve()
        engine.compute_device.close()  # every copy done, every host buffer unregistered
        _device.unplace(engine._items, engine._homes)


def _uses(m: nn.Module) -> Iterator[nn.Parameter]:
    """The params ``m``'s forward is taken to use: a leaf's every one, else its own and those of its
    ``ParameterDict`` / ``ParameterList`` children, which never run a forward of their own to be gathered
    in (PEFT's LoHa and IA3 keep their factors in them; LoHa's hand them to an autograd Function, where a
    use is not seen)."""
    if leaves.is_leaf(m):
        yield from m.parameters()
        return
    yield from m.parameters(recurse=False)
    for child in m.children():
        if isinstance(child, nn.ParameterDict | nn.ParameterList):
            yield from child.parameters(recurse=False)
