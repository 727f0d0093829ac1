"""Old import paths of modules that moved into the layer packages, kept working.

`MOVED` maps each old dotted path to the module's home. A finder placed first on ``sys.meta_path``
answers an import of an old path (or of anything under an old package path, ``zswap.optim._store``) with
the very module object of its home, so ``import zswap.storage`` and ``zswap.store.storage`` are one
object: a ``monkeypatch.setattr(zswap.storage, ...)`` patches the code that runs, and nothing is loaded
twice. ``zswap.<old name>`` as an attribute works too (`zswap.__getattr__`). New code imports the homes;
this table only grows when a module moves, and an entry can go once nothing outside uses its old path.
"""

from __future__ import annotations

import importlib
import importlib.abc
import importlib.machinery
import sys
from types import ModuleType
from typing import Any

MOVED = {
    "zswap.storage": "zswap.store.storage",
    "zswap.params": "zswap.parts.params",
    "zswap.gather": "zswap.parts.gather",
    "zswap._access": "zswap.parts._access",
    "zswap._trace": "zswap.fetch._trace",
    "zswap._between": "zswap.fetch.nextpass",
    "zswap.prefetch": "zswap.fetch.prefetch",
    "zswap.hooks": "zswap.fetch.hooks",
    "zswap.outputs": "zswap.fetch.outputs",
    "zswap.buffers": "zswap.fetch.buffers",
    "zswap.gradstore": "zswap.gradients.gradstore",
    "zswap.grads": "zswap.gradients.grads",
    "zswap.optim": "zswap.step.optim",
    "zswap.earlystep": "zswap.step.earlystep",
    "zswap.stepping": "zswap.step.stepping",
    "zswap.loss_scale": "zswap.step.loss_scale",
    "zswap.schedules": "zswap.step.schedules",
    "zswap.weights": "zswap.io.weights",
    "zswap._hfconv": "zswap.io._hfconv",
    "zswap.init": "zswap.build.init",
    "zswap.module_api": "zswap.build.module_api",
    "zswap._hf": "zswap.build._hf",
    "zswap.runtime": "zswap.train.runtime",
}


def home(name: str) -> str | None:
    """Where the module once imported as ``name`` lives now (``None``: it did not move)."""
    head = name
    while head:
        if head in MOVED:
            return MOVED[head] + name[len(head) :]
        head = head.rpartition(".")[0]
    return None


class _Alias(importlib.abc.Loader):
    def __init__(self, target: str) -> None:
        self.target = target
        self.spec: importlib.machinery.ModuleSpec | None = None

    def create_module(self, spec: importlib.machinery.ModuleSpec) -> ModuleType:
        module = importlib.import_module(self.target)
        self.spec = module.__spec__
        return module

    def exec_module(self, module: ModuleType) -> None:
        module.__spec__ = self.spec  # the import system set the old name's spec: the home's stays


class _Finder(importlib.abc.MetaPathFinder):
    def find_spec(self, fullname: str, path: Any = None, target: Any = None) -> Any:
        new = home(fullname)
        if new is None:
            return None
        return importlib.machinery.ModuleSpec(fullname, _Alias(new))


def install() -> None:
    if not any(isinstance(f, _Finder) for f in sys.meta_path):
        sys.meta_path.insert(0, _Finder())


install()  # on import: `zswap/__init__` imports this module


def attribute(name: str) -> ModuleType:
    """``zswap.<name>`` for a moved module (`zswap.__getattr__`)."""
    if f"zswap.{name}" not in MOVED:
        raise AttributeError(f"module 'zswap' has no attribute {name!r}")
    return importlib.import_module(f"zswap.{name}")
