"""ScienceWorld's task names, the paper's task sets, splits, per-task step caps and focus targets (no JVM needed)."""

from __future__ import annotations

import re

from empo2.envs.base import EnvError

TASK_SETS: dict[str, list[str]] = {
    "chemistry": ["chemistry-mix", "chemistry-mix-paint-secondary-color", "chemistry-mix-paint-tertiary-color"],
    "classification": ["find-animal", "find-living-thing", "find-non-living-thing", "find-plant"],
    "biology1": ["identify-life-stages-1", "identify-life-stages-2"],
    "biology2": ["lifespan-longest-lived", "lifespan-longest-lived-then-shortest-lived", "lifespan-shortest-lived"],
    "electricity": ["power-component", "power-component-renewable-vs-nonrenewable-energy", "test-conductivity",
                    "test-conductivity-of-unknown-substances"],
    "measurement": ["measure-melting-point-known-substance", "use-thermometer"],
}
"""The paper's six topics (its ScienceWorld panel); ``panel18`` is their union and ``all`` every task."""
TASK_SETS["panel18"] = [t for topic in list(TASK_SETS.values()) for t in topic]

try:  # task names ship with the package as data; no JVM needed
    from scienceworld.constants import ID2TASK as _ID2TASK

    TASK_NAMES: list[str] = list(_ID2TASK.values())
except ImportError:  # pragma: no cover - scienceworld is a hard dependency
    TASK_NAMES = []
TASK_SETS["all"] = list(TASK_NAMES)

SPLITS = {"train": "train", "dev": "dev", "eval": "dev", "test": "test"}
"""Our split names and the simulator's (``eval`` is its ``dev``)."""
DEFAULT_STEP_CAP = 30
DEFAULT_STEP_CAPS = {"chemistry-mix": 60, "measure-melting-point-known-substance": 120}
def expand_tasks(names: list[str] | str) -> list[str]:
    """Resolve task and task-set names (``panel18``, ``biology1`` …) to task names, in order, without duplicates."""
    if isinstance(names, str):
        names = [names]
    out: list[str] = []
    for name in names:
        if name in TASK_SETS:
            out.extend(TASK_SETS[name])
        elif name in TASK_NAMES:
            out.append(name)
        else:
            raise EnvError(f"unknown ScienceWorld task {name!r}; valid task sets: {', '.join(TASK_SETS)}; "
                           f"valid tasks: {', '.join(TASK_NAMES)}")
    return list(dict.fromkeys(out))


def step_cap(task: str, max_steps: int | None = None, step_caps: dict[str, int] | None = None) -> int:
    """Step cap of ``task``: ``step_caps[task]``, else ``max_steps``, else the released default (authors' code)."""
    if step_caps and task in step_caps:
        return step_caps[task]
    if max_steps is not None:
        return max_steps
    return DEFAULT_STEP_CAPS.get(task, DEFAULT_STEP_CAP)


def parse_focus_targets(description: str) -> list[str]:
    """The objects the task description allows to FOCUS on (``focus on the thermometer`` → ``thermometer``)."""
    found = re.findall(r"focus on (?:the |a |an )?([^.;]+?)(?:[.;]|$)", description, flags=re.IGNORECASE)
    return list(dict.fromkeys(f.strip() for f in found if f.strip()))


def check_task(task: str) -> None:
    """Raise :class:`EnvError` (one line, the valid names) unless ``task`` is a ScienceWorld task."""
    if task not in TASK_NAMES:
        raise EnvError(f"unknown ScienceWorld task {task!r}; valid tasks: {', '.join(TASK_NAMES)}")
