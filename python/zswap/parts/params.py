"""One record per managed parameter, the registry that finds it, and the partition math.

A managed param keeps only its local partition (1/world of its flattened, padded elements) in a store: CPU
memory, its own device (``remote_device="none"``), or the swap engine. While it is not gathered, ``p.data``
is an empty tensor of the right dtype on the param's device; `param_state` gives its real shape.
"""

from __future__ import annotations

import contextlib
import copyreg
import enum
import itertools
import weakref
from collections.abc import Iterable, Iterator
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Literal

import torch

from .. import memory
from ..errors import ZswapError
from ..pool import BufferPool, is_free
from ..pool import _storage_uses as _storage_uses  # (its old path)
from ..store import storage as _storage

if TYPE_CHECKING:
    from torch.distributed import ProcessGroup

Tier = Literal["cpu", "nvme", "none"]


class Status(enum.Enum):
    """Where a managed param's full data is."""

    AVAILABLE = "available"
    """``p.data`` is the full tensor."""
    NOT_AVAILABLE = "not_available"
    """``p.data`` is empty; the data is partitioned in the store (and across ranks)."""
    INFLIGHT = "inflight"
    """A gather has started and not finished."""


class GradStore:
    """One backend for partition gradients, keyed by `ParamState`: the interface, declared here (a record
    holds its store); the backends are `zswap.gradstore`'s."""

    wanted = False
    """Whether its gradients were needed between a backward and the step: read by `zswap.full_grad`, or
    added to by a second backward. ``Engine.keep_applied_grads = "auto"`` keeps the gradients the early
    step applies from then on."""

    def add(self, st: ParamState, part: torch.Tensor, room: int = 0) -> torch.Tensor | None:
        """Accumulate one backward's local partition (the store may keep ``part``: callers hand it over).
        ``room``: bytes a store that keeps gradients in memory up to a cap may hold past it for this one.
        Returns the sum now held, where the store has it at hand (read only), else ``None``."""
        raise NotImplementedError

    def add_fp32(self, st: ParamState, part: torch.Tensor, room: int = 0) -> torch.Tensor | None:
        """`add`, accumulating in float32: a float16/bfloat16 ``part`` (it crossed from the compute device in
        its own dtype) is added to a float32 partition gradient, so the sum of several backwards is rounded
        once per add in float32 rather than in the low precision. As with `add` the store may keep ``part``
        (a pooled landing buffer counts as in use while anything references it). Other dtypes: `add`."""
        raise NotImplementedError

    def has(self, st: ParamState) -> bool:
        raise NotImplementedError

    def dtype(self, st: ParamState) -> torch.dtype | None:
        """The dtype ``st``'s partition gradient is kept in (``None``: it has none), without reading it."""
        raise NotImplementedError

    def norm(self, st: ParamState) -> torch.Tensor | None:
        """The float32 L2 norm of the partition gradient, if the store computed it when it stored it
        (``torch.linalg.vector_norm(g, 2.0, dtype=torch.float32)``: what `zswap.grads.global_scale` would
        compute after `load`, the same bits); ``None``: load it."""
        return None

    def load(self, st: ParamState) -> tuple[torch.Tensor, Any]:
        """(the partition gradient, or a buffer being filled with it; a handle to ``wait()`` on, or None).
        The tensor may be modified in place (clipping) but is not stored back."""
        raise NotImplementedError

    def earlier(self, st: ParamState) -> tuple[torch.Tensor, Any]:
        """`load`, from inside a backward that gave ``st`` no gradient: the sum the earlier ones left
        (this backward's own writes are left to its end). Read only."""
        return self.load(st)

    def clear(self, sts: Iterable[ParamState]) -> None:
        raise NotImplementedError

    def wait_all(self) -> None:
        """Every gradient written; raises the first write error."""

    def close(self) -> None:
        pass


