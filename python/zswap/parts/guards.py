"""Ways of training a zswap model that cannot work are refused where they happen, not left to do nothing.

A param zswap partitioned holds an empty tensor as ``.data`` and keeps its gradient in zswap's gradient store,
not in ``.grad``. So these ordinary moves would silently do nothing on it, or fail far from their cause:

- ``optimizer.step()`` of any torch optimizer over such params (zswap's own `OffloadedAdamW` called outside
  `Engine.step` included): it sees no gradient and changes nothing. A global optimizer step pre-hook
  (``torch.optim.optimizer.register_optimizer_step_pre_hook``) raises instead, unless the step runs inside
  `Engine.step` (`engine_step`), which shows the optimizer each partition and its gradient.
- ``torch.nn.utils.clip_grad_norm_`` over them: it sees no gradient and returns 0. The function is wrapped
  (module attribute, so callers that look it up at call time — Accelerate, Lightning, transformers — get the
  wrapper); with managed params among those it is given it raises, naming the engine's clipping. Inside
  `Engine.step` the original runs untouched. ``clip_grad_value_`` likewise (it failed in a torch kernel),
  naming a gradient hook that clamps.
- a forward with no open engine (``initialize`` forgotten, or after ``engine.close()``): torch would fail
  deep in a kernel with ``'weight' must be 2-D``. A global module forward pre-hook raises a `ZswapError`
  naming `zswap.initialize` and `zswap.GatheredParameters` for a module whose own params are partitioned,
  not gathered, and run by no open engine (and no `zswap.Init` is active: it gathers on access).

- ``optimizer.zero_grad()`` or ``model.zero_grad()`` over such params: torch clears ``p.grad``, where they
  have none, and the next backward would sum onto the gradients still in zswap's store (DeepSpeed's ZeRO-3
  optimizer clears its partitions). ``torch.optim.Optimizer.zero_grad`` and ``nn.Module.zero_grad`` are
  wrapped: over managed params they also call ``zero_grad()`` of every open engine that runs them (the
  optimizer a script built and passed to `zswap.initialize`, which the engine adopted, included); a
  module's over part of an engine's params raises (the engine drops all its gradients or none).

- ``weight_norm`` (a parametrization with a ``right_inverse``, which computes its originals from the
  param) and ``torch.nn.utils.prune`` (a mask from the param's values) on a partitioned param: they would
  compute from the empty placeholder (torch's "cannot reshape tensor of 0 elements", or a mask of shape
  ``(0,)`` that fails at the next forward). ``register_parametrization`` and ``BasePruningMethod.apply``
  are wrapped to raise, naming the way that works: apply them before zswap partitions the module.

All five are installed by `install`, called when the first `zswap.Init` is entered or the first `Engine`
is built, so a process that never uses zswap pays nothing (a global module hook takes every module call off
torch's fast path). Each check looks at the given params only and lets anything zswap does not manage
through unchanged.
"""

from __future__ import annotations

import contextlib
import functools
import threading
import warnings
from collections.abc import Callable, Iterable, Iterator
from typing import Any

import torch
from torch import nn
from torch.nn.utils import parametrize as _parametrize
from torch.nn.utils import prune as _prune
from torch.optim.optimizer import register_optimizer_step_pre_hook

from ..errors import ZswapError, ZswapWarning
from .params import Status, param_state
from .runners import RUNNERS, runners_of


class _State(threading.local):
    """Per thread: how many `Engine.step` calls are running (an optimizer may be stepped in them)."""

    depth = 0


_STATE = _State()
_INSTALLED: list[Any] = []  # the handles and the original clip_grad_norm_, once installed
_BUILDING: list[Callable[[], bool]] = []  # `zswap.Init`'s "active on this thread" (it gathers on access)
_LOCK = threading.Lock()

