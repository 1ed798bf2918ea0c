"""The house rules of rft's imports, counted with every import (top level or inside a function):
no import circles, and the layers hold (LAYERS below, the order docs/reference/architecture.md
describes): a module imports only its own layer and the layers below it.

A small AST walk rather than a dependency: an import is an edge to the module it names (or to
the package, for a name that is not a submodule); a package's `__init__` counts only when code
outside that package imports it.
"""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

RFT = Path(__file__).resolve().parents[2] / "rft"


def modules(root: Path) -> dict[str, Path]:
    """Dotted module name -> file, for every .py under `root` (a package directory)."""
    found = {}
    for path in sorted(root.rglob("*.py")):
        parts = list(path.relative_to(root.parent).with_suffix("").parts)
        if parts[-1] == "__init__":
            parts.pop()
        found[".".join(parts)] = path
    return found


def imported_names(module: str, path: Path, is_package: bool) -> list[str]:
    """Every name an import statement in `path` imports ("pkg.mod" or "pkg.mod.attr"), relative
    imports resolved."""
    package = module if is_package else module.rpartition(".")[0]
    names = []
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Import):
            names += [alias.name for alias in node.names]
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                anchor = package.split(".")[: len(package.split(".")) - node.level + 1]
                base = ".".join(anchor + ([base] if base else []))
            names += [f"{base}.{alias.name}" for alias in node.names]
    return names


def import_graph(root: Path) -> dict[str, set[str]]:
    """module -> the modules of `root` its imports run: the module named (or the package defining
    the name imported) and every package above it that the importer is not inside."""
    known = modules(root)

    def owner(name: str) -> str | None:  # "rft.config.RFTConfig" -> "rft.config"
        while name and name not in known:
            name = name.rpartition(".")[0]
        return name or None

    graph: dict[str, set[str]] = {}
    for module, path in known.items():
        edges = set()
        for name in imported_names(module, path, path.name == "__init__.py"):
            target = owner(name)
            while target:
                if target != module and not module.startswith(target + "."):
                    edges.add(target)
                target = owner(target.rpartition(".")[0])
        graph[module] = edges
    return graph


def circles(graph: dict[str, set[str]]) -> list[list[str]]:
    """The strongly connected components with more than one module (Tarjan), each sorted."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    found: list[list[str]] = []

    def visit(v: str) -> None:
        index[v] = low[v] = len(index)
        stack.append(v)
        on_stack.add(v)
        for w in sorted(graph[v]):
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on_stack:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            component = []
            while True:
                w = stack.pop()
                on_stack.discard(w)
                component.append(w)
                if w == v:
                    break
            if len(component) > 1:
                found.append(sorted(component))

    for v in sorted(graph):
        if v not in index:
            visit(v)
    return found


@pytest.fixture(scope="module")
def graph() -> dict[str, set[str]]:
    return import_graph(RFT)


def test_rft_has_no_import_circles(graph):
    found = circles(graph)
    assert not found, "import circles (break them by moving what both sides share down a layer):\n" + "\n".join(
        " <-> ".join(c) for c in found)


def test_a_new_circle_is_found(tmp_path):
    """The walk sees a circle closed by an import inside a function, and one through a package."""
    pkg = tmp_path / "pkg"
    (pkg / "sub").mkdir(parents=True)
    (pkg / "__init__.py").write_text("")
    (pkg / "a.py").write_text("from pkg.b import thing\n")
    (pkg / "b.py").write_text("def thing():\n    from pkg import a\n")
    (pkg / "sub" / "__init__.py").write_text("from pkg.sub import c\n")
    (pkg / "sub" / "c.py").write_text("from pkg.d import x\n")
    (pkg / "d.py").write_text("from pkg.sub import y\n")
    (pkg / "e.py").write_text("from pkg.sub import c\n")  # no circle: e is imported by nobody
    assert circles(import_graph(pkg)) == [["pkg.a", "pkg.b"], ["pkg.d", "pkg.sub", "pkg.sub.c"]]


# Bottom to top; a module imports only its own layer and those below it. The roles (trainer,
# explorer) share a layer but never import each other: what both need lives below them.
LAYERS = (
    ("rft.registry", "rft.lazy", "rft.config"),  # the typed config (its schema), the registry contract, lazy imports
    ("rft.runtime",),  # the plumbing inside every rank: storage, checkpoints, monitor, topology, ...
    ("rft.models", "rft.algorithms"),
    ("rft.data", "rft.buffer", "rft.review", "rft.weights"),  # what the roles use
    ("rft.trainer", "rft.explorer"),  # the roles
    ("rft.runtime.task",),  # a rank's entry: picks its role
    # run by the launcher: they read every registry
    ("rft.config.checks", "rft.config.plugin_checks", "rft.config.judge_checks", "rft.config.layout_checks",
     "rft.config.mode_checks"),
    ("rft.launch", "rft.plot", "rft.doctor", "rft.export"),  # the login node: launching, following, drawing a run; checking a node; converting a checkpoint
)


def layer_of(module: str) -> tuple[int, str]:
    """(layer index, the LAYERS prefix that placed it): the longest prefix wins."""
    matches = [(len(prefix), index, prefix) for index, prefixes in enumerate(LAYERS) for prefix in prefixes
               if module == prefix or module.startswith(prefix + ".")]
    assert matches or module == "rft", f"{module} is in no layer of LAYERS: add it where it belongs"
    _, index, prefix = max(matches) if matches else (0, 0, "rft")
    return index, prefix


def test_the_layers_hold(graph):
    wrong = []
    for module, targets in sorted(graph.items()):
        (layer, prefix) = layer_of(module)
        for target in sorted(targets):
            target_layer, target_prefix = layer_of(target)
            if target_layer > layer:
                wrong.append(f"{module} imports {target}, a layer above it")
            elif target_layer == layer == 4 and target_prefix != prefix:
                wrong.append(f"{module} imports {target}: the roles share nothing but the layers below them")
    assert not wrong, "\n".join(wrong)


def test_the_layer_test_sees_an_import_upwards():
    assert layer_of("rft.weights.engines") < layer_of("rft.trainer.model")
    assert layer_of("rft.runtime.task")[0] > layer_of("rft.trainer.trainer")[0] > layer_of("rft.runtime.control")[0]
    assert layer_of("rft.config.checks")[0] > layer_of("rft.config.model")[0]


def test_few_modules_are_loose_at_the_top():
    loose = sorted(p.name for p in RFT.glob("*.py") if p.name != "__init__.py")
    assert len(loose) <= 5, f"rft/ holds {loose}: put each in the package of the layer it belongs to"
