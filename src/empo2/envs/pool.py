"""Run N text environments in parallel worker processes (one JVM each for ScienceWorld).

The parent talks to each worker over a pipe. :meth:`EnvPool.step` sends every command before reading any reply, so
the workers run at the same time. A worker whose process or JVM dies (or that stops answering) is killed with its
whole process tree and started again; its episode comes back as a failed result and the pool stays usable.
"""

from __future__ import annotations

import logging
import multiprocessing as mp
import os
import signal
from dataclasses import dataclass, field
from typing import Any

import psutil

from empo2.envs.base import EnvError, StepResult
from empo2.envs.failures import (  # noqa: F401 - re-exported: the pool's failure types are part of its API
    EnvFailuresError,
    Failure,
    FailureStreak,
    WorkerError,
    failed_step,
)


class _Dead(Exception):
    """Internal: the worker is gone or silent."""


def _worker_main(conn, factory, env_kwargs: dict) -> None:
    """Worker process: build one environment with ``factory(**env_kwargs)`` (the registry entry's constructor, passed
    as an importable callable so environments registered outside ``src/`` work too), then serve ``(method, args)``
    requests until ``close`` or EOF."""
    # Ctrl-C, preemption and a closed terminal are the parent's business; it closes us
    for signum in (signal.SIGINT, signal.SIGTERM, signal.SIGHUP):
        signal.signal(signum, signal.SIG_IGN)
    logging.getLogger("py4j").setLevel(logging.CRITICAL)  # a dead JVM is reported to the parent, not logged here
    # py4j also calls the module-level logging.exception(), which would install a stderr handler on the root logger
    # and print a traceback under the parent's one-line error; a handler on root stops that.
    logging.getLogger().addHandler(logging.NullHandler())
    try:
        env = factory(**env_kwargs)
    except BaseException as exc:  # noqa: BLE001 - report everything, the parent decides
        conn.send(("env_error" if isinstance(exc, EnvError) else "crash", f"{type(exc).__name__}: {exc}"))
        return
    java_pid = env.java_pid() if hasattr(env, "java_pid") else None
    conn.send(("ready", {"pid": os.getpid(), "java_pid": java_pid}))
    try:
        while True:
            try:
                method, args = conn.recv()
            except (EOFError, OSError):
                break
            if method == "close":
                break
            try:
                reply = ("ok", getattr(env, method)(*args))
            except EnvError as exc:
                reply = ("env_error", str(exc))
            except Exception as exc:  # noqa: BLE001 - the JVM died or the env broke: the parent restarts us
                reply = ("crash", f"{type(exc).__name__}: {exc}")
            try:
                conn.send(reply)
            except OSError:  # the parent is gone (killed): nobody to answer, and nothing to print
                break
            if reply[0] == "crash":
                break
    finally:
        try:
            env.close()
        except Exception:  # noqa: BLE001
            pass


@dataclass
class _Slot:
    process: Any
    conn: Any
    ready: bool = False
    procs: list = field(default_factory=list)  # psutil handles of the worker and its JVM (safe against pid reuse)
    java_pid: int | None = None


