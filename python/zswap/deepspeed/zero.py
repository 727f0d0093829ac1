"""``deepspeed.zero``'s call shapes on zswap: `Init` (and `MiCS_Init`), `GatheredParameters`,
`register_external_parameter`, `unwrap_model_for_generation`."""

from __future__ import annotations

import contextlib
import warnings
from collections.abc import Iterator
from typing import Any

import torch
from torch import nn

from ..build import init
from ..errors import ZswapError, ZswapWarning
from ..parts import gather
from ._args import not_here, refuse

_UNSET: Any = object()


class Init(init.Init):
    """DeepSpeed's ``deepspeed.zero.Init`` signature over `zswap.Init`.

    ``config_dict_or_path`` (or ``config``, its deprecated name; not both) → the config;
    ``data_parallel_group`` → ``process_group``; ``remote_device``, ``dtype``, ``enabled``, ``module`` as
    zswap's. ``pin_memory``: as in DeepSpeed, the config's ``offload_param.pin_memory`` decides when a config
    is given and ``pin_memory`` is left at ``False``; ``True`` pins. ``mem_efficient_linear``: zswap never
    keeps a gathered weight alive for backward (saved weights are re-fetched), which is what DeepSpeed's
    memory-efficient linear is for, so ``True`` (the default) is what zswap does; ``False`` (DeepSpeed's
    plain F.linear, the same results) is ignored with a `ZswapWarning`.
    ``mpu``, ``zero_param_parallel_group``, ``sequence_data_parallel_group``, ``param_swapper``,
    ``tensor_overrides`` and the quantized-weight switches are not supported: a `TypeError` naming the
    keyword unless left at the default.
    """

    def __init__(
        self,
        module: nn.Module | None = None,
        data_parallel_group: Any = None,
        mem_efficient_linear: bool = True,
        remote_device: str | None = None,
        pin_memory: bool = False,
        config_dict_or_path: Any = None,
        config: Any = None,
        enabled: bool = True,
        dtype: torch.dtype | None = None,
        mpu: Any = None,
        zero_param_parallel_group: Any = None,
        zero_quantized_weights: bool = False,
        zero_quantized_nontrainable_weights: bool = False,
        sequence_data_parallel_group: Any = None,
        param_swapper: Any = None,
        tensor_overrides: Any = _UNSET,
    ) -> None:
        refuse(
            "zero.Init",
            mpu=(mpu, None),
            zero_param_parallel_group=(zero_param_parallel_group, None),
            zero_quantized_weights=(zero_quantized_weights, False),
            zero_quantized_nontrainable_weights=(zero_quantized_nontrainable_weights, False),
            sequence_data_parallel_group=(sequence_data_parallel_group, None),
            param_swapper=(param_swapper, None),
            tensor_overrides=(tensor_overrides, _UNSET),
        )
        if not mem_efficient_linear:
            # DeepSpeed's False only keeps torch's F.linear (which saves the gathered weight for backward);
            # no result depends on it, and zswap re-fetches saved weights in backward either way.
            warnings.warn(
                "zswap.deepspeed.zero.Init: mem_efficient_linear=False is ignored (zswap never keeps a "
                "gathered weight alive for backward; results are the same)",
                ZswapWarning,
                stacklevel=2,
            )
        if config_dict_or_path is not None and config is not None:
            raise TypeError(
                "zswap.deepspeed.zero.Init got both config_dict_or_path= and config= (its deprecated name); "
                "pass one"
            )
        cfg = config_dict_or_path if config_dict_or_path is not None else config
        pin: bool | None = bool(pin_memory) if pin_memory or cfg is None else None
        super().__init__(
            cfg,
            remote_device=remote_device,
            pin_memory=pin,
            dtype=dtype,
            enabled=enabled,
            process_group=data_parallel_group,
            module=module,
        )


