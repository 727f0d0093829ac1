"""`zswap.Init`: partition and offload every param as soon as the module that owns it is built.

Construction hooks. While an Init is active, the ``__init__`` of every class in the MRO of every
`nn.Module` subclass is wrapped: the classes that exist are found by walking ``__subclasses__`` at entry,
classes defined inside the context through a patched ``nn.Module.__init_subclass__``, and a class missed by
both (an ``__init_subclass__`` that does not chain up) is caught by the wrapped ``nn.Module.__init__`` and
swept at the next sync point. A per-instance depth (in `_InitContext.building`) tells when the *outermost*
``__init__`` of an instance returns; its params that zswap does not manage yet are then partitioned.
Every patch goes on `_PatchStack` and is undone at the outermost exit, also when the body raised.

Writes after partitioning (a parent initialising a child's weight, Hugging Face ``post_init``,
``model.apply(init_fn)``) go through `AccessMode` (`_access.py`), a torch-function mode: a torch call that
reaches a managed, not-gathered param first gathers it ("touched"); shape queries are answered from its
`ParamState` without I/O. Touched params are re-partitioned from their current data at the next sync
point: when an outermost ``__init__`` returns, after each ``fn(module)`` of ``nn.Module.apply``, when
touched data would exceed `TOUCH_BUDGET_BYTES` (oldest first, never one still aliased elsewhere), and at
exit.
"""

from __future__ import annotations

import dataclasses
import functools
import sys
import threading
import weakref
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import nn

from .. import _dist, memory
from .. import pool as _pool
from ..checkpoint import peft_save, statedict
from ..config import load_config
from ..errors import ConfigError, ZswapError
from ..parts import guards as _guards
from ..parts._access import AccessMode
from ..parts.gather import Placement, fetch, manage, no_torch_function, offload
from ..parts.params import MemoryStore, NvmeStore, ParamState, Status, param_state
from ..parts.placing import PLACING
from . import _hf, _lineage, module_api

# Data gathered by the access hook and not yet written back is bounded by this (one larger param may
# exceed it alone): Hugging Face's init pass walks the whole model without a sync point of its own.
TOUCH_BUDGET_BYTES = 256 << 20

_ABSENT = object()
_HEAPTYPE = 1 << 9  # Py_TPFLAGS_HEAPTYPE: only classes defined in Python can take a new __init__


class _PatchStack:
    """(owner, name, original) of everything patched, restored in reverse order.

    A patch that someone else replaced in the meantime (a metaclass wrapping ``__init__`` after
    ``__init_subclass__`` ran, as ``torch.jit.ScriptMeta`` does) is left to them: our wrapper inside theirs
    is inert once no Init is active.
    """

    def __init__(self) -> None:
        self._entries: list[tuple[Any, str, Any, Any]] = []

    def set(self, owner: Any, name: str, value: Any) -> None:
        self._entries.append((owner, name, _own_attr(owner, name), value))
        setattr(owner, name, value)

    def restore(self) -> None:
        while self._entries:
            owner, name, original, value = self._entries.pop()
            if _own_attr(owner, name) is not value:
                continue
            if original is _ABSENT:
                delattr(owner, name)
            else:
                setattr(owner, name, original)


def _own_attr(owner: Any, name: str) -> Any:
    return owner.__dict__.get(name, _ABSENT) if isinstance(owner, type) else getattr(owner, name, _ABSENT)


@dataclass(eq=False)
class _Frame:
    """One active Init: where its params go, the modules built under it, and the params it manages (cast
    to ``placement.dtype`` at its exit: the build itself runs in the dtypes a plain build uses)."""

    placement: Placement
    built: weakref.WeakSet[nn.Module] = field(default_factory=weakref.WeakSet)
    orphans: weakref.WeakSet[nn.Module] = field(default_factory=weakref.WeakSet)
    created: list[weakref.ref[torch.Tensor]] = field(default_factory=list)
    keep_fp32: tuple[str, ...] | None = None
    """``data_types.keep_in_fp32_modules``: buffer name patterns left in float32 (``None``: the model's
    own Hugging Face lists, `_lineage.kept_in_fp32`)."""

    @property
    def build_placement(self) -> Placement:
        """Where params go while the frame builds: its store and group, in the dtype they were built in."""
        return dataclasses.replace(self.placement, dtype=None)


