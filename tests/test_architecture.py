"""The package's structure: imports only go down a declared order of layers (LAYERS, which
docs/development.md's layout table lists), so there are no cycles (lazy imports included);
stages never import each other, and no module shadows a standard-library name."""

import ast
import importlib.util
import itertools
import pkgutil
import re
import sys
from pathlib import Path

PACKAGE = "flowgrpo_cli"

# The layers, top first: a module imports only from its own layer and the layers below it
# (deferred imports in functions and TYPE_CHECKING imports included). A top-level module is
# placed by its name (`cli` is flowgrpo_cli/cli.py), a sub-package by its name for every module
# in it (`rewards`: flowgrpo_cli/rewards/*); `flowgrpo_cli` is the package's own __init__ (its
# __version__). The last layer is the base every other one may use. A new module or
# sub-package must be placed here (test_every_module_is_placed).
LAYERS: tuple[tuple[str, ...], ...] = (
    ("__main__",),  # `python -m flowgrpo_cli`
    ("cli",),  # the typer app
    ("loop",),  # the resident loop chaining the stages
    ("ray_cluster",),  # ranks and score tasks on a Ray cluster: launches the stages
    ("export",),  # `flowgrpo export`
    ("model_card",),  # the exported model's card
    ("planning",),  # `flowgrpo plan`
    ("stages",),  # prepare, rollout, score, update, evaluate
    ("engines",),  # rollout engines and the denoising loop
    ("training",),  # the policy and the trainer
    ("models",),  # pipeline adapters, tiny pipelines
    ("rewards",),  # named rewards, their weighting, the reward server
    ("launch",),  # SPMD: the process group, rank errors, the stage skeleton
    ("reporting",),  # progress, tables, grids, the HTML report
    ("store",),  # a run on disk: config, run directory, manifests, trajectories
    ("algorithm",),  # the math
    ("flowgrpo_cli", "errors", "hub_errors", "untrusted", "loading"),  # the base
)
RANK = {name: rank for rank, layer in enumerate(LAYERS) for name in layer}


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


def layer_of(module: str) -> str:
    """The LAYERS name a module is placed by: `flowgrpo_cli.rewards.clip` -> `rewards`,
    `flowgrpo_cli.cli` -> `cli`, `flowgrpo_cli` -> `flowgrpo_cli`."""
    parts = module.split(".")
    return parts[1] if len(parts) > 1 else parts[0]


def upward_imports(graph: dict[str, set[str]], rank: dict[str, int] = RANK) -> list[str]:
    """Every edge `importer -> imported` whose imported module sits in a higher layer than
    its importer, sorted."""
    return sorted(
        f"{importer} -> {imported}"
        for importer, targets in graph.items()
        for imported in targets
        if rank[layer_of(imported)] < rank[layer_of(importer)]
    )


def test_imports_only_go_down_the_layers():
    upward = upward_imports(import_graph())
    assert upward == [], (
        "imports that go up the declared order (LAYERS in tests/test_architecture.py); move "
        "what they import down, or the importer up:\n  " + "\n  ".join(upward)
    )


def test_the_layer_check_reports_a_planted_upward_import():
    # A synthetic graph: c is below b, which is below a; c importing a goes up twice.
    rank = {"a": 0, "b": 1, "c": 2}
    graph = {"p.a": {"p.b", "p.c"}, "p.b": {"p.c"}, "p.c": {"p.a", "p.b"}}
    assert upward_imports(graph, rank) == ["p.c -> p.a", "p.c -> p.b"]
    # The real graph with one planted edge (the files are untouched): the base importing the
    # CLI, and a model adapter importing a reward, as `rewards.clip` once imported `models`.
    graph = import_graph()
    graph[f"{PACKAGE}.errors"].add(f"{PACKAGE}.cli")
    graph[f"{PACKAGE}.rewards.clip"].add(f"{PACKAGE}.models")
    planted = {f"{PACKAGE}.errors -> {PACKAGE}.cli", f"{PACKAGE}.rewards.clip -> {PACKAGE}.models"}
    assert planted <= set(upward_imports(graph))


def test_every_module_is_placed():
    unplaced = sorted(m for m in modules() if layer_of(m) not in RANK)
    assert unplaced == [], f"modules in no layer (add them to LAYERS): {unplaced}"
    names = {layer_of(m) for m in modules()}
    assert sorted(RANK.keys() - names) == [], "LAYERS names modules that do not exist"
    assert len(RANK) == sum(len(layer) for layer in LAYERS), "a name is in two layers"


def test_the_documented_layout_lists_the_layers_in_order():
    """docs/development.md's layout table: its first column names every layer, top first."""
    text = (Path(__file__).resolve().parents[1] / "docs" / "development.md").read_text()
    start = text.index("| package | its job |")
    rows = text[start:].splitlines()[2:]  # past the header and its |---| line
    documented = []
    for row in itertools.takewhile(lambda line: line.strip().startswith("|"), rows):
        first = row.strip().split("|")[1]
        documented += [re.sub(r"(\.py|/)$", "", name) for name in re.findall(r"`([^`]+)`", first)]
    documented = [PACKAGE if name == "__init__" else name for name in documented]
    assert documented == [name for layer in LAYERS for name in layer]


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
