"""Imports point one way: bench -> controlplane -> workers -> kvtransfer -> the generated wire code (``epd``).

Read from the source with ``ast`` (nothing is imported): every import statement counts, a function-level
one and one under ``if TYPE_CHECKING:`` too, since a lazy or type-only import is still a dependency.
"""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

pytestmark = [pytest.mark.unit]

ROOT = Path(__file__).resolve().parents[2]
LAYERS = ("bench", "controlplane", "workers", "kvtransfer", "epd")  # top first
SOURCE_PACKAGES = LAYERS[:-1]  # epd is generated from proto/ and imports only protobuf and grpc


def module_name(path: Path) -> str:
    parts = list(path.relative_to(ROOT).with_suffix("").parts)
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def source_modules() -> dict[str, Path]:
    return {module_name(p): p for pkg in SOURCE_PACKAGES for p in sorted((ROOT / pkg).rglob("*.py"))}


def imported_names(path: Path, known: dict[str, Path]) -> set[str]:
    """Every module name an import statement in ``path`` names (relative imports resolved)."""
    return names_in(path.read_text(), module_name(path), path.name == "__init__.py", known)


def names_in(source: str, module: str, is_package: bool, known: dict[str, Path]) -> set[str]:
    here = module.split(".")
    package = here if is_package else here[:-1]
    names: set[str] = set()
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, ast.Import):
            names.update(alias.name for alias in node.names)
        elif isinstance(node, ast.ImportFrom):
            base = package[:len(package) - node.level + 1] if node.level else []
            module = ".".join(base + ([node.module] if node.module else []))
            submodules = {f"{module}.{alias.name}" for alias in node.names} & known.keys()
            names.update(submodules)
            if len(submodules) < len(node.names):  # also names defined in the module itself
                names.add(module)
    return names


def owner(name: str, known: dict[str, Path]) -> str | None:
    """The source module (or package) ``name`` lives in; None outside the layered packages."""
    while name and name not in known:
        name = name.rpartition(".")[0]
    return name or None


def import_graph() -> dict[str, set[str]]:
    known = source_modules()
    graph: dict[str, set[str]] = {}
    for module, path in known.items():
        targets = {owner(name, known) for name in imported_names(path, known)}
        graph[module] = {t for t in targets if t is not None and t != module}
    return graph


def cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """The strongly connected components of more than one node (Tarjan, iterative)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    found: list[list[str]] = []
    for root in graph:
        if root in index:
            continue
        work = [(root, iter(sorted(graph[root])))]
        index[root] = low[root] = len(index)
        stack.append(root)
        on_stack.add(root)
        while work:
            node, successors = work[-1]
            step = next(successors, None)
            if step is not None:
                if step not in index:
                    index[step] = low[step] = len(index)
                    stack.append(step)
                    on_stack.add(step)
                    work.append((step, iter(sorted(graph.get(step, ())))))
                elif step in on_stack:
                    low[node] = min(low[node], index[step])
                continue
            work.pop()
            if work:
                low[work[-1][0]] = min(low[work[-1][0]], low[node])
            if low[node] == index[node]:
                component = []
                while True:
                    member = stack.pop()
                    on_stack.discard(member)
                    component.append(member)
                    if member == node:
                        break
                if len(component) > 1:
                    found.append(sorted(component))
    return found


def layer(module: str) -> int:
    return LAYERS.index(module.split(".")[0])


def upward(module: str, names: set[str]) -> list[str]:
    """The imports of ``module`` that name a higher layer."""
    return [f"{module} imports {name}" for name in sorted(names)
            if name.split(".")[0] in LAYERS and LAYERS.index(name.split(".")[0]) < layer(module)]


def test_no_import_points_up_a_layer():
    known = source_modules()
    found = [line for module, path in known.items() for line in upward(module, imported_names(path, known))]
    assert not found, "imports must point bench -> controlplane -> workers -> kvtransfer -> epd:\n" + \
        "\n".join(found)


def test_no_import_cycle_between_top_level_packages():
    packages: dict[str, set[str]] = {pkg: set() for pkg in SOURCE_PACKAGES}
    for module, targets in import_graph().items():
        packages[module.split(".")[0]].update(t.split(".")[0] for t in targets)
    for pkg, targets in packages.items():
        targets.discard(pkg)
    assert cycles(packages) == []


def test_no_import_cycle_between_modules():
    """No two modules import each other, directly or around a loop: an import inside a function or under
    ``if TYPE_CHECKING:`` counts as well, since moving an import there hides a circle without removing it."""
    found = cycles(import_graph())
    assert found == [], "modules that import each other (around a loop):\n" + "\n".join(map(str, found))


def test_the_checks_see_an_upward_import_and_a_cycle():
    """The checks themselves can fail: a lazy import upward is seen (relative ones resolved), and so is a
    cycle."""
    known = source_modules()
    lazy = "import os\n\ndef f():\n    from bench.cli import add_bench_parser\n"
    assert upward("kvtransfer.wire", names_in(lazy, "kvtransfer.wire", False, known)) == [
        "kvtransfer.wire imports bench.cli"]
    relative = "from ..runtime import engine\nfrom . import prefill\n"
    names = names_in(relative, "workers.prefill.service", False, known)
    assert "workers.runtime.engine" in names and "workers.prefill" in names
    assert upward("workers.prefill.service", names) == []
    assert upward("workers.decode.loop", {"controlplane.settings"}) == [
        "workers.decode.loop imports controlplane.settings"]
    hidden = "import a\nif TYPE_CHECKING:\n    import b\ntry:\n    import c\nexcept ImportError:\n    import d\n" \
             "def f():\n    import e\n"
    assert names_in(hidden, "m", False, known) == {"a", "b", "c", "d", "e"}
    assert cycles({"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}) == [["a", "b", "c"]]
    assert cycles({"a": {"b"}, "b": set()}) == []
