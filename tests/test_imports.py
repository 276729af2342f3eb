"""Dependencies point one way: each package imports only itself and the layers below it (never a layer above, nor
another package of its own layer), no import cycle among gptopt's modules, lazy imports included, and nothing
imports the command line.

    pytest -q tests/test_imports.py
"""

from __future__ import annotations

import ast
from pathlib import Path

import gptopt

SRC = Path(gptopt.__file__).resolve().parent  # src/gptopt

# gptopt's layers, lowest first (docs/design.md says what each holds). A module may import modules of its own
# package and of the layers below; never of a layer above, nor of another package of its own layer: packages that
# share a layer are independent of each other. Where one package needs another, that one sits in a layer below it.
# The package root (gptopt/__init__: the version) is below them all.
LAYERS: tuple[tuple[str, ...], ...] = (
    ("utils",),  # plain helpers: the user's error, optional extras, log lines, paths, tables
    ("config",),  # options, presets and their checks
    ("outputs", "runtime"),  # how gptopt writes a user's disk; the device, its memory and torch's switches
    ("data",),  # tokenizers, corpora -> token shards, the loader
    ("models",),  # the model and its families, Hugging Face in and out, checkpoints, FLOPs
    ("infer",),  # loading for inference, the KV cache, the sampler, the Generator, CPU layouts, quantisation, ONNX
    ("train",),  # the step, optimizers, wrapping, the loop, resuming, its memory estimate
    ("bench",),  # the ladders: training and inference rungs measured side by side (bench's verb; tune runs rungs)
    ("commands", "serve"),  # the verbs: each uses the layers below, never another verb
    ("cli",),  # the command line
    ("__main__",),  # python -m gptopt
)


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


def _package(module: str) -> str:
    return module.split(".")[1] if "." in module else ""


def upward(graph: dict[str, dict[str, str]]) -> list[str]:
    """Every import of a module in a layer above the importer's, as 'importer -> imported  (file:line)'."""
    return sorted(f"{name} -> {target}  ({where})" for name, edges in graph.items() if layer(name) is not None
                  for target, where in edges.items() if layer(target) is not None and layer(target) > layer(name))


def sideways(graph: dict[str, dict[str, str]]) -> list[str]:
    """Every import of a module of another package in the importer's own layer (commands -> serve, say)."""
    return sorted(f"{name} -> {target}  ({where})" for name, edges in graph.items() if layer(name) is not None
                  for target, where in edges.items()
                  if layer(target) == layer(name) and _package(target) != _package(name))


def test_the_layers_name_every_package() -> None:
    unplaced = sorted({_package(m) for m in import_graph() if layer(m) is None})
    assert not unplaced, f"in no layer of tests/test_imports.py's LAYERS (place them): {', '.join(unplaced)}"


def test_no_module_imports_a_layer_above_its_own() -> None:
    found = upward(import_graph())
    assert not found, "imports that point up the layers (tests/test_imports.py's LAYERS):\n" + "\n".join(found)


def test_no_package_imports_another_of_its_own_layer() -> None:
    found = sideways(import_graph())
    assert not found, ("imports between packages of one layer (move what both need to a layer below, or place the "
                       "imported package in a layer below in tests/test_imports.py's LAYERS):\n" + "\n".join(found))


def _tree(tmp_path: Path, files: dict[str, str]) -> Path:
    pkg = tmp_path / "gptopt"
    for rel, text in {"__init__.py": "", **files}.items():
        (pkg / rel).parent.mkdir(parents=True, exist_ok=True)
        (pkg / rel).write_text(text)
    return pkg


def test_the_layer_check_sees_an_upward_import(tmp_path: Path) -> None:
    pkg = _tree(tmp_path, {
        "models/__init__.py": "", "train/__init__.py": "",
        "train/loop.py": "from gptopt.models import gpt\n",
        "models/gpt.py": "def f():\n    from gptopt.train import loop\n",  # lazy, and upward
    })
    graph = import_graph(pkg)
    assert upward(graph) == ["gptopt.models.gpt -> gptopt.train.loop  (gptopt/models/gpt.py:2)"]
    assert sideways(graph) == []


def test_the_layer_check_sees_an_import_of_a_package_beside_the_importer(tmp_path: Path) -> None:
    pkg = _tree(tmp_path, {
        "commands/__init__.py": "", "serve/__init__.py": "", "bench/__init__.py": "",
        "commands/export.py": "from gptopt.bench import ladder\n",  # down a layer: allowed
        "commands/tune.py": "def f():\n    from gptopt.serve.engine import Engine\n",  # lazy, and beside
        "serve/engine.py": "from gptopt.commands import export\n",  # beside, the other way
        "bench/ladder.py": "",
    })
    graph = import_graph(pkg)
    assert sideways(graph) == ["gptopt.commands.tune -> gptopt.serve.engine  (gptopt/commands/tune.py:2)",
                               "gptopt.serve.engine -> gptopt.commands.export  (gptopt/serve/engine.py:1)"]
    assert upward(graph) == []
