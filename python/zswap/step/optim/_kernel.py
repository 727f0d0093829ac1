"""`cpu_adam_step`: the Rust Adam/AdamW kernel over validated CPU tensors."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import torch

from ... import _zswap

_PARAM_DTYPES = {torch.float32: "float32", torch.bfloat16: "bfloat16", torch.float16: "float16"}
STEPPED_DTYPES = frozenset(_PARAM_DTYPES)
"""The param dtypes the kernel steps (`OffloadedAdamW` refuses others when it is built)."""


TORCH_LANES = 8
"""float32 elements per step of the vector loop of torch's fused CPU AdamW: 8, also where torch reports
AVX-512 (measured against torch 2.15 element by element: a 16-lane split disagrees, an 8-lane one agrees)."""


def torch_tail(numel: int) -> int:
    """Where the scalar tail of a ``numel``-element tensor begins in torch's fused CPU AdamW: its vector
    loop covers whole vectors of `TORCH_LANES` float32 and a scalar loop the rest."""
    return numel - numel % TORCH_LANES


def _tensor(name: str, t: object) -> torch.Tensor:
    if not isinstance(t, torch.Tensor):
        raise TypeError(f"{name} must be a torch.Tensor, got {type(t).__name__}")
    if t.device.type != "cpu" or t.layout != torch.strided:
        raise ValueError(f"{name} must be a dense CPU tensor, got layout {t.layout} on {t.device}")
    if not t.is_contiguous():
        raise ValueError(f"{name} must be contiguous (shape {tuple(t.shape)}, stride {t.stride()})")
    return t


def _dtype(name: str, t: torch.Tensor, allowed: tuple[torch.dtype, ...]) -> None:
    if t.dtype not in allowed:
        names = ", ".join(str(d) for d in allowed)
        raise TypeError(f"{name} must be {names}; got {t.dtype}")


def _state(
    param: object, master: object, exp_avg: object, exp_avg_sq: object, step: object
) -> tuple[torch.Tensor, torch.Tensor | None, torch.Tensor, torch.Tensor]:
    """The kernel's param and state tensors, checked (see `cpu_adam_step`), and its step number."""
    param = _tensor("param", param)
    exp_avg = _tensor("exp_avg", exp_avg)
    exp_avg_sq = _tensor("exp_avg_sq", exp_avg_sq)
    _dtype("param", param, tuple(_PARAM_DTYPES))
    _dtype("exp_avg", exp_avg, (torch.float32,))
    _dtype("exp_avg_sq", exp_avg_sq, (torch.float32,))
    if master is None:
        if param.dtype != torch.float32:
            raise ValueError(f"a {param.dtype} param needs a float32 master (master=None is for float32)")
    else:
        master = _tensor("master", master)
        _dtype("master", master, (torch.float32,))
    n = param.numel()
    for name, t in (("master", master), ("exp_avg", exp_avg), ("exp_avg_sq", exp_avg_sq)):
        if isinstance(t, torch.Tensor) and t.numel() != n:
            raise ValueError(f"{name} has {t.numel()} elements but param has {n}")
    if isinstance(step, bool) or not isinstance(step, int) or step < 1:
        raise ValueError(f"step must be an int >= 1 (the step being taken), got {step!r}")
    return param, master if isinstance(master, torch.Tensor) else None, exp_avg, exp_avg_sq


