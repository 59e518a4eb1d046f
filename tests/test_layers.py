"""The package's layering, checked on its source: no import cycles and no upward imports.

Layers, lowest first (docs/architecture.md)::

    _version < ir < rules < passes < numerics < options < report < export < stages < api < inplace < partition < lightning < cli

``vocab`` (the names of every choice, and the one precision normaliser) is part of ``ir``.
``train`` stands beside the stack: it may import ``converter.ir`` (and ``converter.vocab``) and nothing else from the package, so the
training wrapper never drags in the converter. ``fp8`` (the FP8 kernels) and ``kernels`` (the
upcast GEMMs) stand beside it too and import nothing of the package at all: model.py carries their source verbatim. ``converter/__init__.py`` and ``__main__`` sit on top.
Every import counts, also those inside functions: a lazy import is still a dependency.
"""
from __future__ import annotations

import ast
from pathlib import Path

import networkx as nx

PACKAGE = Path(__file__).resolve().parent.parent / "converter"
LAYERS = ["_version", "ir", "rules", "passes", "numerics", "options", "report", "export", "stages", "api", "inplace", "serving", "partition",
          "lightning", "cli"]
RANK = {name: i for i, name in enumerate(LAYERS)}
#: ``converter/vocab.py``, the vocabulary of choices and the one precision normaliser, belongs to the ir layer
#: (torch-free; it imports only ``converter.ir.errors``, and ``converter.ir.meta`` reads it)
RANK["vocab"] = RANK["ir"]
#: torch-only kernel packages that model.py carries verbatim: they import nothing of the package
STANDALONE = ("fp8", "kernels")


def _module_name(path: Path) -> str:
    parts = list(path.relative_to(PACKAGE.parent).with_suffix("").parts)
    if parts[-1] == "__init__":
        parts.pop()
    return ".".join(parts)


def _imports(path: Path, module: str) -> set[str]:
    tree = ast.parse(path.read_text(encoding="utf-8"), filename=str(path))
    package = module if path.name == "__init__.py" else module.rpartition(".")[0]
    found = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            found.update(a.name for a in node.names if a.name.split(".")[0] == "converter")
        elif isinstance(node, ast.ImportFrom):
            if node.level:
                base = package.split(".")
                base = base[: len(base) - (node.level - 1)]
                target = ".".join(base + ([node.module] if node.module else []))
            else:
                target = node.module or ""
            if target.split(".")[0] != "converter":
                continue
            for alias in node.names:  # `from converter.x import y` may name a submodule y
                sub = f"{target}.{alias.name}"
                found.add(sub if _exists(sub) else target)
    return found


def _exists(module: str) -> bool:
    rel = Path(*module.split("."))
    return (PACKAGE.parent / rel.with_suffix(".py")).is_file() or (PACKAGE.parent / rel / "__init__.py").is_file()


def _graph() -> nx.DiGraph:
    graph = nx.DiGraph()
    for path in sorted(PACKAGE.rglob("*.py")):
        module = _module_name(path)
        graph.add_node(module)
        for target in _imports(path, module):
            if target != module:
                graph.add_edge(module, target)
    return graph


def _layer(module: str) -> str | None:
    parts = module.split(".")
    return parts[1] if len(parts) > 1 and parts[1] not in ("__main__",) else None


def test_the_import_graph_is_found():
    graph = _graph()
    assert {"converter.ir.meta", "converter.api", "converter.cli.main"} <= set(graph), sorted(graph)
    assert graph.number_of_edges() > 40, graph.number_of_edges()


def test_no_import_cycles():
    # Package __init__ files that only re-export their own children are not cycles of substance, but they are
    # counted too: a subpackage's __init__ must not import a module that imports the subpackage back.
    cycles = sorted(sorted(c) for c in nx.simple_cycles(_graph()))
    assert not cycles, f"{len(cycles)} import cycle(s): {cycles[:10]}"


def test_no_upward_imports():
    upward = []
    for src, dst in _graph().edges:
        a, b = _layer(src), _layer(dst)
        if a is None or b is None:  # converter/__init__ and __main__ sit on top; importing `converter` itself is upward
            if b is None and a is not None:
                upward.append(f"{src} -> {dst}")
            continue
        if a in STANDALONE:
            upward.append(f"{src} -> {dst} ({a}/ imports nothing of the package: model.py carries it)")
            continue
        if a == "train":
            if b not in ("train", "ir", "vocab", "_version"):
                upward.append(f"{src} -> {dst} (train/ may import only converter.ir and converter.vocab)")
            continue
        if b == "train" or b in STANDALONE:
            continue  # anyone may use the training wrapper's public pieces
        if RANK[b] > RANK[a]:
            upward.append(f"{src} ({a}) -> {dst} ({b})")
    assert not upward, "upward imports:\n" + "\n".join(sorted(upward))
