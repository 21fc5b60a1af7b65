"""Fault injection: what a user sees when processes, files, disks or inputs go wrong (issue 10).

Everything here is real: `empo2` runs as a subprocess (its own process group), on real ScienceWorld JVMs, real SQLite
files and, for the full disk, a real tmpfs mounted for the test (needs root; skipped otherwise). Training runs use the
tiny random model of tests/conftest.py, because the model is not what these tests are about.

Each test checks what the user cares about: the exit code, the one-line message, files byte-identical, no tip lost,
no iteration repeated, no process left. Scenarios already covered elsewhere, not repeated here:
kill -9 of the whole process group then ``--resume`` (tests/test_train.py::test_kill_mid_iteration_then_resume, which
also checks no JVM is left); a text or random-bytes file as memory.sqlite (tests/test_memory_cli.py::
test_user_errors_exit_2_with_one_line, tests/test_memory_store.py::test_corrupt_and_foreign_files_are_refused_and_untouched);
an unknown config key or task (tests/test_train.py::test_unknown_key_and_task_write_nothing).
"""

from __future__ import annotations

import hashlib
import json
import os
import random
import shutil
import signal
import sqlite3
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
import psutil
import pytest

from empo2.cli import main
from empo2.config import Config
from empo2.memory.store import MemoryStoreError, TipMemory
from empo2.rundir.runlock import LOCK_NAME, RunLock
from helpers.processes import cli_env

REPO = Path(__file__).resolve().parents[1]
FAST = ["env.tasks=[find-animal]", "env.max_steps=2", "env.eval_variations=1", "algo.num_generations=2",
        "policy.few_shot=0", "policy.max_completion_length=8", "policy.reflection_max_tokens=16",
        "train.progress=false", "train.report_to=none", "algo.p_memory=1.0"]


# ------------------------------------------------------------------------------------------------------ helpers
def empo2(*args, env: dict | None = None, timeout: float = 300) -> subprocess.CompletedProcess:
    """Run ``python -m empo2.cli ARGS`` to the end (arguments may be bytes, as a shell passes them)."""
    return subprocess.run([sys.executable, "-m", "empo2.cli", *args], capture_output=True, timeout=timeout, cwd=REPO,
                          env=cli_env(**(env or {})))


def start_train(run: Path, model: str, *overrides: str) -> subprocess.Popen:
    args = [sys.executable, "-m", "empo2.cli", "train", "--config", "configs/scienceworld_cpu.yaml",
            f"train.output_dir={run}", f"policy.model={model}", *FAST, *overrides]
    # SIGINT back to its default in the child: a runner that starts tests in the background leaves it ignored, and
    # Python then never turns Ctrl-C into KeyboardInterrupt
    return subprocess.Popen(args, cwd=REPO, env=cli_env(), stdout=subprocess.DEVNULL, stderr=subprocess.PIPE,
                            start_new_session=True, preexec_fn=lambda: signal.signal(signal.SIGINT, signal.SIG_DFL))


def wait_for(what: str, ready, proc: subprocess.Popen, timeout: float = 400) -> None:
    deadline = time.time() + timeout
    while not ready():
        assert proc.poll() is None, f"the run ended ({proc.returncode}) before {what}: {proc.stderr.read()[-2000:]!r}"
        assert time.time() < deadline, f"timed out waiting for {what}"
        time.sleep(0.1)


def javas(pid: int) -> list[psutil.Process]:
    """The live JVMs below process ``pid``."""
    try:
        kids = psutil.Process(pid).children(recursive=True)
    except psutil.NoSuchProcess:
        return []
    return [p for p in kids if _is_java(p)]


def _is_java(p: psutil.Process) -> bool:
    """A live JVM; a process that exits while it is looked at is not one (a race while a run shuts down)."""
    try:
        return _alive(p) and p.name() == "java"
    except psutil.NoSuchProcess:
        return False


def _alive(p: psutil.Process) -> bool:
    try:
        return p.is_running() and p.status() != psutil.STATUS_ZOMBIE
    except psutil.NoSuchProcess:
        return False


