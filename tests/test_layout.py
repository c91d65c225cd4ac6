"""The package's layout: its modules import one another without a circle, its floors point down, and
its rooms stay small enough to hold in mind.

The floors, from the bottom: ``core`` (the engine), ``features`` (what is built on it), ``instruments``
(measuring, plotting, the benchmark), ``scenarios`` (runnable examples). A module imports only from
its own floor or below. Every import counts, those under ``TYPE_CHECKING`` and inside functions too:
a reader follows them all.
"""

from __future__ import annotations

import ast
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
PACKAGE = ROOT / "offload_examples"
FLOORS = ["core", "features", "instruments", "scenarios"]
#: The most lines a module may have, by folder (the longest folder that holds it decides). A scenario
#: is what users copy, so it is the shortest; the engine's module tells the life of a tensor whole.
MOST_LINES = {"core": 500, "features": 500, "instruments/bench": 400, "scenarios": 250, "core/engine.py": 600}


def _module_name(path: Path) -> str:
    parts = path.relative_to(ROOT).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def _imports() -> dict[str, set[str]]:
    """``{module: modules of the package it imports}``, every import statement included."""
    modules = {_module_name(p): p for p in PACKAGE.rglob("*.py")}
    graph: dict[str, set[str]] = {}
    for name, path in modules.items():
        package = name if path.name == "__init__.py" else name.rsplit(".", 1)[0]
        found: set[str] = set()
        for node in ast.walk(ast.parse(path.read_text(), str(path))):
            if isinstance(node, ast.Import):
                targets = [alias.name for alias in node.names]
            elif isinstance(node, ast.ImportFrom):
                base = node.module or ""
                if node.level:
                    anchor = package.split(".")[: len(package.split(".")) - node.level + 1]
                    base = ".".join(anchor + ([base] if base else []))
                targets = [f"{base}.{alias.name}" for alias in node.names] + [base]
            else:
                continue
            for target in targets:
                while target and target not in modules:  # "pkg.module.Name" -> "pkg.module"
                    target = target.rpartition(".")[0]
                if target and target != name and modules[target].name != "__init__.py":
                    found.add(target)
        graph[name] = found
    return graph


def _cycle(graph: dict[str, set[str]]) -> list[str] | None:
    state: dict[str, int] = {}  # 1: on the path, 2: done
    path: list[str] = []

    def visit(node: str) -> list[str] | None:
        state[node] = 1
        path.append(node)
        for nxt in sorted(graph.get(node, ())):
            if state.get(nxt) == 1:
                return path[path.index(nxt):] + [nxt]
            if nxt not in state and (found := visit(nxt)):
                return found
        path.pop()
        state[node] = 2
        return None

    for node in sorted(graph):
        if node not in state and (found := visit(node)):
            return found
    return None


def _floor(module: str) -> int | None:
    parts = module.split(".")
    return FLOORS.index(parts[1]) if len(parts) > 1 and parts[1] in FLOORS else None


def test_no_import_circle_in_the_package():
    cycle = _cycle(_imports())
    assert cycle is None, "import circle: " + " -> ".join(cycle)


def test_each_floor_imports_only_from_its_own_floor_or_below():
    upward = [f"{m} -> {t}" for m, targets in _imports().items() for t in targets
              if _floor(m) is not None and _floor(t) is not None and _floor(t) > _floor(m)]
    assert not upward, "imports from a floor above: " + ", ".join(sorted(upward))


def test_the_checks_see_a_circle_and_an_upward_import():
    assert _cycle({"a": {"b"}, "b": {"c"}, "c": {"a"}}) == ["a", "b", "c", "a"]
    assert _cycle({"a": {"b"}, "b": set()}) is None
    assert _floor("offload_examples.scenarios.basic") > _floor("offload_examples.core.engine")


def _most_lines(path: Path) -> int | None:
    where = path.relative_to(PACKAGE).as_posix()
    holders = [folder for folder in MOST_LINES if where == folder or where.startswith(folder + "/")]
    return MOST_LINES[max(holders, key=len)] if holders else None


def test_each_module_is_small_enough_to_hold_in_mind():
    too_long = [f"{path.relative_to(ROOT)}: {lines} lines, more than {most}" for path in sorted(PACKAGE.rglob("*.py"))
                if (most := _most_lines(path)) is not None and (lines := len(path.read_text().splitlines())) > most]
    assert not too_long, "modules too long to hold in mind: " + "; ".join(too_long)


def test_the_size_limits_apply_where_they_are_meant():
    assert _most_lines(PACKAGE / "core" / "engine.py") == 600 and _most_lines(PACKAGE / "core" / "schedule.py") == 500
    assert _most_lines(PACKAGE / "instruments" / "bench" / "protocol.py") == 400
    assert _most_lines(PACKAGE / "instruments" / "timeline.py") is None
