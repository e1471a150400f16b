"""The house as drawn in docs/architecture.md: no import runs back up a layer, no package
imports a sibling of its own layer, and no module imports itself round a circle (imports inside
functions count: a lazy import is still an arrow)."""

from __future__ import annotations

import ast
from collections.abc import Iterable
from pathlib import Path

SOURCE = Path(__file__).parents[1] / "src" / "memsearcher"

LAYERS: list[set[str]] = [
    {"memsearcher", "types", "errors", "paths", "text", "folders", "worker", "config", "web"},
    {"llm", "data", "serving"},
    {"retrieval"},
    {"agent"},
    {"eval", "ask"},
    {"rl", "teach"},
    {"demo", "api", "integrations", "recipe"},
    {"cli"},
]
"""Bottom to top; each name a top-level module or package of ``memsearcher``. docs/architecture.md
shows the same table."""


def module_imports(source: Path = SOURCE) -> dict[str, set[str]]:
    """Every module of the package (dotted, without the ``memsearcher.`` prefix; a package is
    its name) and the memsearcher modules it imports, anywhere in its body."""
    graph: dict[str, set[str]] = {}
    for path in sorted(source.rglob("*.py")):
        parts = list(path.relative_to(source).with_suffix("").parts)
        if parts[-1] == "__init__":
            parts = parts[:-1]
        name = ".".join(parts) or "memsearcher"
        graph[name] = set()
        for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
            targets: Iterable[str] = ()
            if isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
                targets = [node.module]
            elif isinstance(node, ast.Import):
                targets = [alias.name for alias in node.names]
            for target in targets:
                if target == "memsearcher":
                    graph[name].add("memsearcher")
                elif target.startswith("memsearcher."):
                    graph[name].add(target.removeprefix("memsearcher."))
    return graph


def layer_of(module: str, layers: list[set[str]]) -> int:
    top = module.split(".")[0]
    for number, names in enumerate(layers):
        if top in names:
            return number
    raise AssertionError(f"{module} is in no layer: add it to LAYERS and docs/architecture.md")


def upward_or_sideways(graph: dict[str, set[str]], layers: list[set[str]]) -> list[str]:
    """The arrows that reach a higher layer, or another package of the same layer (the ground
    floor's single modules may import each other)."""
    bad = []
    for module, targets in graph.items():
        for target in targets:
            if module.split(".")[0] == target.split(".")[0]:
                continue  # inside one package
            here, there = layer_of(module, layers), layer_of(target, layers)
            if there > here or (there == here and here > 0):
                bad.append(f"{module} -> {target}")
    return sorted(bad)


def circles(graph: dict[str, set[str]]) -> list[list[str]]:
    """The modules on import circles, one list per circle found (depth-first search)."""
    known = set(graph)
    found: list[list[str]] = []
    state: dict[str, int] = {}  # 1: on the current path, 2: done
    path: list[str] = []

    def visit(module: str) -> None:
        state[module] = 1
        path.append(module)
        for target in sorted(graph.get(module, ())):
            target = target if target in known else target.rsplit(".", 1)[0]  # a name in it
            if state.get(target) == 1:
                found.append(path[path.index(target) :] + [target])
            elif target in known and target not in state:
                visit(target)
        path.pop()
        state[module] = 2

    for module in sorted(graph):
        if module not in state:
            visit(module)
    return found


def test_no_import_runs_back_up_a_layer_or_sideways() -> None:
    assert upward_or_sideways(module_imports(), LAYERS) == []


def test_no_module_imports_itself_round_a_circle() -> None:
    assert circles(module_imports()) == []


def test_every_module_has_a_layer_and_the_docs_show_the_same_layers() -> None:
    for module in module_imports():
        layer_of(module, LAYERS)
    architecture = (SOURCE.parents[1] / "docs" / "architecture.md").read_text(encoding="utf-8")
    for number, names in enumerate(LAYERS):
        row = next(line for line in architecture.splitlines() if line.startswith(f"| {number} |"))
        assert {n.strip("` ") for n in row.split("|")[2].split(",")} == names, row


def test_the_checks_catch_an_arrow_up_a_sideways_one_and_a_circle() -> None:
    """Negative controls, on the real graph with one arrow added each time."""
    graph = module_imports()
    graph["rl.config"] = graph["rl.config"] | {"demo.pipeline"}  # up
    assert upward_or_sideways(graph, LAYERS) == ["rl.config -> demo.pipeline"]
    graph = module_imports()
    graph["teach.wiki"] = graph["teach.wiki"] | {"rl.config"}  # sideways: rl and teach
    assert upward_or_sideways(graph, LAYERS) == ["teach.wiki -> rl.config"]
    graph = module_imports()
    graph["rl.schedules"] = graph["rl.schedules"] | {"rl.optim"}  # the old circle, back
    assert any("rl.schedules" in circle and "rl.optim" in circle for circle in circles(graph))
