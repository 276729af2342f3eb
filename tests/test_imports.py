"""Dependencies point one way: no import cycle among gptopt's modules, lazy imports included.

    pytest -q tests/test_imports.py
"""

from __future__ import annotations

import ast
from pathlib import Path

import gptopt

SRC = Path(gptopt.__file__).resolve().parent  # src/gptopt


def _module_name(path: Path, src: Path) -> str:
    parts = ("gptopt", *path.relative_to(src).with_suffix("").parts)
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def _runtime_nodes(tree: ast.AST) -> list[ast.AST]:
    """Every node that can run, at any depth (function bodies too), except `if TYPE_CHECKING:` blocks:
    those never execute, so they close no circle at import time."""
    nodes, todo = [], [tree]
    while todo:
        node = todo.pop()
        nodes.append(node)
        if isinstance(node, ast.If) and "TYPE_CHECKING" in ast.unparse(node.test):
            todo.extend(node.orelse)
            continue
        todo.extend(ast.iter_child_nodes(node))
    return nodes


def import_graph(src: Path = SRC) -> dict[str, dict[str, str]]:
    """module -> {imported gptopt module: 'file:line' of the first such import}.

    `from gptopt.a import b` imports the submodule gptopt.a.b where one exists, else gptopt.a; a package
    stands for its __init__; relative imports resolve against the importing module's package."""
    files = {_module_name(p, src): p for p in sorted(src.rglob("*.py"))}
    graph: dict[str, dict[str, str]] = {}
    for name, path in files.items():
        package = name if path.name == "__init__.py" else name.rpartition(".")[0]
        edges: dict[str, str] = {}
        for node in _runtime_nodes(ast.parse(path.read_text(encoding="utf-8"), str(path))):
            targets: list[str] = []
            if isinstance(node, ast.Import):
                targets = [a.name for a in node.names]
            elif isinstance(node, ast.ImportFrom):
                if node.level:
                    base = ".".join(package.split(".")[: len(package.split(".")) - node.level + 1])
                    base = f"{base}.{node.module}" if node.module else base
                else:
                    base = node.module or ""
                targets = [f"{base}.{a.name}" if f"{base}.{a.name}" in files else base for a in node.names]
            for target in targets:
                if target in files and target != name:
                    edges.setdefault(target, f"{path.relative_to(src.parent)}:{node.lineno}")
        graph[name] = edges
    return graph


def cycles(graph: dict[str, dict[str, str]]) -> list[list[str]]:
    """The strongly connected components of more than one module (Tarjan), each sorted."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    found: list[list[str]] = []

    def visit(v: str) -> None:
        index[v] = low[v] = len(index)
        stack.append(v)
        for w in graph[v]:
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in stack:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            component = []
            while True:
                w = stack.pop()
                component.append(w)
                if w == v:
                    break
            if len(component) > 1:
                found.append(sorted(component))

    for v in sorted(graph):
        if v not in index:
            visit(v)
    return sorted(found)


def test_the_graph_resolves_every_import_form(tmp_path: Path) -> None:
    pkg = tmp_path / "gptopt"
    (pkg / "sub").mkdir(parents=True)
    files = {
        "__init__.py": "",
        "a.py": "from gptopt import b\nfrom gptopt.sub import c\n",
        "b.py": "def f():\n    from . import sub\n",  # lazy, relative, a package: its __init__
        "sub/__init__.py": "from .c import g\n",
        "sub/c.py": "from typing import TYPE_CHECKING\nif TYPE_CHECKING:\n    from gptopt import a\n"
                    "from ..b import f\nimport gptopt.a\n",
    }
    for rel, text in files.items():
        (pkg / rel).write_text(text)
    graph = import_graph(pkg)
    assert set(graph["gptopt.a"]) == {"gptopt.b", "gptopt.sub.c"}
    assert set(graph["gptopt.b"]) == {"gptopt.sub"}
    assert set(graph["gptopt.sub"]) == {"gptopt.sub.c"}
    assert set(graph["gptopt.sub.c"]) == {"gptopt.b", "gptopt.a"}
    assert graph["gptopt.sub.c"]["gptopt.a"] == "gptopt/sub/c.py:5"  # the TYPE_CHECKING import is not it
    assert cycles(graph) == [["gptopt.a", "gptopt.b", "gptopt.sub", "gptopt.sub.c"]]


def test_no_import_cycles() -> None:
    graph = import_graph()
    found = cycles(graph)
    lines = []
    for component in found:
        lines.append(" <-> ".join(component))
        lines += [f"    {a} -> {b}  ({graph[a][b]})" for a in component for b in component if b in graph[a]]
    assert not found, "import cycles (each with the imports that close it):\n" + "\n".join(lines)


def test_nothing_below_the_command_line_imports_it() -> None:
    # Dependencies point one way, cli -> commands -> library: only `python -m gptopt` starts from the CLI.
    graph = import_graph()
    importers = sorted(f"{name} ({edges['gptopt.cli']})" for name, edges in graph.items()
                       if "gptopt.cli" in edges and name != "gptopt.__main__")
    assert not importers, "gptopt.cli imported by: " + ", ".join(importers)