def pid_alive(pid: int) -> bool:
    try:
        return _alive(psutil.Process(pid))
    except psutil.NoSuchProcess:
        return False


def finish(proc: subprocess.Popen, seen: set[int], timeout: float = 600) -> tuple[int, str]:
    """Wait for a run, adding every JVM it starts to ``seen``; return (exit code, stderr)."""
    deadline = time.time() + timeout
    while proc.poll() is None and time.time() < deadline:
        seen |= {p.pid for p in javas(proc.pid)}
        time.sleep(0.2)
    if proc.poll() is None:
        return -1, "(still running)"
    _, err = proc.communicate()
    return proc.returncode, err.decode("utf-8", "replace")


def last_line(stderr: str | bytes) -> str:
    """The message a user reads: the last stderr line, after checking no traceback was printed."""
    text = stderr.decode("utf-8", "replace") if isinstance(stderr, bytes) else stderr
    assert "Traceback" not in text, text[-3000:]
    return text.strip().splitlines()[-1]


def sha(path: Path) -> str:
    return hashlib.sha256(Path(path).read_bytes()).hexdigest()


def tree(folder: Path) -> dict[str, str]:
    return {str(p.relative_to(folder)): sha(p) for p in sorted(Path(folder).rglob("*")) if p.is_file()}


def iterations(run: Path) -> list[int]:
    return [json.loads(line)["iteration"] for line in (run / "metrics.jsonl").read_text().splitlines()]


# ------------------------------------------------------------------------------- 1 + 3: a live run and its neighbours
@pytest.mark.slow
def test_live_run_owns_its_folder_and_survives_a_killed_jvm(tmp_path, tiny_model):
    """While a trainer runs: a second trainer on its folder exits 2 naming the owner (nothing else written),
    ``memory stats`` reads without the lock, and kill -9 of the JVMs costs each its episode only."""
    run = tmp_path / "run"
    # Both workers' JVMs are killed as soon as the first checkpoint exists, so iteration 1's rollout meets dead
    # workers; the checks that start CLI processes (seconds each) come after, while iterations 1-5 keep the run alive
    # (a fast machine finishes a tiny iteration in a few seconds).
    proc = start_train(run, tiny_model, "train.iterations=6")
    seen: set[int] = set()
    try:
        wait_for("the first checkpoint", lambda: (run / "checkpoints" / "iter_000000").is_dir(), proc)
        victims = javas(proc.pid)
        seen |= {p.pid for p in victims}
        assert len(victims) == 2
        for victim in victims:
            victim.kill()
        second = empo2("train", "--resume", str(run))
        assert second.returncode == 2
        msg = last_line(second.stderr)
        assert len(second.stderr.decode().strip().splitlines()) == 1
        assert f"in use by pid {proc.pid} on " in msg and "train" in msg, msg
        stats = empo2("memory", "stats", "--json", "--db", str(run))
        assert stats.returncode == 0, stats.stderr
        assert json.loads(stats.stdout)["path"].endswith("memory.sqlite")
        rc, err = finish(proc, seen)
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
    assert rc == 0, err[-3000:]
    assert iterations(run) == list(range(6))  # the run went on; nothing repeated
    rows = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]
    assert 1 <= sum(r["train"]["failed_episodes"] for r in rows) <= len(victims)  # each dead JVM: its episode only
    assert not [p for p in seen if pid_alive(p)]  # no JVM left
    assert (run / LOCK_NAME).read_text() == ""  # released


