"""``deepspeed.ops``: the optimizers DeepSpeed scripts build by hand (``ops.adam``). DeepSpeed's other
kernels (its transformer, sparse attention, quantizers, Lamb, Adagrad, Lion) have no counterpart: zswap
runs the model's own modules and steps Adam / AdamW (or an element-wise torch optimizer, in memory)."""

from __future__ import annotations

from typing import Any

from . import adam


def __getattr__(name: str) -> Any:
    raise AttributeError(
        f"zswap.deepspeed.ops has no {name!r}: of DeepSpeed's ops zswap maps only its Adam optimizers "
        "(zswap.deepspeed.ops.adam.DeepSpeedCPUAdam, FusedAdam); other optimizers: a torch optimizer passed "
        "to initialize (an element-wise one steps in memory)"
    )


__all__ = ["adam"]
