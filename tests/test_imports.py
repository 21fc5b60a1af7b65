"""The import graph of ``src/empo2``: no circles between files, and no import from a lower package back up.

Every module is parsed with :mod:`ast` (nothing is imported), so imports inside functions count as much as those at
the top of a file, and so do imports under ``if TYPE_CHECKING``. An edge goes to the most specific module an import
names: ``from empo2.envs import pool`` is an edge to ``empo2.envs.pool``, ``from empo2.envs import make_env`` one to
``empo2.envs`` (its ``__init__``).

The package is a house of rooms on floors, written down once in :data:`LAYERS` (lowest floor first): a module may
import its own room and any room on a lower floor, never a room on its own floor or above. The config sits above the
components (``envs``, ``policy``, ``memory``, ``algo``, ``agent``): it checks names against their registries, and they
take the config section they need as an argument instead of importing it. Every module of the package must have a
room, so a new top-level file is placed here when it is added.

Print the graph's circles and upward imports: ``python tests/test_imports.py`` (exit code 1 when there are any).
"""

from __future__ import annotations

import ast
import sys
from pathlib import Path

SRC = Path(__file__).resolve().parent.parent / "src"
PACKAGE = "empo2"
LAYERS: tuple[tuple[str, ...], ...] = (
    ("version", "errors", "bounds", "home", "file_modes", "stdio", "progress", "allocator", "signals"),  # foundations
    ("policy", "envs", "memory", "algo"),  # components that know nothing of each other
    ("agent",),  # prompts and reflection over an environment's actions and memory's entries
    ("config",),
    ("parallel",),  # data-parallel ranks and FSDP sharding
    ("episodes", "rundir"),  # playing episodes (for train, eval, adapt, play); the run folder (checkpoints, metrics)
    ("train", "machine"),  # the training loop; the record of the machine a run used
    ("play", "experiments", "sft"),  # commands built on the loop: play episodes by hand; compare, adapt, report; the
    # warm start before it
    ("cli",),
    ("empo2",),  # the package's public names (Config, Trainer), re-exported from the rooms below
)
"""Rooms by floor, lowest first. A room is a top-level module or subpackage of ``empo2`` (``empo2`` itself is its
``__init__``)."""


def module_files(src: Path = SRC) -> dict[str, Path]:
    """``{dotted module name: file}`` for every module of the package (``pkg/__init__.py`` is ``pkg``)."""
    modules = {}
    for path in sorted((src / PACKAGE).rglob("*.py")):
        parts = list(path.relative_to(src).with_suffix("").parts)
        if parts[-1] == "__init__":
            parts.pop()
        modules[".".join(parts)] = path
    return modules


def _base(module: str, is_package: bool, node: ast.ImportFrom) -> str:
    """The absolute module ``from <node.module> import ...`` names, relative dots resolved against ``module``."""
    if not node.level:
        return node.module or ""
    anchor = module.split(".") if is_package else module.split(".")[:-1]
    anchor = anchor[: len(anchor) - (node.level - 1)]
    return ".".join(anchor + ([node.module] if node.module else []))


def _most_specific(name: str, modules: dict[str, Path]) -> str | None:
    """``name`` or its nearest enclosing module that is a file of the package (``None`` outside it)."""
    while name:
        if name in modules:
            return name
        name = name.rpartition(".")[0]
    return None


def imports_of(module: str, modules: dict[str, Path]) -> set[str]:
    """The package's modules that ``module`` imports anywhere in its file."""
    path = modules[module]
    tree = ast.parse(path.read_text(), filename=str(path))
    targets = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            names = [alias.name for alias in node.names]
        elif isinstance(node, ast.ImportFrom):
            base = _base(module, path.name == "__init__.py", node)
            names = [f"{base}.{alias.name}" for alias in node.names] or [base]
        else:
            continue
        targets |= {t for t in (_most_specific(n, modules) for n in names) if t}
    targets.discard(module)
    return targets


def import_graph(src: Path = SRC) -> dict[str, set[str]]:
    modules = module_files(src)
    return {m: imports_of(m, modules) for m in modules}


def cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """One circle per strongly connected group of files that import each other (Tarjan's algorithm)."""
    index, low, stack, on_stack, groups = {}, {}, [], set(), []

    def visit(node: str) -> None:
        index[node] = low[node] = len(index)
        stack.append(node)
        on_stack.add(node)
        for succ in sorted(graph[node]):
            if succ not in index:
                visit(succ)
                low[node] = min(low[node], low[succ])
            elif succ in on_stack:
                low[node] = min(low[node], index[succ])
        if low[node] == index[node]:
            group = set()
            while True:
                member = stack.pop()
                on_stack.discard(member)
                group.add(member)
                if member == node:
                    break
            if len(group) > 1:
                groups.append(group)

    for node in sorted(graph):
        if node not in index:
            visit(node)
    return [_circle_in(group, graph) for group in groups]


