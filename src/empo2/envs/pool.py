"""Run N text environments in parallel worker processes (one JVM each for ScienceWorld).

The parent talks to each worker over a pipe; the requests and what a crash gives are :class:`WorkerPool`'s. A worker
whose process or JVM dies (or that stops answering) is killed with its whole process tree and started again; its
episode comes back as a failed result and the pool stays usable.
"""

from __future__ import annotations

import multiprocessing as mp
import signal
from dataclasses import dataclass, field
from typing import Any

import psutil

from empo2.envs.base import EnvError
from empo2.envs.failures import (  # noqa: F401 - re-exported: the pool's failure types are part of its API
    EnvFailuresError,
    Failure,
    FailureStreak,
    WorkerError,
    failed_step,
)
from empo2.envs.pool_base import Reply, WorkerGone, WorkerPool, close_quietly, open_env, quiet_worker_logs, serve


def _worker_main(conn, factory, env_kwargs: dict) -> None:
    """Worker process: build one environment with ``factory(**env_kwargs)`` (the registry entry's constructor, passed
    as an importable callable so environments registered outside ``src/`` work too), then serve ``(method, args)``
    requests until ``close`` or EOF."""
    # Ctrl-C, preemption and a closed terminal are the parent's business; it closes us
    for signum in (signal.SIGINT, signal.SIGTERM, signal.SIGHUP):
        signal.signal(signum, signal.SIG_IGN)
    quiet_worker_logs()
    env, started = open_env(factory, env_kwargs)
    conn.send(started)
    if env is None:
        return
    try:
        while True:
            try:
                method, args = conn.recv()
            except (EOFError, OSError):
                break
            if method == "close":
                break
            reply = serve(env, method, args)
            try:
                conn.send(reply)
            except OSError:  # the parent is gone (killed): nobody to answer, and nothing to print
                break
            if reply[0] == "crash":
                break
    finally:
        close_quietly(env)


@dataclass
class _Slot:
    process: Any
    conn: Any
    procs: list = field(default_factory=list)  # psutil handles of the worker and its JVM (safe against pid reuse)


class EnvPool(WorkerPool):
    """``size`` worker processes (spawn context), each hosting the registered environment ``env_name``.

    ``timeout`` bounds one request (seconds); ``start_timeout`` bounds a worker's start (JVM launch).
    """

    def __init__(self, env_name: str, env_kwargs: dict | None = None, size: int = 2, timeout: float = 300.0,
                 start_timeout: float = 180.0):
        super().__init__(env_name, size)
        self.env_kwargs = dict(env_kwargs or {})
        self.timeout, self.start_timeout = timeout, start_timeout
        from empo2.envs.specs import get_env_spec

        self._factory = get_env_spec(env_name).factory
        self._ctx = mp.get_context("spawn")
        self._slots: list[_Slot | None] = [None] * size
        self._all_procs: list[psutil.Process] = []  # every worker/JVM ever started, for close()
        self._start_all()

    def started_pids(self) -> list[int]:
        """Every worker and JVM process id this pool has started (restarts included)."""
        return [p.pid for p in self._all_procs]

    def __del__(self):
        try:
            self.close()
        except Exception:  # noqa: BLE001
            pass

    # ------------------------------------------------------------------ the transport: a pipe per worker process
    def _launch(self, i: int) -> None:
        parent, child = self._ctx.Pipe()
        process = self._ctx.Process(target=_worker_main, args=(child, self._factory, self.env_kwargs),
                                    name=f"empo2-env-{i}", daemon=True)
        try:
            process.start()
        except BlockingIOError:  # the process limit, reached by other processes since the check before the pool
            raise EnvError(f"cannot start {self.env_name} worker {i}: the process limit (ulimit -u) is reached; "
                           "use fewer environment workers, or raise the limit") from None
        child.close()
        slot = _Slot(process, parent, [psutil.Process(process.pid)])
        self._all_procs.append(slot.procs[0])
        self._slots[i] = slot

    def _start_reply(self, i: int) -> Reply:
        kind, payload = reply = self._recv(i, self.start_timeout)
        if kind == "ready" and payload["java_pid"] is not None:  # the JVM is killed with the worker, by its handle
            try:
                handle = psutil.Process(payload["java_pid"])
                self._slots[i].procs.append(handle)
                self._all_procs.append(handle)
            except psutil.NoSuchProcess:
                pass
        return reply

    def _send(self, i: int, method: str, args: tuple) -> int:
        try:
            self._slots[i].conn.send((method, args))
        except (OSError, ValueError) as exc:
            raise WorkerGone(f"{type(exc).__name__}: {exc}") from None
        return i

    def _receive(self, i: int, handle: int) -> Reply:
        return self._recv(i, self.timeout)

    def _recv(self, i: int, timeout: float) -> Reply:
        conn = self._slots[i].conn
        try:
            if not conn.poll(timeout):
                raise WorkerGone(f"no reply within {timeout:.0f} s")
            return conn.recv()
        except (EOFError, OSError) as exc:
            raise WorkerGone(f"process ended ({type(exc).__name__})") from None

    def _discard(self, i: int) -> None:
        """Kill worker ``i``'s process tree (its JVM included)."""
        slot = self._slots[i]
        if slot is None:
            return
        try:
            slot.conn.close()
        except OSError:
            pass
        _kill_tree(slot.procs)
        slot.process.join(timeout=5)

    def _shutdown(self) -> None:
        """Ask every worker to close its environment, then kill whatever remains of their process trees."""
        for slot in self._slots:
            if slot is not None:
                try:
                    slot.conn.send(("close", ()))
                except (OSError, ValueError):
                    pass
        for i, slot in enumerate(self._slots):
            if slot is not None:
                slot.process.join(timeout=10)
                self._discard(i)
        _kill_tree(self._all_procs)


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


def make_pool(kind: str, env_name: str, env_kwargs: dict | None, size: int) -> WorkerPool:
    """``env.pool``: ``process`` (:class:`EnvPool`, local worker processes) or ``ray`` (Ray actors, any node)."""
    if kind == "ray":
        from empo2.envs.ray_pool import RayEnvPool

        return RayEnvPool(env_name, env_kwargs, size)
    return EnvPool(env_name, env_kwargs, size)