@pytest.mark.slow
def test_jvms_killed_in_the_middle_of_a_rollout_cost_their_episodes_only(tmp_path, tiny_model):
    """kill -9 of the JVMs while episodes are between steps (the progress line after a step, with episodes still
    playing): each unfinished episode is lost at its next step and dropped from the update, the novelty reward and
    the rest of the iteration go on, the workers restart, and the next iteration loses nothing. It used to end the run
    with ``ValueError: an episode with steps needs the state its last step reached (final_state)``. Trained in this
    process (the Python API) so that the progress callback can kill at that moment."""
    from empo2 import Trainer

    cfg = Config.load("configs/scienceworld_cpu.yaml", [
        f"policy.model={tiny_model}", *FAST, "algo.num_generations=4", "env.max_steps=3", "train.iterations=3",
        "algo.intrinsic_weight=1.0", "algo.novelty_threshold=1.0", "train.eval_at_start=false"])
    killed: dict[str, int] = {}

    def progress(label: str, done: int, total: int) -> None:
        if killed or not label.endswith("rollouts") or done == total or label.startswith("iter 2"):
            return
        victims = javas(os.getpid())
        for victim in victims:
            victim.kill()
        killed.update(jvms=len(victims), unfinished=total - done, iteration=int(label.split()[1].rstrip(":")))

    with Trainer(cfg, output_dir=tmp_path / "run") as trainer:
        records = [trainer.iteration(it, progress) for it in range(3)]
    assert javas(os.getpid()) == []
    assert killed, "every episode ended at its first step in two iterations: nothing was killed mid-rollout"
    assert killed["jvms"] == 4
    hit = records[killed["iteration"]]
    assert hit["train"]["failed_episodes"] == killed["unfinished"]  # each unfinished episode, no other
    assert (hit["loss"].get("rows", 0) > 0) == (killed["unfinished"] < 4)  # the update trained on the rest
    assert [r["train"]["failed_episodes"] for r in records[killed["iteration"] + 1:]] == [0] * (
        2 - killed["iteration"])  # restarted workers: later iterations lose nothing


@pytest.mark.slow
def test_jvms_that_keep_dying_stop_the_run_with_one_line(tmp_path, tiny_model):
    """N crashed episodes in a row (here N=1) end the run: exit 2, one line, no JVM left, lock released."""
    run = tmp_path / "run"
    proc = start_train(run, tiny_model, "train.iterations=2", "train.max_consecutive_env_failures=1")
    seen: set[int] = set()
    try:
        wait_for("the run to start rolling out", lambda: (run / "config.yaml").is_file(), proc)
        victims = javas(proc.pid)
        assert len(victims) == 2
        for p in victims:
            p.kill()
        rc, err = finish(proc, seen)
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
    assert rc == 2, err[-3000:]
    msg = last_line(err)
    assert msg.startswith("error: ") and "in a row were lost to crashed environment workers" in msg, msg
    assert "train.max_consecutive_env_failures=1" in msg
    # the iteration that met the dead JVMs wrote nothing (the tiny model may finish iteration 0 before they die)
    assert not (run / "metrics.jsonl").exists() or iterations(run) in ([], [0])
    assert seen and not [p for p in seen if pid_alive(p)]  # restarted JVMs included
    assert (run / LOCK_NAME).read_text() == ""


@pytest.mark.slow  # real simulator
def test_crash_during_demonstration_marks_the_episode_failed():
    """The worker-call path of every rollout phase: a JVM killed before ``demonstration()`` fails that episode only,
    the worker is restarted, and the pool keeps serving (the user saw a WorkerError traceback end the run)."""
    from empo2.envs.pool import EnvPool
    from empo2.episodes.episode import Episode
    from empo2.episodes.rollout import call_worker

    with EnvPool("scienceworld", {}, size=1) as pool:
        pool.reset([(0, "find-animal", 0)])
        old = pool.java_pids()[0]
        os.kill(old, signal.SIGKILL)
        ep = Episode("find-animal", 0, 0, "on")
        assert call_worker(pool, ep, 0, "demonstration", "find-animal", 0, 1) is None
        assert ep.failed and ep.done and "crashed during demonstration()" in ep.error
        assert pool.restarts == 1
        obs, info = pool.reset([(0, "find-animal", 1)])[0]
        assert info["variation"] == 1 and pool.java_pids()[0] != old
        assert call_worker(pool, Episode("find-animal", 1, 0, "on"), 0, "task_description")


