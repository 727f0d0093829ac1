"""The hooks that gather params around each module's forward and backward, without changing the graph.

Forward: a pre-hook on every module acquires its params (direct ones, plus any it was seen using that
belong to another module) through the `Scheduler`; a post-hook (``always_call``, so also when forward
raises) releases them. While any hooked forward runs, a torch-function mode watches the params reaching
torch calls: a managed param a module uses without owning it (a parent reading a child's weight, an
attribute shared outside the module tree) is fetched on the spot and from then on counted as that module's.

Backward: autograd keeps the param *object* among a node's saved tensors, so gathering its data again before
the node runs is enough. A node that saves a *view* of a param instead (``F.linear`` saves ``weight.t()``)
would keep the gathered memory alive until backward; while a hooked forward runs, saved-tensor hooks keep
such a view as (param, layout) and rebuild it from the param's data when the node runs. A user's own
saved-tensor hooks (``save_on_cpu``…) active around the forward get every other tensor through ours.

When a module's forward under grad mode ends, a hook goes on each output tensor
(fires right before the first of the module's backward nodes: *pre-backward*, acquires the params again)
and on each non-param input (fires right before the node that produced it, after all of the module's nodes:
*post-backward*, releases them). The CPU autograd engine runs ready nodes in decreasing creation order, so
every node a module created has run by then. Where one module's output is the next one's input, the later
module's post-backward hook is moved ahead of the earlier one's pre-backward hook on that tensor: it
releases before the next gathers, so a live budget of one module holds in backward too (`_order`). A
module whose inputs need no grad (token ids) releases at the end of the backward, from a callback queued on
the graph task. Nothing is inserted into the graph, so gradients are summed in the same order as in a plain
model. On the CPU the nodes between a call's outputs and inputs also get the hooks that compute their large
matmul outputs into reused memory (`zswap.outputs`).

Activation checkpointing: ``use_reentrant=True`` re-runs the forward inside backward — the forward hooks
fetch and release as usual and the re-run registers its own backward hooks for the inner backward;
``use_reentrant=False`` keeps detached aliases of what the re-run saved, which hold the gathered data
until its nodes ran — but a tensor that requires no grad (a frozen param) it keeps itself, and compares its
shape with the first forward's as soon as the re-run returns, so the re-run lets those go only at the next
backward hook (`_release_forward`). A backward that raised never runs its end callback (autograd drops a
failed task's): the next forward outside backward ends it, releasing what it held. Tied params are one
param object in two modules: each use acquires it, and its gradient is taken once, after autograd summed
every use (`zswap.grads`).
"""

from __future__ import annotations

import functools
import sys
from collections.abc import Callable, Hashable
from contextlib import AbstractContextManager
from dataclasses import dataclass, field
from typing import Any, Protocol

import torch
from torch import nn
from torch.overrides import TorchFunctionMode
from torch.utils._pytree import tree_leaves
from torch.utils.weak import WeakIdKeyDictionary

from ..errors import FunctionalTransformError
from ..parts._access import _ABSENT, _META_GETSETS, _META_METHODS, _shape_answer
from ..parts.gather import no_torch_function
from ..parts.params import ParamState, Status, param_state
from . import casts
from .outputs import BackwardOutputs
from .prefetch import Scheduler, Slot


@dataclass(eq=False)
class ModuleInfo:
    index: int
    name: str
    slots: list[Slot]
    """Params its forward uses: its own (``recurse=False``, and its ``ParameterDict`` / ``ParameterList``
    children's: `zswap.train.wiring._uses`), then any found in use while it ran."""
    ids: set[int] = field(default_factory=set)
    leaf: bool = False
    """A leaf module (`zswap.fetch.leaves`): ``slots`` are every param inside it."""

    def add(self, slot: Slot) -> None:
        if id(slot.p) not in self.ids:
            self.ids.add(id(slot.p))
            self.slots.append(slot)


