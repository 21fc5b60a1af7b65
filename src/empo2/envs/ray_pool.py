"""Environment workers as Ray actors (``env.pool: ray``; ``pip install 'empo2[ray]'``).

The same interface as :class:`empo2.envs.pool.EnvPool` (``reset``, ``step``, ``call``, ``restarts``, ``close``), so
the trainer and rollouts do not know which one they drive. Use it to put environments on other machines than the
GPUs: ``ray start --head`` on one node, ``ray start --address=HEAD:6379`` on the CPU nodes, then train with
``RAY_ADDRESS=HEAD:6379`` (or ``auto``) and ``env.pool=ray``. Without ``RAY_ADDRESS`` a local Ray instance starts.

A dead actor (its process killed, its node gone, or its JVM crashed) is replaced by a fresh one and its episode
comes back failed, exactly as the process pool does. Requests to all actors are sent before any reply is awaited.
"""

from __future__ import annotations

import logging
import os
from typing import Any

import psutil

from empo2.envs.base import EnvError, StepResult
from empo2.envs.failures import Failure, WorkerError, failed_step


class _EnvActor:
    """Runs inside a Ray worker process: one environment, served method by method."""

    def __init__(self, env_name: str, env_kwargs: dict):
        logging.getLogger("py4j").setLevel(logging.CRITICAL)
        from empo2.envs import make_env

        self.env = make_env(env_name, **env_kwargs)

    def info(self) -> dict:
        java = self.env.java_pid() if hasattr(self.env, "java_pid") else None
        return {"pid": os.getpid(), "java_pid": java, "node": _node_ip()}

    def call(self, method: str, args: tuple) -> tuple[str, Any]:
        try:
            return "ok", getattr(self.env, method)(*args)
        except EnvError as exc:
            return "env_error", str(exc)
        except Exception as exc:  # noqa: BLE001 - the JVM died or the env broke: the pool replaces this actor
            return "crash", f"{type(exc).__name__}: {exc}"

    def close(self) -> None:
        self.env.close()


def _node_ip() -> str:
    import ray

    return ray.util.get_node_ip_address()


def _import_ray():
    try:
        import ray
    except ImportError as exc:
        raise EnvError(f"env.pool=ray needs Ray: pip install 'empo2[ray]' ({exc})") from None
    return ray


class RayEnvPool:
    """``size`` Ray actors, each hosting ``make_env(env_name, **env_kwargs)`` (one CPU each)."""

    def __init__(self, env_name: str, env_kwargs: dict | None = None, size: int = 2, timeout: float = 300.0,
                 start_timeout: float = 300.0):
        if size < 1:
            raise ValueError("RayEnvPool size must be >= 1")
        ray = self._ray = _import_ray()
        if not ray.is_initialized():
            ray.init(address=os.environ.get("RAY_ADDRESS"), include_dashboard=False, log_to_driver=False)
        self.env_name, self.env_kwargs, self.size = env_name, dict(env_kwargs or {}), size
        self.timeout, self.start_timeout, self.restarts = timeout, start_timeout, 0
        self._cls = ray.remote(num_cpus=1, max_restarts=0)(_EnvActor)
        self._actors: list[Any] = [None] * size
        self._info: list[dict] = [{}] * size
        self._closed = False
        try:
            for i in range(size):
                self._actors[i] = self._cls.remote(self.env_name, self.env_kwargs)
            infos = ray.get([a.info.remote() for a in self._actors], timeout=start_timeout)
            self._info = list(infos)
        except BaseException as exc:
            self.close()
            if isinstance(exc, EnvError):
                raise
            raise RuntimeError(f"{env_name} Ray actors failed to start: {exc}") from None

    # ------------------------------------------------------------------ public API (as EnvPool)
    def reset(self, assignments: list[tuple[int, str, int]]) -> dict[int, tuple[str, dict] | Failure]:
        replies = self._request({i: ("reset", (task, variation)) for i, task, variation in assignments})
        return {i: Failure(i, payload) if kind == "crash" else payload for i, (kind, payload) in replies.items()}

    def restore(self, assignments: list[tuple[int, str, int, list[list[str]]]]) -> dict[int, tuple[str, dict] | Failure]:
        """Put worker ``i`` into the state after a recorded prefix, ``(i, task, variation, step_commands)`` each, in
        parallel (the environment's ``restore_prefix``); failures and errors as :meth:`reset`."""
        replies = self._request({i: ("restore_prefix", (task, variation, steps))
                                 for i, task, variation, steps in assignments})
        return {i: Failure(i, payload) if kind == "crash" else payload for i, (kind, payload) in replies.items()}

    def step(self, actions: dict[int, str]) -> dict[int, StepResult]:
        replies = self._request({i: ("step", (action,)) for i, action in actions.items()})
        return {i: failed_step(payload) if kind == "crash" else payload for i, (kind, payload) in replies.items()}

    def call(self, i: int, method: str, *args: Any) -> Any:
        kind, payload = self._request({i: (method, args)})[i]
        if kind == "crash":
            raise WorkerError(f"actor {i} crashed during {method}(): {payload}; it has been restarted")
        return payload

    def java_pids(self) -> dict[int, int | None]:
        return {i: info.get("java_pid") for i, info in enumerate(self._info)}

    def worker_pids(self) -> dict[int, int]:
        return {i: info["pid"] for i, info in enumerate(self._info) if info}

    def close(self) -> None:
        """Stop every actor (and, on this node, its JVM). Idempotent; leaves Ray itself running."""
        if self._closed:
            return
        self._closed = True
        for i, actor in enumerate(self._actors):
            if actor is not None:
                self._stop(i)

    def __enter__(self) -> RayEnvPool:
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    # ------------------------------------------------------------------ internals
    def _request(self, requests: dict[int, tuple[str, tuple]]) -> dict[int, tuple[str, Any]]:
        if self._closed:
            raise RuntimeError("RayEnvPool is closed")
        for i in requests:
            if not 0 <= i < self.size:
                raise IndexError(f"worker index {i} out of range 0..{self.size - 1}")
        refs = {i: self._actors[i].call.remote(method, args) for i, (method, args) in requests.items()}
        replies = {}
        for i, ref in refs.items():
            try:
                replies[i] = self._ray.get(ref, timeout=self.timeout)
            except Exception as exc:  # noqa: BLE001 - actor died (RayActorError), timed out, or its node is gone
                replies[i] = ("crash", f"actor {i} died: {type(exc).__name__}")
        for i, (kind, _) in replies.items():
            if kind == "crash":
                self._restart(i)
        errors = [payload for kind, payload in replies.values() if kind == "env_error"]
        if errors:
            raise EnvError(errors[0])
        return replies

    def _restart(self, i: int) -> None:
        self._stop(i)
        self.restarts += 1
        self._actors[i] = self._cls.remote(self.env_name, self.env_kwargs)
        self._info[i] = self._ray.get(self._actors[i].info.remote(), timeout=self.start_timeout)

    def _stop(self, i: int) -> None:
        info = self._info[i]
        try:
            self._ray.kill(self._actors[i], no_restart=True)
        except Exception:  # noqa: BLE001 - already gone
            pass
        java = info.get("java_pid")
        if java and info.get("node") == _node_ip():  # a JVM outlives a killed actor; reachable only locally
            try:
                proc = psutil.Process(java)
                proc.kill()
                psutil.wait_procs([proc], timeout=5)  # SIGKILL is asynchronous: return once it is gone
            except psutil.NoSuchProcess:
                pass