class _InitContext:
    """All of Init's state while any Init is active in this process: one object, nesting included."""

    def __init__(self) -> None:
        self.frames: list[_Frame] = []
        self.thread: int | None = None
        self.patches = _PatchStack()
        self.wrapped: set[type] = set()
        self.building: dict[int, int] = {}
        self.touched: dict[int, tuple[torch.Tensor, int, int]] = {}  # id -> (param, storage uses, bytes)
        self.touched_bytes = 0
        self.dirty: dict[int, Any] = {}  # stores written by write-backs: waited for at the outermost exit
        self.mode: AccessMode | None = None
        self.lineage = _lineage.Lineage()  # what the frame's dtype as the default would have made in it

    @property
    def active(self) -> bool:
        return bool(self.frames) and threading.get_ident() == self.thread

    # -- install / uninstall -----------------------------------------------------------------------

    def install(self) -> None:
        self.thread = threading.get_ident()
        try:
            for cls in _subclasses(nn.Module):
                self.hook_class(cls)
            self.patches.set(nn.Module, "__init_subclass__", classmethod(_make_init_subclass(self)))
            self.patches.set(nn.Module, "apply", _make_apply(self, nn.Module.apply))
            self.patches.set(nn.Module, "to_empty", _make_to_empty(self, nn.Module.to_empty))
            casting = lambda: self.active and self.frames[-1].placement.dtype is not None  # noqa: E731
            self.patches.set(torch, "get_default_dtype", _lineage.watch_default(self.lineage, casting))
            _hf.install(self)  # from_pretrained partitions as it loads (when transformers is imported)
            self.mode = AccessMode(self)
            self.mode.__enter__()
        except BaseException:
            self.uninstall()
            raise

    def uninstall(self) -> None:
        try:
            if self.mode is not None:
                self.mode.__exit__(None, None, None)
        finally:
            self.mode = None
            self.lineage.clear()
            self.patches.restore()
            self.wrapped.clear()
            self.building.clear()
            self.thread = None

    def hook_class(self, cls: type) -> None:
        for klass in cls.__mro__:
            if klass in self.wrapped or klass is object or not klass.__flags__ & _HEAPTYPE:
                continue
            self.wrapped.add(klass)
            if "__init__" in klass.__dict__:
                self.patches.set(klass, "__init__", _make_init(self, klass.__dict__["__init__"]))

    # -- sync points -------------------------------------------------------------------------------

    def module_built(self, module: nn.Module) -> None:
        frame = self.frames[-1]
        frame.built.add(module)
        self.manage_new(module.parameters(), frame)
        statedict.install(module)  # state_dict() gathers partitioned params instead of returning empties
        peft_save.install()  # PEFT's seams (gathering a base weight, saving adapters), once peft is imported
        for orphan in list(frame.orphans):
            self.manage_new(orphan.parameters(recurse=False), frame)
        self.sync_touched()

    def manage_new(self, params: Iterable[torch.Tensor], frame: _Frame | None = None) -> None:
        frame = frame or self.frames[-1]
        where = frame.build_placement
        with no_torch_function():
            for p in params:
                if param_state(p) is None and p.device.type != "meta" and not _uninitialized(p):
                    manage(p, where)
                    frame.created.append(weakref.ref(p))

    def touch(self, items: list[tuple[torch.Tensor, ParamState]]) -> None:
        need = sum(st.numel * st.dtype.itemsize for _, st in items)
        if self.touched and self.touched_bytes + need > TOUCH_BUDGET_BYTES:
            self.sync_touched(evict_for={id(p) for p, _ in items})
        fetch(items, private=False)
        for p, st in items:
            st.touched = True
            nbytes = st.numel * st.dtype.itemsize
            self.touched[id(p)] = (p, _storage_uses(p), nbytes)
            self.touched_bytes += nbytes

    def made(self, func: Any, args: tuple[Any, ...], kwargs: dict[str, Any], out: Any) -> None:
        """A torch call inside the Init returned ``out``: noted where the frame casts (`_lineage`)."""
        if self.frames[-1].placement.dtype is not None:
            self.lineage.note(func, args, kwargs, out)

    def adopt(self, p: torch.Tensor) -> None:
        """``p.data = x`` on a managed param: ``x`` is now its data, to be partitioned at the next sync."""
        st = param_state(p)
        if st is None or st.gathered_by is not None or st.touched:
            return
        st.status, st.touched = Status.AVAILABLE, True
        self.touched[id(p)] = (p, -1, st.numel * st.dtype.itemsize)  # -1: never evicted early
        self.touched_bytes += st.numel * st.dtype.itemsize

    def sync_touched(self, evict_for: set[int] | None = None) -> None:
        """Write back touched params. With ``evict_for`` (a budget eviction in the middle of user code),
        skip those params and any whose data is still referenced from elsewhere (a ``w = p.data`` alias
        whose later writes would be lost), and stop once under budget."""
        for pid, (p, uses, nbytes) in list(self.touched.items()):
            st = param_state(p)
            if st is not None and st.touched:
                if evict_for is not None:
                    if self.touched_bytes <= TOUCH_BUDGET_BYTES // 2:
                        return
                    if pid in evict_for or uses < 0 or _storage_uses(p) != uses:
                        continue
                offload(p, st, from_first_rank=True)  # rank 0's write, as the build itself
                self.dirty[id(st.store)] = st.store
            del self.touched[pid]
            self.touched_bytes -= nbytes

    def finish(self, frame: _Frame) -> None:
        """Exit of ``frame``: partition what its modules gained after ``__init__``, write back, cast to the
        frame's dtype, wait."""
        modules = [*frame.built, *frame.orphans]
        for module in modules:
            self.manage_new(module.parameters(recurse=False), frame)
        self.sync_touched()
        dtype = frame.placement.dtype
        if dtype is not None:
            module_api.cast_params([r() for r in frame.created], dtype)
            with no_torch_function():
                kept = _lineage.kept_in_fp32(modules, dtype, frame.keep_fp32)
                _lineage.cast_buffers(modules, dtype, self.lineage, kept)
        frame.created.clear()
        module_api.attach(modules)
        frame.placement.store.wait_all()
        if len(self.frames) == 1:
            stores, self.dirty = list(self.dirty.values()), {}
            for store in stores:
                store.wait_all()


