"""RayEnvPool on a local Ray instance: real ScienceWorld actors (parallel play, an actor killed mid-episode and
during a restore), and a training run with ``env.pool=ray`` built by the trainer from its config."""

from __future__ import annotations

import json
import os
import signal

import psutil
import pytest

ray = pytest.importorskip("ray")  # in the dev extra; skipped (= not tested) only where Ray is not installed

import empo2  # noqa: E402
from empo2.envs.failures import Failure  # noqa: E402
from empo2.envs.ray_pool import RayEnvPool  # noqa: E402
from helpers.signal_env import checksum_room  # noqa: E402

TASK = "find-animal"


@pytest.fixture(scope="module")
def local_ray():
    ray.init(num_cpus=2, include_dashboard=False, log_to_driver=False)  # one CPU per actor: two actors at a time
    yield
    ray.shutdown()


def _alive(pid: int) -> bool:
    try:
        return psutil.Process(pid).status() != psutil.STATUS_ZOMBIE
    except psutil.NoSuchProcess:
        return False


@pytest.mark.slow
def test_killed_actor_gives_failed_episode_and_a_fresh_actor(local_ray):
    pool = RayEnvPool("scienceworld", {}, 2, start_timeout=900)  # JVM start-up is slow on a loaded CI box
    try:
        replies = pool.reset([(0, TASK, 0), (1, TASK, 1)])
        assert [r[1]["variation"] for r in replies.values()] == [0, 1]
        first = pool.step({0: "look around", 1: "look around"})
        assert not any(r.done for r in first.values())

        old_pid, old_java = pool.worker_pids()[1], pool.java_pids()[1]
        os.kill(old_pid, signal.SIGKILL)  # the actor's process dies mid-episode
        results = pool.step({0: "look around", 1: "look around"})
        assert results[1].done and results[1].reward == 0 and results[1].info["failed"] is True
        assert results[1].info["error"] and "failed" not in results[0].info and not results[0].done
        assert pool.restarts == 1

        again = pool.reset([(1, TASK, 2)])  # the replacement actor plays a new episode
        assert not isinstance(again[1], Failure) and again[1][1]["variation"] == 2
        assert pool.worker_pids()[1] != old_pid and pool.call(1, "valid_actions")
        assert not _alive(old_java)  # the dead actor's JVM was not left behind

        # An actor killed before a restore (ELPO's branching) gives a Failure there too, and a fresh actor
        old_pid = pool.worker_pids()[0]
        os.kill(old_pid, signal.SIGKILL)
        lost = pool.restore([(0, TASK, 0, [["look around"]]), (1, TASK, 2, [["look around"]])])
        assert isinstance(lost[0], Failure) and lost[0].worker == 0 and "died" in lost[0].error
        assert lost[1][1]["steps"] == 1 and pool.restarts == 2
        obs, info = pool.restore([(0, TASK, 0, [["look around"]])])[0]
        assert info["steps"] == 1 and pool.worker_pids()[0] != old_pid
        javas = [p for p in pool.java_pids().values() if p]
    finally:
        pool.close()
    assert not any(_alive(p) for p in javas)


@pytest.mark.slow  # end-to-end training, as test_trainer_api.py's runs
def test_train_with_env_pool_ray_runs_an_iteration_and_the_final_evaluation(tmp_path, tiny_model, embedder, local_ray):
    """``env.pool=ray``, the way docs/scaling.md trains: the trainer builds a RayEnvPool from the config (its build
    and the evaluator ask the pool for variations with ``retries=1``), plays an iteration's episodes on the actors,
    updates, checkpoints and evaluates. ChecksumRoom (tests/helpers/signal_env.py) runs in the actors: Ray's workers import
    it by reference, as spawned worker processes do."""
    run = tmp_path / "run"
    overrides = [f"policy.model={tiny_model}", "env.name=checksum-room", "env.pool=ray", "algo.name=empo2",
                 "algo.num_generations=2", "train.tasks_per_batch=1", "train.iterations=1",
                 "train.mini_batch_size=2", "env.eval_variations=1", "policy.few_shot=0",
                 "policy.max_completion_length=6", "policy.reflection_max_tokens=8", "train.progress=false",
                 "train.report_to=none", "algo.low_prob_threshold=0"]
    with checksum_room():
        cfg = empo2.Config.load(None, overrides)
        with empo2.Trainer(cfg, embedder=embedder, output_dir=run) as trainer:
            pool = trainer.pool
            assert isinstance(pool, RayEnvPool) and pool.size == 2
            final = trainer.train()
            actors = pool.worker_pids()
    assert len(set(actors.values())) == 2 and os.getpid() not in actors.values()  # played in the actors
    (record,) = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]
    assert record["iteration"] == 0 and record["loss"]["rows"] == 2 and record["loss"]["optimizer_steps"] == 1
    assert final["summary"]["episodes"] >= 1 and (run / "eval" / "final.json").is_file()
    with pytest.raises(RuntimeError, match="closed"):  # the trainer closed the pool it made
        pool.step({0: "hello"})
