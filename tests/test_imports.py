"""The import graph of ``src/empo2``: no circles between files, and no import from a lower package back up.

Every module is parsed with :mod:`ast` (nothing is imported), so imports inside functions count as much as those at
the top of a file, and so do imports under ``if TYPE_CHECKING``. An edge goes to the most specific module an import
names: ``from empo2.envs import pool`` is an edge to ``empo2.envs.pool``, ``from empo2.envs import make_env`` one to
``empo2.envs`` (its ``__init__``).

"Up" is the top level of the package: ``empo2.config*`` and ``empo2.cli*`` hold the run's configuration and its
command line, and the component packages below them (``envs``, ``policy``, ``algo``, ``memory``, ``agent``) take the
config section they need as an argument instead of importing it.

Print the graph's circles and back-imports: ``python tests/test_imports.py`` (exit code 1 when there are any).
"""

from __future__ import annotations

import ast
import sys
from pathlib import Path

SRC = Path(__file__).resolve().parent.parent / "src"
PACKAGE = "empo2"
LOWER = ("envs", "policy", "algo", "memory", "agent")
UPPER_PREFIXES = ("empo2.config", "empo2.cli")


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


def back_imports(graph: dict[str, set[str]]) -> list[tuple[str, str]]:
    """``(lower module, upper module)`` for each import from a component package up to the config or the CLI."""
    lower = tuple(f"{PACKAGE}.{p}" for p in LOWER)
    return sorted((m, t) for m, targets in graph.items() if m == lower or m.startswith(lower)
                  for t in targets if t.startswith(UPPER_PREFIXES))


def report(graph: dict[str, set[str]]) -> list[str]:
    lines = ["circle: " + " -> ".join(c) for c in cycles(graph)]
    return lines + [f"back-import: {m} -> {t}" for m, t in back_imports(graph)]


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
    assert back_imports(graph) == [("empo2.envs.b", "empo2.config")]
    assert back_imports({"empo2.envs.x": {"empo2.config_sections"}, "empo2.train.t": {"empo2.config"}}) == \
        [("empo2.envs.x", "empo2.config_sections")]


def test_no_import_circles_between_files():
    found = cycles(import_graph())
    assert not found, "files that import each other:\n" + "\n".join(" -> ".join(c) for c in found)


def test_no_import_from_a_component_package_up_to_config_or_cli():
    found = back_imports(import_graph())
    assert not found, "component modules importing the config or the CLI:\n" + \
        "\n".join(f"{m} -> {t}" for m, t in found)


if __name__ == "__main__":
    problems = report(import_graph())
    print("\n".join(problems) or f"no circles, no back-imports ({len(module_files())} modules)")
    sys.exit(1 if problems else 0)
