"""Gradients of managed params: taken from autograd as each one is complete, reduce-scattered across ranks,
and accumulated as this rank's partition on the offload tier (`ParamState.grad`).

Autograd's own graph and `AccumulateGrad` are left exactly as they are: a param used in several places (tied
embeddings, activation checkpointing) still has its contributions summed by autograd in the same order as in
a plain model, and ``p.grad`` is read and cleared by a post-accumulate hook, so one backward's gradient is
folded into the partition with one in-place add — the op autograd itself uses to accumulate into ``p.grad``.
With one rank nothing else touches the values, so they are bitwise those of the plain model.

With a compute device (`zswap.device`) the reduce-scatter runs there (NCCL) and each partition gradient is
copied to page-locked host memory on the device's copy stream, in its own dtype (a registered engine buffer
from a reused pool where the store lets go of it: `GradSink.land_in`); the store receives it once the copy
has landed, so backward goes on meanwhile, and accumulates float16/bfloat16 gradients in float32
(`GradStore.add_fp32`). Partitions are kept by a `zswap.gradstore.GradStore`:
in CPU memory as ``ParamState.grad`` (on the param's device for tier "none"), or on NVMe when the optimizer
lives there; the optimizer step loads them from it.
"""

from __future__ import annotations

import weakref
from collections import deque
from collections.abc import Iterable, Mapping
from typing import Any, Protocol

import torch
import torch.distributed as dist

from .. import _dist
from ..device import Alloc, Copy, Device, ReusePool, on_host
from ..errors import SparseGradientError
from ..parts.gather import host_buffers, no_torch_function
from ..parts.params import Item, NvmeStore, ParamState, Status, param_state
from .gradstore import LOW_PRECISION, MemoryGrads, NvmeGrads, store_of


def sparse_message(name: str) -> str:
    return (
        f"{name} has a sparse gradient (nn.Embedding or F.embedding with sparse=True): zswap partitions, "
        "reduces and offloads dense gradients only. Build the embedding with sparse=False: the same "
        "values, and what Adam needs (torch's Adam and AdamW refuse sparse gradients too)"
    )


class GradTaker(Protocol):
    """Who may take a param's complete partition gradient before its store does (`GradSink.hand_first_to`):
    the early step, which applies it in backward."""

    def on_grad(self, p: torch.Tensor, st: ParamState, part: torch.Tensor, sink: Any = None) -> bool:
        """True: ``part`` is placed (taken, and stored too where gradients are kept); False: the sink hands
        it to the param's gradient store (on a compute device, ``sink`` is the `GradSink` whose landing
        it goes through)."""
        ...

    def summing_room(self) -> int:
        """Bytes the gradient store may keep in memory past its stash for a gradient landing now."""
        ...


