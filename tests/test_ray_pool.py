"""RayEnvPool on a local Ray instance with real ScienceWorld actors: parallel play, an actor killed mid-episode."""

from __future__ import annotations

import os
import signal

import psutil
import pytest

ray = pytest.importorskip("ray")  # in the dev extra; skipped (= not tested) only where Ray is not installed

from empo2.envs.failures import Failure  # noqa: E402
from empo2.envs.ray_pool import RayEnvPool  # noqa: E402

TASK = "find-animal"


def _alive(pid: int) -> bool:
    try:
        return psutil.Process(pid).status() != psutil.STATUS_ZOMBIE
    except psutil.NoSuchProcess:
        return False


@pytest.mark.slow
def test_killed_actor_gives_failed_episode_and_a_fresh_actor():
    ray.init(num_cpus=2, include_dashboard=False, log_to_driver=False)
    try:
        pool = RayEnvPool("scienceworld", {}, 2, start_timeout=900)  # JVM start-up is slow on a loaded CI box
        replies = pool.reset([(0, TASK, 0), (1, TASK, 1)])
        assert [r[1]["variation"] for r in replies.values()] == [0, 1]
        first = pool.step({0: "look around", 1: "look around"})
        assert not any(r.done for r in first.values())

        old_pid, old_java = pool.worker_pids()[1], pool.java_pids()[1]
        os.kill(old_pid, signal.SIGKILL)  # the actor's process dies mid-episode
        results = pool.step({0: "look around", 1: "look around"})
        assert results[1].done and results[1].reward == 0 and results[1].info["failed"] is True
        assert results[1].info["error"] and "failed" not in results[0].info and not results[0].done
        assert pool.restarts == 1 and pool.worker_pids()[1] != old_pid

        again = pool.reset([(1, TASK, 2)])  # the replacement actor plays a new episode
        assert not isinstance(again[1], Failure) and again[1][1]["variation"] == 2
        assert pool.call(1, "valid_actions")
        assert not _alive(old_java)  # the dead actor's JVM was not left behind
        javas = [p for p in pool.java_pids().values() if p]
        pool.close()
        assert not any(_alive(p) for p in javas)
    finally:
        ray.shutdown()
