"""The text-environment protocol shared by ScienceWorld and WebShop.

Environments know nothing of models: they take an action string and return text. A trajectory step is plain data.
"""

from __future__ import annotations

import os
import shutil
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from typing import Any, Protocol, runtime_checkable

from empo2.errors import UserError


class EnvError(UserError, RuntimeError):
    """A user-facing environment error (unknown task, variation out of range, missing Java/data); exit code 2."""


@dataclass
class StepResult:
    observation: str
    reward: float
    done: bool
    info: dict[str, Any] = field(default_factory=dict)
    """Always holds: ``score`` (0–100 scale), ``success`` (bool), ``valid_actions`` (list[str]),
    ``raw_action`` and ``action`` (after correction), and ``state`` (see :func:`state_of`). ScienceWorld adds
    ``look`` and ``inventory``."""


def state_of(observation: str, info: dict[str, Any]) -> str:
    """The state an environment is in after a reset or step: ``info["state"]`` where the environment defines one,
    else the observation with its whitespace folded.

    The state is what the memory keys tips by and retrieves with, what the novelty reward counts and what GiGPO and
    ProxMO group steps by. It must name the situation, not the last message: ScienceWorld's observation is a one-line
    reply ("The door is already open." in every room), so it defines its state as the task's progress, the inventory
    and the room; an environment whose observation is the whole situation (a WebShop page) may leave
    ``info["state"]`` out. Two visits of one situation should give the same text, so listings whose order the
    environment does not fix come sorted; and what the task has scored is part of the situation.
    """
    state = info.get("state") if isinstance(info, dict) else None
    if isinstance(state, str) and state.strip():
        return state
    return " ".join(str(observation).split())


DEMO_OBS_CHARS = 160
"""Longest observation line a demonstration shows."""


def short_line(text: str, limit: int = DEMO_OBS_CHARS) -> str:
    """One line, at most ``limit`` characters (an observation in a demonstration)."""
    text = " ".join(text.split())
    return text if len(text) <= limit else text[: limit - 1] + "…"


@runtime_checkable
class TextEnv(Protocol):
    """A multi-step text environment. ``reset`` returns ``(observation, info)``; ``step`` returns :class:`StepResult`."""

    name: str

    def task_names(self) -> list[str]: ...

    def variations(self, task: str, split: str) -> list[int]:
        """Variation ids of ``task`` in ``split`` (``train``, ``dev``/``eval``, ``test``)."""
        ...

    def reset(self, task: str, variation: int) -> tuple[str, dict[str, Any]]: ...

    def step(self, action: str) -> StepResult: ...

    def valid_actions(self) -> list[str]: ...

    def task_description(self) -> str: ...

    def demonstration(self, task: str, variation: int, n: int = 1) -> str:
        """Few-shot demo text from OTHER variations' gold paths (never ``variation`` itself); may be empty."""
        ...

    def gold_actions(self) -> list[str]:
        """The gold action sequence of the current episode (for ``play --policy gold`` and tests)."""
        ...

    def close(self) -> None: ...


def stop_java_simulator(sim) -> None:
    """Close a simulator that runs in a JVM of its own over py4j (ScienceWorld's, TextWorldExpress's) and wait for
    the JVM to end, killing it if it has not within 5 s."""
    proc = sim._gateway.java_process
    try:
        sim.close()
    except Exception:
        pass
    sim.close = lambda: None  # the package's __del__ calls close() again
    try:
        proc.wait(timeout=5)
    except Exception:
        proc.kill()
        proc.wait(timeout=5)


def start_java_simulator(start: Callable[[], Any], name: str, java_options: str | None, hint: str) -> Any:
    """``start()``, a simulator constructor that starts its own JVM, with ``java_options`` in ``JAVA_TOOL_OPTIONS``
    (after the user's, so theirs win); no ``java`` on PATH, or a JVM that does not start, is one :class:`EnvError`
    ending in ``hint``."""
    if shutil.which("java") is None:
        raise EnvError(f"java not found. {hint}")
    with _java_tool_options(java_options):
        try:
            return start()
        except Exception as exc:  # py4j raises plain exceptions when the JVM cannot start
            raise EnvError(f"could not start the {name} JVM: {exc}. {hint}") from None


@contextmanager
def _java_tool_options(options: str | None) -> Iterator[None]:
    """``JAVA_TOOL_OPTIONS`` = ``options`` then the user's own (so theirs win), while a JVM starts."""
    user = os.environ.get("JAVA_TOOL_OPTIONS")
    if options:
        os.environ["JAVA_TOOL_OPTIONS"] = f"{options} {user or ''}".strip()
    try:
        yield
    finally:
        if user is None:
            os.environ.pop("JAVA_TOOL_OPTIONS", None)
        else:
            os.environ["JAVA_TOOL_OPTIONS"] = user