STEP_MESSAGE = (
    "{what} over params zswap partitioned does nothing: their data and gradients live in zswap's stores, "
    "which only engine.step() applies the optimizer to. Call engine.step() after backward (engine = "
    "zswap.initialize(model, config, optimizer=...)), and let it clip (max_grad_norm= or the config's "
    "'gradient_clipping'); with the Hugging Face Trainer use zswap.transformers.Trainer"
)
CLIP_MESSAGE = (
    "torch.nn.utils.clip_grad_norm_ over params zswap partitioned cannot see their gradients (they live in "
    "zswap's gradient store, not in p.grad) and would return 0 without clipping: let engine.step() clip by "
    "the global norm instead — zswap.initialize(..., max_grad_norm=...) or the config's "
    "'gradient_clipping' — and read the norm from engine.last_grad_norm"
)
VALUE_MESSAGE = (
    "torch.nn.utils.clip_grad_value_ over params zswap partitioned cannot see their gradients (they live in "
    "zswap's gradient store, not in p.grad): engine.step() clips by the global norm (max_grad_norm= or the "
    "config's 'gradient_clipping'); to clamp each element instead, hook each param's gradient before zswap "
    "takes it: p.register_hook(lambda g: g.clamp(-value, value))"
)
FORWARD_MESSAGE = (
    "{module} has params zswap partitioned that are not gathered, and no open zswap Engine runs them "
    "({why}): call engine = zswap.initialize(model, config) before running the model, or run it inside "
    "`with zswap.GatheredParameters(model.parameters()):`"
)


@contextlib.contextmanager
def engine_step() -> Iterator[None]:
    """Marks `Engine.step` running on this thread: optimizers may step and clip over managed params."""
    _STATE.depth += 1
    try:
        yield
    finally:
        _STATE.depth -= 1


def install(building: Callable[[], bool] | None = None) -> None:
    """Install the guards (idempotent). ``building``: tells whether an Init is active on this thread
    (`zswap.init` passes it: this module sits below it and does not import it)."""
    with _LOCK:
        if building is not None and building not in _BUILDING:
            _BUILDING.append(building)
        if _INSTALLED:
            return
        original = torch.nn.utils.clip_grad_norm_
        wrapped = _wrap_clip(original, CLIP_MESSAGE)
        torch.nn.utils.clip_grad_norm_ = wrapped
        torch.nn.utils.clip_grad.clip_grad_norm_ = wrapped
        by_value = _wrap_clip(torch.nn.utils.clip_grad_value_, VALUE_MESSAGE)
        torch.nn.utils.clip_grad_value_ = by_value
        torch.nn.utils.clip_grad.clip_grad_value_ = by_value
        _parametrize.register_parametrization = _wrap_reader(
            _parametrize.register_parametrization, "a parametrization", reads=_inverts
        )
        _prune.BasePruningMethod.apply = classmethod(  # type: ignore[method-assign,assignment]
            _wrap_reader(_prune.BasePruningMethod.apply.__func__, "pruning", skip=1)  # type: ignore[attr-defined]
        )
        torch.optim.Optimizer.zero_grad = _wrap_zero_grad(torch.optim.Optimizer.zero_grad)  # type: ignore[method-assign]
        nn.Module.zero_grad = _wrap_module_zero_grad(nn.Module.zero_grad)  # type: ignore[method-assign]
        _INSTALLED.extend(
            [
                register_optimizer_step_pre_hook(_before_step),
                nn.modules.module.register_module_forward_pre_hook(_before_forward),
                original,
            ]
        )


READER_MESSAGE = (
    "{what} on {module}.{name}, a param zswap partitioned: its data here is an empty placeholder, which "
    "{what} would compute from (weight_norm's norms, a pruning mask). Apply it before zswap partitions the "
    "module: build the model without zswap.Init, apply it, then zswap.initialize partitions the params it "
    "made"
)


def _inverts(pos: tuple[Any, ...], kwargs: dict[str, Any]) -> bool:
    """Whether a parametrization computes its originals from the param (``right_inverse``: weight_norm's);
    one without keeps the param itself as its original and works on a partitioned one."""
    parametrization = pos[2] if len(pos) > 2 else kwargs.get("parametrization")
    return hasattr(parametrization, "right_inverse")


