"""Argument checks shared by the DeepSpeed-shaped entry points."""

from __future__ import annotations

from collections.abc import Callable, Mapping
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


def not_here(module: str, table: Mapping[str, str]) -> Callable[[str], Any]:
    """A module ``__getattr__`` for the DeepSpeed names ``module`` does not mirror: an `AttributeError`
    saying so and what to use (``table``: name → what zswap has none of, and the way instead), Python's
    own message for any other name."""

    def __getattr__(name: str) -> Any:
        what = table.get(name)
        if what is None:
            raise AttributeError(f"module {module!r} has no attribute {name!r}")
        raise AttributeError(f"{module}.{name}: zswap has no {what}")

    return __getattr__