class GradSink:
    """Installs, on each managed param that requires grad, the hooks that move its gradient to its
    partition. ``remove()`` takes them off again."""

    def __init__(
        self,
        items: Iterable[Item],
        device: Device | None = None,
        leaves: Mapping[int, list[Item]] | None = None,
    ) -> None:
        self._handles: list[Any] = []
        # Params of leaf modules over several ranks (`zswap.fetch.leaves`): leaf → its params in one order;
        # their gradients wait for the leaf's backward to end (`leaf_done`).
        self._leaves = {k: [(p, st) for p, st in v if p.requires_grad] for k, v in (leaves or {}).items()}
        self._leaf_of = {id(p): k for k, v in self._leaves.items() for p, st in v if st.world_size > 1}
        self._waiting: dict[int, torch.Tensor] = {}
        self.device = None if device is None or device.passthrough else device
        self._pending: deque[tuple[ParamState, Copy]] = deque()
        self._flush_task = -1
        self.placeholders = 0
        """Times a param was not gathered when autograd accumulated its gradient (see `_pre`)."""
        self.landing: ReusePool | None = None
        """Registered host buffers the device-to-host copies land in (`land_in`); ``None``: pinned memory."""
        self._first: GradTaker | None = None  # offered each complete partition gradient first
        self.reduce_in: torch.dtype | None = None
        """The dtype ranks reduce gradients in (``communication_data_type``; `local_part`)."""
        self.keep_reduced = False
        """The average stays in ``reduce_in`` (float32 where gradients are summed in float32 too)."""
        self.names: dict[int, str] = {}
        """{id(param): its name in the model}, for messages (set by the engine)."""
        self.frozen: set[int] = set()
        """Ids of the params that required no grad when the hooks went on (they have none)."""
        for p, st in items:
            if p.requires_grad:
                post: list[int] = []  # its handle's key, once registered (`_make_pre` keeps it last)
                self._handles.append(p.register_hook(self._make_pre(p, st, post)))
                self._handles.append(p.register_post_accumulate_grad_hook(self._make_post(st)))
                post.append(self._handles[-1].id)
            else:
                self.frozen.add(id(p))

    def hand_first_to(self, taker: GradTaker | None) -> None:
        """Offer each complete partition gradient to ``taker`` first (the early step,
        `zswap.step.earlystep.EarlyStep`; ``None``: none): what it does not place goes to the store."""
        self._first = taker

    def remove(self) -> None:
        for h in self._handles:
            h.remove()
        self._handles.clear()
        self.flush()
        self.drop_waiting()

    def drop_waiting(self) -> None:
        """Forget leaf gradients still waiting (a backward that raised before its end left them)."""
        self._waiting.clear()

    def land_in(self, alloc: Alloc | None, pool_bytes: int) -> None:
        """Land device-to-host copies in buffers from ``alloc`` (engine buffers registered with the device:
        one DMA hop, and the NVMe write goes out of the same page-aligned memory), reused once their store
        let go of them, up to ``pool_bytes`` kept. Used where the store does let go: a float16/bfloat16
        gradient (widened into float32 memory of the store's own) or a gradient store on NVMe (written out
        of it). A float32 gradient kept in memory *is* the landed buffer, so it lands in torch's pinned
        memory instead (cached by torch, never registered again per step)."""
        if alloc is None:
            self.landing = None
            return
        self.landing = ReusePool(lambda numel, dtype: alloc((numel,), dtype), lambda: None)
        self.landing.keep(pool_bytes)

    def host_buffer(self, st: ParamState, numel: int, dtype: torch.dtype) -> torch.Tensor:
        dev = self.device
        assert dev is not None
        store = store_of(st)
        if self.landing is not None and (dtype in LOW_PRECISION or not isinstance(store, MemoryGrads)):
            return self.landing.take(numel, dtype)[0]
        return dev.host_empty(numel, dtype)

    def flush(self) -> None:
        """Hand every gradient still being copied to the host to its store, in arrival order."""
        dev = self.device
        while self._pending:
            st, copy = self._pending.popleft()
            assert dev is not None
            store_of(st).add_fp32(st, dev.synchronize(copy), self._room())

    def _to_host(self, st: ParamState, part: torch.Tensor) -> None:
        """Start the device-to-host copy of one partition gradient (in its own dtype) on the copy stream;
        it reaches the store when it has landed: at a later gradient's hook if done by then, at the end
        of the backward (a callback on the graph task) at the latest, so backward never waits for it."""
        dev = self.device
        assert dev is not None
        part = part.contiguous()
        self._pending.append((st, dev.d2h(part, self.host_buffer(st, part.numel(), part.dtype))))
        while self._pending and dev.query(self._pending[0][1]):
            st0, copy = self._pending.popleft()
            store_of(st0).add_fp32(st0, copy.dst, self._room())
        task = int(torch._C._current_graph_task_id())
        if self._pending and task >= 0 and task != self._flush_task:
            self._flush_task = task
            torch.autograd.Variable._execution_engine.queue_callback(self._task_done)

    def _room(self) -> int:
        """Bytes the gradient store may keep in memory past its stash for what lands now: the early
        step's allowance while it sums micro-batches before an accumulation boundary, else 0."""
        return self._first.summing_room() if self._first is not None else 0

    def _task_done(self) -> None:
        self._flush_task = -1
        self.flush()

    # The hooks live on the param, inside torch's C++ autograd state where the garbage collector cannot
    # see them: a strong reference from a hook back to the param (or to this sink, which reaches it
    # through the early step's optimizer) made an uncollectable cycle, so an Engine dropped without
    # `close` kept its buffers mapped until the process exited. They hold both weakly.
    def _make_pre(self, p: torch.Tensor, st: ParamState, post: list[int]) -> Any:
        param, sink = weakref.ref(p), weakref.ref(self)

        def pre(grad: torch.Tensor) -> None:
            p, me = param(), sink()
            if p is None or me is None:
                return
            # A caller's post-accumulate-grad hook registered after ours would run after `post` took the
            # gradient, and see .grad None: ours goes last again (re-inserted under its key, which its
            # handle removes), so such a hook sees, and may change, each backward's gradient.
            hooks = p._post_accumulate_grad_hooks
            if hooks is not None and post and post[0] in hooks and next(reversed(hooks)) != post[0]:
                hooks[post[0]] = hooks.pop(post[0])
            # AccumulateGrad lays a new gradient out like the param and copies it into that layout, which
            # fails on an empty ``.data``. The module hooks keep a param gathered until its gradient is in,
            # so this is a safety net (a param whose last use needs no data, outside every hooked module):
            # a stride-0 placeholder of the full shape and one element makes autograd keep the gradient as
            # it is; `post` puts the empty tensor back.
            if st.status is not Status.AVAILABLE:
                with no_torch_function():
                    p.data = torch.empty((), dtype=st.dtype, device=st.device).expand(st.shape)
                me.placeholders += 1

        return pre

    def _make_post(self, st: ParamState) -> Any:
        sink = weakref.ref(self)

        def post(p: torch.Tensor) -> None:
            me = sink()
            if me is None:
                return
            with no_torch_function():
                grad = p.grad
                p.grad = None  # never left holding a full-size gradient
                if st.status is not Status.AVAILABLE:
                    p.data = torch.empty(0, dtype=st.dtype, device=st.device)
                if grad is None:
                    return
                if grad.layout is not torch.strided:
                    raise SparseGradientError(sparse_message(me.names.get(id(p), st.key)))
                if id(p) in me._leaf_of:
                    held = me._waiting.get(id(p))
                    me._waiting[id(p)] = grad if held is None else held + grad
                    return
                me._route(p, st, grad)

        return post

    def _route(self, p: torch.Tensor, st: ParamState, grad: torch.Tensor) -> None:
        """Reduce ``p``'s full gradient to this rank's partition and hand it on: to the early step first,
        else to the store (from a compute device: copied to the host first)."""
        part = local_part(st, grad, self.reduce_in, self.keep_reduced)  # (on a compute device: there)
        if self.device is not None and on_host(st):
            if self._first is None or not self._first.on_grad(p, st, part, self):
                self._to_host(st, part)
        elif self._first is None or not self._first.on_grad(p, st, part):
            store_of(st).add(st, part)  # else the early step stored it, or applies it

    def leaf_done(self, leaf: int | None = None) -> None:
        """The backward of leaf module ``leaf`` ended (``None``: the whole backward did — every leaf's
        gradients still waiting, a param used outside its leaf too): every rank reduces, in the leaf's
        order, each of its params that got a gradient on any rank (zeros where this one got none), as
        DDP does for a param some ranks did not use. What runs inside a leaf may differ between ranks
        (which experts a mixture-of-experts block runs), its params' gradient reductions may not."""
        items = [it for k in ([leaf] if leaf is not None else self._leaves) for it in self._leaves.get(k, [])]
        items = [(p, st) for p, st in items if id(p) in self._leaf_of]
        if not items:
            return
        with no_torch_function():
            group = items[0][1].group
            anywhere = torch.tensor(
                [id(p) in self._waiting for p, _ in items],
                dtype=torch.uint8,
                device=_dist.small_tensor_device(group),
            )
            dist.all_reduce(anywhere, op=dist.ReduceOp.MAX, group=group)
            for (p, st), used in zip(items, anywhere.tolist(), strict=True):
                if used:
                    grad = self._waiting.pop(id(p), None)
                    if grad is None:  # where this rank's others are: the compute device, or the param's
                        where = (
                            self.device.torch_device if self.device is not None and on_host(st) else st.device
                        )
                        grad = torch.zeros(st.shape, dtype=st.dtype, device=where)
                    self._route(p, st, grad)