@dataclass(eq=False)
class ParamState:
    """Everything zswap knows about one param; found with `param_state`.

    ``tier`` is where the local partition lives: ``"cpu"`` (CPU memory, pinned when asked and possible),
    ``"nvme"`` (the swap engine), or ``"none"`` (``remote_device="none"``: partitioned across ranks only,
    the partition stays on the device the param was built on).
    """

    shape: torch.Size
    dtype: torch.dtype
    status: Status
    tier: Tier
    partition_numel: int
    rank: int = field(repr=False)
    world_size: int = field(repr=False)
    group: ProcessGroup | None = field(repr=False)
    device: torch.device = field(repr=False)
    """Device the full data is gathered to (the one the param was built on)."""
    store: Store = field(repr=False)
    key: str = field(repr=False)
    touched: bool = field(default=False, repr=False)
    """Gathered by `zswap.Init`'s access hook: re-partitioned (written back) at its next sync point."""
    gathered_by: object | None = field(default=None, repr=False)
    """The `GatheredParameters` block holding it gathered, if any."""
    gathered_version: int = field(default=-1, repr=False)
    """The param's version counter when its gathered data was installed (`note_gathered`): an engine that
    drops the data sees an in-place change made since (`changed_in_place`)."""
    grad: torch.Tensor | None = field(default=None, repr=False)
    """This rank's partition of the accumulated gradient (1-D, ``partition_numel`` elements, on the CPU —
    on the param's device for tier "none"), filled by `zswap.initialize`'s backward hooks; ``None`` when
    there is none, or when it lives on NVMe (``grad_store``). An optimizer reads (and clears) it;
    `zswap.full_grad` gathers the whole."""
    grad_store: GradStore | None = field(default=None, repr=False)
    """Where the partition gradient lives when not in ``grad`` (`zswap.gradstore.NvmeGrads`); ``None``:
    in memory. Set by `zswap.initialize` while its engine is open."""

    @property
    def numel(self) -> int:
        return self.shape.numel()

    def bounds(self) -> tuple[int, int]:
        """[start, end) of this rank's slice of the flattened param (end may lie in the padding)."""
        start = self.rank * self.partition_numel
        return start, start + self.partition_numel