class EnvPool:
    """``size`` worker processes (spawn context), each hosting the registered environment ``env_name``.

    ``timeout`` bounds one request (seconds); ``start_timeout`` bounds a worker's start (JVM launch).
    """

    def __init__(self, env_name: str, env_kwargs: dict | None = None, size: int = 2, timeout: float = 300.0,
                 start_timeout: float = 180.0):
        if size < 1:
            raise ValueError("EnvPool size must be >= 1")
        self.env_name, self.env_kwargs, self.size = env_name, dict(env_kwargs or {}), size
        self.timeout, self.start_timeout = timeout, start_timeout
        self.restarts = 0
        from empo2.envs.registry import get_env_spec

        self._factory = get_env_spec(env_name).factory
        self._ctx = mp.get_context("spawn")
        self._slots: list[_Slot | None] = [None] * size
        self._all_procs: list[psutil.Process] = []  # every worker/JVM ever started, for close()
        self._closed = False
        try:
            for i in range(size):
                self._spawn(i)
            for i in range(size):
                self._start_with_retry(i)
        except BaseException:
            self.close()
            raise

    # ------------------------------------------------------------------ public API
    def reset(self, assignments: list[tuple[int, str, int]]) -> dict[int, tuple[str, dict] | Failure]:
        """Reset worker ``i`` to ``(task, variation)`` for each assignment, in parallel.

        A crashed worker gives a :class:`Failure` (and is restarted); an :class:`EnvError` (unknown task, variation
        out of range) is raised once every reply is in.
        """
        replies = self._request({i: ("reset", (task, variation)) for i, task, variation in assignments})
        return {i: Failure(i, payload) if kind == "crash" else payload for i, (kind, payload) in replies.items()}

    def restore(self, assignments: list[tuple[int, str, int, list[list[str]]]]) -> dict[int, tuple[str, dict] | Failure]:
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

        A crash restarts the worker and raises :class:`WorkerError`, after ``retries`` more tries on the fresh
        worker (only for calls that do not depend on the episode state, such as ``variations``).
        """
        for _attempt in range(retries + 1):
            kind, payload = self._request({i: (method, args)})[i]
            if kind != "crash":
                return payload
        raise WorkerError(f"worker {i} crashed during {method}(): {payload}; it has been restarted")

    def java_pids(self) -> dict[int, int | None]:
        """Current JVM process id of each worker (``None`` for environments without a JVM or not yet started)."""
        return {i: slot.java_pid if slot else None for i, slot in enumerate(self._slots)}

    def worker_pids(self) -> dict[int, int]:
        return {i: slot.process.pid for i, slot in enumerate(self._slots) if slot}

    def started_pids(self) -> list[int]:
        """Every worker and JVM process id this pool has started (restarts included)."""
        return [p.pid for p in self._all_procs]

    def close(self) -> None:
        """Stop every worker and kill whatever remains of their process trees (JVMs included). Idempotent."""
        if self._closed:
            return
        self._closed = True
        for slot in self._slots:
            if slot is not None:
                try:
                    slot.conn.send(("close", ()))
                except (OSError, ValueError):
                    pass
        for slot in self._slots:
            if slot is not None:
                slot.process.join(timeout=10)
                self._kill(slot)
        _kill_tree(self._all_procs)

    def __enter__(self) -> EnvPool:
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    def __del__(self):
        try:
            self.close()
        except Exception:  # noqa: BLE001
            pass

    # ------------------------------------------------------------------ internals
    def _request(self, requests: dict[int, tuple[str, tuple]]) -> dict[int, tuple[str, Any]]:
        """Send all requests, then read all replies; restart crashed workers; raise EnvError after collecting."""
        if self._closed:
            raise RuntimeError("EnvPool is closed")
        for i in requests:
            if not 0 <= i < self.size:
                raise IndexError(f"worker index {i} out of range 0..{self.size - 1}")
        replies: dict[int, tuple[str, Any]] = {}
        sent = []
        for i, message in requests.items():
            try:
                self._ensure_ready(i)
                self._slots[i].conn.send(message)
                sent.append(i)
            except (_Dead, OSError, ValueError) as exc:
                replies[i] = ("crash", f"worker {i} unavailable: {exc}")
            except EnvError as exc:  # a restarted worker could not start; keep reading the others' replies
                replies[i] = ("env_error", str(exc))
        for i in sent:
            try:
                replies[i] = self._recv(i, self.timeout)
            except _Dead as exc:
                replies[i] = ("crash", f"worker {i} died: {exc}")
        for i, (kind, _) in replies.items():
            if kind == "crash":
                self._restart(i)
        errors = [payload for kind, payload in replies.values() if kind == "env_error"]
        if errors:
            raise EnvError(errors[0])
        return {i: replies[i] for i in requests}

    def _spawn(self, i: int) -> None:
        parent, child = self._ctx.Pipe()
        process = self._ctx.Process(target=_worker_main, args=(child, self._factory, self.env_kwargs),
                                    name=f"empo2-env-{i}", daemon=True)
        try:
            process.start()
        except BlockingIOError:  # the process limit, reached by other processes since the check before the pool
            raise EnvError(f"cannot start {self.env_name} worker {i}: the process limit (ulimit -u) is reached; "
                           "use fewer environment workers, or raise the limit") from None
        child.close()
        slot = _Slot(process, parent)
        slot.procs.append(psutil.Process(process.pid))
        self._all_procs.append(slot.procs[0])
        self._slots[i] = slot

    def _start_with_retry(self, i: int) -> None:
        """Await worker ``i``'s start; one that dies starting (e.g. its JVM was killed) gets one fresh try."""
        try:
            self._ensure_ready(i)
            return
        except _Dead:
            self._restart(i)
        try:
            self._ensure_ready(i)
        except _Dead as exc:
            raise EnvError(f"{self.env_name} worker {i} failed to start twice: {exc}") from None

    def _ensure_ready(self, i: int) -> None:
        """Wait for worker ``i``'s start-up message; a start-up EnvError (e.g. Java missing) is raised as is."""
        slot = self._slots[i]
        if slot.ready:
            return
        kind, payload = self._recv(i, self.start_timeout)
        if kind == "env_error":
            raise EnvError(payload.split(": ", 1)[-1])
        if kind != "ready":
            raise _Dead(f"start-up failed: {payload}")
        slot.ready = True
        slot.java_pid = payload["java_pid"]
        if slot.java_pid is not None:
            try:
                handle = psutil.Process(slot.java_pid)
                slot.procs.append(handle)
                self._all_procs.append(handle)
            except psutil.NoSuchProcess:
                pass

    def _recv(self, i: int, timeout: float) -> tuple[str, Any]:
        conn = self._slots[i].conn
        try:
            if not conn.poll(timeout):
                raise _Dead(f"no reply within {timeout:.0f} s")
            return conn.recv()
        except (EOFError, OSError) as exc:
            raise _Dead(f"process ended ({type(exc).__name__})") from None

    def _restart(self, i: int) -> None:
        """Kill worker ``i``'s tree and start a fresh worker (its start-up is awaited lazily, on next use)."""
        self._kill(self._slots[i])
        self.restarts += 1
        self._spawn(i)

    def _kill(self, slot: _Slot) -> None:
        try:
            slot.conn.close()
        except OSError:
            pass
        _kill_tree(slot.procs)
        slot.process.join(timeout=5)


def _kill_tree(procs: list[psutil.Process]) -> None:
    """SIGKILL the given processes and all their descendants; wait for them."""
    victims = []
    for proc in procs:
        try:
            victims += [proc] + proc.children(recursive=True)
        except psutil.NoSuchProcess:
            pass
    for proc in victims:
        try:
            proc.kill()
        except psutil.NoSuchProcess:
            pass
    psutil.wait_procs(victims, timeout=5)


def make_pool(kind: str, env_name: str, env_kwargs: dict | None, size: int):
    """``env.pool``: ``process`` (:class:`EnvPool`, local worker processes) or ``ray`` (Ray actors, any node)."""
    if kind == "ray":
        from empo2.envs.ray_pool import RayEnvPool

        return RayEnvPool(env_name, env_kwargs, size)
    return EnvPool(env_name, env_kwargs, size)

