"""How an environment pool reports episodes lost to crashed workers; shared by the local and the Ray pool."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from empo2.envs.base import EnvError, StepResult


@dataclass
class Failure:
    """A reset that did not happen because worker ``worker`` crashed (it has been restarted)."""

    worker: int
    error: str


class WorkerError(RuntimeError):
    """A :meth:`EnvPool.call` whose worker crashed; the worker has been restarted (its episode is lost)."""


class EnvFailuresError(EnvError):
    """Too many episodes in a row were lost to crashed workers: the environment is broken, not unlucky."""


class FailureStreak:
    """Counts episodes lost to crashed workers in a row; :meth:`update` raises :class:`EnvFailuresError` at ``limit``
    (``train.max_consecutive_env_failures``)."""

    def __init__(self, limit: int):
        self.limit, self.count = limit, 0

    def update(self, errors: list[str | None], run_dir: Any = None) -> bool:
        """Feed one batch in episode order (``None`` = the episode ran, else its error); True if any failed."""
        for error in errors:
            self.count = self.count + 1 if error is not None else 0
            if self.count >= self.limit:
                last = (error.splitlines() or ["unknown error"])[0][:160]
                resume = f"; resume with --resume {run_dir}" if run_dir is not None else ""
                raise EnvFailuresError(f"{self.count} training episodes in a row were lost to crashed environment "
                                       f"workers (last: {last}); stopping (train.max_consecutive_env_failures="
                                       f"{self.limit}){resume}")
        return any(e is not None for e in errors)


def failed_step(error: str) -> StepResult:
    """The result reported for an episode lost to a crashed worker."""
    return StepResult("", 0.0, True, {"failed": True, "error": error, "success": False, "score": 0})
