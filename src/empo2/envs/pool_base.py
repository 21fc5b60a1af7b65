"""What every environment pool does, written once: one episode per worker index, the requests that drive the
workers, and what a crashed worker gives.

A request sends one ``(method, args)`` to each of its workers before awaiting any reply, so the workers run at the
same time. Each reply is one of three kinds:

- ``ok``: the environment's answer;
- ``env_error``: an :class:`~empo2.envs.base.EnvError` (unknown task, variation out of range), a mistake of the
  caller's, raised once every reply is in;
- ``crash``: anything else, or a worker that died or went silent (its process, its JVM, its Ray actor or its node):
  the worker is replaced by a fresh one (started lazily, on its next request) and its episode comes back failed.

The pools differ only in where an environment lives and how a request reaches it, the methods a subclass defines:
in this process (:class:`~empo2.envs.local_pool.LocalEnvPool`), in a worker process each
(:class:`~empo2.envs.pool.EnvPool`) or in a Ray actor each (:class:`~empo2.envs.ray_pool.RayEnvPool`).
"""

from __future__ import annotations

import logging
import os
from abc import ABC, abstractmethod
from typing import Any

from empo2.envs.base import EnvError, StepResult
from empo2.envs.failures import Failure, WorkerError, failed_step

Reply = tuple[str, Any]
"""``("ok", value)``, ``("env_error", message)`` or ``("crash", message)``; a start-up reply is ``("ready", info)``
in place of ``ok``, ``info`` holding the worker's ``pid`` and its JVM's ``java_pid`` (``None`` without one)."""


class WorkerGone(Exception):
    """A worker died, lost its connection or did not answer in time (raised by a pool's transport methods)."""


# ---------------------------------------------------------------------------------------------- the worker's side
def quiet_worker_logs() -> None:
    """In a worker process: a dead JVM is reported to the pool as a ``crash`` reply, not logged there."""
    logging.getLogger("py4j").setLevel(logging.CRITICAL)
    # py4j also calls the module-level logging.exception(), which would install a stderr handler on the root logger
    # and print a traceback under the parent's one-line error; a handler on root stops that.
    logging.getLogger().addHandler(logging.NullHandler())


def _reply_to(exc: Exception) -> Reply:
    if isinstance(exc, EnvError):
        return "env_error", str(exc)
    return "crash", f"{type(exc).__name__}: {exc}"


def open_env(factory, env_kwargs: dict) -> tuple[Any, Reply]:
    """``factory(**env_kwargs)`` and the start-up reply: ``(env, ("ready", info))``, or ``(None, reply)`` when the
    constructor raised."""
    try:
        env = factory(**env_kwargs)
    except Exception as exc:  # noqa: BLE001 - reported to the pool, which decides
        return None, _reply_to(exc)
    java_pid = env.java_pid() if hasattr(env, "java_pid") else None
    return env, ("ready", {"pid": os.getpid(), "java_pid": java_pid})


def serve(env, method: str, args: tuple) -> Reply:
    """Run one request on the environment."""
    try:
        return "ok", getattr(env, method)(*args)
    except Exception as exc:  # noqa: BLE001 - a dead JVM or a broken environment is a crash: the pool replaces us
        return _reply_to(exc)


def close_quietly(env) -> None:
    """Close an environment that may be broken (its JVM killed): cleaning up must not raise."""
    try:
        env.close()
    except Exception:  # noqa: BLE001
        pass


