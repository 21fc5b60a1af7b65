"""N text environments in this process, behind the same interface as :class:`~empo2.envs.pool.EnvPool`.

For a :class:`~empo2.train.trainer.Trainer` given an environment factory: each environment is built with ``factory()``
and asked in turn, so nothing is spawned and nothing is pickled (a class defined in a notebook or a test works).
What the process pool adds is left out: environments do not run at the same time. An environment that raises (its
JVM killed) is replaced, and its episode fails, as in the other pools; a factory that raises ends the call.
"""

from __future__ import annotations

import os
from collections.abc import Callable
from typing import Any

from empo2.envs.pool_base import Reply, WorkerPool, close_quietly, serve


class LocalEnvPool(WorkerPool):
    """``size`` environments made by ``factory()``, one episode per index, asked one after the other."""

    def __init__(self, factory: Callable[[], Any], size: int):
        super().__init__(getattr(factory, "name", "environment"), size)
        self._factory = factory
        self.envs: list[Any] = [None] * size
        self._start_all()

    # ------------------------------------------------------------------ the transport: a call in this process
    def _launch(self, i: int) -> None:
        self.envs[i] = self._factory()

    def _start_reply(self, i: int) -> Reply:
        env = self.envs[i]
        return "ready", {"pid": os.getpid(), "java_pid": env.java_pid() if hasattr(env, "java_pid") else None}

    def _send(self, i: int, method: str, args: tuple) -> Reply:
        return serve(self.envs[i], method, args)  # answered at once: the reply is the handle

    def _receive(self, i: int, handle: Reply) -> Reply:
        return handle

    def _discard(self, i: int) -> None:
        if self.envs[i] is not None:
            close_quietly(self.envs[i])
            self.envs[i] = None
