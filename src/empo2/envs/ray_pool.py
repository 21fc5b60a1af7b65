"""Environment workers as Ray actors (``env.pool: ray``; ``pip install 'empo2[ray]'``).

The same pool as :class:`empo2.envs.pool.EnvPool` (:class:`~empo2.envs.pool_base.WorkerPool`'s requests, replies
and crash handling), so the trainer and rollouts do not know which one they drive. Use it to put environments on
other machines than the GPUs: ``ray start --head`` on one node, ``ray start --address=HEAD:6379`` on the CPU nodes,
then train with ``RAY_ADDRESS=HEAD:6379`` (or ``auto``) and ``env.pool=ray``. Without ``RAY_ADDRESS`` a local Ray
instance starts.

A dead actor (its process killed, its node gone, or its JVM crashed) is replaced by a fresh one and its episode
comes back failed, exactly as the process pool does.
"""

from __future__ import annotations

import os
import pickle
import sys
from typing import Any

import psutil

from empo2.envs.base import EnvError
from empo2.envs.pool_base import Reply, WorkerGone, WorkerPool, close_quietly, open_env, quiet_worker_logs, serve


class _EnvActor:
    """Runs inside a Ray worker process: one environment built by the pickled ``factory(**env_kwargs)``, served
    request by request. The constructor never raises: a failed start is its start-up reply, as in a worker process.

    The driver's ``sys.path`` comes along and the factory is unpickled only after it is added, so the actor imports
    what a spawned worker process would (Ray itself adds only the driver's script folder and working folder)."""

    def __init__(self, pickled_factory: bytes, env_kwargs: dict, driver_path: list[str]):
        quiet_worker_logs()
        sys.path.extend(p for p in driver_path if p not in sys.path)
        try:
            factory = pickle.loads(pickled_factory)
        except Exception as exc:  # noqa: BLE001 - fails the same on every try: the user's to fix, not a crash
            self.env, self.started = None, ("env_error", f"the environment's constructor cannot be imported on "
                                                         f"Ray node {_node_ip()}: {type(exc).__name__}: {exc}")
            return
        self.env, self.started = open_env(factory, env_kwargs)
        if self.env is not None:
            self.started[1]["node"] = _node_ip()

    def start_reply(self) -> Reply:
        return self.started

    def call(self, method: str, args: tuple) -> Reply:
        return serve(self.env, method, args)

    def close(self) -> None:
        if self.env is not None:
            close_quietly(self.env)


def _node_ip() -> str:
    import ray

    return ray.util.get_node_ip_address()


def _first_line(exc: Exception) -> str:
    """Ray's errors run to many lines (tracebacks, hints); the first says what happened."""
    return f"{type(exc).__name__}: {(str(exc).splitlines() or [''])[0][:200]}"


def _import_ray():
    try:
        import ray
    except ImportError as exc:
        raise EnvError(f"env.pool=ray needs Ray: pip install 'empo2[ray]' ({exc})") from None
    return ray


class RayEnvPool(WorkerPool):
    """``size`` Ray actors (one CPU each), each hosting the registered environment ``env_name``.

    The registry entry's constructor is sent to the actors by reference, with the driver's ``sys.path``, as to
    worker processes: an environment registered outside ``src/`` works where its module can be imported.
    ``timeout`` bounds one request (seconds); ``start_timeout`` bounds an actor's start (placement and JVM launch).
    """

    def __init__(self, env_name: str, env_kwargs: dict | None = None, size: int = 2, timeout: float = 300.0,
                 start_timeout: float = 300.0):
        super().__init__(env_name, size)
        ray = self._ray = _import_ray()
        if not ray.is_initialized():
            ray.init(address=os.environ.get("RAY_ADDRESS"), include_dashboard=False, log_to_driver=False)
        self.env_kwargs = dict(env_kwargs or {})
        self.timeout, self.start_timeout = timeout, start_timeout
        from empo2.envs.specs import get_env_spec

        self._factory = pickle.dumps(get_env_spec(env_name).factory)
        self._cls = ray.remote(num_cpus=1, max_restarts=0)(_EnvActor)
        self._actors: list[Any] = [None] * size
        self._starting: list[Any] = [None] * size  # each actor's start-up reply, as a Ray object reference
        self._start_all()

    # ------------------------------------------------------------------ the transport: a Ray actor per worker
    def _launch(self, i: int) -> None:
        self._actors[i] = self._cls.remote(self._factory, self.env_kwargs, sys.path)
        self._starting[i] = self._actors[i].start_reply.remote()

    def _start_reply(self, i: int) -> Reply:
        try:
            return self._ray.get(self._starting[i], timeout=self.start_timeout)
        except self._ray.exceptions.GetTimeoutError:  # most often unplaceable: a second try would wait as long
            cpus = self._ray.cluster_resources().get("CPU", 0)
            raise EnvError(f"{self.env_name} Ray actor {i} did not start within {self.start_timeout:.0f} s; each "
                           f"actor takes one CPU, and the Ray cluster has {cpus:g} for this pool's "
                           f"{self.size}") from None
        except Exception as exc:  # noqa: BLE001 - the actor died (RayActorError) or its node is gone
            raise WorkerGone(_first_line(exc)) from None

    def _send(self, i: int, method: str, args: tuple) -> Any:
        return self._actors[i].call.remote(method, args)

    def _receive(self, i: int, handle: Any) -> Reply:
        try:
            return self._ray.get(handle, timeout=self.timeout)
        except Exception as exc:  # noqa: BLE001 - the actor died (RayActorError), timed out, or its node is gone
            raise WorkerGone(_first_line(exc)) from None

    def _discard(self, i: int) -> None:
        """Kill actor ``i``, and its JVM when it ran on this node (a JVM outlives a killed actor)."""
        if self._actors[i] is None:
            return
        try:
            self._ray.kill(self._actors[i], no_restart=True)
        except Exception:  # noqa: BLE001 - already gone
            pass
        self._actors[i] = self._starting[i] = None
        java, node = self._info[i].get("java_pid"), self._info[i].get("node")
        if java and node == _node_ip():
            try:
                proc = psutil.Process(java)
                proc.kill()
                psutil.wait_procs([proc], timeout=5)  # SIGKILL is asynchronous: return once it is gone
            except psutil.NoSuchProcess:
                pass
