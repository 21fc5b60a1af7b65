"""EnvPool with real ScienceWorld workers: parallel steps, a JVM killed mid-episode, no leaked processes; the same
JVM killed under LocalEnvPool; the request methods every pool shares."""

from __future__ import annotations

import inspect
import os
import signal
import time
from functools import partial

import psutil
import pytest

from empo2.envs import make_env
from empo2.envs.base import EnvError
from empo2.envs.local_pool import LocalEnvPool
from empo2.envs.pool import EnvPool, Failure
from empo2.envs.pool_base import WorkerPool
from empo2.envs.ray_pool import RayEnvPool
from empo2.episodes.protocols import EnvWorkers

slow = pytest.mark.slow  # real simulators: `pytest -m "not slow"` skips them

TASK = "find-animal"


def test_every_pool_serves_the_requests_written_once():
    """The three pools take their requests from WorkerPool and none redefines one, so a keyword one of them lacks
    (``call(..., retries=1)``) cannot come back; the rollouts' structural type has the same ``call``."""
    requests = ("reset", "restore", "step", "call", "close", "java_pids", "worker_pids", "_request")
    for pool in (EnvPool, LocalEnvPool, RayEnvPool):
        assert issubclass(pool, WorkerPool) and not [m for m in requests if m in vars(pool)], pool
    assert inspect.signature(EnvWorkers.call) == inspect.signature(WorkerPool.call)
    assert "retries" in inspect.signature(EnvWorkers.call).parameters
    assert [n for n in ("reset", "restore", "step", "call") if not hasattr(EnvWorkers, n)] == []


@pytest.fixture(scope="module")
def pool():
    p = EnvPool("scienceworld", {}, size=4)
    yield p
    p.close()


def alive(pid: int) -> bool:
    try:
        return psutil.Process(pid).status() != psutil.STATUS_ZOMBIE
    except psutil.NoSuchProcess:
        return False


def command_of(c: psutil.Process, name_only: bool = False) -> str:
    """Its command line (or name), or "" for a process that has exited while being looked at."""
    try:
        return c.name() if name_only else " ".join(c.cmdline())
    except psutil.NoSuchProcess:
        return ""


@slow
def test_a_group_fetches_its_demonstration_once(pool):
    """The G rollouts of a group (same task and variation) share one demonstration: one worker plays the gold
    trajectories, the others get the text from the rollout context. (Workers used to write their own, and the
    simulator's gold path can differ from one reset to the next, so a group's prompts could differ.)"""
    from types import SimpleNamespace

    from empo2.episodes.rollout import RolloutContext, run_episodes
    from empo2.policy.generate import Generation

    asked = []
    real_call = pool.call

    def counting_call(i, method, *args, **kwargs):
        asked.append(method)
        return real_call(i, method, *args, **kwargs)

    pool.call = counting_call
    try:
        cfg = SimpleNamespace(few_shot=1, history_window=2, max_prompt_length=1024)
        ctx = RolloutContext(None, None, pool, None, None, "scienceworld", cfg, None)
        look = lambda ctx, active, eps, prompts: [Generation([], [], "look around") for _ in active]  # noqa: E731
        episodes, _ = run_episodes(ctx, [(TASK, 3, 0, "on")] * 4, actions=look)
        assert asked.count("demonstration") == 1
        (key, demo), = ctx.demonstrations.items()
        assert key == (TASK, 3, 1) and demo.startswith("Task:") and demo.count("\n> ") >= 2
        assert all(not ep.failed and ep.steps for ep in episodes)
        run_episodes(ctx, [(TASK, 3, 0, "on")] * 2, actions=look)
        assert asked.count("demonstration") == 1  # the next rollout asks no worker again
    finally:
        pool.call = real_call


@slow
def test_four_workers_play_in_parallel(pool):
    pids = pool.java_pids()
    assert len(set(pids.values())) == 4 and all(alive(p) for p in pids.values())
    assert len(set(pool.worker_pids().values())) == 4
    replies = pool.reset([(i, TASK, i) for i in range(4)])
    assert all(isinstance(r, tuple) and r[1]["variation"] == i for i, r in replies.items())
    golds = {i: pool.call(i, "gold_actions") for i in range(4)}
    returns, done = {i: float(r[1]["initial_score"]) for i, r in replies.items()}, {}
    for t in range(max(map(len, golds.values()))):
        actions = {i: g[t] for i, g in golds.items() if i not in done and t < len(g)}
        if not actions:
            break
        for i, result in pool.step(actions).items():
            returns[i] += result.reward
            if result.done:
                done[i] = result
    assert returns == {i: 100.0 for i in range(4)}
    assert all(r.info["success"] for r in done.values())


