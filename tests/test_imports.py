"""Dependencies point one way: each package imports only its own layer and the layers below it, no import cycle
among gptopt's modules, lazy imports included, and nothing imports the command line.

    pytest -q tests/test_imports.py
"""

from __future__ import annotations

import ast
from pathlib import Path

import gptopt

SRC = Path(gptopt.__file__).resolve().parent  # src/gptopt

# gptopt's layers, lowest first (docs/design.md says what each holds). A module may import modules of its own
# layer and of the layers below; never of a layer above. The package root (gptopt/__init__: the version) is
# below them all.
LAYERS: tuple[tuple[str, ...], ...] = (
    ("config", "utils"),  # options, presets and their checks; plain helpers (extras, logs, tables)
    ("outputs", "runtime"),  # how gptopt writes a user's disk; the device, its memory and torch's switches
    ("data",),  # tokenizers, corpora -> token shards, the loader
    ("models",),  # the model and its families, Hugging Face in and out, checkpoints, FLOPs
    ("infer",),  # loading for inference, the KV cache, the sampler, the Generator, CPU layouts, quantisation
    ("train",),  # the step, optimizers, wrapping, the loop, resuming, its memory plan
    ("commands", "bench", "serve"),  # the verbs: each uses the layers below, another verb's public functions only
    ("cli", "__main__"),  # the command line
)
# The old import paths kept for users' code (re-exports): nothing of gptopt's imports them.
OLD_PATHS = ("model", "hf", "checkpoint", "export")


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


def layer(module: str) -> int | None:
    """The index in LAYERS of a module's top-level package (or module); -1 for the package root; None if none."""
    top = module.split(".")[1] if "." in module else None
    if top is None:
        return -1
    return next((i for i, names in enumerate(LAYERS) if top in names), None)


def test_the_layers_name_every_package_and_the_old_paths_only_re_export() -> None:
    graph = import_graph()
    old = {f"gptopt.{name}" for name in OLD_PATHS}
    unplaced = sorted({m.split(".")[1] for m in graph if m not in old and layer(m) is None})
    assert not unplaced, f"in no layer of tests/test_imports.py's LAYERS (place them): {', '.join(unplaced)}"
    importers = sorted(f"{name} -> {target} ({where})" for name, edges in graph.items()
                       for target, where in edges.items() if target in old)
    assert not importers, "gptopt's own modules import an old path (import its new home):\n" + "\n".join(importers)


def test_no_module_imports_a_layer_above_its_own() -> None:
    graph = import_graph()
    upward = sorted(f"{name} -> {target}  ({where})" for name, edges in graph.items() if layer(name) is not None
                    for target, where in edges.items() if (layer(target) or -1) > layer(name))
    assert not upward, "imports that point up the layers (tests/test_imports.py's LAYERS):\n" + "\n".join(upward)


def test_the_layer_check_sees_an_upward_import(tmp_path: Path) -> None:
    pkg = tmp_path / "gptopt"
    for d in ("models", "train"):
        (pkg / d).mkdir(parents=True)
        (pkg / d / "__init__.py").write_text("")
    (pkg / "__init__.py").write_text("")
    (pkg / "train" / "loop.py").write_text("from gptopt.models import gpt\n")
    (pkg / "models" / "gpt.py").write_text("def f():\n    from gptopt.train import loop\n")  # lazy, and upward
    graph = import_graph(pkg)
    up = [(a, b) for a, edges in graph.items() for b in edges
          if layer(a) is not None and layer(b) is not None and layer(b) > layer(a)]
    assert up == [("gptopt.models.gpt", "gptopt.train.loop")]