_CTX = _InitContext()


def active() -> bool:
    """Whether a `zswap.Init` is active on this thread (its access hook gathers what a call touches)."""
    return _CTX.active


def touched_bytes() -> int:
    """Bytes of params an active `Init` gathered for writes and has not written back yet (at most about
    `TOUCH_BUDGET_BYTES`; 0 outside Init)."""
    return _CTX.touched_bytes


def _subclasses(root: type) -> list[type]:
    out: list[type] = [root]
    stack: list[type] = [root]
    seen: set[type] = {root}
    while stack:
        subs: list[type] = stack.pop().__subclasses__()
        for sub in subs:
            if sub not in seen:
                seen.add(sub)
                out.append(sub)
                stack.append(sub)
    return out


def _uninitialized(p: torch.Tensor) -> bool:
    return isinstance(p, nn.parameter.UninitializedParameter)  # lazy modules: materialised at first use


def _storage_uses(p: torch.Tensor) -> int:
    """References to ``p``'s storage (≥ 0), or -1 when torch cannot say (`zswap.pool`'s count, read past
    the access mode)."""
    with no_torch_function():
        return _pool._storage_uses(p.data)


def _make_init(ctx: _InitContext, init: Callable[..., None]) -> Callable[..., None]:
    @functools.wraps(init)
    def __init__(self: Any, *args: Any, **kwargs: Any) -> None:
        if not isinstance(self, nn.Module) or not ctx.active:
            return init(self, *args, **kwargs)
        key = id(self)
        depth = ctx.building.get(key, 0)
        orphan = depth == 0 and not hasattr(type(self).__init__, "__zswap_init__")
        if orphan:
            # The instance's own __init__ was never wrapped (its class escaped both hooks), so this is not
            # its outermost __init__: wrap the class for the next instances, and sweep this one at the
            # next sync point and at exit.
            ctx.hook_class(type(self))
            ctx.frames[-1].orphans.add(self)
        ctx.building[key] = depth + 1
        try:
            init(self, *args, **kwargs)
        finally:
            if depth:
                ctx.building[key] = depth
            else:
                ctx.building.pop(key, None)
        if depth == 0 and not orphan and ctx.active:
            ctx.module_built(self)

    __init__.__zswap_init__ = True  # type: ignore[attr-defined]
    return __init__


def _make_init_subclass(ctx: _InitContext) -> Callable[..., None]:
    def __init_subclass__(cls: type[nn.Module], **kwargs: Any) -> None:
        super(nn.Module, cls).__init_subclass__(**kwargs)
        ctx.hook_class(cls)
        _hf.class_defined(ctx, cls)  # transformers imported inside the context

    return __init_subclass__


