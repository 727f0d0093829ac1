"""``deepspeed.ops.adam``: ``DeepSpeedCPUAdam`` and ``FusedAdam``, DeepSpeed's two Adam kernels, which
scripts build and pass to ``initialize(optimizer=…)`` (``DeepSpeedCPUAdam`` where the optimizer is
offloaded, ``FusedAdam`` where not). Each makes the torch optimizer computing the same update —
``torch.optim.AdamW`` (decoupled weight decay, their default) or ``torch.optim.Adam`` (L2 weight decay:
``adamw_mode`` / ``adam_w_mode`` false) — which `zswap.deepspeed.initialize` turns into zswap's offloaded
AdamW, its state where the config's ``offload_optimizer`` says, as it does any torch Adam it is given.
A setting zswap's AdamW does not have (``amsgrad``, no bias correction, states below float32) is a
`TypeError` naming it."""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any

import torch

from .._args import refuse


class DeepSpeedCPUAdam:
    """DeepSpeed's CPU Adam: ``DeepSpeedCPUAdam(model_params, lr=1e-3, bias_correction=True,
    betas=(0.9, 0.999), eps=1e-8, weight_decay=0, amsgrad=False, adamw_mode=True,
    fp32_optimizer_states=True)`` makes a ``torch.optim.AdamW`` (``adamw_mode`` false: ``Adam``) with
    those values (see the module doc)."""

    def __new__(  # type: ignore[misc]
        cls,
        model_params: Iterable[Any],
        lr: float = 1e-3,
        bias_correction: bool = True,
        betas: tuple[float, float] = (0.9, 0.999),
        eps: float = 1e-8,
        weight_decay: float = 0,
        amsgrad: bool = False,
        adamw_mode: bool = True,
        fp32_optimizer_states: bool = True,
    ) -> torch.optim.Optimizer:
        refuse(
            "ops.adam.DeepSpeedCPUAdam",
            bias_correction=(bias_correction, True),
            amsgrad=(amsgrad, False),
            fp32_optimizer_states=(fp32_optimizer_states, True),
        )
        return _torch_adam(model_params, adamw_mode, lr, betas, eps, weight_decay)


class FusedAdam:
    """DeepSpeed's fused (GPU) Adam: ``FusedAdam(params, lr=1e-3, bias_correction=True, betas=(0.9, 0.999),
    eps=1e-8, adam_w_mode=True, weight_decay=0.0, amsgrad=False, set_grad_none=True)`` makes a
    ``torch.optim.AdamW`` (``adam_w_mode`` false: ``Adam``) with those values (see the module doc);
    ``set_grad_none`` (its ``zero_grad``'s) is torch's default too."""

    def __new__(  # type: ignore[misc]
        cls,
        params: Iterable[Any],
        lr: float = 1e-3,
        bias_correction: bool = True,
        betas: tuple[float, float] = (0.9, 0.999),
        eps: float = 1e-8,
        adam_w_mode: bool = True,
        weight_decay: float = 0.0,
        amsgrad: bool = False,
        set_grad_none: bool = True,
    ) -> torch.optim.Optimizer:
        refuse(
            "ops.adam.FusedAdam",
            bias_correction=(bias_correction, True),
            amsgrad=(amsgrad, False),
            set_grad_none=(set_grad_none, True),
        )
        return _torch_adam(params, adam_w_mode, lr, betas, eps, weight_decay)


def _torch_adam(
    params: Iterable[Any],
    decoupled: bool,
    lr: float,
    betas: tuple[float, float],
    eps: float,
    weight_decay: float,
) -> torch.optim.Optimizer:
    kind = torch.optim.AdamW if decoupled else torch.optim.Adam
    return kind(params, lr=lr, betas=betas, eps=eps, weight_decay=weight_decay)


__all__ = ["DeepSpeedCPUAdam", "FusedAdam"]