def landing_alloc(device: Device, grad_stores: Iterable[Any], stores: Iterable[Any]) -> Alloc | None:
    """Registered engine buffers for `GradSink.land_in`: from the gradient store's engine on NVMe, else
    the params' NVMe engine; ``None`` (torch's pinned memory) on the CPU or where no engine runs."""
    if device.passthrough:
        return None
    engines = [gs.engine for gs in grad_stores if isinstance(gs, NvmeGrads)]
    engines += [s.engine for s in stores if isinstance(s, NvmeStore)]
    return device.register_alloc(engines[0].empty) if engines else None


def step_grad(p: torch.Tensor, grad: torch.Tensor, wide_ok: bool) -> torch.Tensor:
    """What to assign to ``p.grad`` for an optimizer step over a partition. A float32 gradient accumulated
    for a float16/bfloat16 partition (`GradStore.add_fp32`) stays float32 where the optimizer takes any
    gradient dtype (``wide_ok``: `zswap.optim.OffloadedAdamW`, which up-casts in its kernel) — the param's
    ``grad_dtype`` is opened for it (torch ≥ 2.10) and put back by `clear_step_grad` — and is rounded
    once to the param's dtype for any other optimizer (torch's own need matching dtypes)."""
    if grad.dtype != p.dtype:
        if wide_ok and hasattr(p, "grad_dtype"):
            p.grad_dtype = None
        else:
            grad = grad.to(p.dtype)
    return grad


