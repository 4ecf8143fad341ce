"""The code's shape, checked: no import circles, no oversized modules.

The import graph counts every import, at module level or inside a function (a lazy import that
closes a circle is still a circle: each module needs the other to make sense), except those under
``if TYPE_CHECKING:``, which never run.
"""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
PACKAGES = ("radixserve", "bench")
MAX_LINES = 450


def _module_name(path: Path) -> str:
    parts = path.relative_to(ROOT).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def _modules() -> dict[str, Path]:
    return {_module_name(p): p for pkg in PACKAGES for p in sorted((ROOT / pkg).rglob("*.py"))}


def _is_type_checking(node: ast.If) -> bool:
    test = node.test
    return (isinstance(test, ast.Name) and test.id == "TYPE_CHECKING") or (isinstance(test, ast.Attribute) and test.attr == "TYPE_CHECKING")


def _imports(path: Path, name: str, known: set[str]) -> set[str]:
    """Project modules that ``path`` imports (``from pkg import mod`` counts as ``pkg.mod``)."""
    is_package = path.name == "__init__.py"
    found: set[str] = set()

    def resolve(target: str) -> str | None:
        while target and target not in known:  # `from a.b import func`: the module is a.b
            target = target.rpartition(".")[0]
        return target or None

    def visit(node: ast.AST) -> None:
        if isinstance(node, ast.If) and _is_type_checking(node):
            for child in node.orelse:
                visit(child)
            return
        if isinstance(node, ast.Import):
            for alias in node.names:
                if (mod := resolve(alias.name)) is not None:
                    found.add(mod)
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                anchor = name.split(".") if is_package else name.split(".")[:-1]
                anchor = anchor[: len(anchor) - (node.level - 1)]
                base = ".".join(anchor + ([base] if base else []))
            for alias in node.names:
                if (mod := resolve(f"{base}.{alias.name}" if base else alias.name)) is not None:
                    found.add(mod)
        for child in ast.iter_child_nodes(node):
            visit(child)

    visit(ast.parse(path.read_text(), str(path)))
    found.discard(name)
    return found


def _graph() -> dict[str, set[str]]:
    modules = _modules()
    known = set(modules)
    graph = {}
    for name, path in modules.items():
        deps = _imports(path, name, known)
        # A package's own __init__ importing its submodules (re-exports) and a submodule importing
        # its package's __init__ are not circles of meaning; leave the parent-child edges out.
        graph[name] = {d for d in deps if not d.startswith(name + ".") and not name.startswith(d + ".")}
    return graph


def _cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """Strongly connected components with more than one module (Tarjan)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    out: list[list[str]] = []
    counter = [0]

    def strong(v: str) -> None:
        index[v] = low[v] = counter[0]
        counter[0] += 1
        stack.append(v)
        on_stack.add(v)
        for w in sorted(graph.get(v, ())):
            if w not in index:
                strong(w)
                low[v] = min(low[v], low[w])
            elif w in on_stack:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            comp = []
            while True:
                w = stack.pop()
                on_stack.discard(w)
                comp.append(w)
                if w == v:
                    break
            if len(comp) > 1:
                out.append(sorted(comp))

    for v in sorted(graph):
        if v not in index:
            strong(v)
    return out


def test_the_import_graph_sees_lazy_imports_and_circles():
    """The checker itself: a lazy import closing a circle is found; TYPE_CHECKING is not counted."""
    graph = {"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}
    assert _cycles(graph) == [["a", "b", "c"]]
    src = ROOT / "radixserve" / "engine" / "scheduler.py"
    assert "radixserve.kv.radix" in _imports(src, "radixserve.engine.scheduler", set(_modules()))


def test_no_import_circles():
    cycles = _cycles(_graph())
    assert not cycles, "import circles (each set imports itself through the others): " + "; ".join(" <-> ".join(c) for c in cycles)


@pytest.mark.parametrize("package", ["radixserve"])
def test_no_module_over_the_line_limit(package):
    too_long = {str(p.relative_to(ROOT)): n for p in sorted((ROOT / package).rglob("*.py")) if (n := len(p.read_text().splitlines())) > MAX_LINES}
    assert not too_long, f"modules over {MAX_LINES} lines (split them along a seam): {too_long}"