def test_failure_streak_counts_in_a_row_across_batches():
    from empo2.envs.base import EnvError
    from empo2.envs.pool import FailureStreak

    streak = FailureStreak(3)
    assert streak.update(["crash", None, "crash"]) is True and streak.count == 1  # a good episode resets it
    assert streak.update([None, None]) is False and streak.count == 0
    streak.update(["a", "b"])
    with pytest.raises(EnvError, match=r"3 training episodes in a row .*\(last: c\).*max_consecutive_env_failures=3"):
        streak.update(["c\ntraceback lines", None])


# ----------------------------------------------------------------------------------------------- 1: lock details
def test_lock_names_a_live_owner_and_takes_over_a_dead_ones(tmp_path, capsys):
    """A lock held by a live process refuses a second holder; the file a SIGKILLed holder left is taken over with a
    warning naming it; release clears it. A folder that held nothing but the lock is removed again."""
    run = tmp_path / "run"
    holder = subprocess.Popen([sys.executable, "-c", (
        "import sys, time; from empo2.rundir.runlock import RunLock; lock = RunLock(sys.argv[1]).acquire(); "
        "print('held', flush=True); time.sleep(600)"), str(run)], stdout=subprocess.PIPE, cwd=REPO)
    try:
        assert holder.stdout.readline().strip() == b"held"
        with pytest.raises(Exception, match=rf"in use by pid {holder.pid} on "):
            RunLock(run).acquire()
    finally:
        holder.kill()
        holder.wait()
    with RunLock(run):
        assert f"pid {holder.pid}" in capsys.readouterr().err  # stale owner named in the warning
        assert f"pid {os.getpid()} on " in (run / LOCK_NAME).read_text()
    assert (run / LOCK_NAME).read_text() == ""
    fresh = tmp_path / "fresh"
    with RunLock(fresh):
        pass
    assert not fresh.exists()
    with RunLock(fresh):  # a user deletes the run folder while the run holds it: the release still succeeds
        shutil.rmtree(fresh)
    assert not fresh.exists()


# ----------------------------------------------------------------------------------------- 2: a damaged memory
@pytest.fixture()
def memory_run(tmp_path, tiny_model):
    """A run folder (config + memory of 300 tips + the last checkpoint's copy of it), built without training."""
    run = tmp_path / "run"
    (run / "checkpoints" / "iter_000000").mkdir(parents=True)
    Config.load(REPO / "configs" / "scienceworld_cpu.yaml", [f"policy.model={tiny_model}", f"train.output_dir={run}",
                                                   *FAST]).save(run / "config.yaml")
    rng = np.random.default_rng(0)
    with TipMemory(run / "memory.sqlite") as mem:
        mem.bulk_insert("find-animal", [f"tip number {i}: look for the animal" for i in range(300)],
                        rng.normal(size=(300, 384)), rng.normal(size=(300, 384)))
        mem.copy_to(run / "checkpoints" / "iter_000000" / "memory.sqlite")
    return run


def corrupt(path: Path, where: str, seed: int = 0) -> str:
    """Overwrite 4 KiB of ``path`` with seeded random bytes, 123 bytes into a page (not aligned, as a real fault):
    the middle of the file, or the namespace index's root page, which loading the tips (a table scan) never reads
    (before the quick_check, such a file was accepted and then written to). Returns the new sha256."""
    data = bytearray(path.read_bytes())
    if where == "index":
        conn = sqlite3.connect(path)  # read-write, so closing it removes the -wal/-shm files it opened
        root = conn.execute("SELECT rootpage FROM sqlite_master WHERE name = 'tips_namespace'").fetchone()[0]
        conn.close()
        start = (root - 1) * 4096 + 123
    else:
        start = len(data) // 2 + 123
    data[start:start + 4096] = random.Random(seed).randbytes(4096)
    path.write_bytes(bytes(data))
    return sha(path)


