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
            takes = "synced_gpus" in inspect.signature(generate).parameters
        except (TypeError, ValueError):
            continue
        if takes:
            # On the instance, not the class (shared with models no engine runs).
            wrapper = SyncedGenerate(m)
            vars(m)["generate"] = wrapper
            done.wrapped.append((m, wrapper))
    return done


class Installed:
    """What `install` set, taken off by `remove` (with the engine's module hooks)."""

    def __init__(self) -> None:
        self.wrapped: list[tuple[nn.Module, SyncedGenerate]] = []

    def remove(self) -> None:
        for m, wrapper in self.wrapped:
            if vars(m).get("generate") is wrapper:
                del vars(m)["generate"]
        self.wrapped.clear()


class SyncedGenerate:
    """``module.generate`` (its class's) with ``synced_gpus`` true unless the call gives it."""

    def __init__(self, module: nn.Module) -> None:
        self.module = module
        cls: Any = type(module)
        self.generate = cls.generate  # the class's function
        functools.update_wrapper(self, self.generate)  # its name, doc and signature

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        generate = self.generate
        if "synced_gpus" not in kwargs:
            try:
                bound = inspect.signature(generate).bind_partial(self.module, *args, **kwargs)
                given = "synced_gpus" in bound.arguments
            except TypeError:
                given = True  # a call generate cannot take: its own error says why
            if not given:
                kwargs["synced_gpus"] = True
        return generate(self.module, *args, **kwargs)
