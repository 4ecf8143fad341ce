"""Architecture metrics for reviews: the largest files, the longest functions, and the import
edges between radixserve's subpackages (an AST scan, nothing is imported).

    python tools/arch_metrics.py [REPO_ROOT]
"""

from __future__ import annotations

import ast
import collections
import pathlib
import sys


def main(root: pathlib.Path) -> None:
    files = [p for d in ("radixserve", "bench", "examples") for p in sorted((root / d).rglob("*.py"))]
    sizes = sorted(((len(p.read_text().splitlines()), str(p.relative_to(root))) for p in files), reverse=True)
    print("== largest files (lines)")
    for n, name in sizes[:10]:
        print(f"{n:6d} {name}")

    exports = _package_exports(root / "radixserve" / "__init__.py")
    funcs: list[tuple[int, str]] = []
    edges: collections.Counter[tuple[str, str]] = collections.Counter()
    for p in files:
        rel = p.relative_to(root)
        tree = ast.parse(p.read_text())
        for node in ast.walk(tree):
            if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
                funcs.append((node.end_lineno - node.lineno + 1, f"{rel}:{node.lineno} {node.name}"))
        if rel.parts[0] == "radixserve":
            src = rel.parts[1] if len(rel.parts) > 2 else rel.parts[1].removesuffix(".py")
            for dst in _imported_subpackages(tree, rel.parts, exports, root):
                if dst != src:
                    edges[(src, dst)] += 1

    funcs.sort(reverse=True)
    print("== longest functions (lines)")
    for n, name in funcs[:12]:
        print(f"{n:6d} {name}")
    print("== functions over 60 lines:", sum(1 for n, _ in funcs if n > 60), "of", len(funcs))
    print("== import edges between radixserve subpackages (count of import statements)")
    for (a, b), n in sorted(edges.items()):
        print(f"  {a} -> {b}: {n}")


def _package_exports(init: pathlib.Path) -> dict[str, str]:
    """Names ``radixserve/__init__.py`` re-exports -> the subpackage they come from (its lazy
    ``_LAZY`` table included)."""
    out: dict[str, str] = {}
    for node in ast.walk(ast.parse(init.read_text())):
        if isinstance(node, ast.ImportFrom) and node.module and node.module.startswith("radixserve."):
            for alias in node.names:
                out[alias.asname or alias.name] = node.module.split(".")[1]
        if isinstance(node, ast.Dict):
            for k, v in zip(node.keys, node.values):
                if isinstance(k, ast.Constant) and isinstance(v, ast.Constant) and str(v.value).startswith("radixserve."):
                    out[str(k.value)] = str(v.value).split(".")[1]
    return out


def _imported_subpackages(tree: ast.AST, parts: tuple[str, ...], exports: dict[str, str], root: pathlib.Path):
    for node in ast.walk(tree):
        modules: list[str] = []
        if isinstance(node, ast.Import):
            modules = [a.name for a in node.names]
        elif isinstance(node, ast.ImportFrom):
            if node.level:
                base = list(parts[:-1])[: len(parts) - node.level]
                modules = [".".join(base + ([node.module] if node.module else []))]
            elif node.module == "radixserve":  # from radixserve import X
                modules = [f"radixserve.{_home(a.name, exports, root)}" for a in node.names]
            else:
                modules = [node.module or ""]
        for m in modules:
            mp = m.split(".")
            if mp[0] == "radixserve" and len(mp) >= 2 and mp[1]:
                yield mp[1]


def _home(name: str, exports: dict[str, str], root: pathlib.Path) -> str:
    """The subpackage a ``from radixserve import name`` reaches ('' for a plain attribute)."""
    if name in exports:
        return exports[name]
    pkg = root / "radixserve"
    return name if (pkg / name).is_dir() or (pkg / f"{name}.py").is_file() else ""


if __name__ == "__main__":
    main(pathlib.Path(sys.argv[1] if len(sys.argv) > 1 else "."))