def partition_numel(numel: int, world_size: int) -> int:
    """Elements each rank keeps: ``numel`` padded up to a multiple of ``world_size``, divided by it."""
    return -(-numel // world_size)


def local_slice(flat: torch.Tensor, rank: int, part_numel: int) -> torch.Tensor:
    """This rank's ``part_numel`` elements of ``flat``, zero-filled past its end; a view when possible."""
    start = rank * part_numel
    end = min(start + part_numel, flat.numel())
    if end - start == part_numel:
        return flat[start:end]
    out = flat.new_zeros(part_numel)
    if end > start:
        out[: end - start] = flat[start:end]
    return out


# id(param) -> state. One entry per live managed param, removed by a weakref finaliser when the param dies,
# which also frees its partition in the store.
_REGISTRY: dict[int, ParamState] = {}
_IDS = itertools.count()
"""``ds_id`` of each param registered, in order (DeepSpeed numbers its params so too)."""


Item = tuple[torch.Tensor, "ParamState"]
"""A managed param with its record, as the layers above pass them around."""


def param_state(p: object) -> ParamState | None:
    """The `ParamState` of a param partitioned by zswap, or ``None`` for any other object."""
    return _REGISTRY.get(id(p)) if isinstance(p, torch.Tensor) else None


def register(p: torch.Tensor, state: ParamState) -> None:
    if id(p) in _REGISTRY:
        raise ZswapError(f"param of shape {tuple(state.shape)} is already managed by zswap")
    _REGISTRY[id(p)] = state
    # DeepSpeed ZeRO-3's attributes for a partitioned param's real shape and size (a managed param's is
    # never changed: a resize makes new params): PEFT reads ds_shape where p.shape is the placeholder (GPT-2's
    # Conv1D, 3-D expert weights) and ds_numel to count params; ds_id marks a partitioned param for scripts
    # ported from DeepSpeed. Nothing else of DeepSpeed's param API (ds_status, all_gather…) is offered.
    p.ds_shape = state.shape  # type: ignore[attr-defined]
    p.ds_numel = state.numel  # type: ignore[attr-defined]
    p.ds_id = next(_IDS)  # type: ignore[attr-defined]
    fin = weakref.finalize(p, _forget, id(p), state)
    fin.atexit = False  # at interpreter exit the stores go away whole


def _reduce_parameter(p: torch.nn.Parameter) -> Any:
    """How pickle (``torch.save(model)``, ``pickle.dumps``) reduces an ``nn.Parameter``: torch's own way,
    except for a managed param not gathered, whose ``.data`` is an empty placeholder — the file would load
    as a model without those weights and nothing would say so (inside ``GatheredParameters`` its ``.data`` is
    the full tensor, written as a plain param's). Registered for the type in `copyreg` (which pickle and
    ``copy.copy`` consult before the class's ``__reduce_ex__``; ``copy.deepcopy`` uses the class's
    ``__deepcopy__``, and torch's multiprocessing its own reducers)."""
    state = _REGISTRY.get(id(p))
    if state is not None and not (state.status is Status.AVAILABLE and p.numel() == state.numel):
        raise ZswapError(
            f"pickling a param zswap partitioned (shape {tuple(state.shape)}; torch.save(model), pickle) "
            "would write its empty placeholder, not its values: the file would load without its weights. "
            "Save model.state_dict() (full values, one param at a time), or write them with "
            "zswap.save_weights(model, dir) or model.save_pretrained(dir); engine.save_checkpoint(dir) to "
            "resume training"
        )
    return torch.nn.Parameter.__reduce_ex__(p, 2)  # (a copyreg reducer is not told the protocol: torch's
    # reduce of a param does not read it)


copyreg.pickle(torch.nn.Parameter, _reduce_parameter)


def _forget(pid: int, state: ParamState) -> None:
    if _REGISTRY.get(pid) is state:
        del _REGISTRY[pid]
    state.store.free(state.key)


def managed_params(params: Iterator[torch.Tensor]) -> Iterator[tuple[torch.Tensor, ParamState]]:
    for p in params:
        st = _REGISTRY.get(id(p))
        if st is not None:
            yield p, st


class Store:
    """Keeps local partitions by key. Subclasses: `MemoryStore` and `NvmeStore`."""

    tier: Tier

    def __init__(self) -> None:
        self._ids = itertools.count()

    def new_key(self) -> str:
        return f"p{next(self._ids)}"

    def put(self, key: str, part: torch.Tensor) -> None:
        """Store ``part`` (1-D, contiguous; the store may keep it, so callers hand over ownership)."""
        raise NotImplementedError

    def load(self, key: str, numel: int, dtype: torch.dtype) -> tuple[torch.Tensor, Any]:
        """(the partition, or a buffer being filled with it; a handle to ``wait()`` on, or ``None``)."""
        raise NotImplementedError

    def free(self, key: str) -> None:
        raise NotImplementedError

    def wait_all(self) -> None:
        """Wait for every queued write; raise the first error after all have finished."""


class MemoryStore(Store):
    """Partitions in memory: on the CPU (tier "cpu", pinned when asked and CUDA is there), or left on
    the device the param was built on (tier "none")."""

    def __init__(self, tier: Literal["cpu", "none"], pin_memory: bool) -> None:
        super().__init__()
        self.tier = tier
        # Pinning needs a CUDA runtime; without one there is nothing to pin for.
        self.pin = pin_memory and tier == "cpu" and torch.cuda.is_available()
        self._parts: dict[str, torch.Tensor] = {}

    def put(self, key: str, part: torch.Tensor) -> None:
        if self.tier == "cpu" and part.device.type != "cpu":
            part = part.to("cpu", non_blocking=False)
        old = self._parts.get(key)
        same = old is not None and old.data_ptr() == part.data_ptr() and old.numel() == part.numel()
        if same and part.numel():  # (an empty tensor has no address: a cast one is a new partition)
            return  # gathered zero-copy: the partition was written in place
        if self.pin and not part.is_pinned():
            if old is not None and old.shape == part.shape and old.dtype == part.dtype:
                old.copy_(part)
                return
            part = part.pin_memory()
        elif part.untyped_storage().nbytes() != part.nbytes:
            part = part.clone()  # a view would keep the whole gathered tensor alive
        self._parts[key] = part

    def load(self, key: str, numel: int, dtype: torch.dtype) -> tuple[torch.Tensor, None]:
        return self._parts[key], None

    def free(self, key: str) -> None:
        self._parts.pop(key, None)


def _allocate(ref: weakref.ref[NvmeStore], numel: int, dtype: torch.dtype) -> torch.Tensor:
    """`NvmeStore._allocate` of the store ``ref`` points to (alive: it is the one asking)."""
    store = ref()
    assert store is not None
    return store._allocate(numel, dtype)


def _unused(buf: torch.Tensor, uses: int) -> bool:
    """Whether a pooled buffer the caller holds in a variable (besides the pool's entry) is free again
    (`zswap.pool.is_free`)."""
    return is_free(buf, uses, held=3)  # the entry, the caller's variable, this parameter


class NvmeStore(Store):
    """Partitions in a namespace (``p/<n>``) of the swap directory's one `zswap.storage.Storage`: writes
    are queued, not awaited (bounded by the storage's write queue), and copy-on-write — a failed write
    leaves the previous value readable. Inside a step transaction (`zswap.storage.step_transaction`) a
    `put` is staged in it. ``engine``: a `SwapEngine` (or a `Storage`) to keep the partitions in."""

    tier: Tier = "nvme"

    def __init__(self, engine: Any) -> None:
        super().__init__()
        self.storage = _storage.storage_for(engine)
        self.ns = self.storage.namespace("p")
        weakref.finalize(self, self.ns.close).atexit = False
        ref = weakref.ref(self)  # (not self: the store would be in a reference cycle, freed late)
        self.pool = BufferPool(lambda numel, dtype: _allocate(ref, numel, dtype), 0)
        """The fetch pool: load buffers kept for reuse (`zswap.pool`'s one peak rule, at most
        `pool_bytes`). Fetched params land in memory already mapped, instead of faulting in (and zeroing)
        fresh pages on every fetch; the early step's copies come from it too."""
        self.host_alloc: Any = None
        """``alloc(shape, dtype)`` for load buffers instead of ``engine.empty`` (``None``: that): a GPU
        `zswap.initialize` sets one that registers each buffer with CUDA (`zswap.device`)."""

    @property
    def engine(self) -> Any:
        return self.storage.engine

    def physical(self, key: str) -> str | None:
        """The engine key holding ``key``'s current value (None: none)."""
        return self.ns.physical(key, _storage.current())

    def version(self, key: str) -> str | None:
        """The stored version a read of ``key`` would see now; None while a write of it is unsettled
        (`zswap.storage.Namespace.version`: never waits or raises)."""
        return self.ns.version(key, _storage.current())

    def put(self, key: str, part: torch.Tensor) -> None:
        self.ns.put(key, part, _storage.current())

    def load(self, key: str, numel: int, dtype: torch.dtype) -> tuple[torch.Tensor, Any]:
        buf = self._buffer(numel, dtype)  # page-aligned: read without a bounce copy
        return buf, self.ns.read(key, buf, _storage.current())

    @property
    def pool_bytes(self) -> int:
        """Bytes of load buffers kept for reuse (0: none). `zswap.initialize` sets it to its live budget
        while it runs."""
        return self.pool.limit or 0

    @pool_bytes.setter
    def pool_bytes(self, nbytes: int) -> None:
        self.pool.limit = nbytes

    def serve(self, pool_bytes: int, host_alloc: Any = None) -> None:
        """An engine runs over this store: keep up to ``pool_bytes`` of load buffers (at least what is
        kept now) and make new ones with ``host_alloc`` (registered with its compute device; ``None``:
        ``engine.empty``), until `unserve`."""
        self.pool.limit = max(self.pool_bytes, pool_bytes)
        self.host_alloc = host_alloc

    def unserve(self) -> None:
        """The engine `serve` was for ended: nothing pooled, plain engine buffers."""
        self.pool.limit = 0
        self.host_alloc = None
        self.trim()

    @contextlib.contextmanager
    def pool_widened(self, nbytes: int) -> Iterator[None]:
        """Pool ``nbytes`` more while the block runs (a load's buffers in flight), then let go of what
        the wider pool kept past the old limit."""
        before = self.pool_bytes
        self.pool.limit = before + nbytes
        try:
            yield
        finally:
            self.pool.limit = before
            self._evict(self._pooled - before)

    def widen_pool(self, nbytes: int) -> None:
        """Pool ``nbytes`` more for a holder whose buffers come from this pool (the early step's param
        copies: `zswap.memory.Allowances.early_step`), until `unserve` (the engine's end)."""
        self.pool.limit = self.pool_bytes + nbytes

    def fresh(self, numel: int, dtype: torch.dtype) -> torch.Tensor:
        """A load buffer nothing is read into, for a partition about to be overwritten whole (its values
        are whatever the buffer held)."""
        return self._buffer(numel, dtype)

    def _buffer(self, numel: int, dtype: torch.dtype) -> torch.Tensor:
        """A pooled buffer nothing uses any more, else a new one, pooled while the pool has room."""
        return self.pool.take(numel, dtype)[0]

    def _allocate(self, numel: int, dtype: torch.dtype) -> torch.Tensor:
        with memory.purpose("fetch"):
            return (self.host_alloc or self.engine.empty)((numel,), dtype)

    def prefill(self, numel: int, dtype: torch.dtype) -> torch.Tensor | None:
        """A new pooled load buffer, its pages already faulted in (engine buffers are populated when
        made; the caller holds it until it has taken all it wants, so each call makes a new one);
        ``None`` once the pool has no room for it."""
        return self.pool.fill(numel, dtype)

    # The pool's state under the names it had before `zswap.pool` (tests and `zswap.io.weights` read them).
    @property
    def _pool(self) -> dict[tuple[int, torch.dtype], list[list[Any]]]:
        return self.pool.bufs

    @property
    def _pooled(self) -> int:
        return self.pool.pooled

    @property
    def _peak_in_use(self) -> int:
        return self.pool.peak_in_use

    def _idle(self) -> int:
        return self.pool.idle()

    def _evict(self, nbytes: int) -> None:
        self.pool.evict(nbytes)

    def trim(self) -> None:
        """Forget the pooled buffers (those still in use are freed by their last user)."""
        self.pool.clear()

    def free(self, key: str) -> None:
        self.ns.free(key)

    def wait_all(self) -> None:
        self.ns.wait()