def _circle_in(group: set[str], graph: dict[str, set[str]]) -> list[str]:
    """A concrete circle through the group's first member, found breadth-first (the shortest one back to it)."""
    start = min(group)
    paths = {start: [start]}
    frontier = [start]
    while frontier:
        nxt = []
        for node in frontier:
            for succ in sorted(graph[node] & group):
                if succ == start:
                    return paths[node] + [start]
                if succ not in paths:
                    paths[succ] = paths[node] + [succ]
                    nxt.append(succ)
        frontier = nxt
    raise AssertionError(f"{sorted(group)} is not strongly connected")


def room_of(module: str) -> str:
    """The room of a dotted module name: its top-level name under ``empo2``."""
    return module.split(".")[1] if "." in module else module


def floor_of(room: str) -> int | None:
    """The floor of a room in :data:`LAYERS` (0 is the lowest), ``None`` for a room not written down."""
    return next((i for i, rooms in enumerate(LAYERS) if room in rooms), None)


def unplaced(graph: dict[str, set[str]]) -> list[str]:
    """Modules whose room is on no floor of :data:`LAYERS`."""
    return sorted(m for m in graph if floor_of(room_of(m)) is None)


def upward_imports(graph: dict[str, set[str]]) -> list[tuple[str, str]]:
    """``(importer, imported)`` for each import of a room on the importer's floor or above (its own room excepted)."""
    found = []
    for module, targets in graph.items():
        here, floor = room_of(module), floor_of(room_of(module))
        for target in targets:
            there = room_of(target)
            if there != here and None not in (floor, floor_of(there)) and floor_of(there) >= floor:
                found.append((module, target))
    return sorted(found)


def shared_file_names(modules: dict[str, Path]) -> dict[str, list[str]]:
    """``{file name: its modules}`` for each file name that modules of more than one room share (a package's
    ``__init__.py`` and ``__main__.py`` excepted); files of one room may share a name (each environment's
    ``env.py``)."""
    by_name: dict[str, dict[str, list[str]]] = {}
    for module, path in modules.items():
        if path.name not in ("__init__.py", "__main__.py"):
            by_name.setdefault(path.name, {}).setdefault(room_of(module), []).append(module)
    return {name: sorted(m for found in rooms.values() for m in found) for name, rooms in by_name.items()
            if len(rooms) > 1}


def describe_edge(module: str, target: str) -> str:
    """One upward import with the rooms and floors it joins: ``empo2.config -> empo2.experiments.arm_runs (config, floor
    3 -> experiments, floor 5)``."""
    here, there = room_of(module), room_of(target)
    return f"{module} -> {target} ({here}, floor {floor_of(here)} -> {there}, floor {floor_of(there)})"


def report(graph: dict[str, set[str]]) -> list[str]:
    lines = ["circle: " + " -> ".join(c) for c in cycles(graph)]
    return (lines + [f"no room: {m} (place it in LAYERS)" for m in unplaced(graph)]
            + [f"upward: {describe_edge(m, t)}" for m, t in upward_imports(graph)])


def test_graph_sees_function_level_and_relative_imports(tmp_path):
    pkg = tmp_path / PACKAGE
    (pkg / "envs").mkdir(parents=True)
    (pkg / "__init__.py").write_text("")
    (pkg / "config.py").write_text("")
    (pkg / "envs" / "__init__.py").write_text("from . import a\n")
    (pkg / "envs" / "a.py").write_text("def f():\n    from empo2.envs.b import g\n")
    (pkg / "envs" / "b.py").write_text("from ..config import X\nfrom .a import f\nimport empo2.envs\nimport numpy\n")
    graph = import_graph(tmp_path)
    assert graph == {"empo2": set(), "empo2.config": set(), "empo2.envs": {"empo2.envs.a"},
                     "empo2.envs.a": {"empo2.envs.b"}, "empo2.envs.b": {"empo2.config", "empo2.envs.a", "empo2.envs"}}
    assert cycles(graph) == [["empo2.envs", "empo2.envs.a", "empo2.envs.b", "empo2.envs"]]
    assert upward_imports(graph) == [("empo2.envs.b", "empo2.config")]


def test_no_import_circles_between_files():
    found = cycles(import_graph())
    assert not found, "files that import each other:\n" + "\n".join(" -> ".join(c) for c in found)