def clear_step_grad(p: torch.Tensor, dtype: torch.dtype) -> None:
    """Undo `step_grad`: no gradient, and ``grad_dtype`` the param's own again."""
    p.grad = None
    if hasattr(p, "grad_dtype") and p.grad_dtype != dtype:
        p.grad_dtype = dtype


def accumulate(st: ParamState, grad: torch.Tensor) -> None:
    """Add one backward's full gradient of a param to its local partition (in its `GradStore`)."""
    store_of(st).add(st, local_part(st, grad))


def local_part(
    st: ParamState, grad: torch.Tensor, reduce_in: torch.dtype | None = None, keep: bool = False
) -> torch.Tensor:
    """This rank's slice of ``grad`` averaged over the ranks: reduce-scatter (sum in rank order) then divide
    by the world size. DDP and DeepSpeed's ZeRO-3 divide each rank's gradient first, which gives the same
    bits where the world size is a power of two (barring overflow and underflow); in float16 zswap divides
    first too, as DeepSpeed, so that ranks whose sum passes float16's range but whose average does not
    overflow no more than there (the loss scaler would skip the step and halve the scale). One rank: the
    flattened gradient itself. ``reduce_in``: the dtype the ranks sum and divide in (DeepSpeed's
    ``communication_data_type``; ``None``: the gradient's own), the average then rounded to the gradient's
    dtype, or kept in ``reduce_in`` where ``keep``."""
    flat = grad.reshape(-1)
    if st.world_size == 1:
        return flat
    dtype, owned = flat.dtype, False
    if reduce_in is not None and reduce_in != dtype:
        flat, owned = flat.to(reduce_in), True
    padded_numel = st.partition_numel * st.world_size
    if flat.numel() != padded_numel:
        padded = flat.new_zeros(padded_numel)
        padded[: flat.numel()] = flat
        flat, owned = padded, True
    first = flat.dtype == torch.float16
    if first:
        flat = flat.div_(st.world_size) if owned else flat / st.world_size
    out = flat.new_empty(st.partition_numel)
    _reduce_scatter(out, flat.contiguous(), st)
    if not first:
        out.div_(st.world_size)
    return out if keep or out.dtype == dtype else out.to(dtype)