@slow
def test_call_and_env_errors_keep_pool_usable(pool):
    demo = pool.call(0, "demonstration", TASK, 0)
    assert demo.startswith("Task: ") and "> " in demo
    assert isinstance(pool.call(1, "valid_actions"), list)
    with pytest.raises(EnvError, match="valid tasks"):
        pool.reset([(0, "find-unicorn", 0), (1, TASK, 0)])
    obs, info = pool.reset([(0, TASK, 3)])[0]
    assert info["variation"] == 3 and pool.restarts == 0


@slow
def test_killed_jvm_gives_failed_episode_and_restarted_worker(pool):
    pool.reset([(i, TASK, 10 + i) for i in range(4)])
    pool.step({i: "look around" for i in range(4)})
    old_java = pool.java_pids()[2]
    os.kill(old_java, signal.SIGKILL)
    results = pool.step({i: "look around" for i in range(4)})
    failed = results[2]
    assert failed.done and failed.reward == 0
    assert failed.info["failed"] is True and failed.info["success"] is False and failed.info["score"] == 0
    assert failed.info["error"]
    assert all(not results[i].done and "failed" not in results[i].info for i in (0, 1, 3))
    assert pool.restarts == 1

    replies = pool.reset([(2, TASK, 12)])
    assert not isinstance(replies[2], Failure) and replies[2][1]["variation"] == 12
    assert pool.java_pids()[2] != old_java and not alive(old_java)
    total = float(replies[2][1]["initial_score"])
    for action in pool.call(2, "gold_actions"):
        result = pool.step({2: action})[2]
        total += result.reward
        if result.done:
            break
    assert total == 100 and result.info["success"]


@slow
def test_missing_java_fails_fast_without_leaks(monkeypatch):
    monkeypatch.setenv("PATH", "/nonexistent")
    def children() -> set[int]:  # multiprocessing's own resource tracker may appear and stay; it is not ours
        return {c.pid for c in psutil.Process().children(recursive=True)
                if alive(c.pid) and "resource_tracker" not in command_of(c)}

    before = children()
    with pytest.raises(EnvError, match="openjdk-17-jre-headless"):
        EnvPool("scienceworld", {}, size=1)
    time.sleep(0.2)
    assert children() <= before


@slow
def test_close_ends_every_jvm(pool):
    started = pool.started_pids()
    javas = [p for p in started if alive(p) and "java" in psutil.Process(p).name()]
    assert len(javas) == 4  # one live JVM per worker before closing (the killed one is gone)
    pool.close()
    assert not any(alive(p) for p in started)
    ours = [c for c in psutil.Process().children(recursive=True) if alive(c.pid)]
    assert not [c for c in ours if "java" in command_of(c, name_only=True)]
    with pytest.raises(RuntimeError, match="closed"):
        pool.step({0: "look around"})


@slow
def test_local_pool_replaces_an_environment_whose_jvm_was_killed():
    """LocalEnvPool (ScienceWorld in this process): the episode whose JVM died fails, the others go on, and a fresh
    environment plays the next episode, as in the process and Ray pools."""
    with LocalEnvPool(partial(make_env, "scienceworld"), 2) as local:
        local.reset([(0, TASK, 0), (1, TASK, 1)])
        old_java = local.java_pids()[1]
        os.kill(old_java, signal.SIGKILL)
        results = local.step({0: "look around", 1: "look around"})
        assert results[1].done and results[1].reward == 0 and results[1].info["failed"] is True
        assert results[1].info["error"] and "failed" not in results[0].info and not results[0].done
        assert local.restarts == 1
        obs, info = local.reset([(1, TASK, 2)])[1]
        assert info["variation"] == 2 and local.java_pids()[1] not in (None, old_java) and not alive(old_java)
        javas = list(local.java_pids().values())
    assert not any(alive(p) for p in javas)