def _make_apply(ctx: _InitContext, apply: Callable[..., nn.Module]) -> Callable[..., nn.Module]:
    @functools.wraps(apply)
    def wrapped(self: nn.Module, fn: Callable[[nn.Module], None]) -> nn.Module:
        if not ctx.active or getattr(fn, "__zswap_synced__", False):
            return apply(self, fn)

        def synced(module: nn.Module) -> None:
            fn(module)
            ctx.sync_touched()  # one module's params gathered at a time, not the whole model

        synced.__zswap_synced__ = True  # type: ignore[attr-defined]
        return apply(self, synced)

    return wrapped


def _make_to_empty(ctx: _InitContext, to_empty: Callable[..., nn.Module]) -> Callable[..., nn.Module]:
    @functools.wraps(to_empty)
    def wrapped(self: nn.Module, *args: Any, **kwargs: Any) -> nn.Module:
        out = to_empty(self, *args, **kwargs)
        if ctx.active:  # meta-built params become real here (skip_init, meta + to_empty)
            ctx.manage_new(self.parameters(recurse=kwargs.get("recurse", True)))
            ctx.sync_touched()
        return out

    return wrapped


class Init:
    """Partition and offload each module's params as it is built.

    ``config``: a path, mapping, `ZswapConfig` or ``None`` (`zswap.load_config`); only the values Init
    needs are kept, so later changes to the caller's config change nothing. Keyword arguments override it:
    ``remote_device`` ("cpu", "nvme", or "none": partitioned across ranks only, the partition stays on the
    device the param was built on), ``pin_memory``, ``dtype`` (floating params are kept in; ``None``: the
    config's, where ``None`` keeps the built dtype). The model is built exactly as a plain build (float32
    where that is the default, the same random numbers) and each floating param is cast to ``dtype`` when
    the Init exits: the same seed gives bitwise ``plain_model.to(dtype)``. Floating buffers take ``dtype``
    where a build with it as torch's default dtype would have made them in it (BatchNorm's statistics; not
    a float32 rotary ``inv_freq``; `_lineage`), but those kept in float32 (``data_types``, Hugging Face's
    ``_keep_in_fp32_modules_strict``), as transformers' ``from_pretrained(dtype=…)`` builds them.
    ``process_group``: partition across it (default: the default group when torch.distributed is
    initialised, else a single process). ``module``: an already built model, converted at once.
    ``enabled=False`` makes Init do nothing.

    The nvme path is checked here, before any module is built: a missing directory is `NvmePathMissing`
    (a `ConfigError` and a `FileNotFoundError`; never created: a typo must not fill the wrong disk), not a
    directory `NvmePathNotADirectory` (also `NotADirectoryError`), not writable `NvmePathNotWritable`
    (also `PermissionError`); the swap engine then probes direct I/O.
    """

    def __init__(
        self,
        config: Any = None,
        *,
        remote_device: str | None = None,
        pin_memory: bool | None = None,
        dtype: torch.dtype | None = None,
        enabled: bool = True,
        process_group: Any = None,
        module: nn.Module | None = None,
    ) -> None:
        self._enabled = enabled
        self._frames: list[_Frame] = []
        if not enabled:
            return
        _guards.install(active)  # a forward, step or clip the partitioned params cannot honour is refused
        cfg = load_config(config)
        device = cfg.offload_param.device if remote_device is None else remote_device
        if device not in ("none", "cpu", "nvme"):
            raise ConfigError(f"remote_device must be 'none', 'cpu' or 'nvme', not {device!r}")
        pin = cfg.offload_param.pin_memory if pin_memory is None else bool(pin_memory)
        if dtype is None:
            dtype = cfg.torch_dtype()
        elif not isinstance(dtype, torch.dtype):
            raise TypeError(f"dtype must be a torch.dtype, not {type(dtype).__name__}")
        if dtype is not None and not dtype.is_floating_point:
            raise ConfigError(f"dtype must be a floating dtype to build params in, not {dtype}")
        group, rank, world = _dist.resolve_group(process_group)
        _dist.check_launch(process_group)
        if device == "nvme":
            store: MemoryStore | NvmeStore = NvmeStore(_open_engine(cfg.offload_param.nvme_path, cfg.aio))
        else:
            store = MemoryStore("cpu" if device == "cpu" else "none", pin)
        self._placement = Placement(store, group, rank, world, dtype)
        self._keep_fp32 = cfg.data_types.keep_in_fp32_modules
        del cfg
        if module is not None:
            self._convert(module)

    @classmethod
    def _at(cls, placement: Placement) -> Init:
        """An Init that puts new params where ``placement`` says (with its store and group)."""
        self = cls.__new__(cls)
        self._enabled, self._frames, self._placement, self._keep_fp32 = True, [], placement, None
        return self

    def _convert(self, module: nn.Module, keep: set[int] | frozenset[int] = frozenset()) -> None:
        """Partition ``module``'s unpartitioned params, cast to this Init's dtype but those in ``keep``
        (ids), which keep theirs."""
        own = dataclasses.replace(self._placement, dtype=None)
        with no_torch_function():  # already built: cast as it is partitioned, no build to reproduce
            for p in module.parameters():
                if param_state(p) is None and p.device.type != "meta" and not _uninitialized(p):
                    manage(p, own if id(p) in keep else self._placement)
        module_api.attach(module.modules())
        statedict.install(module)
        peft_save.install()
        self._placement.store.wait_all()

    def __enter__(self) -> Init:
        if not self._enabled:
            return self
        ctx = _CTX
        if ctx.frames and ctx.thread != threading.get_ident():
            raise ZswapError("zswap.Init is already active in another thread")
        frame = _Frame(self._placement, keep_fp32=self._keep_fp32)
        if not ctx.frames:
            memory.bound_heap()  # freed weights go back to the kernel, not into glibc's heap
            ctx.install()
        ctx.frames.append(frame)
        self._frames.append(frame)
        return self

    def __exit__(self, exc_type: Any, exc: BaseException | None, tb: Any) -> None:
        if not self._enabled:
            return
        ctx = _CTX
        frame = self._frames.pop()
        try:
            if ctx.frames[-1] is not frame:
                raise ZswapError("zswap.Init contexts were exited out of order")
            ctx.finish(frame)
        except Exception as err:
            if exc is None:
                raise
            note = getattr(exc, "add_note", None)  # Python >= 3.11; the original error wins either way
            if note is not None:
                note(f"zswap.Init could not finish offloading while this error propagated: {err!r}")
        finally:
            ctx.frames.remove(frame)
            if not ctx.frames:
                ctx.uninstall()
                memory.trim()


