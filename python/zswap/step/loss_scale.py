"""fp16 loss scaling, with DeepSpeed's rules (its ``fp16`` config section).

`Engine.backward` multiplies the loss by `LossScaler.loss_scale` before autograd runs, so small fp16
gradients do not flush to zero; `Engine.step` divides the gradients by it again (inside the Adam kernel,
together with clipping) and skips the step when any rank's gradients are not finite. `LossScaler.update`
then moves the scale:

- static (``loss_scale`` > 0): the scale never changes; an overflowing step is still skipped.
- dynamic (``loss_scale`` 0): it starts at ``2**initial_scale_power``. An overflow first uses up the
  ``hysteresis`` (overflows tolerated before lowering); once at 1, each overflow halves the scale, never
  below ``min_loss_scale``; an overflow with the scale already at that floor raises `LossScaleError`.
  After ``loss_scale_window`` steps in a row without overflow the scale doubles and the hysteresis is
  refilled; with ``consecutive_hysteresis`` the hysteresis is refilled after every clean step.

These are the rules of DeepSpeed's ``DynamicLossScaler`` (``deepspeed/runtime/fp16/loss_scaler.py``),
counting steps exactly as it does, so a run that overflows at the same steps sees the same scales.
"""

from __future__ import annotations

import logging
from typing import Any

from ..config.models import FP16Config
from ..errors import ConfigError, ZswapError

SCALE_FACTOR = 2.0
"""Factor the dynamic scale is lowered and raised by (DeepSpeed's, fixed)."""


class LossScaleError(ZswapError, FloatingPointError):
    """The gradients overflowed with the dynamic loss scale already at ``min_loss_scale``."""


class LossScaler:
    """The loss scale of one engine and its dynamic-scaling state (see the module docstring).

    ``state_dict()`` / ``load_state_dict()`` hold everything `update` reads, so a resumed run continues
    the same scale sequence."""

    def __init__(
        self,
        scale: float,
        *,
        dynamic: bool,
        scale_window: int = 1000,
        min_scale: float = 1.0,
        hysteresis: int = 2,
        consecutive_hysteresis: bool = False,
        torch_amp: bool = False,
    ) -> None:
        if not scale > 0:
            raise ValueError(f"the loss scale must be positive, got {scale!r}")
        self.loss_scale = float(scale)
        """The factor `Engine.backward` multiplies the loss by."""
        self.dynamic = dynamic
        self.scale_window = scale_window
        self.min_scale = float(min_scale)
        self.hysteresis = hysteresis
        self.consecutive_hysteresis = consecutive_hysteresis
        self.torch_amp = torch_amp
        """`torch.amp.GradScaler`'s count: the scale grows at the window-th clean step (DeepSpeed's: the one
        after it)."""
        self.cur_hysteresis = hysteresis
        """Overflows still tolerated before the scale is lowered."""
        self.cur_iter = 0
        """Updates so far (one per optimizer step, skipped or not)."""
        self.last_overflow_iter = -1

    @classmethod
    def from_config(cls, fp16: FP16Config) -> LossScaler:
        """The scaler an ``fp16`` section describes: static when ``loss_scale`` > 0, else dynamic."""
        if not fp16.dynamic():
            return cls(fp16.loss_scale, dynamic=False)
        problem = fp16.dynamic_problem()  # fp16 params under a config with fp16 not enabled: seen only here
        if problem:
            raise ConfigError(problem)
        return cls(
            2.0**fp16.initial_scale_power,
            dynamic=True,
            scale_window=fp16.loss_scale_window,
            min_scale=fp16.min_loss_scale,
            hysteresis=fp16.hysteresis,
            consecutive_hysteresis=fp16.consecutive_hysteresis,
        )

    @classmethod
    def for_autocast(cls) -> LossScaler:
        """What DeepSpeed scales an fp16 ``torch_autocast`` run by: `torch.amp.GradScaler`'s defaults (2**16,
        halved at each overflow with no floor or hysteresis, doubled after 2000 clean steps)."""
        return cls(2.0**16, dynamic=True, scale_window=2000, min_scale=0.0, hysteresis=1, torch_amp=True)

    def update(self, overflow: bool) -> None:
        """Account for one optimizer step; ``overflow``: its gradients were not finite (it was skipped,
        said in the log at warning level, as DeepSpeed prints it: a loop counting its own steps, Lightning's
        ``global_step``, goes on counting one)."""
        before = self.loss_scale
        self._update(overflow)
        if overflow:
            logging.getLogger(__name__).warning(
                "fp16 gradients overflowed at loss scale %g: optimizer step %d skipped, loss scale now %g",
                before, self.cur_iter, self.loss_scale,
            )  # fmt: skip

    def _update(self, overflow: bool) -> None:
        if not self.dynamic:
            return
        if overflow:
            if self.cur_hysteresis > 1:
                self.cur_hysteresis -= 1
            elif self.loss_scale == self.min_scale:
                raise LossScaleError(
                    f"fp16 gradients overflowed with the loss scale already at fp16.min_loss_scale "
                    f"({self.min_scale:g}); training cannot continue at this scale"
                )
            else:
                self.loss_scale = max(self.loss_scale / SCALE_FACTOR, self.min_scale)
            self.last_overflow_iter = self.cur_iter
        else:
            if self.consecutive_hysteresis:
                self.cur_hysteresis = self.hysteresis
            # Clean steps before this one (GradScaler's count: up to this one).
            clean = self.cur_iter - self.last_overflow_iter - (0 if self.torch_amp else 1)
            if clean > 0 and clean % self.scale_window == 0:
                if not self.consecutive_hysteresis:
                    self.cur_hysteresis = self.hysteresis
                self.loss_scale *= SCALE_FACTOR
        self.cur_iter += 1

    def state_dict(self) -> dict[str, Any]:
        return {
            "loss_scale": self.loss_scale,
            "dynamic": self.dynamic,
            "cur_hysteresis": self.cur_hysteresis,
            "cur_iter": self.cur_iter,
            "last_overflow_iter": self.last_overflow_iter,
        }

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Restore `state_dict`'s values; the settings (window, floor, hysteresis) stay this scaler's."""
        if bool(state["dynamic"]) != self.dynamic:
            kind = "dynamic" if state["dynamic"] else "static"
            raise ValueError(f"the saved loss scaler is {kind}, this config's is not")
        self.loss_scale = float(state["loss_scale"])
        self.cur_hysteresis = int(state["cur_hysteresis"])
        self.cur_iter = int(state["cur_iter"])
        self.last_overflow_iter = int(state["last_overflow_iter"])

    def __repr__(self) -> str:
        kind = "dynamic" if self.dynamic else "static"
        return f"<zswap.LossScaler {kind} scale={self.loss_scale:g}>"
