"""N text environments in this process, behind the interface of :class:`~empo2.envs.pool.EnvPool`.

For a :class:`~empo2.train.trainer.Trainer` given an environment factory: each environment is built with ``factory()``
and asked in turn, so nothing is spawned and nothing is pickled (a class defined in a notebook or a test works).
What the process pool adds is left out: environments do not run at the same time, and an environment that raises
ends the call instead of being restarted.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from empo2.envs.base import StepResult


class LocalEnvPool:
    """``size`` environments made by ``factory()``, one episode per index, stepped one after the other."""

    def __init__(self, factory: Callable[[], Any], size: int):
        if size < 1:
            raise ValueError("LocalEnvPool size must be >= 1")
        self.size = size
        self.envs: list[Any] = []
        try:
            for _ in range(size):
                self.envs.append(factory())
        except BaseException:
            self.close()
            raise

    def reset(self, assignments: list[tuple[int, str, int]]) -> dict[int, tuple[str, dict]]:
        return {i: self.envs[i].reset(task, variation) for i, task, variation in assignments}

    def restore(self, assignments: list[tuple[int, str, int, list[list[str]]]]) -> dict[int, tuple[str, dict]]:
        return {i: self.envs[i].restore_prefix(task, variation, steps) for i, task, variation, steps in assignments}

    def step(self, actions: dict[int, str]) -> dict[int, StepResult]:
        return {i: self.envs[i].step(action) for i, action in actions.items()}

    def call(self, i: int, method: str, *args: Any, retries: int = 0) -> Any:
        return getattr(self.envs[i], method)(*args)

    def close(self) -> None:
        while self.envs:
            self.envs.pop().close()
