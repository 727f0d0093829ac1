"""DeepSpeed's backward through the engine's outputs: what a backward that does not go through
`DeepSpeedEngine.backward` gets (``loss.backward()``, ``out.backward(grad)``,
``engine.scale(loss).backward()``).

Since DeepSpeed 0.18 its engine hooks every tensor its forward returns: the gradient reaching one is divided
by ``gradient_accumulation_steps`` unless `engine.backward` runs (which divides the loss itself, or not with
``scale_wrt_gas=False``), and with an fp16 loss scale a backward neither `engine.backward` nor
``engine.scale(loss)`` scaled raises. `zswap.deepspeed` keeps those call shapes, so its engine does the same
(`zswap.initialize`'s engine keeps PyTorch's: ``loss.backward()`` is the loss's own gradient).
"""

from __future__ import annotations

import weakref
from collections.abc import Mapping
from typing import TYPE_CHECKING, Any

import torch

from ..errors import ZswapError

if TYPE_CHECKING:
    from ._engine import DeepSpeedEngine


class LossScalingRequiredError(ZswapError, RuntimeError):
    """An fp16 backward through the engine's outputs that `DeepSpeedEngine.backward` did not run and
    ``engine.scale(loss)`` did not scale (DeepSpeed's RuntimeError)."""


class ScaleInputError(ZswapError, ValueError, AssertionError):
    """``engine.scale`` given what is not a scalar loss with a graph (DeepSpeed asserts)."""


NOT_SCALED = (
    "Loss scaling is required for this configuration (fp16), but backward() was called directly without "
    "scaling the loss: call engine.backward(loss), or engine.scale(loss).backward()"
)


def wrap_outputs(engine: DeepSpeedEngine, out: Any) -> Any:
    """``out`` with each tensor backward can reach (nested in tuples, lists, dicts, model outputs) passed
    through `_Entry`: where the caller's gradient enters the engine's graph. DeepSpeed hooks the output
    tensors themselves, so a gradient that reaches one through another (a model's loss computed from the
    logits it also returns) is divided twice; past the entries, inside the forward's graph, it is not."""
    if not torch.is_grad_enabled():
        return out
    return _rebuild(out, weakref.ref(engine))


class _Entry(torch.autograd.Function):
    """The identity forward; backward divides the caller's gradient as DeepSpeed does (`_direct`)."""

    @staticmethod
    def forward(ctx: Any, x: torch.Tensor, me: Any) -> torch.Tensor:
        ctx.me = me
        return x.detach()  # an alias, not a view: the caller may still change it in place

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor, None]:
        return _direct(ctx.me, grad), None


def _rebuild(out: Any, me: weakref.ref[DeepSpeedEngine]) -> Any:
    if isinstance(out, torch.Tensor):
        return _Entry.apply(out, me) if out.requires_grad else out
    if type(out) is dict:
        return {key: _rebuild(value, me) for key, value in out.items()}
    if isinstance(out, Mapping) and hasattr(out, "__setitem__"):
        for key in list(out.keys()):  # in place: a model output's attributes follow its items
            new = _rebuild(out[key], me)
            if new is not out[key]:
                out[key] = new
        return out
    if isinstance(out, list):
        return [_rebuild(v, me) for v in out]
    if isinstance(out, tuple):
        items = [_rebuild(v, me) for v in out]
        return type(out)(*items) if hasattr(out, "_fields") else type(out)(items)
    return out


def _direct(me: weakref.ref[DeepSpeedEngine], grad: torch.Tensor) -> torch.Tensor:
    engine = me()
    if engine is None or engine._in_backward:
        return grad
    if engine.loss_scaler is not None and not engine._loss_scaled:
        raise LossScalingRequiredError(NOT_SCALED)
    torch.autograd.Variable._execution_engine.queue_callback(lambda: _ended(me))
    gas = engine.gradient_accumulation_steps()
    return grad / gas if gas > 1 else grad


def _ended(me: weakref.ref[DeepSpeedEngine]) -> None:
    engine = me()
    if engine is not None:
        engine._loss_scaled = False  # each backward asks for its own scale


def scale(engine: DeepSpeedEngine, loss: Any) -> torch.Tensor:
    """`DeepSpeedEngine.scale`: ``loss`` times the fp16 loss scale (unchanged without one), for a backward
    the caller runs; its gradients are unscaled at the step, as `engine.backward`'s."""
    if engine.optimizer is None:
        raise ZswapError("engine.scale(loss) needs an optimizer: pass one to initialize, or configure one")
    if not isinstance(loss, torch.Tensor) or loss.numel() != 1 or loss.grad_fn is None:
        raise ScaleInputError(
            "engine.scale: loss must be a scalar tensor with grad_fn (for a non-scalar tensor, call "
            "tensor.backward(grad))"
        )
    engine._loss_scaled = True
    if engine.loss_scaler is None:
        return loss
    engine._scaled_backward = True
    return loss * engine.loss_scaler.loss_scale
