"""Argument checks shared by the DeepSpeed-shaped entry points."""

from __future__ import annotations

from typing import Any


def refuse(where: str, **given: tuple[Any, Any]) -> None:
    """`TypeError` naming the first DeepSpeed keyword given a value other than its default ``(value,
    default)``: zswap has no equivalent for it, and dropping it silently would change what the script
    asked for."""
    for name, (value, default) in given.items():
        if value is not default and value != default:
            raise TypeError(
                f"zswap.deepspeed.{where}: {name}={value!r} is not supported by zswap (only the default "
                f"{default!r} is accepted)"
            )


def resolve_config(args: Any, config: Any, config_params: Any) -> Any:
    """The one config of `initialize`: ``config``, ``config_params`` (its old name) or
    ``args.deepspeed_config`` (``args.deepscale_config``); two of them at once is a `TypeError`."""
    sources = {}
    if config is not None:
        sources["config"] = config
    if config_params is not None:
        sources["config_params"] = config_params
    for name in ("deepspeed_config", "deepscale_config"):
        value = getattr(args, name, None)
        if value is not None:
            sources[f"args.{name}"] = value
    if len(sources) > 1:
        raise TypeError(
            f"zswap.deepspeed.initialize got a config from {' and '.join(sources)}; pass exactly one"
        )
    if not sources:
        raise TypeError(
            "zswap.deepspeed.initialize needs a config: config= (a path or a dict), config_params= or "
            "args.deepspeed_config"
        )
    return next(iter(sources.values()))