@pytest.mark.parametrize("where", ["middle", "index"])
def test_damaged_memory_is_refused_by_readers_and_writers_untouched(memory_run, where):
    db = memory_run / "memory.sqlite"
    digest = corrupt(db, where)
    copy = memory_run / "checkpoints" / "iter_000000" / "memory.sqlite"
    for args in (["memory", "stats", "--db", str(memory_run)], ["memory", "stats", "--check", "--db", str(db)],
                 ["memory", "search", "--db", str(memory_run), "where is the animal"],
                 ["train", "--resume", str(memory_run)]):
        res = empo2(*args)
        assert res.returncode == 2, (args, res.stderr[-2000:])
        msg = last_line(res.stderr)
        assert "is damaged" in msg and "left unchanged" in msg and f"cp {copy} {db}" in msg, (args, msg)
        assert sha(db) == digest, args
    with pytest.raises(MemoryStoreError, match="is damaged"):
        TipMemory(db)
    assert sha(db) == digest
    assert not (memory_run / "metrics.jsonl").exists() and (memory_run / LOCK_NAME).read_text() == ""
    assert sorted(p.name for p in memory_run.iterdir()) == [LOCK_NAME, "checkpoints", "config.yaml", "memory.sqlite"]

    (db.parent / "memory.sqlite").write_bytes(copy.read_bytes())  # the hint works
    res = empo2("memory", "stats", "--check", "--json", "--db", str(memory_run))
    assert res.returncode == 0 and json.loads(res.stdout)["tips"] == 300