class MiCS_Init(Init):
    """DeepSpeed's ``deepspeed.zero.MiCS_Init``: `Init`, with a `ZswapWarning`. MiCS shards each param
    within groups of ``mics_shard_size`` ranks and replicates it across them, which changes where bytes
    live and how they move, not what training computes; zswap partitions each param over the whole group
    (the config's ``mics_*`` keys are accepted and ignored likewise)."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        warnings.warn(
            "zswap.deepspeed.zero.MiCS_Init partitions each param over the whole process group, as "
            "zswap.deepspeed.zero.Init does (MiCS's sharding groups are not implemented; results are the "
            "same)",
            ZswapWarning,
            stacklevel=2,
        )
        super().__init__(*args, **kwargs)


class GatheredParameters(gather.GatheredParameters):
    """DeepSpeed's ``deepspeed.zero.GatheredParameters(params, modifier_rank=None, fwd_module=None,
    enabled=True)`` over `zswap.GatheredParameters`.

    ``fwd_module``: DeepSpeed registers ``params`` as external parameters of that module so its forward
    may use them; zswap fetches a managed param wherever a hooked forward uses it, so there is nothing to
    register (see `register_external_parameter`). It must be a module or ``None``."""

    def __init__(
        self,
        params: Any,
        modifier_rank: int | None = None,
        fwd_module: nn.Module | None = None,
        enabled: bool = True,
    ) -> None:
        if fwd_module is not None and not isinstance(fwd_module, nn.Module):
            raise TypeError(f"fwd_module must be an nn.Module or None, not {type(fwd_module).__name__}")
        super().__init__(params, modifier_rank=modifier_rank, enabled=enabled)


class NotAParameterError(ZswapError, RuntimeError):
    """`register_external_parameter` was given something that is not an ``nn.Parameter`` (DeepSpeed raises
    ``RuntimeError`` too)."""


def register_external_parameter(module: nn.Module, parameter: nn.Parameter) -> None:
    """A no-op in zswap, kept so DeepSpeed code runs: DeepSpeed needs to be told that ``module``'s forward
    uses a param of another module; zswap's engine catches every use of a managed param inside a hooked
    forward (a torch-function mode) and fetches it there, so nothing needs registering. Checks its
    arguments as DeepSpeed does."""
    if not isinstance(parameter, nn.Parameter):
        raise NotAParameterError(f"parameter must be an nn.Parameter, not {type(parameter).__name__}")
    if not isinstance(module, nn.Module):
        raise TypeError(f"module must be an nn.Module, not {type(module).__name__}")


def unregister_external_parameter(module: nn.Module, parameter: nn.Parameter) -> None:
    """The counterpart of `register_external_parameter`: a no-op for the same reason."""
    register_external_parameter(module, parameter)


@contextlib.contextmanager
def unwrap_model_for_generation(model: Any) -> Iterator[Any]:
    """DeepSpeed's ZeRO-3 ``unwrap_model_for_generation``: every param of ``model`` (an engine or its
    module) gathered for the block, so that a generation loop inside reads nothing more; yields ``model``.
    DeepSpeed also takes its hooks off for the block; zswap's leave a gathered param as it is, so they
    stay, and training goes on after the block as before it."""
    with gather.GatheredParameters(list(model.parameters())):
        yield model


_TILED = (
    "DeepSpeed splits a Linear into tiles so that ZeRO-3 gathers one tile at a time; zswap gathers whole "
    "params within stage3_max_live_parameters, so build the layer as torch.nn.Linear (the same function; "
    "TiledLinear's sums of tiles differ from it only in rounding)"
)


class TiledLinear:
    """DeepSpeed's ``zero.TiledLinear``, which zswap does not implement: building one raises, naming what to
    use (a class, so that ``from deepspeed.zero import TiledLinear`` still imports and the message is
    seen)."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        raise NotImplementedError(f"zswap.deepspeed.zero.{type(self).__name__}: zswap has none: {_TILED}")


class TiledLinearReturnBias(TiledLinear):
    """DeepSpeed's ``zero.TiledLinearReturnBias``: as `TiledLinear`."""


_NOT_HERE = {
    "ZeroParamStatus": (
        "ZeroParamStatus (a param's ds_status): a zswap param is gathered only inside a hooked forward or "
        "a GatheredParameters block: read it there (zswap.param_state(p) tells its shape, dtype and tier)"
    ),
    "ZeroParamType": "ZeroParamType: a param zswap partitions carries ds_id, ds_shape and ds_numel",
}
"""Names of ``deepspeed.zero`` zswap does not implement, with what to use instead."""


__getattr__ = not_here(__name__, _NOT_HERE)


__all__ = [
    "GatheredParameters",
    "Init",
    "MiCS_Init",
    "register_external_parameter",
    "unregister_external_parameter",
    "unwrap_model_for_generation",
]