def test_every_floor_is_checked_in_both_directions():
    """For every pair of rooms on different floors, an import from the lower to the higher is reported, naming the
    edge, and the import the other way is not; two rooms on one floor may not import each other either way."""
    rooms = [(floor, room) for floor, names in enumerate(LAYERS) for room in names]
    for low_floor, low in rooms:
        for high_floor, high in rooms:
            if low == high:
                continue
            importer, imported = f"empo2.{low}.a", f"empo2.{high}.b"
            found = upward_imports({importer: {imported}, imported: set()})
            if low_floor < high_floor:
                assert found == [(importer, imported)], (low, high)
                assert f"{low}, floor {low_floor} -> {high}, floor {high_floor}" in describe_edge(importer, imported)
            elif low_floor == high_floor:
                assert found == [(importer, imported)], (low, high)
            else:
                assert found == [], (low, high)
    assert upward_imports({"empo2.config.core": {"empo2.config.sections"}, "empo2.cli.app": {"empo2.cli.parser"},
                           "empo2.envs.a": {"empo2.envs"}}) == []  # one room's own files
    assert upward_imports({"empo2.signals": {"empo2.rundir.checkpoint"}}) == [("empo2.signals", "empo2.rundir.checkpoint")]
    assert unplaced({"empo2.newroom": set(), "empo2.config_new": set(), "empo2.cli": set()}) == ["empo2.config_new",
                                                                                                 "empo2.newroom"]


def test_every_module_has_a_room():
    missing = unplaced(import_graph())
    assert not missing, "modules on no floor of LAYERS (place each where it belongs):\n" + "\n".join(missing)


def test_no_import_runs_up_a_floor():
    found = upward_imports(import_graph())
    assert not found, "imports of a room on the importer's floor or above:\n" + \
        "\n".join(describe_edge(m, t) for m, t in found)


def test_no_two_rooms_hold_a_file_of_the_same_name():
    """A file's name says which module it is: a ``report.py`` in two rooms makes an import, a traceback or a search
    ambiguous."""
    sample = {"empo2.memory.report": Path("memory/report.py"), "empo2.experiments.report": Path("experiments/report.py"),
              "empo2.envs.a.env": Path("envs/a/env.py"), "empo2.envs.b.env": Path("envs/b/env.py"),
              "empo2.cli": Path("cli/__init__.py"), "empo2.envs": Path("envs/__init__.py")}
    assert shared_file_names(sample) == {"report.py": ["empo2.experiments.report", "empo2.memory.report"]}
    found = shared_file_names(module_files())
    assert not found, f"file names shared by rooms (rename the less central one): {found}"


def private_names_used(source: str) -> list[str]:
    """The package's private names (``_x``) a file of tests reaches: imported from an ``empo2`` module, or read as an
    attribute of a name bound to one (``import empo2.signals as s; s._state``, ``from empo2 import machine;
    machine._commit``). Attributes of objects are not seen: an object's private state is its class's business."""
    tree, modules, found = ast.parse(source), set(), []
    for node in ast.walk(tree):
        if isinstance(node, ast.ImportFrom) and node.module and node.module.split(".")[0] == PACKAGE:
            found += [f"{node.module}.{a.name}" for a in node.names if a.name.startswith("_")]
            modules |= {a.asname or a.name for a in node.names}
        elif isinstance(node, ast.Import):
            modules |= {a.asname or a.name for a in node.names if a.name.split(".")[0] == PACKAGE}
    for node in ast.walk(tree):
        if (isinstance(node, ast.Attribute) and node.attr.startswith("_") and not node.attr.startswith("__")
                and isinstance(node.value, ast.Name) and node.value.id in modules):
            found.append(f"{node.value.id}.{node.attr}")
    return found


def test_tests_reach_the_package_through_public_names_only():
    sample = ("from empo2.machine import _commit, record\nfrom empo2 import signals\nimport empo2.cli as cli\n"
              "signals._state['x']\ncli.main\ncli._train_config\nrecord.__doc__\nobj._hidden\n")
    assert sorted(private_names_used(sample)) == ["cli._train_config", "empo2.machine._commit", "signals._state"]
    tests = Path(__file__).resolve().parent
    found = {str(f.relative_to(tests)): names for f in sorted(tests.rglob("*.py"))
             if (names := private_names_used(f.read_text()))}
    assert not found, f"tests reaching private names (make them public or test through a public one): {found}"


if __name__ == "__main__":
    problems = report(import_graph())
    print("\n".join(problems) or f"no circles, no upward imports ({len(module_files())} modules)")
    sys.exit(1 if problems else 0)