@dataclass(eq=False)
class _Call:
    """One run of a module's forward, and later of its backward."""

    info: ModuleInfo
    held: list[Slot] = field(default_factory=list)
    bw_held: list[Slot] | None = None
    task: int = -1
    counted: bool = False
    """A leaf's call this backward has still to end (`ModuleHooks._leaf_post`)."""

    def __hash__(self) -> int:
        return id(self)


@dataclass(frozen=True, eq=False)
class _ParamView:
    """A saved view of a managed param, or of its copy in ``dtype`` (`zswap.fetch.casts`), kept as its
    layout instead of its (gathered) memory."""

    param: torch.Tensor
    size: torch.Size
    stride: tuple[int, ...]
    offset: int
    dtype: torch.dtype | None = None


@dataclass(frozen=True, eq=False)
class _Outer:
    """A saved tensor as the user's saved-tensor hooks under ours packed it, with their unpack."""

    packed: Any
    unpack: Callable[[Any], torch.Tensor]


def _is_checkpoints(hooks: tuple[Callable[..., Any], Callable[..., Any]]) -> bool:
    """Whether the saved-tensor hooks on top are ``torch.utils.checkpoint``'s (a non-reentrant checkpoint's
    forward or recomputation)."""
    return getattr(hooks[0], "__module__", None) == "torch.utils.checkpoint"


def _raised(output: Any) -> bool:
    """Whether an ``always_call`` post-hook runs because the forward raised (torch calls it from its
    ``except`` block, with no output)."""
    return output is None and sys.exc_info()[1] is not None


def _graph_task() -> int:
    """Id of the backward graph task running on this thread, -1 outside backward."""
    return int(torch._C._current_graph_task_id())


def _nonreentrant_rerun() -> bool:
    """Whether a forward runs as a non-reentrant checkpoint's re-run (inside backward, under saved-tensor
    hooks): its outputs are matched to the first forward's saved tensors, never backpropagated through."""
    return _graph_task() >= 0 and torch._C._autograd._top_saved_tensors_default_hooks(False) is not None


class PassLedger(Protocol):
    def begin(self) -> None: ...
    def end(self) -> None: ...


