"""The everyday module API on a partitioned model: it works on the partitions, or refuses.

`attach` equips each module of a model zswap partitioned (at the exit of `zswap.Init`, by
``Init(module=…)`` and by `zswap.initialize`):

- ``load_state_dict`` (torch's own method): a load-state-dict pre-hook writes each managed param's entry into
  its partition (this rank's slice, cast to its dtype) and leaves torch a zero-element copy to make, so
  torch's own strict checks (missing and unexpected keys, size mismatches — reported with the real shape) and
  its error behave as on a plain model. ``assign=True`` is refused: it would swap a partitioned param for a
  plain tensor.
- ``_apply`` (behind ``.to``, ``.half``, ``.bfloat16``, ``.float``, ``.double``, ``.cuda``…): an instance
  wrapper runs the conversion on an empty probe of each managed param first. A dtype change converts the
  stored partitions (`cast_params`) before torch converts the (empty) ``.data``; a device change
  (``"meta"``, a GPU) is a `ZswapError` before anything changed. With an open `zswap.Engine` over the params
  a dtype change is refused too: the engine's optimizer state and buffers were laid out for the old dtype.
- ``copy.deepcopy``: a real copy; each managed param gets a new param with its own partition (same store),
  then torch's deepcopy runs; refused while an open `zswap.Engine` runs the params.
- On transformers models, ``resize_token_embeddings`` runs under an Init with the model's placement (so the
  new embedding is partitioned as it is built and the rows are copied through the access hook; under an
  open `zswap.Engine` the engine is wired again over the new shapes, refused once its optimizer has state
  for the embedding or head), and
  ``num_parameters`` counts each managed param by its real size (transformers 5 counts ``p.numel()``; it has
  no ZeRO-3 ``ds_numel`` convention left to register for).
"""

from __future__ import annotations

import contextlib
import copy
import dataclasses
import threading
import weakref
from collections.abc import Iterable
from typing import Any

import torch
from torch import nn
from torch.overrides import TorchFunctionMode

from ..errors import ZswapError
from ..parts._access import _ABSENT, _shape_answer, _unavailable
from ..parts.gather import Placement, no_torch_function
from ..parts.params import ParamState, Status, param_state
from ..parts.placing import PLACING
from ..parts.runners import runners_of

_ATTACHED: weakref.WeakSet[nn.Module] = weakref.WeakSet()
_LOCAL = threading.local()


def attach(modules: Iterable[nn.Module]) -> None:
    """Equip each module (once) with the hooks and wrappers described in the module docstring."""
    for m in modules:
        if m in _ATTACHED:
            continue
        _ATTACHED.add(m)
        m.register_load_state_dict_pre_hook(_load_pre_hook)
        m.__dict__["_apply"] = _Bound(m, _apply)
        m.__dict__["__deepcopy__"] = _Bound(m, _deepcopy)
        if hasattr(type(m), "resize_token_embeddings") and hasattr(type(m), "num_parameters"):
            m.__dict__["resize_token_embeddings"] = _Bound(m, _resize_token_embeddings)
            m.__dict__["num_parameters"] = _Bound(m, _num_parameters)
            if hasattr(type(m), "_adjust_bias"):
                m.__dict__["_adjust_bias"] = _Bound(m, adjust_bias)


class _Bound:
    """``fn`` bound to a module through a weak reference: an instance attribute that shadows a method
    without making the module part of a reference cycle (it is freed as soon as it is unreferenced).
    ``copy.deepcopy`` binds the copy to the copied module; pickling keeps the module."""

    __slots__ = ("_fn", "_ref")

    def __init__(self, module: nn.Module, fn: Any) -> None:
        self._ref = weakref.ref(module)
        self._fn = fn

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        module = self._ref()
        if module is None:
            raise ReferenceError("the module this zswap wrapper belongs to was freed")
        return self._fn(module, *args, **kwargs)

    def __deepcopy__(self, memo: dict[int, Any]) -> _Bound:
        module = self._ref()
        if module is None:
            raise ReferenceError("the module this zswap wrapper belongs to was freed")
        return _Bound(memo.get(id(module), module), self._fn)

    def __reduce__(self) -> Any:
        module = self._ref()
        if module is None:
            raise ReferenceError("the module this zswap wrapper belongs to was freed")
        return (_Bound, (module, self._fn))


# -- dtype -----------------------------------------------------------------------------------------