def _current_placement() -> Placement | None:
    return _CTX.frames[-1].placement if _CTX.active else None


PLACING.register(_current_placement, Init._at)


def _open_engine(paths: Any, aio: Any) -> Any:
    if not paths:
        raise ConfigError(
            "remote_device='nvme' needs zero_optimization.offload_param.nvme_path (an existing directory)"
        )
    from ..store.storage import open_dir  # the native engine is loaded only when NVMe is used

    # Shared with gradients and optimizer records on the same paths.
    return open_dir(list(paths), aio, "offload_param.nvme_path")


def partition_rest(config: Any, module: nn.Module) -> None:
    """Partition ``module``'s params that no `Init` partitioned: in the config's dtype (as
    ``Init(config, module=module)``), except, where the model was built under `Init`, those whose dtype the
    forward copes with as it is: under ``torch_autocast`` every one (DeepSpeed's rule and its test: float32
    adapters on a bf16 base stay float32), else a PEFT tuner layer's or prompt encoder's (PEFT makes them
    float32 on a bf16 base and casts their inputs or outputs). A plain layer attached after the build is
    cast: in float32 beside bf16 activations its matmul would fail."""
    states = [param_state(p) for p in module.parameters()]
    if all(st is not None for st in states):
        return
    cfg = load_config(config)
    keep: set[int] = set()
    if any(st is not None for st in states):
        if cfg.torch_autocast.enabled:
            keep = {id(p) for p in module.parameters()}
        else:
            keep = {id(p) for m in module.modules() if _tuner_layer(m) for p in m.parameters()}
    Init(cfg)._convert(module, keep)


def _tuner_layer(m: nn.Module) -> bool:
    """A module PEFT makes in float32 on any base and casts what flows through: a tuner layer (LoRA's, IA3's…)
    or a prompt learning encoder (prompt / prefix tuning, p-tuning: a module of ``peft.tuners`` that is not
    the tuner wrapping the whole model)."""
    tuners = sys.modules.get("peft.tuners.tuners_utils")
    if tuners is None:
        return False
    if isinstance(m, tuners.BaseTunerLayer):
        return True
    return type(m).__module__.startswith("peft.tuners.") and not isinstance(m, tuners.BaseTuner)
