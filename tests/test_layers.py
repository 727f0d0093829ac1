"""The import structure of python/zswap: no circle among runtime imports, no import up a layer (the
layers of pyproject's import-linter contract), no module over 600 lines. The checker is
tools/import_graph.py; the first tests show it catches each fault on a small made-up package."""

from __future__ import annotations

import importlib.util
import sys
from pathlib import Path

import pytest

from zswap import _moved

ROOT = Path(__file__).resolve().parents[1]
_spec = importlib.util.spec_from_file_location("_zswap_import_graph", ROOT / "tools" / "import_graph.py")
assert _spec is not None and _spec.loader is not None
graph = importlib.util.module_from_spec(_spec)
sys.modules[_spec.name] = graph
_spec.loader.exec_module(graph)

MAX_LINES = 600
UNLAYERED = ("zswap", "zswap._moved", "zswap._zswap")  # the face, old paths, the compiled extension


def _package(tmp_path: Path, files: dict[str, str]) -> Path:
    root = tmp_path / "pkg"
    for name, text in {"__init__.py": "", **files}.items():
        path = root / name
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(text)
    return root


def test_the_checker_sees_a_circle_through_a_function_level_import(tmp_path):
    root = _package(
        tmp_path,
        {
            "low.py": "def f():\n    from .high import g\n",
            "high.py": "from . import low\n",
            "typed.py": "from typing import TYPE_CHECKING\nif TYPE_CHECKING:\n    from .high import g\n",
            "side.py": "from .typed import x\n",
        },
    )
    edges = graph.graph(root)
    assert graph.cycles(edges) == [["pkg.high", "pkg.low"]]
    assert edges["pkg.typed"] == set()  # an import for annotations only does not run


def test_the_checker_sees_an_import_going_up_a_layer(tmp_path):
    root = _package(
        tmp_path,
        {
            "top/__init__.py": "",
            "top/a.py": "",
            "bottom/__init__.py": "",
            "bottom/b.py": "from ..top import a\n",
        },
    )
    layers = [["pkg.top"], ["pkg.bottom"]]
    assert graph.upward(graph.graph(root), layers) == [("pkg.bottom.b", "pkg.top.a")]
    assert graph.upward(graph.graph(root), [["pkg.top", "pkg.bottom"]]) == []  # siblings


def test_no_import_circle():
    assert graph.cycles(graph.graph()) == []


def test_every_layered_module_is_in_a_layer_and_imports_only_downward():
    layers = graph.contract()
    edges = graph.graph()
    unplaced = [m for m in edges if graph.layer_of(m, layers) is None and m not in UNLAYERED]
    assert unplaced == [], "add these modules to a layer of [tool.importlinter] in pyproject.toml"
    assert graph.upward(edges, layers) == []


@pytest.mark.parametrize(("old", "new"), sorted(_moved.MOVED.items()))
def test_an_old_import_path_is_the_moved_module_itself(old, new):
    import importlib

    assert importlib.import_module(old) is importlib.import_module(new)


def test_no_module_over_600_lines():
    over = [(n, name) for n, name in graph.sizes() if n > MAX_LINES]
    assert over == [], "split these modules along their jobs (docs/architecture.md)"


def test_the_size_check_counts_lines(tmp_path):
    root = _package(tmp_path, {"big.py": "x = 1\n" * (MAX_LINES + 1), "small.py": "x = 1\n"})
    assert graph.sizes(root)[0] == (MAX_LINES + 1, "pkg.big")
