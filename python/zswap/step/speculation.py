"""What the early step assumes of the step it runs ahead of, and why it cannot run where it cannot.

The early step (`zswap.step.earlystep`) updates each optimizer record in backward, before `Engine.step`
knows two things the ordinary step decides from every gradient: the clip factor (``gradient_clipping``:
``max_norm / (norm + 1e-6)`` capped at 1, `zswap.gradients.grads.global_scale`) and whether the gradients
are finite (the fp16 / bf16 overflow check). So it *speculates*: the update runs with the factor the step
will use if clipping does not bite — ``1 / loss scale`` exactly, the float the ordinary step computes then
— and `Engine.step`, having computed the real factor from the norms noted in backward, commits it only if
the two are the same float. A different factor (clipping bit) drops the staged update and the ordinary step
runs from the kept gradients; non-finite gradients drop it and the step is skipped, as it would have been.
Either way the result is bitwise the ordinary step's. After a step whose clipping bit, the next one is
not speculated (the factor will most likely differ again) but *deferred*: the copies and gradients are
held through backward and every record updated at the step, with its factor, until a step finds clipping
inactive. So is the step after one whose param groups' hyper-parameters were assigned between backward and
step (a schedule applied right before ``step()``): deferred, the update takes the values set there. A
first such assignment of lr, eps or a decoupled weight decay, after steps without, is redone at the step
from the staged moments (`zswap.step.early_rehyper`).

With gradient accumulation the update runs in the boundary micro-batch's backward: the micro-batches
before it have their gradients summed in the store (in memory within the early step's ``room``, written
past it), and the boundary's gradients are added to them as the store adds them; what is applied is the
stored sum. A front end that runs the accumulation itself (Lightning, the Hugging Face Trainer: the
engine's ``gradient_accumulation_steps`` 1) says which backward ends its window (``Engine.window_ends``);
one that learns the clip norm only after backward (Lightning's ``configure_gradient_clipping``) sets
``Engine.clipping_after_backward``, so the gradients a clipped step needs are kept.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from . import early_memory, stepping
from .optim import OffloadedAdamW

MICRO_BATCH = "a micro-batch before the accumulation boundary"
"""`EarlyStep.plan`'s answer between accumulation boundaries: the gradients are summed in the store (in
memory within ``room``) and the update waits for the boundary's backward."""


ACCUMULATES = (
    "backwards are summed before engine.step() with gradient_accumulation_steps 1: set it to the number of "
    "backwards per step (and call engine.step() after each), or with zswap.deepspeed's engine call "
    "set_gradient_accumulation_boundary(is_last) before each backward, so that the update runs in the last "
    "one"
)
"""Why no early step runs once the caller was seen summing backwards itself (`EarlyStep.accumulates`):
the update in the first backward of each step would be dropped by the next, its transfers wasted."""


@dataclass(frozen=True)
class Guess:
    """What an early step assumes of the step it runs ahead of (`EarlyStep.plan`, asked when a backward
    begins and again at the step: a different answer drops it)."""

    factor: float | None
    """The gradient scale the updates run with: ``1 / loss scale`` (clipping assumed not to bite);
    `Engine.step` commits only if the scale it computes is exactly this float. ``None``: *deferred* —
    the param copies and gradients are held through backward and every record is updated at the step,
    with the scale it computed (clipping bit at the last step); those past the early step's cap are not
    held, their records updated by the ordinary step within the same commit (`EarlyStep.passed`)."""
    keep: bool
    """The gradients are stored too (in memory within the early step's ``room``, written past it): the
    step may need them — clipping may bite (the ordinary step then runs from them), or, accumulating, a
    param with earlier micro-batches' gradient may get none in this backward. A deferred step holds its
    gradients until the step and applies them there: it hands them to their store only where it is
    dropped or leaves their records to the ordinary step (`early_commit.ordinary_part`)."""
    sums: bool
    """Earlier micro-batches of this step left gradients in the store: each is summed with this
    backward's as the store sums them, and the stored sum is applied."""
    ranks: int
    """Ranks the params are partitioned over; past 1 the update works on this rank's slice of each
    gathered param and no seeds are kept (`zswap.fetch.prefetch.Scheduler.seed` takes one rank's only)."""


def planner(engine: Any, optimizer: Any, ranks: int) -> Callable[[], Guess | str]:
    """``plan()`` for the early step of ``engine`` (a `zswap.Engine`) over ``optimizer``: the `Guess` for
    the step the next backward leads to, or why no early step can run for it."""
    ids = engine._ids

    def plan() -> Guess | str:
        if not engine.early_step:
            return "engine.early_step is False"
        if engine.optimizer is not optimizer:
            return "the engine's optimizer was replaced"
        if optimizer.max_grad_norm is not None:
            return "OffloadedAdamW clips by itself (its max_grad_norm): use gradient_clipping instead"
        if any(p.requires_grad for p in engine.module.parameters() if id(p) not in ids):
            return "a param that requires grad is not managed by zswap"
        ends = engine.window_ends  # a front end's own accumulation windows (engine gas 1)
        if not (engine.is_gradient_accumulation_boundary() if ends is None else ends()):
            return MICRO_BATCH
        clipping = engine.max_grad_norm is not None or engine.clipping_after_backward
        sums = engine._gas > 1 or ends is not None  # a window of one (an epoch's last) sums nothing
        # Deferred (the gradients it holds are applied at the step only): after a step whose clipping bit,
        # or one whose hyper-parameters were assigned between backward and step (a schedule applied there).
        moved = engine._early is not None and engine._early.hypers_moved
        if (clipping and engine._clipped) or moved:
            return Guess(None, keep=sums, sums=sums, ranks=ranks)
        loss_scale = stepping.current_scale(engine) if engine._scaled_backward else 1.0
        return Guess(1.0 / loss_scale, keep=clipping or sums, sums=sums, ranks=ranks)

    return plan


def why_not(engine: Any, optimizer: Any) -> str:
    """Why ``engine`` has no early step at all ("" if its setup allows one): the setups
    `zswap.step.early_build.for_engine` does not build one for."""
    if optimizer is None:
        return "no optimizer"
    if not isinstance(optimizer, OffloadedAdamW):
        return f"the optimizer is {type(optimizer).__name__}, not zswap's OffloadedAdamW"
    if not engine._items:
        return "no param is managed"
    return early_memory.why_not(engine, optimizer)  # NVMe or CPU memory, in any combination
