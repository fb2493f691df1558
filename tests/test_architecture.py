"""The package's structure: imports only go one way (no cycles, lazy imports included), stages
never import each other, and no module shadows a standard-library name."""

import ast
import importlib.util
import pkgutil
import sys
from pathlib import Path

PACKAGE = "flowgrpo_cli"


def modules() -> dict[str, Path]:
    """Every module of the installed package (stages/ included), name -> source file."""
    import flowgrpo_cli.stages  # installed from the top-level stages/: not under __path__

    found = {PACKAGE: Path(flowgrpo_cli.__file__)}
    for package in (flowgrpo_cli, flowgrpo_cli.stages):
        found[package.__name__] = Path(package.__file__)
        for info in pkgutil.walk_packages(package.__path__, package.__name__ + "."):
            found[info.name] = Path(importlib.util.find_spec(info.name).origin)
    return found


def import_graph() -> dict[str, set[str]]:
    """module -> the package's modules it imports anywhere in its body (functions included:
    an import deferred into a function is still a dependency)."""
    files = modules()
    graph: dict[str, set[str]] = {}
    for name, path in files.items():
        is_package = path.name == "__init__.py"
        edges = set()
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.Import):
                targets = [alias.name for alias in node.names]
            elif isinstance(node, ast.ImportFrom):
                base = node.module or ""
                if node.level:  # relative: resolve against this module's package
                    package = name if is_package else name.rsplit(".", 1)[0]
                    parts = package.split(".")[: len(package.split(".")) - node.level + 1]
                    base = ".".join(filter(None, [*parts, node.module or ""]))
                # `from pkg import module` depends on that module; `from mod import name` on mod
                targets = [f"{base}.{a.name}" if f"{base}.{a.name}" in files else base
                           for a in node.names]  # fmt: skip
            else:
                continue
            edges.update(t for t in targets if t in files and t != name)
        graph[name] = edges
    return graph


def find_cycle(graph: dict[str, set[str]]) -> list[str] | None:
    """One import cycle as [a, b, ..., a], or None."""
    state: dict[str, int] = {}  # 1: on the current path, 2: done
    path: list[str] = []

    def visit(node: str) -> list[str] | None:
        state[node] = 1
        path.append(node)
        for nxt in sorted(graph[node]):
            if state.get(nxt) == 1:
                return [*path[path.index(nxt) :], nxt]
            if nxt not in state and (cycle := visit(nxt)):
                return cycle
        path.pop()
        state[node] = 2
        return None

    for node in sorted(graph):
        if node not in state and (cycle := visit(node)):
            return cycle
    return None


def test_the_cycle_finder_finds_a_cycle():
    graph = {"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": set()}
    assert find_cycle(graph) == ["a", "b", "c", "a"]
    assert find_cycle({"a": {"b"}, "b": set()}) is None


def test_no_import_cycles():
    cycle = find_cycle(import_graph())
    assert cycle is None, " -> ".join(cycle)


def test_stages_do_not_import_each_other():
    graph = import_graph()
    stages = {m for m in graph if m.startswith(f"{PACKAGE}.stages.")}
    assert {"prepare", "rollout", "score", "update", "evaluate"} <= {
        m.rsplit(".", 1)[1] for m in stages
    }
    for stage in stages:
        assert not graph[stage] & stages, (stage, graph[stage] & stages)


def test_no_module_shadows_a_standard_library_module():
    shadowing = [m for m in modules() if m.rsplit(".", 1)[-1] in sys.stdlib_module_names]
    assert shadowing == []