# ------------------------------------------------------------------------------------------------ the pool's side
class WorkerPool(ABC):
    """``size`` environments, one episode per worker index ``0 .. size - 1``.

    ``restarts`` counts workers replaced after a crash. A subclass defines how a worker is launched, awaited, sent a
    request, read from and discarded; it calls :meth:`_start_all` at the end of its constructor.
    """

    def __init__(self, env_name: str, size: int):
        if size < 1:
            raise ValueError(f"{type(self).__name__} size must be >= 1")
        self.env_name, self.size, self.restarts = env_name, size, 0
        self._ready = [False] * size
        self._info: list[dict] = [{} for _ in range(size)]  # each worker's start-up info, once it has started
        self._closed = False

    # ------------------------------------------------------------------ requests
    def reset(self, assignments: list[tuple[int, str, int]]) -> dict[int, tuple[str, dict] | Failure]:
        """Reset worker ``i`` to ``(task, variation)`` for each assignment, in parallel.

        A crashed worker gives a :class:`Failure` (and is replaced); an :class:`EnvError` (unknown task, variation
        out of range) is raised once every reply is in.
        """
        replies = self._request({i: ("reset", (task, variation)) for i, task, variation in assignments})
        return {i: Failure(i, payload) if kind == "crash" else payload for i, (kind, payload) in replies.items()}

    def restore(self, assignments: list[tuple[int, str, int, list[list[str]]]],
                ) -> dict[int, tuple[str, dict] | Failure]:
        """Put worker ``i`` into the state after a recorded prefix, ``(i, task, variation, step_commands)`` each, in
        parallel (the environment's ``restore_prefix``); failures and errors as :meth:`reset`."""
        replies = self._request({i: ("restore_prefix", (task, variation, steps))
                                 for i, task, variation, steps in assignments})
        return {i: Failure(i, payload) if kind == "crash" else payload for i, (kind, payload) in replies.items()}

    def step(self, actions: dict[int, str]) -> dict[int, StepResult]:
        """Send ``actions[i]`` to worker ``i`` for every ``i`` at once, then collect the results.

        A crashed worker's episode comes back as :func:`failed_step` (``done``, reward 0, ``info['failed']``).
        """
        replies = self._request({i: ("step", (action,)) for i, action in actions.items()})
        return {i: failed_step(payload) if kind == "crash" else payload for i, (kind, payload) in replies.items()}

    def call(self, i: int, method: str, *args: Any, retries: int = 0) -> Any:
        """Call ``method(*args)`` on worker ``i``'s environment (e.g. ``demonstration``, ``valid_actions``).

        A crash replaces the worker and raises :class:`WorkerError`, after ``retries`` more tries on the fresh
        worker (only for calls that do not depend on the episode state, such as ``variations``).
        """
        for _attempt in range(retries + 1):
            kind, payload = self._request({i: (method, args)})[i]
            if kind != "crash":
                return payload
        raise WorkerError(f"worker {i} crashed during {method}(): {payload}; it has been restarted")

    def java_pids(self) -> dict[int, int | None]:
        """Each worker's JVM process id (``None`` for environments without a JVM, or a worker not started yet)."""
        return {i: info.get("java_pid") for i, info in enumerate(self._info)}

    def worker_pids(self) -> dict[int, int]:
        """The process id of each started worker."""
        return {i: info["pid"] for i, info in enumerate(self._info) if info}

    def close(self) -> None:
        """Stop every worker and whatever it started (JVMs included). Idempotent."""
        if self._closed:
            return
        self._closed = True
        self._shutdown()

    def __enter__(self):
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    # ------------------------------------------------------------------ the request logic
    def _request(self, requests: dict[int, tuple[str, tuple]]) -> dict[int, Reply]:
        """Send every request, then read every reply; replace crashed workers; raise an EnvError after collecting."""
        if self._closed:
            raise RuntimeError(f"{type(self).__name__} is closed")
        for i in requests:
            if not 0 <= i < self.size:
                raise IndexError(f"worker index {i} out of range 0..{self.size - 1}")
        replies: dict[int, Reply] = {}
        pending = {}
        for i, (method, args) in requests.items():
            try:
                self._await_start(i)
                pending[i] = self._send(i, method, args)
            except WorkerGone as exc:
                replies[i] = ("crash", f"worker {i} unavailable: {exc}")
            except EnvError as exc:  # a replaced worker could not start; the others' replies are still read
                replies[i] = ("env_error", str(exc))
        for i, handle in pending.items():
            try:
                replies[i] = self._receive(i, handle)
            except WorkerGone as exc:
                replies[i] = ("crash", f"worker {i} died: {exc}")
        for i, (kind, _) in replies.items():
            if kind == "crash":
                self._replace(i)
                self.restarts += 1
        errors = [payload for kind, payload in replies.values() if kind == "env_error"]
        if errors:
            raise EnvError(errors[0])
        return {i: replies[i] for i in requests}

    def _start_all(self) -> None:
        """Launch every worker, then await each; one that dies starting (e.g. its JVM killed) gets one fresh try.
        Anything raised closes what was started."""
        try:
            for i in range(self.size):
                self._launch(i)
            for i in range(self.size):
                try:
                    self._await_start(i)
                except WorkerGone:
                    self._replace(i)
                    try:
                        self._await_start(i)
                    except WorkerGone as exc:
                        raise EnvError(f"{self.env_name} worker {i} failed to start twice: {exc}") from None
        except BaseException:
            self.close()
            raise

    def _await_start(self, i: int) -> None:
        """Wait for worker ``i``'s start-up reply; a start-up EnvError (e.g. Java missing) is raised as is."""
        if self._ready[i]:
            return
        kind, payload = self._start_reply(i)
        if kind == "env_error":
            raise EnvError(payload)
        if kind != "ready":
            raise WorkerGone(f"start-up failed: {payload}")
        self._ready[i], self._info[i] = True, payload

    def _replace(self, i: int) -> None:
        self._discard(i)
        self._ready[i], self._info[i] = False, {}
        self._launch(i)

    def _shutdown(self) -> None:
        for i in range(self.size):
            self._discard(i)

    # ------------------------------------------------------------------ the transport, per pool
    @abstractmethod
    def _launch(self, i: int) -> None:
        """Start worker ``i`` (its start-up is awaited by :meth:`_start_reply`)."""

    @abstractmethod
    def _start_reply(self, i: int) -> Reply:
        """Worker ``i``'s start-up reply; raises :class:`WorkerGone` if it died or timed out starting."""

    @abstractmethod
    def _send(self, i: int, method: str, args: tuple) -> Any:
        """Send one request to worker ``i`` without awaiting it; the handle returned is given to :meth:`_receive`."""

    @abstractmethod
    def _receive(self, i: int, handle: Any) -> Reply:
        """Await worker ``i``'s reply; raises :class:`WorkerGone` if it died or timed out."""

    @abstractmethod
    def _discard(self, i: int) -> None:
        """Stop worker ``i`` and everything it started (also one that is broken or was never started)."""