def _reduce_scatter(out: torch.Tensor, flat: torch.Tensor, st: ParamState) -> None:
    _dist.note(st.group, st.key, 1)
    if _dist.is_gloo(st.group) and _sum_of_slices(out, flat, st):
        return
    try:
        dist.reduce_scatter_tensor(out, flat, op=dist.ReduceOp.SUM, group=st.group)
    except (RuntimeError, NotImplementedError) as exc:
        if not _dist.unsupported(exc):
            raise
        # A backend without a flat reduce-scatter (gloo before torch 2.5): all-reduce, keep this rank's
        # slice. Every rank takes the same branch, so the collectives still line up.
        total = flat.clone()
        dist.all_reduce(total, op=dist.ReduceOp.SUM, group=st.group)
        start = st.rank * st.partition_numel
        out.copy_(total[start : start + st.partition_numel])


def _sum_of_slices(out: torch.Tensor, flat: torch.Tensor, st: ParamState) -> bool:
    """gloo's reduce-scatter as one all-to-all — slice r of every rank's ``flat`` to rank r — and a sum of
    the slices in rank order, ``((s0 + s1) + s2) + ...``: for two ranks the sum DDP's averaged gradients
    hold, bitwise. gloo's own reduce-scatter costs 1.5–3.3 ms a call on loopback from 4 KiB to 1 MiB, the
    all-to-all 0.2–0.9 ms (benches/README.md, "The step matrix"), and backward makes one per param.
    False where this gloo has no all-to-all (every rank fails alike, so the caller's collectives still
    line up). Ranks on one host exchange the slices through shared memory instead (`_dist.host_channel`),
    summed in the same order."""
    ch = _dist.host_channel(st.group) if flat.device.type == "cpu" else None
    if ch is not None:
        ch.sum_slices(out, flat)
        return True
    pooled = host_buffers(st)
    got = pooled(flat.numel(), flat.dtype) if pooled else torch.empty_like(flat)
    try:
        dist.all_to_all_single(got, flat, group=st.group)
    except (RuntimeError, NotImplementedError) as exc:
        if not _dist.unsupported(exc):
            raise
        return False
    parts = got.view(st.world_size, st.partition_numel)
    torch.add(parts[0], parts[1], out=out)
    for r in range(2, st.world_size):
        out.add_(parts[r])
    return True


def full_grad(p: torch.Tensor) -> torch.Tensor | None:
    """The full-shape gradient of ``p`` after backward and before `Engine.step` (``p.grad`` for a param zswap
    does not manage), or ``None`` if it has none.

    For a partitioned param the partitions are gathered across ranks, so every rank must call it for the
    same params in the same order. The result is a new tensor on the param's device, in the dtype its
    partition gradient is kept in: the param's, except float32 for a float16/bfloat16 param whose gradients
    came from a compute device (accumulated in float32 where they landed, `GradStore.add_fp32`).
    """
    st = param_state(p)
    if st is None:
        return p.grad
    store = store_of(st)
    store.wanted = True  # "auto" keeps the early step's gradients from the next backward on
    if not store.has(st):
        return None
    part, handle = store.load(st)
    if handle is not None:
        handle.wait()
    with no_torch_function():
        if st.world_size == 1:
            full = part.to(st.device, copy=True)
        else:
            local = part.to(st.device)
            full = torch.empty(st.partition_numel * st.world_size, dtype=part.dtype, device=st.device)
            dist.all_gather_into_tensor(full, local.contiguous(), group=st.group)
        return full[: st.numel].view(st.shape)


def clear(items: Iterable[Item]) -> None:
    """Drop the gradients of ``items`` (partitions of managed params, ``p.grad`` of the rest). Raises a
    gradient write error nothing has reported yet, after dropping them all."""
    stores: dict[int, tuple[Any, list[ParamState]]] = {}
    for p, st in items:
        store = store_of(st)
        stores.setdefault(id(store), (store, []))[1].append(st)
        p.grad = None
    for store, sts in stores.values():
        store.clear(sts)


