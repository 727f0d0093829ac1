"""Leaf modules: a module whose params are gathered together when its forward (and its backward) begins,
whatever runs inside it, and released together when it ends — DeepSpeed's ZeRO-3 leaf modules, with
its flag (``module._z3_leaf``), so a module marked by DeepSpeed's own ``set_z3_leaf_modules`` is one too.

Over several ranks every rank must gather the same params in the same order. A module whose inside
differs between ranks (a mixture-of-experts block running only the experts its tokens pick, a branch on
the rank) breaks that unless it is a leaf; `zswap.Engine.step` raises `zswap.errors.RanksDivergedError`
where it was not. The flags are read when an engine is built (`zswap.initialize`).
"""

from __future__ import annotations

import contextlib
import warnings
from collections.abc import Iterable
from typing import Any

from torch import nn

from ..errors import ZswapWarning
from ..parts.runners import runners_of

FLAG = "_z3_leaf"
"""The attribute marking a leaf module (DeepSpeed's name)."""


def is_leaf(module: nn.Module) -> bool:
    return bool(getattr(module, FLAG, False))


def leaves(model: nn.Module) -> list[nn.Module]:
    """The modules of ``model`` marked as leaves."""
    return [m for m in model.modules() if is_leaf(m)]


def mark(model: nn.Module, modules: Iterable[nn.Module], flag: bool = True) -> list[nn.Module]:
    """Mark ``modules`` (of ``model``) as leaves, or not; an open engine running ``model`` is wired again
    over the new marks (between steps: what it holds is released first), so they count from its next
    forward. Returns ``modules``."""
    out = list(modules)
    changed = [m for m in out if is_leaf(m) != flag]
    with contextlib.ExitStack() as stack:
        if changed:
            for engine in runners_of(model.parameters()):
                stack.enter_context(engine.rewired())
        for m in changed:
            setattr(m, FLAG, flag)
    return out


def by_class(model: nn.Module, classes: Iterable[type | str]) -> list[nn.Module]:
    """Modules of ``model`` that are instances of one of ``classes`` (types, or names: a class's own
    name or its fully qualified ``module.QualName``)."""
    wanted = list(classes)
    for c in wanted:
        if not isinstance(c, type | str):
            raise TypeError(f"leaf module classes must be classes or class names, got {type(c).__name__}")
    out = []
    for m in model.modules():
        cls = type(m)
        names = {cls.__name__, f"{cls.__module__}.{cls.__qualname__}"}
        if any(isinstance(m, c) if isinstance(c, type) else c in names for c in wanted):
            out.append(m)
    return out


def by_name(
    model: nn.Module, names: Iterable[str], suffix: bool = False
) -> tuple[list[nn.Module], list[str]]:
    """(modules of ``model`` named one of ``names`` in ``named_modules()`` — or whose name ends with one,
    ``suffix`` — each once; the names that matched none)."""
    named = dict(model.named_modules())
    found: dict[int, nn.Module] = {}
    missing = []
    for wanted in names:
        hits = [m for n, m in named.items() if (n.endswith(wanted) if suffix else n == wanted)]
        if not hits:
            missing.append(wanted)
        for m in hits:
            found.setdefault(id(m), m)
    return list(found.values()), missing


DEFAULT_CLASSES = (
    "transformers.models.mixtral.modeling_mixtral.MixtralSparseMoeBlock",
    "transformers.models.qwen2_moe.modeling_qwen2_moe.Qwen2MoeSparseMoeBlock",
    "transformers.models.qwen3_moe.modeling_qwen3_moe.Qwen3MoeSparseMoeBlock",
)
"""DeepSpeed's default leaf classes (``leaf_module_config.py``): mixture-of-experts blocks that run only
the experts their tokens pick."""


def from_config(model: nn.Module, cfg: Any, several_ranks: bool) -> None:
    """Mark what the config's ``zero_optimization.leaf_module`` (`zswap.config.LeafModuleConfig`) names,
    as an engine is first built. Its ``classes`` default to `DEFAULT_CLASSES` where the params span
    several ranks (on one rank nothing needs them, and gathering every expert at once costs memory).
    Entries given that match no module are named in a `ZswapWarning`."""
    classes = cfg.classes if cfg.classes is not None else (DEFAULT_CLASSES if several_ranks else ())
    found = by_class(model, classes)
    named, missing = by_name(model, cfg.names)
    suffixed, missing_suffixes = by_name(model, cfg.name_suffixes, suffix=True)
    unmatched = [*(c for c in (cfg.classes or ()) if not by_class(model, [c])), *missing, *missing_suffixes]
    if unmatched:
        warnings.warn(
            f"zero_optimization.leaf_module: {unmatched} match no module of the model",
            ZswapWarning,
            stacklevel=4,
        )
    for m in (*found, *named, *suffixed):
        setattr(m, FLAG, True)


def inside(root: nn.Module) -> dict[int, nn.Module]:
    """``id`` of each module inside a leaf module of ``root`` → that outermost leaf (whose params it
    uses are gathered by the leaf)."""
    out: dict[int, nn.Module] = {}

    def walk(m: nn.Module, leaf: nn.Module | None) -> None:
        for child in m.children():
            if id(child) in out:
                continue
            if leaf is not None:
                out[id(child)] = leaf
            walk(child, leaf if leaf is not None else (child if is_leaf(child) else None))

    walk(root, root if is_leaf(root) else None)
    return out