def cast_params(params: Iterable[torch.Tensor | None], dtype: torch.dtype) -> None:
    """Convert the stored partition (and the gathered data, if any) of each managed floating param to
    ``dtype``, one param at a time; the rounding of ``Tensor.to``."""
    stores = {}
    with no_torch_function():
        for p in params:
            st = param_state(p)
            if p is None or st is None or not st.dtype.is_floating_point or st.dtype == dtype:
                continue
            part, handle = st.store.load(st.key, st.partition_numel, st.dtype)
            if handle is not None:
                handle.wait()
            st.store.put(st.key, part.to(dtype))
            st.dtype = dtype
            if st.status is Status.NOT_AVAILABLE:
                p.data = torch.empty(0, dtype=dtype, device=st.device)
            else:
                p.data = p.data.to(dtype)
            stores[id(st.store)] = st.store
    for store in stores.values():
        store.wait_all()


def _apply(self: nn.Module, fn: Any, recurse: bool = True) -> nn.Module:
    plain = type(self)._apply
    if getattr(_LOCAL, "applying", False):  # an outer _apply already checked and converted this subtree
        return plain(self, fn, recurse)
    modules = list(self.modules()) if recurse else [self]
    casts: dict[torch.dtype, list[torch.Tensor]] = {}
    cast_names: list[str] = []
    for name, p, st in _managed(modules):
        with no_torch_function():
            probe = fn(torch.empty(0, dtype=st.dtype, device=st.device))
        if not isinstance(probe, torch.Tensor):
            continue
        if probe.device != st.device:
            what = (
                "would drop its partitioned weights"
                if probe.device.type == "meta"
                else "is not supported yet"
            )
            raise ZswapError(
                f"moving a zswap-partitioned model to {probe.device} {what} (param {name!r} lives on "
                f"{st.tier}); zswap.initialize(model, device=…) runs it on a compute device"
            )
        if probe.dtype != st.dtype:
            casts.setdefault(probe.dtype, []).append(p)
            cast_names.append(name)
    if casts and runners_of([p for ps in casts.values() for p in ps]):
        to = ", ".join(str(d) for d in casts)
        raise ZswapError(
            f"cannot convert the dtype of params an open zswap Engine runs ({', '.join(cast_names)} of a "
            f"{type(self).__name__}, to {to}): its optimizer state and buffers are laid out for them as they "
            f"are. A model that converts them itself as it runs (a router kept in float32) must have them in "
            f"that dtype before zswap.initialize: call .to({to}) on that {type(self).__name__} first; else "
            "engine.close(), then zswap.initialize the model again"
        )
    if casts:
        for dtype, ps in casts.items():
            cast_params(ps, dtype)
    _LOCAL.applying = True
    try:
        return plain(self, fn, recurse)
    finally:
        _LOCAL.applying = False


def _managed(modules: list[nn.Module]) -> list[tuple[str, torch.Tensor, ParamState]]:
    out: dict[int, tuple[str, torch.Tensor, ParamState]] = {}
    names = {id(m): n for n, m in (modules[0].named_modules() if modules else [])}
    for m in modules:
        for n, p in m._parameters.items():
            st = param_state(p)
            if p is not None and st is not None and id(p) not in out:
                prefix = names.get(id(m), "")
                out[id(p)] = (f"{prefix}.{n}" if prefix else n, p, st)
    return list(out.values())


def _refuse_if_engine(params: list[torch.Tensor], what: str) -> None:
    if runners_of(params):
        raise ZswapError(
            f"cannot {what} params an open zswap Engine runs (its optimizer state and buffers are laid "
            "out for them as they are); engine.close() first, then zswap.initialize the model again"
        )


# -- copy.deepcopy ---------------------------------------------------------------------------------


def _deepcopy(self: nn.Module, memo: dict[int, Any]) -> nn.Module:
    """A real deep copy: each managed param of the subtree is copied first into a new param with a new
    partition (this rank's slice, in the same store), then torch's own deepcopy of the module finds the
    copies in ``memo``. Refused while an open Engine runs the params (its hooks on the modules would be
    copied with them, and gathered copies come and go under it)."""
    managed = [(n, p, st) for n, p, st in _managed(list(self.modules())) if id(p) not in memo]
    if managed and runners_of([p for _, p, _ in managed]):
        raise ZswapError(
            f"copy.deepcopy of a {type(self).__name__} whose params an open zswap Engine runs: "
            "engine.close() first (or copy before zswap.initialize), then initialize each model"
        )
    stores = {}
    with no_torch_function(), torch.no_grad():
        for name, p, st in managed:
            memo[id(p)] = _copy_param(name, p, st, memo)
            stores[id(st.store)] = st.store
    for store in stores.values():
        store.wait_all()
    own = self.__dict__.pop("__deepcopy__")
    try:
        new = copy.deepcopy(self, memo)  # torch's way, with this wrapper out of the way
    finally:
        self.__dict__["__deepcopy__"] = own
    new.__dict__["__deepcopy__"] = _Bound(new, _deepcopy)
    _ATTACHED.add(new)
    return new


