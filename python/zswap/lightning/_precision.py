"""`ZswapPrecision`: the Lightning precision plugin through which the strategy's backward, optimizer step
and gradient clipping reach the zswap `Engine`.

zswap keeps the params in one dtype (``Init``'s, from the config or the Trainer's ``"bf16-true"`` /
``"16-true"``), so only the *true* precisions exist here: the module is never converted by Lightning (it was
built in its dtype under ``zswap.Init``) and floating inputs are cast to that dtype. Mixed precision
(autocast) and float64 are refused by `ZswapStrategy` when the Trainer is built.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Generator
from typing import TYPE_CHECKING, Any, Literal

import torch
from lightning.fabric.utilities.apply_func import apply_to_collection
from lightning.pytorch.plugins.precision import Precision
from lightning.pytorch.utilities import GradClipAlgorithmType
from lightning.pytorch.utilities.model_helpers import is_overridden
from torch import Tensor, nn

from ..errors import ConfigError

if TYPE_CHECKING:
    import lightning.pytorch as pl

    from ..train.runtime import Engine

TruePrecision = Literal["32-true", "bf16-true", "16-true"]
DTYPES: dict[str, torch.dtype] = {
    "32-true": torch.float32,
    "bf16-true": torch.bfloat16,
    "16-true": torch.float16,
}


class ZswapPrecision(Precision):
    """Params, inputs and the default dtype inside forward in one dtype (``precision``: ``"32-true"``,
    ``"bf16-true"`` or ``"16-true"``); backward and the optimizer step through the strategy's engine;
    gradient clipping by norm handed to the engine (it clips the global norm over every rank's partitions,
    before the optimizer reads any state; told before backward that the norm may come after it, so the
    update it runs in backward keeps what a clipped step is redone from)."""

    def __init__(self, precision: TruePrecision = "32-true") -> None:
        if precision not in DTYPES:
            raise ConfigError(
                f"ZswapPrecision takes one of {', '.join(map(repr, DTYPES))}, got {precision!r}"
            )
        self.precision = precision
        self.dtype = DTYPES[precision]
        self.clip_norm: float | None = None
        """The norm `clip_gradients` asked for during the current optimizer step (None: not asked)."""
        self._engine: Callable[[], Engine] | None = None

    def attach(self, engine: Callable[[], Engine]) -> None:
        """``engine()`` returns the engine of the run in progress (set by `ZswapStrategy.setup`)."""
        self._engine = engine

    # -- dtype ---------------------------------------------------------------------------------------

    def convert_module(self, module: nn.Module) -> nn.Module:
        return module  # built in its dtype under zswap.Init; `.to(dtype)` would touch every partition

    def convert_input(self, data: Any) -> Any:
        if self.dtype == torch.float32:
            return data
        return apply_to_collection(data, Tensor, _cast_floating, self.dtype)

    def tensor_init_context(self) -> contextlib.AbstractContextManager:
        return contextlib.nullcontext()  # zswap.Init sets the dtype while modules are built

    def module_init_context(self) -> contextlib.AbstractContextManager:
        return contextlib.nullcontext()

    @contextlib.contextmanager
    def forward_context(self) -> Generator[None, None, None]:
        previous = torch.get_default_dtype()
        torch.set_default_dtype(self.dtype)
        try:
            yield
        finally:
            torch.set_default_dtype(previous)

    # -- backward, step, clipping --------------------------------------------------------------------

    def backward(  # type: ignore[override]
        self, tensor: Tensor, model: pl.LightningModule, optimizer: Any, *args: Any, **kwargs: Any
    ) -> None:
        engine = self._current()
        if not model.automatic_optimization:  # the module may call clip_gradients between this and its step
            engine.clipping_after_backward = True
        if is_overridden("backward", model):
            model.backward(tensor, *args, **kwargs)  # the module's own backward, as written (no loss scale)
        elif args or set(kwargs) - {"retain_graph"}:
            raise TypeError(
                "ZswapStrategy runs backward through the zswap Engine, which takes retain_graph= only; got "
                f"{len(args)} positional argument(s) and {sorted(kwargs)}"
            )
        else:
            engine.backward(tensor, **kwargs)  # fp16: scaled by the engine's loss scale
        engine.end_micro_batch()  # before a window's last batch: the next forward's first params kept

    def optimizer_step(  # type: ignore[override]
        self, optimizer: Any, model: pl.LightningModule, closure: Callable[[], Any], **kwargs: Any
    ) -> Any:
        """Runs the closure (training_step, zero_grad, backward), the hooks Lightning runs before a step
        (``on_before_optimizer_step``, ``configure_gradient_clipping``), then one engine step."""
        if kwargs:
            raise TypeError(
                f"ZswapStrategy steps through the zswap Engine, which takes no arguments; got "
                f"optimizer.step(**{sorted(kwargs)})"
            )
        engine = self._current()
        if model.automatic_optimization:  # (manual: `clip_gradients` came before, after `backward`)
            self.clip_norm = None
            # The clip norm reaches `clip_gradients` only after the closure's backward: the early step is
            # told that clipping may be set then, so it keeps the gradients a clipped step is redone from
            # (`zswap.step.speculation`); the step it ran in backward is committed if the factor matches.
            engine.clipping_after_backward = may_clip(model)
        default = engine.max_grad_norm
        try:
            result = closure()
            self._after_closure(model, optimizer)
            if self.clip_norm is not None:
                engine.max_grad_norm = self.clip_norm
            if engine.optimizer is None:
                engine.zero_grad()  # configure_optimizers returned None: Lightning runs without steps
            else:
                engine.step()
        finally:
            engine.max_grad_norm = default
            # Kept on between steps where Lightning may clip: an optimizer_step override may run the
            # closure (its backward) before it calls optimizer.step().
            engine.clipping_after_backward = model.automatic_optimization and may_clip(model)
            self.clip_norm = None
        return result

    def clip_gradients(
        self,
        optimizer: Any,
        clip_val: int | float = 0.0,
        gradient_clip_algorithm: GradClipAlgorithmType = GradClipAlgorithmType.NORM,
    ) -> None:
        """Records the norm for the engine's step: the gradients are partitioned (``p.grad`` is None)
        until the engine reads them, so torch's ``clip_grad_norm_`` would see none."""
        if clip_val <= 0:
            return
        if gradient_clip_algorithm == GradClipAlgorithmType.VALUE:
            raise ConfigError(VALUE_CLIPPING)
        self.clip_norm = float(clip_val)

    def _current(self) -> Engine:
        if self._engine is None:
            raise RuntimeError("ZswapPrecision is driven by ZswapStrategy, which has not set it up")
        return self._engine()


def may_clip(model: pl.LightningModule) -> bool:
    """Whether Lightning may ask for clipping at a step of ``model``'s (automatic optimization): the
    norm then reaches the engine only after the step's backward."""
    return bool(model.trainer.gradient_clip_val or is_overridden("configure_gradient_clipping", model))


VALUE_CLIPPING = (
    "gradient_clip_algorithm='value' is not supported by ZswapStrategy: zswap clips the global L2 norm of "
    "the gradients (over every rank's partitions); use gradient_clip_algorithm='norm'"
)


def _cast_floating(t: Tensor, dtype: torch.dtype) -> Tensor:
    return t.to(dtype) if torch.is_floating_point(t) else t
