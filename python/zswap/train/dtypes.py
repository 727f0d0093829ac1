"""DeepSpeed's ``data_types`` section where `zswap.initialize` meets the model, as DeepSpeed's engine does at
its own start: buffers named to stay in float32 under bf16 / fp16 are float32, ``buffer_dtype`` casts the
others, ``grad_accum_dtype`` fp32 sums bf16 / fp16 gradients in float32 on the CPU too (`widens`) and one
zswap would not sum in where it accumulates is refused, and gradients are reduced over ranks in
``communication_data_type`` (`set_reduction`)."""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch

from ..build._lineage import kept_in_fp32
from ..errors import ConfigError
from ..gradients.gradstore import LOW_PRECISION
from ..parts.params import param_state
from ..step.stepping import few

if TYPE_CHECKING:
    from .runtime import Engine


_OTHER_HALF = {torch.bfloat16: torch.float16, torch.float16: torch.bfloat16}


def at_build(engine: Engine) -> None:
    """Set the module's floating buffers' dtypes from ``data_types`` (each in place: aliases follow); refuse
    params in the 16-bit dtype the config's sections did not choose (bf16 on, params float16), and a bf16 /
    fp16 section over a model whose params are all float32 (built under an Init without it)."""
    module, config = engine.module, engine.config
    types = config.data_types
    params = config.torch_dtype()
    other = _OTHER_HALF.get(params) if params is not None else None
    named = module.named_parameters()
    wrong = [n for n, p in named if (st := param_state(p)) is not None and st.dtype == other]
    if wrong:
        name, section = str(other).removeprefix("torch."), "bf16" if params == torch.bfloat16 else "fp16"
        raise ConfigError(
            f"the config's {section} section is on but {few(wrong)} are {name} (built with zswap.Init(..., "
            f"dtype=torch.{name})?): the engine would train them in {name}, not as the section says. Build "
            f"them in {section} (no dtype= beside the section), or switch on the "
            f"{'fp16' if section == 'bf16' else 'bf16'} section instead"
        )
    if params in _OTHER_HALF and not config.torch_autocast.enabled:
        floating = [
            (n, st.dtype)
            for n, p in module.named_parameters()
            if (st := param_state(p)) is not None and st.dtype.is_floating_point
        ]
        if floating and all(d == torch.float32 for _, d in floating):
            section = "bf16" if params == torch.bfloat16 else "fp16"
            names = few([n for n, _ in floating])
            raise ConfigError(
                f"the config's {section} section is on but every param is float32 ({names}"
                f"; built under a zswap.Init whose config has no {section} section?): the engine would train "
                f"in float32, not as the section says. Give zswap.Init the same config as initialize"
            )
    cast = types.torch_dtype(types.buffer_dtype)
    kept = kept_in_fp32(module.modules(), params, types.keep_in_fp32_modules) if params is not None else set()
    for buf in module.buffers():
        if not buf.is_floating_point():
            continue
        if id(buf) in kept:
            if buf.dtype != torch.float32:
                buf.data = buf.data.float()
        elif cast is not None and buf.dtype != cast:
            buf.data = buf.data.to(cast)


def widens(engine: Engine) -> bool:
    """Whether the engine's gradient stores sum float16/bfloat16 gradients in float32 on the CPU:
    ``grad_accum_dtype`` fp32 asks for it (from a compute device they always are)."""
    return engine.config.data_types.grad_accum_dtype == "fp32" and engine.compute_device.passthrough


def sums_in_fp32(engine: Engine) -> bool:
    """Whether float16/bfloat16 gradients are summed in float32 over micro-batches: from a compute device
    (`GradStore.add_fp32`), or on the CPU where `widens`."""
    return not engine.compute_device.passthrough or widens(engine)


def check_accumulation(engine: Engine, steps: int) -> None:
    """``data_types.grad_accum_dtype`` must be the dtype zswap sums gradients in over ``steps``
    micro-batches (> 1): float32 for float32 params and for bf16 / fp16 ones from a compute device
    (`zswap.gradients.gradstore.GradStore.add_fp32`), on the CPU the one asked for of float32 and the
    params' own (`widens`)."""
    asked = engine.config.data_types.grad_accum_dtype
    if asked is None or steps <= 1:
        return
    want = engine.config.data_types.torch_dtype(asked)
    host = engine.compute_device.passthrough
    for dtype in sorted({st.dtype for p, st in engine._items if p.requires_grad}, key=str):
        low = dtype in LOW_PRECISION
        sums = torch.float32 if not low or sums_in_fp32(engine) else dtype
        if dtype.is_floating_point and sums != want:
            where = "on the CPU" if host else "from a compute device"
            can = "fp32 or " + _NAMES[dtype] if low and host else "fp32"
            raise ConfigError(
                f"data_types.grad_accum_dtype is {asked!r} but zswap sums the gradients of {dtype} params "
                f"{where} in {sums} over the {steps} micro-batches of a step; drop "
                f"data_types.grad_accum_dtype or set it to {can}"
            )


_NAMES = {torch.bfloat16: "bf16", torch.float16: "fp16"}


def set_reduction(engine: Engine) -> None:
    """``communication_data_type``: the ranks reduce gradients in it (each rounded to it first, the average
    rounded back to the gradient's dtype, as DeepSpeed converts to its accumulation dtype), and where it and
    ``grad_accum_dtype`` are both float32 the average stays float32 (DeepSpeed converts nothing then)."""
    asked = engine.config.communication_data_type
    engine._grads.reduce_in = engine.config.data_types.torch_dtype(asked)
    engine._grads.keep_reduced = asked == "fp32" and engine.config.data_types.grad_accum_dtype == "fp32"