class ModuleHooks:
    """Installs the forward and backward hooks on every module of ``root``; ``remove()`` takes them off."""

    def __init__(
        self,
        root: nn.Module,
        infos: dict[int, ModuleInfo],
        sched: Scheduler,
        slot_for: Callable[[torch.Tensor, ParamState], Slot],
        *,
        reuse_outputs: Callable[[], bool] = lambda: False,
        leaf_done: Callable[[int | None], None] = lambda _: None,
        autocast: Callable[[], AbstractContextManager[Any]] | None = None,
        ledger: PassLedger | None = None,
    ) -> None:
        self.root = root
        self._ledger = ledger
        """Told when an outermost forward begins, and when one that no backward follows ends (over several
        ranks: `zswap.step.stepping.ForwardLedger`, whose end may raise `RanksDivergedError`)."""
        self._autocast = autocast
        """The context every outermost forward runs in (the config's ``torch_autocast``), or None."""
        self._autocast_on: AbstractContextManager[Any] | None = None
        self._uncached: AbstractContextManager[None] | None = None  # (`casts.uncached`)
        self._leaf_done = leaf_done
        """Told when a leaf module's backward ends (its index) and when the outermost backward does (None):
        the gradient sink reduces the leaf's gradients then (`zswap.gradients.grads.GradSink.leaf_done`)."""
        self.infos = infos
        self.sched = sched
        self._slot_for = slot_for
        self._stack: list[_Call] = []
        self._mode = _ForwardAccess(self)
        self._mode_on = False
        self._saved_hooks_on = False
        self._outer_hooks: tuple[Callable[..., Any], Callable[..., Any]] | None = None
        """The saved-tensor hooks ours were pushed on top of (a user's), which get every other tensor."""
        self._tasks: set[int] = set()
        self._bw_calls: list[_Call] = []
        self._ours: WeakIdKeyDictionary = WeakIdKeyDictionary()
        """Tensors of this pass -> our backward hooks on them, (handle, hook) in firing order (`_order`)."""
        self._leaf_calls: list[_Call] = []
        """This pass's calls of leaf modules, in forward order (`_leaf_post`)."""
        self._leaf_pending: dict[int, int] = {}
        """Leaf module index -> its calls this pass whose backward has not ended yet."""
        self._recomputed: list[Slot] = []  # (`_release_forward`)
        self._closed = False
        self._bw_expected = False
        self.outputs = BackwardOutputs(enabled=reuse_outputs)
        """Where the backward matmuls of hooked modules put their outputs on the CPU (`zswap.outputs`)."""
        self._handles: list[Any] = []
        for module in root.modules():
            info = infos[id(module)]
            self._handles.append(
                module.register_forward_pre_hook(functools.partial(self._pre, info), with_kwargs=True)
            )
            self._handles.append(
                module.register_forward_hook(
                    functools.partial(self._post, info), with_kwargs=True, always_call=True
                )
            )

    def hold(self, handle: Any) -> None:
        """Remove ``handle`` (anything with a ``remove()``, laid over the same module) with these hooks."""
        self._handles.append(handle)

    def remove(self) -> None:
        for h in self._handles:
            h.remove()
        self._handles.clear()
        self._closed = True
        self.outputs.close()
        self._reset()

    # -- forward -----------------------------------------------------------------------------------

    def _pre(self, info: ModuleInfo, module: nn.Module, args: Any, kwargs: Any) -> None:
        if module is self.root and self._stack:
            self._reset()  # a forward interrupted by a BaseException never ran its post-hooks
        if not self._stack:
            if _transforming():
                raise FunctionalTransformError(
                    f"{type(module).__name__}'s forward runs inside a torch.func transform (grad, vmap, "
                    "jacrev…), which cannot follow the params zswap gathers inside it: compute gradients "
                    "with autograd (loss.backward() or engine.backward(loss)), or transform a plain model"
                )
            if _graph_task() < 0:
                # No backward runs here, so a task still listed raised (a checkpoint's re-run, a hook):
                # autograd drops the end callbacks of a failed task. What it held is released now.
                self._tasks.clear()
                self._ours = WeakIdKeyDictionary()
                self._leaf_calls, self._leaf_pending = [], {}
                self._backward_done(-1)  # releases what saved tensors unpacked outside backward held
                self.sched.begin(self._kind(), grad=torch.is_grad_enabled())
                self._bw_expected = False
                if self._ledger is not None:
                    self._ledger.begin()
            self._mode.__enter__()
            self._mode_on = True
            self._push_saved_hooks()
            self._uncached = casts.uncached()  # (in a no_grad pass too: the cache keeps what it casts)
            self._uncached.__enter__()
            if self._autocast is not None:
                self._autocast_on = self._autocast()
                self._autocast_on.__enter__()
        call = _Call(info)
        self._stack.append(call)
        call.held = self.sched.acquire(("F", info.index), info.slots)

    def _post(self, info: ModuleInfo, module: nn.Module, args: Any, kwargs: Any, output: Any) -> None:
        if not self._stack or self._stack[-1].info is not info:
            return  # its pre-hook failed before the call was pushed
        call = self._stack.pop()
        try:
            self._release_forward(call.held)
            if (
                output is not None
                and torch.is_grad_enabled()
                and (call.info.leaf or any(not s.persistent for s in call.info.slots))
            ):  # (a leaf's params reduced at its backward's end: `leaf_done`, even where all stay gathered)
                self._hook_backward(call, args, kwargs, output)
        finally:
            if not self._stack:
                self._exit_mode()
                if (not self._bw_expected or _raised(output)) and _graph_task() < 0:
                    self.sched.end()  # no backward can follow: release at once, prefetches included
                    if not _raised(output):
                        if self._ledger is not None:
                            self._ledger.end()
                        self.sched.read_ahead()  # the next pass's first reads (prefetch.py, "Across passes")

    def _release_forward(self, held: list[Slot]) -> None:
        """A forward's release. In a forward re-run inside backward (a checkpoint's recomputation) a param
        that requires no grad is released at the next backward hook instead: a non-reentrant checkpoint
        keeps such a tensor itself — no detached alias holding the gathered data, as it keeps for the others
        — and compares its shape with the first forward's as soon as the re-run returns, before the
        backward of the modules that use it gathers it again (a frozen block checkpointed at two depths)."""
        if not _nonreentrant_rerun():
            self.sched.release(held)
            return
        frozen = [s for s in held if not s.p.requires_grad]
        self._recomputed.extend(frozen)
        self.sched.release([s for s in held if s.p.requires_grad])

    def _release_recomputed(self) -> None:
        if self._recomputed:
            held, self._recomputed = self._recomputed, []
            self.sched.release(held)

    def _kind(self) -> Hashable:
        return torch.is_grad_enabled(), self.root.training

    def _exit_mode(self) -> None:
        if self._autocast_on is not None:
            on, self._autocast_on = self._autocast_on, None
            on.__exit__(None, None, None)
        if self._uncached is not None:
            cache, self._uncached = self._uncached, None
            cache.__exit__(None, None, None)
        if self._saved_hooks_on:
            self._saved_hooks_on, self._outer_hooks = False, None
            torch._C._autograd._pop_saved_tensors_default_hooks()
        if self._mode_on:
            self._mode_on = False
            self._mode.__exit__(None, None, None)

    def _push_saved_hooks(self) -> None:
        # On top of a user's saved-tensor hooks (``saved_tensors_hooks``, ``save_on_cpu``, an activation
        # offloader), ours pass every other tensor on to theirs. Not on top of a checkpoint's: its
        # recomputation matches what the re-run saves with what the first forward saved, one by one, through
        # its own hooks, and ours would hide the params' views from it in one pass and not the other.
        autograd = torch._C._autograd
        outer = autograd._top_saved_tensors_default_hooks(False)
        if not torch.is_grad_enabled() or (outer is not None and _is_checkpoints(outer)):
            return
        try:
            autograd._push_saved_tensors_default_hooks(self._pack, self._unpack)
        except RuntimeError:  # saved-tensor hooks are disabled here (inside a functorch transform, say)
            return
        self._outer_hooks = outer
        self._saved_hooks_on = True

    def _pack(self, t: torch.Tensor) -> Any:
        base = t._base
        if base is not None and param_state(base) is not None:
            return _ParamView(base, t.size(), t.stride(), int(t.storage_offset() - base.storage_offset()))
        c = t if base is None else base
        p = casts.param_cast(c, (s.p for s in self._stack[-1].held) if self._stack else ())
        if p is not None:  # autocast's copy of a weight: cast again in backward
            return _ParamView(p, t.size(), t.stride(), int(t.storage_offset() - c.storage_offset()), c.dtype)
        outer = self._outer_hooks
        if outer is None or (base is None and param_state(t) is not None):
            return t  # a managed param itself: autograd keeps the object, its data is gathered again
        return _Outer(outer[0](t), outer[1])

    def _unpack(self, x: Any) -> torch.Tensor:
        if isinstance(x, _Outer):
            return x.unpack(x.packed)
        if not isinstance(x, _ParamView):
            return x
        p = x.param
        st = param_state(p)
        if st is not None and st.status is not Status.AVAILABLE:
            self._hold_until_task_end([self._slot_for(p, st)])  # safety net: its module did not hold it
        with no_torch_function():
            if x.dtype is not None:
                return casts.recast(p, x.dtype).as_strided(x.size, x.stride, x.offset)
            return p.detach().as_strided(x.size, x.stride, p.storage_offset() + x.offset)

    def on_access(self, found: list[tuple[torch.Tensor, ParamState]]) -> None:
        """A torch call inside the running forward reached managed params its module does not hold."""
        call = self._stack[-1]
        slots = [self._slot_for(p, st) for p, st in found]
        for s in slots:
            call.info.add(s)
        call.held.extend(self.sched.acquire(("F", call.info.index), slots))

    # -- backward ----------------------------------------------------------------------------------

    def _hook_backward(self, call: _Call, args: Any, kwargs: Any, output: Any) -> None:
        outs = [t for t in tree_leaves(output) if isinstance(t, torch.Tensor) and t.grad_fn is not None]
        if call.info.leaf and not _nonreentrant_rerun():  # (a re-run's hooks never fire)
            call.counted = True
            self._leaf_calls.append(call)
            self._leaf_pending[call.info.index] = self._leaf_pending.get(call.info.index, 0) + 1
        elif not outs:
            return
        self._bw_expected = self._bw_expected or bool(outs)
        pre = functools.partial(self._bw_pre, call)
        post = functools.partial(self._bw_post, call)
        out_ids = {id(t) for t in outs}
        for t in outs:
            self._ours.setdefault(t, []).append((t.register_hook(pre), pre))  # dies with the graph
        ins, through = [], []
        for t in tree_leaves((args, kwargs)):
            # Leaves (a param passed in, an input that requires grad) are skipped: their hook would fire
            # at their AccumulateGrad, which may run before the module's own params' ones, and would stay
            # on a tensor that outlives the graph. Such a call releases at the end of the graph task.
            if not isinstance(t, torch.Tensor) or t.grad_fn is None:
                continue
            if id(t) not in out_ids:
                self._order(t, [post, *(fn for _, fn in self._ours.get(t, ()))])
                ins.append(t)
            elif call.info.leaf:
                through.append(t)
        if through and not ins:
            # A leaf module that returns its input as it is (on this rank: what runs inside it differs
            # between ranks) still ends its backward where that input's gradient is complete, as on the
            # ranks where it computed something from it: its gradients are reduced there on every rank.
            for t in through:
                self._order(t, [pre, post, *(fn for _, fn in self._ours[t] if fn is not pre)])
        self.outputs.instrument(outs, ins)

    def _order(self, t: torch.Tensor, hooks: list[Callable[[torch.Tensor], None]]) -> None:
        """Put our backward hooks on ``t`` in the order ``hooks`` (a tensor's hooks fire in the order they
        were added). A call's post-backward hook goes before the pre-backward hooks earlier calls put on its
        input as their output: where one module's output is the next one's input, backward releases the
        later module's params before it gathers the earlier one's, so at most one module's are live at the
        hand-over (DeepSpeed's order), not two."""
        for handle, _ in self._ours.get(t, ()):
            handle.remove()
        self._ours[t] = [(t.register_hook(fn), fn) for fn in hooks]

    def _bw_pre(self, call: _Call, grad: torch.Tensor) -> None:
        if call.bw_held is not None or self._closed:
            return  # another output of the same call; or hooks left on a graph built before close()
        call.task = self._watch_task()
        self._release_recomputed()
        call.bw_held = self.sched.acquire(("B", call.info.index), call.info.slots)
        self._bw_calls.append(call)

    def _watch_task(self) -> int:
        """The running graph task, with a callback queued for its end (-1 outside backward: what is held
        then is released when the next forward begins)."""
        task = _graph_task()
        if task >= 0 and task not in self._tasks:
            self._tasks.add(task)
            torch.autograd.Variable._execution_engine.queue_callback(
                functools.partial(self._backward_done, task)
            )
        return task

    def _hold_until_task_end(self, slots: list[Slot]) -> None:
        call = _Call(ModuleInfo(-1, "", slots), task=self._watch_task())
        call.bw_held = self.sched.acquire(("B", -1), slots)
        self._bw_calls.append(call)

    def _bw_post(self, call: _Call, grad: torch.Tensor) -> None:
        self._release_recomputed()
        self._leaf_post(call)  # (before the release: the early step takes gathered params' partitions)
        if call.bw_held is not None:
            held, call.bw_held = call.bw_held, None
            self.sched.release(held)

    def _leaf_post(self, call: _Call) -> None:
        """A leaf's call ended its backward — where the gradient of its input is complete, even where none
        reached its output on this rank (what runs inside a leaf differs between ranks), or at the end of
        the backward: once the last of its calls this pass did, its gradients are reduced, every rank at
        the same point and once per backward (a leaf run twice reduced each param twice, a gradient come
        in the second call against zeros in the first)."""
        if not call.counted:
            return
        call.counted = False
        index = call.info.index
        self._leaf_pending[index] = left = self._leaf_pending.get(index, 0) - 1
        if left == 0:
            self._leaf_done(index)

    def _backward_done(self, task: int) -> None:
        self._release_recomputed()
        self._tasks.discard(task)
        ended_backward = task >= 0
        if not self._tasks:
            task = -2  # the outermost backward ended (or a forward begins): nothing is held any more
        ended = [c for c in self._bw_calls if c.task == task or task == -2]
        self._bw_calls = [c for c in self._bw_calls if c not in ended]
        if task == -2 and ended_backward:
            for call in self._leaf_calls:  # in forward order, on every rank alike
                self._leaf_post(call)
        for call in ended:
            self._bw_post(call, None)  # type: ignore[arg-type]
        if task == -2:
            if ended_backward:
                self._leaf_done(None)
            self.sched.end()
            self.outputs.end()

    def _reset(self) -> None:
        for call in self._stack:
            self.sched.release(call.held)
            call.held = []
        self._stack.clear()
        self._release_recomputed()
        self._exit_mode()