def _copy_param(name: str, p: torch.Tensor, st: ParamState, memo: dict[int, Any]) -> torch.Tensor:
    from ..io.weights import _buffer
    from ..parts.params import local_slice, register

    if st.status is Status.INFLIGHT:
        raise ZswapError(f"copy.deepcopy: param {name!r} is being gathered; copy it once the gather is done")
    buf = _buffer(st.store, st.partition_numel, st.dtype)
    if st.status is Status.AVAILABLE:  # gathered in full (touched in Init, a GatheredParameters block)
        buf.copy_(local_slice(p.data.reshape(-1), st.rank, st.partition_numel))
    else:
        part, handle = st.store.load(st.key, st.partition_numel, st.dtype)
        if handle is not None:
            handle.wait()
        buf.copy_(part)
    if st.store.tier == "none" and st.device.type != "cpu":
        buf = buf.to(st.device)
    new = type(p)(torch.empty(0, dtype=st.dtype, device=st.device), p.requires_grad)
    new.__dict__.update(copy.deepcopy(p.__dict__, memo))  # flags others set (_is_hf_initialized)
    copied = dataclasses.replace(
        st, status=Status.NOT_AVAILABLE, key=st.store.new_key(), touched=False, gathered_by=None, grad=None,
        grad_store=None,
    )  # fmt: skip
    register(new, copied)
    st.store.put(copied.key, buf)
    return new


# -- load_state_dict --------------------------------------------------------------------------------


def _load_pre_hook(
    module: nn.Module,
    state_dict: dict[str, Any],
    prefix: str,
    local_metadata: dict[str, Any],
    strict: bool,
    missing_keys: list[str],
    unexpected_keys: list[str],
    error_msgs: list[str],
) -> None:
    from ..io.weights import Target, TensorSource, check_optimizer, fill, quiesce

    todo = []
    seen: list[tuple[str, torch.Tensor]] = []
    for name, p in module._parameters.items():
        st = param_state(p)
        key = prefix + name
        if p is None or st is None or key not in state_dict:
            continue
        value = state_dict[key]
        if not isinstance(value, torch.Tensor):
            continue  # torch reports it
        if local_metadata.get("assign_to_params_buffers", False):
            raise ZswapError(
                f"load_state_dict(assign=True) would replace the partitioned param {key!r} with a plain "
                "tensor; load with assign=False (the default), which writes into the partition"
            )
        if value.shape != st.shape:
            error_msgs.append(
                f"size mismatch for {key}: copying a param with shape {value.shape} from checkpoint, "
                f"the shape in current model is {st.shape}."
            )
        else:
            todo.append((Target(p, [key]), key, TensorSource(value)))
        seen.append((key, p))
    if todo:
        check_optimizer(todo)
        quiesce([t.tensor for t, _, _ in todo])
    for key, held in seen:
        state_dict[key] = held.detach()  # torch's own copy is then a no-op on the (empty or gathered) data
    if todo:
        with no_torch_function(), torch.no_grad():
            for target, _, src in todo:
                st = param_state(target.tensor)
                assert st is not None
                fill(target.tensor, st, src)
            for store in {id(s.store): s.store for t, _, _ in todo if (s := param_state(t.tensor))}.values():
                store.wait_all()


# -- transformers ----------------------------------------------------------------------------------


def _resize_token_embeddings(self: Any, *args: Any, **kwargs: Any) -> Any:
    plain = type(self).resize_token_embeddings
    managed = [(p, st) for p in self.parameters() if (st := param_state(p)) is not None]
    if not managed:
        return plain(self, *args, **kwargs)
    emb = self.get_input_embeddings()
    st = param_state(getattr(emb, "weight", None)) or managed[0][1]
    resized = [p for m in (emb, self.get_output_embeddings()) if m is not None for p in m.parameters()]
    engines = runners_of([p for p, _ in managed])
    for engine in engines:
        engine.check_resizable(resized)
    before = dict(self.named_parameters(remove_duplicate=False))
    with contextlib.ExitStack() as stack:
        for engine in engines:
            stack.enter_context(engine.rewired())
        stack.enter_context(PLACING.build_at(Placement(st.store, st.group, st.rank, st.world_size, None)))
        _LOCAL.resizing = True  # adjust_bias may re-partition the head's bias: the engine is unwired
        try:
            out = plain(self, *args, **kwargs)
        finally:
            _LOCAL.resizing = False
        # An untied head is a new nn.Linear (new params): the optimizer steps those in place of the old.
        new = {
            id(old): p
            for n, p in self.named_parameters(remove_duplicate=False)
            if (old := before.get(n)) is not None and old is not p
        }
        for engine in engines:
            engine.swap_params(new)
        return out