def cpu_adam_step(
    param: torch.Tensor,
    grad: torch.Tensor,
    master: torch.Tensor | None,
    exp_avg: torch.Tensor,
    exp_avg_sq: torch.Tensor,
    *,
    step: int,
    lr: float,
    beta1: float,
    beta2: float,
    eps: float,
    weight_decay: float,
    decoupled: bool,
    grad_scale: float = 1.0,
    tail_from: int | None = None,
) -> None:
    """One Adam/AdamW step over one tensor, in place, in a single multithreaded SIMD pass.

    Args:
        param: the model param (float32, bfloat16 or float16); receives the updated master, rounded to
            nearest-even in its dtype.
        grad: its gradient, same shape, float32, bfloat16 or float16 (up-cast exactly).
        master: float32 master weights with as many elements as `param`, or ``None`` when `param` is
            float32 and is its own master.
        exp_avg, exp_avg_sq: float32 moments with as many elements as `param`.
        step: the number of this step, counting from 1 (bias correction).
        lr, beta1, beta2, eps, weight_decay: as in `torch.optim.AdamW`.
        decoupled: AdamW's decoupled decay (``p *= 1 - lr*wd``) when true, Adam's L2 term
            (``g += wd*p``) when false.
        grad_scale: the gradient is multiplied by this first (clipping or loss-scale removal).
        tail_from: the elements from this index on are updated as torch's fused AdamW updates a tensor's
            scalar tail (`torch_tail`); default: this tensor's own tail. A caller stepping a slice of a
            larger tensor passes where that tensor's tail falls in the slice.

    Every tensor must be a contiguous CPU tensor, none sharing memory with another. The arithmetic is
    that of ``torch.optim.AdamW(fused=True)`` on the CPU, element for element (its scalar tail included:
    ``tail_from``); against the single-tensor path results agree to about an ulp.
    Runs without the GIL, on rayon's thread pool (one thread per core; ``RAYON_NUM_THREADS`` overrides).
    Right after a parallel torch op, torch's OpenMP workers spin-wait on the same cores for a few
    milliseconds; ``OMP_WAIT_POLICY=PASSIVE`` in the environment avoids sharing the cores with them.
    """
    param, master, exp_avg, exp_avg_sq = _state(param, master, exp_avg, exp_avg_sq, step)
    grad = _tensor("grad", grad)
    _dtype("grad", grad, tuple(_PARAM_DTYPES))
    if grad.shape != param.shape:
        raise ValueError(f"grad shape {tuple(grad.shape)} differs from param shape {tuple(param.shape)}")
    n = param.numel()
    if tail_from is None:
        tail_from = torch_tail(n)
    if isinstance(tail_from, bool) or not isinstance(tail_from, int) or tail_from < 0:
        raise ValueError(f"tail_from must be an int >= 0, got {tail_from!r}")
    _zswap.cpu_adam_step(
        n,
        param.data_ptr(),
        _PARAM_DTYPES[param.dtype],
        grad.data_ptr(),
        _PARAM_DTYPES[grad.dtype],
        None if master is None else master.data_ptr(),
        exp_avg.data_ptr(),
        exp_avg_sq.data_ptr(),
        step=step,
        lr=float(lr),
        beta1=float(beta1),
        beta2=float(beta2),
        eps=float(eps),
        weight_decay=float(weight_decay),
        decoupled=bool(decoupled),
        grad_scale=float(grad_scale),
        tail_from=min(tail_from, n),
    )
    # Written behind autograd's back: bump the version counter as an in-place torch op would, so that a
    # graph which saved the param still notices the change.
    torch.autograd.graph.increment_version(param)


def cpu_adam_redo(
    param: torch.Tensor,
    master: torch.Tensor | None,
    exp_avg: torch.Tensor,
    exp_avg_sq: torch.Tensor,
    *,
    step: int,
    lr: float,
    beta1: float,
    beta2: float,
    eps: float,
    weight_decay: float,
    decoupled: bool,
) -> None:
    """`cpu_adam_step` run again with another ``lr``, ``eps`` or decoupled ``weight_decay``, from the
    moments the first run left: ``exp_avg`` and ``exp_avg_sq`` (read only) already hold this step's
    gradient, ``master`` (``param`` itself where it is float32 and ``master`` is ``None``) is the value
    *before* the step; the new master goes there, cast into ``param``. Bitwise the master and param a
    `cpu_adam_step` with these hyper-parameters gives — the moments do not depend on lr, eps or a
    decoupled weight decay (betas and Adam's L2 weight decay they do: a change of those cannot be redone
    this way). `step`: the step's number, as given to that `cpu_adam_step`."""
    param, master, exp_avg, exp_avg_sq = _state(param, master, exp_avg, exp_avg_sq, step)
    _zswap.cpu_adam_redo(
        param.numel(),
        param.data_ptr(),
        _PARAM_DTYPES[param.dtype],
        None if master is None else master.data_ptr(),
        exp_avg.data_ptr(),
        exp_avg_sq.data_ptr(),
        step=step,
        lr=float(lr),
        beta1=float(beta1),
        beta2=float(beta2),
        eps=float(eps),
        weight_decay=float(weight_decay),
        decoupled=bool(decoupled),
    )
    torch.autograd.graph.increment_version(param)


def group_hypers(group: Mapping[str, Any]) -> dict[str, Any]:
    """`cpu_adam_step`'s and `cpu_adam_redo`'s hyper-parameter arguments from a param group: ``lr``,
    ``beta1``, ``beta2``, ``eps``, ``weight_decay`` and ``decoupled`` (its ``decoupled_weight_decay``)."""
    beta1, beta2 = group["betas"]
    return {
        "lr": float(group["lr"]),
        "beta1": float(beta1),
        "beta2": float(beta2),
        "eps": float(group["eps"]),
        "weight_decay": float(group["weight_decay"]),
        "decoupled": bool(group["decoupled_weight_decay"]),
    }


def kernel_isa() -> str:
    """The instruction set `cpu_adam_step` uses on this CPU: "avx512", "avx2" or "portable"."""
    return _zswap.cpu_adam_isa()