def test_truncated_memory_refused_by_train_resume(memory_run):
    db = memory_run / "memory.sqlite"
    db.write_bytes(db.read_bytes()[: db.stat().st_size // 3])
    digest = sha(db)
    res = empo2("train", "--resume", str(memory_run))
    assert res.returncode == 2 and "memory.sqlite" in last_line(res.stderr)
    assert sha(db) == digest


# ------------------------------------------------------------------------------------------- 4: bad config, early
def test_unknown_advantage_exits_2_before_any_run_folder(tmp_path, tiny_model):
    """Registry names are checked at config load (config/core.py); bounded at 90 s, because without that check the run
    trains until the advantage is first needed."""
    run = tmp_path / "run"
    proc = start_train(run, tiny_model, "algo.advantage=nope", "train.iterations=1")
    try:
        rc, err = finish(proc, set(), timeout=90)
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()
    assert rc == 2 and "algo.advantage" in last_line(err)
    assert not run.exists()


def test_bad_yaml_exits_2_and_writes_nothing(tmp_path, capsys):
    bad = tmp_path / "bad.yaml"
    bad.write_text("train: {iterations: [1,\n")
    run = tmp_path / "run"
    assert main(["train", "--config", str(bad), f"train.output_dir={run}"]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "malformed YAML" in err
    assert sorted(p.name for p in tmp_path.iterdir()) == ["bad.yaml"]


# ------------------------------------------------------------------------------------------------- 5: full disk
@pytest.fixture()
def tiny_disk(tmp_path):
    """A 24 MiB tmpfs mounted for the test (root only; the test is skipped where mount is not permitted)."""
    mnt = tmp_path / "disk"
    mnt.mkdir()
    if subprocess.run(["mount", "-t", "tmpfs", "-o", "size=24m", "tmpfs", str(mnt)], capture_output=True).returncode:
        pytest.skip("mounting a tmpfs needs root")
    yield mnt
    subprocess.run(["umount", "-l", str(mnt)], check=False)


def fill(folder: Path) -> None:
    """Write zeros into ``folder/filler`` until the file system is full."""
    with open(folder / "filler", "wb") as fh:
        try:
            while True:
                fh.write(b"\0" * (1 << 16))
                fh.flush()
        except OSError:
            pass


@pytest.mark.slow
def test_full_disk_gives_one_line_and_keeps_the_last_checkpoint(tiny_disk, tiny_model):
    """Uses a real tmpfs (mount), filled right after the first checkpoint."""
    run = tiny_disk / "run"
    proc = start_train(run, tiny_model, "train.iterations=3")
    try:
        first = run / "checkpoints" / "iter_000000"
        wait_for("the first checkpoint", first.is_dir, proc)
        kept = tree(first)
        seen = {p.pid for p in javas(proc.pid)}
        fill(tiny_disk)
        rc, err = finish(proc, seen)
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
    assert rc == 2, err[-3000:]
    msg = last_line(err)
    assert msg.startswith(f"error: cannot write {run}"), msg
    assert f"the last good checkpoint {first} is intact" in msg, msg
    assert tree(first) == kept
    assert seen and not [p for p in seen if pid_alive(p)]
    (tiny_disk / "filler").unlink()
    stats = empo2("memory", "stats", "--check", "--json", "--db", str(run))
    assert stats.returncode == 0, stats.stderr  # the live memory is still sound


# ----------------------------------------------------------------------------------------------- SIGINT
@pytest.mark.slow
def test_sigint_exits_130_with_one_line_and_no_jvm(tmp_path, tiny_model):
    run = tmp_path / "run"
    proc = start_train(run, tiny_model, "train.iterations=2")
    try:
        wait_for("the run to start rolling out", lambda: (run / "config.yaml").is_file(), proc)
        seen = {p.pid for p in javas(proc.pid)}
        assert seen
        proc.send_signal(signal.SIGINT)  # the trainer only (its workers ignore SIGINT, as under Ctrl-C)
        rc, err = finish(proc, seen, timeout=120)
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
    assert rc == 130 and last_line(err).startswith("stopped by SIGINT during "), err
    assert not [p for p in seen if pid_alive(p)]
    assert (run / LOCK_NAME).read_text() == ""


# ------------------------------------------------------------------------------------------- 6: odd query text
def test_memory_search_odd_text(memory_run):
    """Bytes that are not UTF-8 (as a shell passes them), a 100 kB query, and an empty one."""
    res = empo2("memory", "search", "--db", str(memory_run), b"frog \xff\xfe\x80")
    assert res.returncode == 0, res.stderr[-2000:]
    assert b"Traceback" not in res.stderr and res.stdout.strip()  # it says something: tips or "no tips"
    big = empo2("memory", "search", "--db", str(memory_run), "frog " * 20000)
    assert big.returncode == 0 and big.stdout.decode().strip().startswith("no tips"), big.stdout[-500:]
    empty = empo2("memory", "search", "--db", str(memory_run), "  ")
    assert empty.returncode == 2 and "search text is empty" in last_line(empty.stderr)


def test_query_text_replaces_undecodable_bytes():
    from empo2.memory.commands import MemoryCliError, query_text

    raw = b"frog \xff\xfe\x80".decode("utf-8", "surrogateescape")  # what Python makes of such argv bytes
    assert query_text(raw) == "frog \ufffd\ufffd\ufffd"
    assert query_text("frog \ud800") == "frog ?"
    with pytest.raises(MemoryCliError):
        query_text(" \n")


# ------------------------------------------------------------------------------------------- 7: offline models
@pytest.mark.parametrize("env", [{"HF_HUB_OFFLINE": "1"}, {"HF_ENDPOINT": "http://127.0.0.1:9"}],
                         ids=["hf-offline", "endpoint-unreachable"])
def test_unknown_hub_model_offline_fails_at_once(monkeypatch, env):
    """Before: ~70 s of Hub retries, then the error. Port 9 (discard) on localhost refuses at once."""
    from empo2.policy.loader import ModelLoadError, resolve_model_path

    for key in ("HF_HUB_OFFLINE", "TRANSFORMERS_OFFLINE", "HTTPS_PROXY", "https_proxy", "ALL_PROXY", "all_proxy"):
        monkeypatch.delenv(key, raising=False)
    for key, value in env.items():
        monkeypatch.setenv(key, value)
    start = time.perf_counter()
    with pytest.raises(ModelLoadError, match="not in the local Hugging Face cache"):
        resolve_model_path("nobody/no-such-model")
    assert time.perf_counter() - start < 5


def test_unknown_hub_model_cli_one_line(tmp_path):
    run = tmp_path / "run"
    res = empo2("train", "--config", "configs/scienceworld_cpu.yaml", f"train.output_dir={run}",
                "policy.model=nobody/no-such-model", env={"HF_HUB_OFFLINE": "1"})
    assert res.returncode == 2
    assert res.stderr.decode().strip() == last_line(res.stderr)  # exactly one line
    assert "nobody/no-such-model" in last_line(res.stderr) and not run.exists()