def wait(items: Iterable[Item]) -> None:
    """Wait until every partition gradient of ``items`` is stored; raise the first write error."""
    for store in {id(store_of(st)): store_of(st) for _, st in items}.values():
        store.wait_all()


def global_scale(
    items: Iterable[Item],
    others: Iterable[torch.Tensor],
    max_norm: float | None,
    check_finite: bool,
    chunk: int | None = None,
    *,
    loss_scale: float = 1.0,
) -> tuple[float | None, float | None]:
    """``(scale, norm)`` for one optimizer step, decided from the gradients alone, before any optimizer
    state is read: the factor every gradient is to be multiplied by (clipping the global L2 norm to
    ``max_norm``, as `torch.nn.utils.clip_grad_norm_` does: per-tensor norms, then the norm of those, and
    ``max_norm / (norm + 1e-6)`` capped at 1), or ``None`` when ``check_finite`` and the norm is not
    finite (an fp16 overflow: the step is skipped). The norm covers every rank's partitions
    (an all-reduce of the squared local norm), so chunked optimizer steps all use the same scale.
    ``norm`` is ``None`` when neither clipping nor the check needed it. Gradients on NVMe are read in
    batches of about ``chunk`` elements (default: all at once). ``loss_scale``: the gradients are that many
    times too large (fp16 loss scaling); the norm is reported and clipped unscaled and the factor includes
    ``1 / loss_scale``."""
    if max_norm is None and not check_finite and loss_scale == 1.0:
        return 1.0, None
    with_grad = [(p, st) for p, st in items if store_of(st).has(st)]
    parts = [(st.group, st.world_size) for _, st in with_grad]
    norms: list[torch.Tensor] = []
    known = {id(st): n for _, st in with_grad if (n := store_of(st).norm(st)) is not None}  # from backward
    for batch in chunks([item for item in with_grad if id(item[1]) not in known], chunk):
        loads = [store_of(st).load(st) for _, st in batch]  # issued together, waited together
        for _, handle in loads:
            if handle is not None:
                handle.wait()
        for (_, st), (g, _) in zip(batch, loads, strict=True):
            known[id(st)] = torch.linalg.vector_norm(g, 2.0, dtype=torch.float32)
    norms += [known[id(st)] for _, st in with_grad]  # in item order, however they were found
    norms += [
        torch.linalg.vector_norm(p.grad, 2.0, dtype=torch.float32) for p in others if p.grad is not None
    ]
    local = torch.linalg.vector_norm(torch.stack(norms), 2.0) if norms else torch.zeros(())
    world = max((w for _, w in parts), default=1)
    if world > 1:
        # Unmanaged params' gradients are whole on every rank; partitions are disjoint slices. Summing
        # squares over ranks is exact for the partitions and would count unmanaged ones `world` times,
        # which is why initialize leaves no param unmanaged.
        sq = (local * local).reshape(1)
        group = parts[0][0]
        if dist.get_backend(group) == "nccl":  # NCCL reduces device tensors only; the norm is tiny
            sq = sq.to(torch.device("cuda", torch.cuda.current_device()))
        dist.all_reduce(sq, group=group)
        local = sq.sqrt().reshape(()).cpu()
    if check_finite and not torch.isfinite(local):
        return None, float(local)
    if loss_scale != 1.0:
        local = local / loss_scale
    norm = float(local)
    if max_norm is None:
        return 1.0 / loss_scale, norm
    return float(torch.clamp(max_norm / (local + 1e-6), max=1.0)) / loss_scale, norm


def chunks(items: list[Item], chunk: int | None) -> list[list[Item]]:
    """``items`` in order, cut into runs of at most ``chunk`` partition elements (at least one item each;
    ``None``: one run)."""
    out: list[list[Item]] = []
    size = 0
    for item in items:
        numel = item[1].partition_numel
        if not out or (chunk is not None and size + numel > chunk):
            out.append([])
            size = 0
        out[-1].append(item)
        size += numel
    return out