class _ForwardAccess(TorchFunctionMode):
    """Active while a hooked forward runs: hands `ModuleHooks.on_access` the managed params a torch call
    uses that the running module does not hold. Shape and metadata queries need no data and pass."""

    def __init__(self, hooks: ModuleHooks) -> None:
        super().__init__()
        self._hooks = hooks

    def __torch_function__(
        self, func: Any, types: Any, args: tuple[Any, ...] = (), kwargs: dict[str, Any] | None = None
    ) -> Any:
        kwargs = kwargs or {}
        if func in _META_METHODS or getattr(func, "__self__", None) in _META_GETSETS:
            return func(*args, **kwargs)
        stack = self._hooks._stack
        if stack:
            if args and (st := param_state(args[0])) is not None:
                answer = _shape_answer(func, args, kwargs, st)
                if answer is not _ABSENT:
                    return answer
            found = _foreign(args, kwargs, stack[-1].info.ids)
            if found:
                self._hooks.on_access(found)
        return func(*args, **kwargs)


def _foreign(args: tuple[Any, ...], kwargs: dict[str, Any], own: set[int]) -> list[tuple[torch.Tensor, Any]]:
    """Managed params among the arguments (and inside list/tuple arguments) that are not in ``own`` or not
    gathered."""
    found: dict[int, tuple[torch.Tensor, Any]] = {}
    for x in (*args, *kwargs.values()):
        for y in x if isinstance(x, (list, tuple)) else (x,):
            st = param_state(y) if isinstance(y, torch.Tensor) else None
            if st is not None and (id(y) not in own or st.status is not Status.AVAILABLE):
                found[id(y)] = (y, st)
    return list(found.values())


def _transforming() -> bool:
    """Whether a ``torch.func`` transform is active (functorch's interpreter stack is not empty)."""
    peek = getattr(getattr(torch._C, "_functorch", None), "peek_interpreter_stack", None)
    return peek is not None and peek() is not None
