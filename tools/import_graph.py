"""The runtime import graph of python/zswap: import circles, layer order and module sizes.

Reads the source with `ast` (nothing is imported). An import counts when it runs: module-level and
function-level imports both count; imports under `if TYPE_CHECKING:` do not. `zswap.x.y` imported
from a package counts as an edge to the module it names (a sub-module when one exists, else the
package). Used by tests/test_layers.py and runnable by hand:

    python tools/import_graph.py    # circles, imports going up pyproject's layers, the largest modules
"""

from __future__ import annotations

import ast
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent / "python" / "zswap"


def modules(root: Path = ROOT) -> dict[str, Path]:
    out: dict[str, Path] = {}
    for path in sorted(root.rglob("*.py")):
        rel = path.relative_to(root.parent).with_suffix("")
        parts = list(rel.parts)
        if parts[-1] == "__init__":
            parts.pop()
        out[".".join(parts)] = path
    for path in sorted(root.rglob("*.pyi")):  # compiled extensions: leaves of the graph
        name = ".".join(path.relative_to(root.parent).with_suffix("").parts)
        out.setdefault(name, path)
    return out


def _type_checking(test: ast.expr) -> bool:
    return (isinstance(test, ast.Name) and test.id == "TYPE_CHECKING") or (
        isinstance(test, ast.Attribute) and test.attr == "TYPE_CHECKING"
    )


def _imports(tree: ast.AST, name: str, is_pkg: bool) -> list[tuple[str, list[str]]]:
    """(module, names imported from it) for every runtime import in `tree`."""
    found: list[tuple[str, list[str]]] = []

    def visit(node: ast.AST) -> None:
        for child in ast.iter_child_nodes(node):
            if isinstance(child, ast.If) and _type_checking(child.test):
                for sub in child.orelse:
                    visit_one(sub)
                continue
            visit_one(child)

    def visit_one(node: ast.AST) -> None:
        if isinstance(node, ast.Import):
            for alias in node.names:
                found.append((alias.name, []))
        elif isinstance(node, ast.ImportFrom):
            if node.level:
                base = name.split(".") if is_pkg else name.split(".")[:-1]
                base = base[: len(base) - (node.level - 1)]
                mod = ".".join(base + ([node.module] if node.module else []))
            else:
                mod = node.module or ""
            found.append((mod, [a.name for a in node.names]))
        visit(node)

    visit(tree)
    return found


def graph(root: Path = ROOT) -> dict[str, set[str]]:
    mods = modules(root)
    edges: dict[str, set[str]] = {m: set() for m in mods}
    for name, path in mods.items():
        if path.suffix == ".pyi":
            continue
        tree = ast.parse(path.read_text(), str(path))
        is_pkg = path.name == "__init__.py"
        for mod, names in _imports(tree, name, is_pkg):
            targets = []
            for n in names:
                if f"{mod}.{n}" in mods:
                    targets.append(f"{mod}.{n}")
            if not targets or len(targets) < len(names) or not names:
                # the module itself (or the nearest enclosing known module) is imported
                m = mod
                while m and m not in mods:
                    m = m.rpartition(".")[0]
                if m:
                    targets.append(m)
            for t in targets:
                if t != name:
                    edges[name].add(t)
    return edges


def cycles(edges: dict[str, set[str]]) -> list[list[str]]:
    """Strongly connected components with more than one module (Tarjan), each sorted."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on: set[str] = set()
    out: list[list[str]] = []
    counter = [0]
    sys.setrecursionlimit(10000)

    def strong(v: str) -> None:
        index[v] = low[v] = counter[0]
        counter[0] += 1
        stack.append(v)
        on.add(v)
        for w in edges.get(v, ()):
            if w not in index:
                strong(w)
                low[v] = min(low[v], low[w])
            elif w in on:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            comp = []
            while True:
                w = stack.pop()
                on.discard(w)
                comp.append(w)
                if w == v:
                    break
            if len(comp) > 1:
                out.append(sorted(comp))

    for v in sorted(edges):
        if v not in index:
            strong(v)
    return out


def layer_of(name: str, layers: list[list[str]]) -> int | None:
    """Index of the layer (0: top) that ``name`` belongs to, or ``None`` if none lists it."""
    for i, layer in enumerate(layers):
        if any(name == m or name.startswith(m + ".") for m in layer):
            return i
    return None


def upward(
    edges: dict[str, set[str]], layers: list[list[str]], ignore: set[tuple[str, str]] = frozenset()
) -> list[tuple[str, str]]:
    """Imports from a module to one in a higher layer (``layers`` top first, as pyproject lists them)."""
    out = []
    for src in sorted(edges):
        i = layer_of(src, layers)
        for dst in sorted(edges[src]):
            j = layer_of(dst, layers)
            if i is not None and j is not None and j < i and (src, dst) not in ignore:
                out.append((src, dst))
    return out


def contract(pyproject: Path = ROOT.parent.parent / "pyproject.toml") -> list[list[str]]:
    """The layers of pyproject's import-linter contract, top first, each a list of sibling modules."""
    try:
        import tomllib
    except ModuleNotFoundError:  # Python 3.10: pytest depends on tomli there
        import tomli as tomllib  # type: ignore[no-redef]
    conf = tomllib.loads(pyproject.read_text())["tool"]["importlinter"]["contracts"][0]
    return [[m.strip() for m in entry.replace("|", ":").split(":")] for entry in conf["layers"]]


def sizes(root: Path = ROOT) -> list[tuple[int, str]]:
    found = ((len(p.read_text().splitlines()), n) for n, p in modules(root).items() if p.suffix == ".py")
    return sorted(found, reverse=True)


def main() -> int:
    edges = graph()
    found = cycles(edges)
    print(f"{len(edges)} modules, {sum(map(len, edges.values()))} internal runtime imports")
    print(f"{len(found)} import circle(s)")
    for comp in found:
        print(f"  {len(comp)}: {' '.join(comp)}")
    wrong = upward(edges, contract())
    print(f"{len(wrong)} upward import(s)")
    for src, dst in wrong:
        print(f"  {src} -> {dst}")
    print("largest modules:")
    for n, name in sizes()[:8]:
        print(f"  {n:5d} {name}")
    return 1 if found or wrong else 0


if __name__ == "__main__":
    raise SystemExit(main())