def _wrap_reader(
    original: Any,
    what: str,
    skip: int = 0,
    reads: Callable[[tuple[Any, ...], dict[str, Any]], bool] | None = None,
) -> Any:
    """``original(module, name, ...)`` (after ``skip`` leading arguments: a classmethod's class) refused
    where ``module.name`` is a partitioned param not gathered (`READER_MESSAGE`) and ``reads(args, kwargs)``
    (default: always) says the call computes from its data; an active Init gathers on access, so it is let
    through there, as is everything zswap does not manage."""

    @functools.wraps(original)
    def wrapped(*args: Any, **kwargs: Any) -> Any:
        pos = args[skip:]
        module = pos[0] if pos else kwargs.get("module")
        name = pos[1] if len(pos) > 1 else kwargs.get("name", kwargs.get("tensor_name"))
        p = module._parameters.get(name) if isinstance(module, nn.Module) and isinstance(name, str) else None
        st = param_state(p) if p is not None else None
        if (
            st is not None
            and st.status is not Status.AVAILABLE
            and not any(b() for b in _BUILDING)
            and (reads is None or reads(pos, kwargs))
        ):
            raise ZswapError(READER_MESSAGE.format(what=what, module=type(module).__name__, name=name))
        return original(*args, **kwargs)

    return wrapped


def _managed(params: Iterable[Any]) -> bool:
    return any(param_state(p) is not None for p in params)


def _before_step(optimizer: torch.optim.Optimizer, args: Any, kwargs: Any) -> None:
    if _STATE.depth:
        return
    if _managed(p for group in optimizer.param_groups for p in group["params"]):
        raise ZswapError(STEP_MESSAGE.format(what=f"{type(optimizer).__name__}.step()"))


def _wrap_clip(original: Any, message: str) -> Any:
    @functools.wraps(original)
    def clip(parameters: Any, *args: Any, **kwargs: Any) -> Any:
        if _STATE.depth:
            return original(parameters, *args, **kwargs)
        if isinstance(parameters, torch.Tensor):
            parameters = [parameters]
        params = list(parameters)
        if _managed(params):
            raise ZswapError(message)
        return original(params, *args, **kwargs)

    return clip


def _wrap_zero_grad(original: Any) -> Any:
    @functools.wraps(original)
    def zero_grad(self: torch.optim.Optimizer, set_to_none: bool = True) -> None:
        original(self, set_to_none)
        params = [p for group in self.param_groups for p in group["params"]]
        if not _STATE.depth and _managed(params):
            _note_kept_zeros(set_to_none)
            for runner in runners_of(params):
                runner.zero_grad()

    return zero_grad


def _wrap_module_zero_grad(original: Any) -> Any:
    @functools.wraps(original)
    def zero_grad(self: nn.Module, set_to_none: bool = True) -> None:
        original(self, set_to_none)
        if _STATE.depth or not _managed(self.parameters()):
            return
        _note_kept_zeros(set_to_none)
        for runner in runners_of(self.parameters()):
            if not any(m is getattr(runner, "module", None) for m in self.modules()):
                raise ZswapError(
                    f"{type(self).__name__}.zero_grad() over part of the params an open zswap Engine runs: "
                    "their gradients live in the engine's store, which drops them all or none; call "
                    "engine.zero_grad() (or model.zero_grad() on the whole model)"
                )
            runner.zero_grad()

    return zero_grad


def _note_kept_zeros(set_to_none: bool) -> None:
    if not set_to_none:
        warnings.warn(
            "zero_grad(set_to_none=False) over params zswap partitioned drops their gradients, as "
            "set_to_none=True does: a param that gets no gradient before the next step is not stepped, "
            "where torch steps it with a zero gradient (its moments decay, weight decay applies)",
            ZswapWarning,
            stacklevel=3,
        )


def _before_forward(module: nn.Module, args: Any) -> None:
    idle = [
        p
        for p in module._parameters.values()
        if (st := param_state(p)) is not None and st.status is not Status.AVAILABLE
    ]
    if not idle:
        return
    if any(building() for building in _BUILDING):
        return  # Init's access mode gathers what the forward touches
    engines = list(RUNNERS)  # closed ones too (until collected): they say why a param is not run
    if all(any(not e.closed and e.runs({id(p)}) for e in engines) for p in idle):
        return
    closed = any(e.closed and e.runs({id(p)}) for e in engines for p in idle)
    why = "its engine was closed" if closed else "zswap.initialize was not called for them"
    raise ZswapError(FORWARD_MESSAGE.format(module=type(module).__name__, why=why))