def adjust_bias(self: Any, output_embeddings: Any, input_embeddings: Any, plain: Any = None) -> None:
    """transformers' ``_adjust_bias`` on a partitioned model. ``tie_weights`` runs it on every output
    embedding with a bias (BERT's masked-LM decoder) to pad the bias with zeros to the weight's row count
    (or cut it), reading ``weight.shape`` and ``bias.data``: on partitioned params those are the empty
    placeholders, so the plain method would size nothing right (and its ``.data`` access gathers the bias
    under Init only to write the same values back). Here the real shapes decide: equal (as loaded), nothing
    moves; different (the weight resized), the bias is gathered, padded or cut as transformers does, and
    re-partitioned in place (same param, so its ties hold). Refused under an open `zswap.Engine` unless
    ``resize_token_embeddings`` runs it (the engine is wired again over the new shape). ``plain``: the
    method to run when neither is managed (default: the class's)."""
    bias, weight = getattr(output_embeddings, "bias", None), getattr(output_embeddings, "weight", None)
    states = [param_state(t) if isinstance(t, torch.Tensor) else None for t in (weight, bias)]
    if bias is None or weight is None or states == [None, None]:
        (plain or type(self)._adjust_bias)(self, output_embeddings, input_embeddings)
        return
    rows, have = (_rows(t, st) for t, st in zip((weight, bias), states, strict=True))
    if rows != have:
        pad = (0, rows - have)
        bst = states[1]
        if bst is None:
            with no_torch_function(), torch.no_grad():
                bias.data = nn.functional.pad(bias.data, pad, "constant", 0)
        else:
            if not getattr(_LOCAL, "resizing", False):
                _refuse_if_engine([bias], "pad the bias of")
            _repartition(bias, bst, lambda full: nn.functional.pad(full, pad, "constant", 0))
    if hasattr(output_embeddings, "out_features") and hasattr(input_embeddings, "num_embeddings"):
        output_embeddings.out_features = input_embeddings.num_embeddings


def _rows(t: torch.Tensor, st: ParamState | None) -> int:
    """Rows of ``t`` as they are now: a gathered param's data (it may have been replaced, as
    ``resize_token_embeddings`` does), else its record."""
    with no_torch_function():
        return int(t.shape[0] if st is None or st.status is Status.AVAILABLE else st.shape[0])


def _repartition(p: torch.Tensor, st: ParamState, change: Any) -> None:
    """Replace managed ``p``'s full value by ``change(full)``, which may have another shape; ``p`` stays the
    same param (its ties hold). Gathered by Init's access hook: its data is replaced, and Init writes it
    back at the new size with the rest it touched. Not gathered: gathered, changed, and partitioned anew
    under its key."""
    from ..parts.gather import GatheredParameters, offload

    if (
        st.status is Status.INFLIGHT
        or st.gathered_by is not None
        or (st.status is Status.AVAILABLE and not st.touched)
    ):
        raise ZswapError(
            f"a param of shape {tuple(st.shape)} is held gathered (a GatheredParameters block, a running "
            "forward); cannot change its size now"
        )
    if st.status is Status.AVAILABLE:
        with no_torch_function(), torch.no_grad():
            p.data = change(p.data)
        return
    with GatheredParameters([p]), no_torch_function():
        full = p.data.detach().clone()
    with no_torch_function(), torch.no_grad():
        p.data = change(full)
        offload(p, st)
    st.store.wait_all()


class _RealShapes(TorchFunctionMode):
    """Shape queries on not-gathered managed params answered from their records."""

    def __torch_function__(
        self, func: Any, types: Any, args: tuple[Any, ...] = (), kwargs: dict[str, Any] | None = None
    ) -> Any:
        kwargs = kwargs or {}
        if args and (st := _unavailable(args[0])) is not None:
            answer = _shape_answer(func, args, kwargs, st)
            if answer is not _ABSENT:
                return answer
        return func(*args, **kwargs)


def _num_parameters(self: Any, *args: Any, **kwargs: Any) -> int:
    with _RealShapes():
        return int(type(self).num_parameters(self, *args, **kwargs))
