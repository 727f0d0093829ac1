"""Hugging Face ``generate`` on a model partitioned over several ranks.

Every forward gathers each param's partitions from every rank, so the ranks must run the same number of
forwards. In ``generate`` a rank whose sequences have all ended stops calling the model while the others go
on: their next gathers wait for a rank that never comes (a hang until the process group's timeout, or an
error once it exits). transformers keeps the ranks in step — ``synced_gpus``: a finished rank runs the model
on until every rank is done — where it sees DeepSpeed ZeRO-3 or FSDP, which it cannot see here. So while an
engine runs a model over several ranks, `install` makes ``synced_gpus`` default to true for each of its
modules whose ``generate`` takes it (transformers' ``GenerationMixin``); a value the caller passes is kept.
"""

from __future__ import annotations

import functools
import inspect
import types
from collections.abc import Callable
from typing import Any

from torch import nn


def install(module: nn.Module, world: int) -> Installed:
    """Give every module under ``module`` (itself included) whose class's ``generate`` has a
    ``synced_gpus`` parameter a ``generate`` defaulting it to true, when ``world`` > 1."""
    done = Installed()
    if world <= 1:
        return done
    for m in module.modules():
        generate = getattr(type(m), "generate", None)
        if "generate" in vars(m) or not callable(generate):
            continue  # one set on the instance is the caller's (or another engine's): left as it is
        try:
            signature = inspect.signature(generate)
        except (TypeError, ValueError):
            continue
        if "synced_gpus" in signature.parameters:
            # A method bound to the instance, not the class (shared with models no engine runs); the cycle
            # it makes (module -> its __dict__ -> method -> module) is the collector's, and `remove` cuts it.
            wrapper = types.MethodType(_synced(generate, signature), m)
            vars(m)["generate"] = wrapper
            done.set.append((m, wrapper))
    return done


class Installed:
    """What `install` set, taken off by `remove` (with the engine's module hooks)."""

    def __init__(self) -> None:
        self.set: list[tuple[nn.Module, Any]] = []

    def remove(self) -> None:
        for m, wrapper in self.set:
            if vars(m).get("generate") is wrapper:
                del vars(m)["generate"]
        self.set.clear()


def _synced(generate: Callable[..., Any], signature: inspect.Signature) -> Callable[..., Any]:
    @functools.wraps(generate)
    def synced(self: nn.Module, *args: Any, **kwargs: Any) -> Any:
        try:
            given = "synced_gpus" in signature.bind_partial(self, *args, **kwargs).arguments
        except TypeError:
            given = True  # a call generate cannot take: its own error says why
        if not given:
            kwargs["synced_gpus"] = True
        return generate(self, *args, **kwargs)

    return synced
