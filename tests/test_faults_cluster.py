"""Faults a cluster user meets: SIGTERM and Ctrl-C in every phase, kill -9 mid-save, checkpoints from elsewhere, a
changed config on resume, readers beside a live run.

As in tests/test_faults.py everything is real: ``empo2`` runs as a subprocess in its own session on real ScienceWorld
JVMs, real SQLite files and real checkpoint folders, with the tiny random model of tests/conftest.py. The trainer's
``-v`` log names each phase as it starts (``phase: the update of iteration 1``); the tests read it line by line to
signal a run inside the phase they mean, instead of guessing a delay.
"""

from __future__ import annotations

import json
import os
import pickle
import random
import signal
import subprocess
import sys
import threading
import time
from collections import Counter
from pathlib import Path

import numpy as np
import psutil
import pytest
import torch
import yaml

from empo2.cli import main
from empo2.config import Config
from empo2.memory.sqlite_file import check_file
from empo2.rundir import checkpoint as ckpt
from empo2.rundir.resume import RESUME_SAFE, changed_keys, check_checkpoint_settings, memory_digest
from empo2.rundir.runlock import LOCK_NAME
from helpers.processes import cli_env

REPO = Path(__file__).resolve().parents[1]
HOLD = Path(__file__).parent / "helpers" / "phase_hold.py"
CONFIG = "configs/scienceworld_cpu.yaml"
SMALL = ["env.tasks=[find-animal]", "env.max_steps=2", "env.eval_variations=1", "algo.num_generations=2",
         "policy.few_shot=0", "policy.max_completion_length=8", "policy.reflection_max_tokens=16",
         "train.progress=false", "train.report_to=none"]
FAST = [*SMALL, "algo.p_memory=1.0"]


# ------------------------------------------------------------------------------------------------------ helpers
class Run:
    """``python -m empo2.cli -v ARGS`` in its own session; stdout and stderr are read line by line as they come, and
    every process below it (environment workers, JVMs) is remembered so that the test can check none outlives it.
    ``hold``: a phase the process stays in until a signal comes (tests/helpers/phase_hold.py). ``env``: the child's
    environment, by default :func:`processes.cli_env` (it starts on jemalloc without re-executing itself)."""

    def __init__(self, *args: str, verbose: bool = True, hold: str | None = None, env: dict | None = None):
        flags = ["-v"] if verbose else []
        cli, env = ["-m", "empo2.cli"], dict(cli_env() if env is None else env)
        if hold is not None:
            cli, env = [str(HOLD)], {**env, "EMPO2_TEST_HOLD_PHASE": hold}
        # SIGINT and SIGHUP back to their defaults in the child: a runner started in the background or under nohup
        # leaves them ignored
        self.proc = subprocess.Popen([sys.executable, *cli, *flags, *args], cwd=REPO, env=env,
                                     stdout=subprocess.PIPE, stderr=subprocess.PIPE, start_new_session=True,
                                     preexec_fn=_default_signals)
        self.lines: list[str] = []  # stderr: logs, errors, the stop message
        self.out: list[str] = []  # stdout: the banner, warnings, iteration lines, the final table
        self.seen: set[psutil.Process] = set()
        self._cond = threading.Condition()
        self._readers = [threading.Thread(target=self._read, args=(pipe, into), daemon=True)
                         for pipe, into in ((self.proc.stderr, self.lines), (self.proc.stdout, self.out))]
        for reader in self._readers:
            reader.start()

    def _read(self, pipe, into: list[str]) -> None:
        for raw in pipe:
            with self._cond:
                into.append(raw.decode("utf-8", "replace").rstrip("\n"))
                self._cond.notify_all()

    def _note_children(self) -> None:
        try:
            self.seen |= set(psutil.Process(self.proc.pid).children(recursive=True))
        except psutil.NoSuchProcess:
            pass

    def wait_line(self, text: str, timeout: float = 900) -> str:
        """Block until an output line holds ``text`` (the run must still be going); return it."""
        deadline, seen = time.time() + timeout, {id(self.lines): 0, id(self.out): 0}
        while True:
            with self._cond:
                for lines in (self.lines, self.out):
                    for line in lines[seen[id(lines)]:]:
                        if text in line:
                            return line
                    seen[id(lines)] = len(lines)
                self._cond.wait(0.05)
            self._note_children()
            assert self.proc.poll() is None or any(r.is_alive() for r in self._readers), \
                f"the run ended ({self.proc.returncode}) before {text!r}: {self.text()[-3000:]}"
            assert time.time() < deadline, f"timed out waiting for {text!r}"

    def signal(self, signum: int, group: bool = False) -> None:
        self._note_children()
        os.killpg(self.proc.pid, signum) if group else self.proc.send_signal(signum)

    def finish(self, timeout: float = 900) -> int:
        deadline = time.time() + timeout
        while self.proc.poll() is None and time.time() < deadline:
            self._note_children()
            time.sleep(0.1)
        if self.proc.poll() is None:
            self.kill()
            raise AssertionError(f"the run did not end: {self.text()[-3000:]}")
        for reader in self._readers:
            reader.join(30)
        return self.proc.returncode

    def kill(self) -> None:
        """SIGKILL the whole session, as a node failure or an OOM killer would."""
        self._note_children()
        try:
            os.killpg(self.proc.pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
        self.proc.wait()
        for reader in self._readers:
            reader.join(30)

    def text(self) -> str:
        with self._cond:
            return "\n".join(self.lines)

    def last_line(self) -> str:
        text = self.text()
        assert "Traceback" not in text and "BrokenPipeError" not in text, text[-3000:]
        return text.strip().splitlines()[-1]

    def left_behind(self) -> list[str]:
        """Processes this run started that are still alive (JVMs, workers)."""
        time.sleep(0.5)  # a worker the parent closed may still be exiting
        out = []
        for p in self.seen:
            try:
                if p.is_running() and p.status() != psutil.STATUS_ZOMBIE:
                    out.append(f"{p.pid} {p.name()}")
            except psutil.NoSuchProcess:
                pass
        return out


def _default_signals() -> None:
    signal.signal(signal.SIGINT, signal.SIG_DFL)
    signal.signal(signal.SIGHUP, signal.SIG_DFL)


def _javas(pid: int) -> list[psutil.Process]:
    found = []
    try:
        kids = psutil.Process(pid).children(recursive=True)
    except psutil.NoSuchProcess:
        return []
    for p in kids:
        try:
            if p.name() == "java":
                found.append(p)
        except psutil.NoSuchProcess:
            pass
    return found


def _unprefixed(line: str) -> str:
    """A warning line without its ``[warning]`` tag (the console may print it or read it as markup)."""
    return line.strip().removeprefix("[warning]").strip()


def train(run: Path, model: str, *overrides: str, verbose: bool = True, hold: str | None = None,
          env: dict | None = None) -> Run:
    return Run("train", "--config", CONFIG, f"train.output_dir={run}", f"policy.model={model}", *FAST, *overrides,
               verbose=verbose, hold=hold, env=env)


def resume(run: Path, *overrides: str, hold: str | None = None) -> Run:
    return Run("train", "--resume", str(run), *overrides, hold=hold)


def iterations(run: Path) -> list[int]:
    return [json.loads(line)["iteration"] for line in (run / "metrics.jsonl").read_text().splitlines()]


def sample_iterations(run: Path) -> Counter:
    return Counter(json.loads(line)["iteration"] for line in (run / "trajectories.jsonl").read_text().splitlines())


def where_it_continues(run: Path) -> str:
    last = ckpt.latest_checkpoint(run)
    if last is None:
        return "no checkpoint was written yet (start again with the same command)"
    return f"last checkpoint {last} (continue with: empo2 train --resume {run})"


def assert_loads(checkpoint: Path) -> None:
    """Everything ``--resume`` reads from a checkpoint reads back whole."""
    state = ckpt.load_state(checkpoint)
    assert state["iteration"] == int(checkpoint.name[len(ckpt.PREFIX):])
    assert ckpt.load_optimizer(checkpoint)["param_groups"]
    assert ckpt.read_weights(checkpoint, lora=True)
    check_file(checkpoint / "memory.sqlite")


# ----------------------------------------------------------------------------------- 1: SIGTERM / SIGINT, all phases
@pytest.mark.slow
def test_signals_in_every_phase_stop_cleanly_and_resume_loses_nothing(tmp_path, tiny_model):
    """One run stopped five times, each in another phase and each way a cluster or a user stops a job; every stop
    exits 128+signal with one line naming the phase and where to continue, releases the lock and leaves no process;
    each ``--resume`` continues, and the finished run has every iteration, sample and checkpoint exactly once."""
    run = tmp_path / "run"
    stops = [  # (signal, to the whole process group?, phase, resume overrides)
        (signal.SIGTERM, False, "the rollout of iteration 0", []),  # `timeout`, Kubernetes: the trainer only
        (signal.SIGINT, True, "the reflection of iteration 0", []),  # Ctrl-C: the terminal's whole group
        (signal.SIGTERM, True, "the checkpoint write of iteration 0", []),  # SLURM: every process of the job
        (signal.SIGTERM, False, "the update of iteration 1", ["train.preempt_save=true"]),  # grace: save first
        (signal.SIGTERM, False, "the final evaluation", []),
    ]
    outcomes = []
    for n, (signum, group, phase, overrides) in enumerate(stops):
        held = phase if phase != "the rollout of iteration 0" else None  # the others can end within milliseconds
        proc = train(run, tiny_model, "train.iterations=2", hold=held) if n == 0 else resume(run, *overrides, hold=held)
        try:
            proc.wait_line(f"phase: {phase}")
            proc.signal(signum, group)
            rc = proc.finish()
        finally:
            if proc.proc.poll() is None:
                proc.kill()
        name = signal.Signals(signum).name
        assert rc == 128 + signum, proc.text()[-3000:]
        assert proc.last_line() == f"stopped by {name} during {phase}; {where_it_continues(run)}"
        assert (run / LOCK_NAME).read_text() == ""
        assert proc.left_behind() == []
        assert not list(run.glob("checkpoints/.tmp-*"))  # a save the signal cut short was removed
        outcomes.append((name, phase, rc, ckpt.latest_checkpoint(run)))
        if overrides:  # preempt_save: the iteration the signal came in was finished and saved before the exit
            assert ckpt.latest_checkpoint(run).name == "iter_000001" and iterations(run) == [0, 1]
    proc = resume(run)
    assert proc.finish() == 0, proc.text()[-3000:]
    assert iterations(run) == [0, 1]
    assert sample_iterations(run) == {0: 2, 1: 2}  # nothing written twice by the replayed iterations
    assert (run / "eval" / "final.json").is_file() and proc.left_behind() == []
    print(outcomes)


@pytest.mark.slow
def test_sighup_from_a_closed_terminal_stops_like_sigterm(tmp_path, tiny_model):
    """An ssh session or terminal that goes away sends SIGHUP to the run's whole process group: one line naming the
    phase and the last checkpoint, exit 129, the lock released, no process left; ``--resume`` then finishes the run."""
    run = tmp_path / "run"
    phase = "the update of iteration 1"
    proc = train(run, tiny_model, "train.iterations=2", hold=phase)
    try:
        proc.wait_line(f"phase: {phase}")
        proc.signal(signal.SIGHUP, group=True)
        rc = proc.finish()
    finally:
        if proc.proc.poll() is None:
            proc.kill()
    assert rc == 129, proc.text()[-3000:]
    assert proc.last_line() == (f"stopped by SIGHUP during {phase}; last checkpoint {run}/checkpoints/iter_000000 "
                                f"(continue with: empo2 train --resume {run})")
    assert (run / LOCK_NAME).read_text() == ""
    assert proc.left_behind() == []
    proc = resume(run)
    assert proc.finish() == 0, proc.text()[-3000:]
    assert iterations(run) == [0, 1] and (run / "eval" / "final.json").is_file()


@pytest.mark.slow
def test_compare_passes_sigterm_to_its_run(tmp_path, tiny_model):
    """A scheduler signals ``compare`` only: it passes SIGTERM to its training run, which stops cleanly, then exits
    143 itself; no run is left going on without it."""
    out = tmp_path / "cmp"
    proc = Run("compare", "--allow-unreachable", "--config", CONFIG, "--algos", "grpo", "--seeds", "0", "--out", str(out),
               f"policy.model={tiny_model}", *SMALL, "train.iterations=2")
    try:
        deadline = time.time() + 600
        while not (out / "runs" / "grpo-seed0" / "config.yaml").is_file():  # the run is set up: it is evaluating
            assert time.time() < deadline and proc.proc.poll() is None, proc.text()[-3000:]
            time.sleep(0.2)
        assert _javas(proc.proc.pid)
        proc.signal(signal.SIGTERM)
        rc = proc.finish()
    finally:
        if proc.proc.poll() is None:
            proc.kill()
    lines = proc.text().strip().splitlines()
    assert rc == 143, proc.text()[-3000:]
    assert proc.last_line().startswith("stopped by SIGTERM during compare run grpo-seed0"), lines[-3:]
    assert any(line.startswith("stopped by SIGTERM during ") for line in lines[:-1])  # the run's own line
    assert "grpo-seed0: FAILED" not in proc.text()
    assert (out / "runs" / "grpo-seed0" / LOCK_NAME).read_text() == ""
    assert proc.left_behind() == []


@pytest.mark.slow
def test_compare_with_two_jobs_passes_sigterm_to_both_runs(tmp_path, tiny_model):
    """``--jobs 2``: two seeds train at once; SIGTERM to compare reaches each run once, each stops cleanly and says so
    in its own log, compare waits for both and exits 143, and nothing is left going."""
    out = tmp_path / "cmp"
    names = ("grpo-seed0", "grpo-seed1")
    proc = Run("compare", "--allow-unreachable", "--config", CONFIG, "--algos", "grpo", "--seeds", "0-1", "--out", str(out), "--jobs", "2",
               f"policy.model={tiny_model}", *SMALL, "train.iterations=2")
    try:
        deadline = time.time() + 600
        while not all((out / "runs" / n / "config.yaml").is_file() for n in names):  # both are set up at once
            assert time.time() < deadline and proc.proc.poll() is None, proc.text()[-3000:]
            time.sleep(0.2)
        proc.signal(signal.SIGTERM)
        rc = proc.finish()
    finally:
        if proc.proc.poll() is None:
            proc.kill()
    assert rc == 143, proc.text()[-3000:]
    assert proc.last_line().startswith("stopped by SIGTERM during compare, 2 runs at once"), proc.text()[-1000:]
    for name in names:
        log = (out / "logs" / f"{name}.log").read_text()
        assert log.count("stopped by SIGTERM during ") == 1, log[-2000:]
        assert (out / "runs" / name / LOCK_NAME).read_text() == ""
        assert f"{name}: FAILED" not in proc.text()
    assert proc.left_behind() == []


@pytest.mark.slow
def test_ctrl_c_to_compares_group_reaches_its_run_once(tmp_path, tiny_model):
    """Ctrl-C in a terminal signals the whole foreground process group. The run compare starts is in its own
    session, so it gets the signal once, passed on by compare: with ``train.preempt_save`` it finishes and saves the
    iteration it is in (a second signal would stop it at once, unsaved), and compare waits for that save."""
    out = tmp_path / "cmp"
    run = out / "runs" / "grpo-seed0"
    proc = Run("compare", "--allow-unreachable", "--config", CONFIG, "--algos", "grpo", "--seeds", "0", "--out", str(out),
               f"policy.model={tiny_model}", *SMALL, "train.iterations=2", "train.preempt_save=true", "train.progress=true")
    try:
        # the run's own progress line (compare passes it through): iteration 0 has begun, inside the grace period
        proc.wait_line("iter 0: rollouts")
        proc.signal(signal.SIGINT, group=True)
        rc = proc.finish()
    finally:
        if proc.proc.poll() is None:
            proc.kill()
    assert rc == 130, proc.text()[-3000:]
    last = ckpt.latest_checkpoint(run)
    assert last is not None, proc.text()[-3000:]  # the iteration the signal came in was finished and saved
    assert iterations(run)[-1] == int(last.name[len(ckpt.PREFIX):]) and not (run / "eval" / "final.json").exists()
    assert proc.last_line().startswith("stopped by SIGINT during compare run grpo-seed0")
    assert proc.left_behind() == []


@pytest.mark.slow
@pytest.mark.parametrize("signum, delay", [(signal.SIGINT, 0.3), (signal.SIGINT, 1.0), (signal.SIGINT, 2.0),
                                           (signal.SIGTERM, 1.5)])
def test_signal_while_starting_gives_one_line(tmp_path, tiny_model, signum, delay):
    """Ctrl-C while the interpreter imports torch (the first ~2 s): one line, 130, no traceback or crash."""
    run = tmp_path / "run"
    # as a user types it: the command re-executes itself on jemalloc inside this window, and a signal may come then
    proc = train(run, tiny_model, "train.iterations=1", verbose=False, env=dict(os.environ))
    time.sleep(delay)
    proc.signal(signum)
    rc = proc.finish(timeout=120)
    assert rc == 128 + signum, proc.text()[-3000:]
    lines = proc.text().strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith(f"stopped by {signal.Signals(signum).name} during "), lines
    assert "Traceback" not in proc.text()
    assert not run.exists() or (run / LOCK_NAME).read_text() == ""
    assert proc.left_behind() == []


# ------------------------------------------------------------------------- 5 + 6: kill -9 mid-save, memory ahead
@pytest.mark.slow
def test_kill9_between_memory_and_checkpoint_and_during_saves(tmp_path, tiny_model):
    """kill -9 of the whole session (a node failure), first after an iteration wrote its tips but before its
    checkpoint, then at several points of a checkpoint write. The latest complete checkpoint always loads, the
    resume starts from the memory of the weights' iteration (the live one kept beside it, one line said), and the
    finished run has each iteration and sample once. Then the latest checkpoint is cut short: the resume falls back
    to the one before with one warning line."""
    run = tmp_path / "run"
    proc = train(run, tiny_model, "train.iterations=3", hold="the update of iteration 1")
    try:
        proc.wait_line("phase: the update of iteration 1")  # iteration 1's tips are in memory.sqlite, not saved
    finally:
        proc.kill()
    assert proc.left_behind() == []
    first = run / "checkpoints" / "iter_000000"
    assert ckpt.latest_checkpoint(run) == first
    ahead = memory_digest(run / "memory.sqlite")
    assert ahead != memory_digest(first / "memory.sqlite")

    for n, delay in enumerate([0.0, 0.15]):
        proc = resume(run)
        try:
            if n == 0:
                backup = run / "memory.sqlite.ahead-of-iter_000000"
                warned = proc.wait_line("was ahead of")
                assert _unprefixed(warned) == (f"{run / 'memory.sqlite'} was ahead of {first} (written by an iteration "
                                  "that did not finish); resuming with the memory of that point, the live one is kept "
                                  f"as {backup}")
                assert memory_digest(backup) == ahead
            proc.wait_line("phase: the checkpoint write of iteration")
            time.sleep(delay)
        finally:
            proc.kill()
        assert proc.left_behind() == []
        assert_loads(ckpt.latest_checkpoint(run))

    proc = resume(run)
    assert proc.finish() == 0, proc.text()[-3000:]
    assert iterations(run) == [0, 1, 2]
    assert sample_iterations(run) == {0: 2, 1: 2, 2: 2}

    last = ckpt.latest_checkpoint(run)
    adapter = last / "model" / "adapter_model.safetensors"
    adapter.write_bytes(adapter.read_bytes()[: adapter.stat().st_size // 2])  # a copy that was cut off
    proc = resume(run)
    assert proc.finish() == 0, proc.text()[-3000:]
    warnings = [_unprefixed(line) for line in proc.out if "does not load" in line]
    assert len(warnings) == 1 and warnings[0].startswith(f"checkpoint {last} does not load (")
    assert warnings[0].endswith(f"resuming from {run / 'checkpoints' / 'iter_000001'}")
    assert "Traceback" not in proc.text()
    assert iterations(run) == [0, 1, 2] and sample_iterations(run) == {0: 2, 1: 2, 2: 2}


# ------------------------------------------------------------------------------------ 4: readers beside the writer
@pytest.mark.slow
def test_memory_readers_beside_a_live_run_see_whole_snapshots(tmp_path, tiny_model):
    """``memory stats/search/report`` in a loop while a run writes: every answer succeeds, none says "database is
    locked", every stats answer adds up, the run itself finishes."""
    run = tmp_path / "run"
    proc = train(run, tiny_model, "train.iterations=3")
    answers = []
    try:
        deadline = time.time() + 600
        while not (run / "config.yaml").is_file():  # saved once the memory exists and the workers are up
            assert proc.proc.poll() is None and time.time() < deadline, proc.text()[-3000:]
            time.sleep(0.1)
        while proc.proc.poll() is None:
            for args in (["stats", "--json"], ["search", "--json", "find the animal"],
                         ["report", str(tmp_path / "r.html")]):
                res = subprocess.run([sys.executable, "-m", "empo2.cli", "memory", args[0], "--db", str(run),
                                      *args[1:]], capture_output=True, cwd=REPO, env=cli_env(), timeout=300)
                answers.append((args[0], res.returncode, res.stdout, res.stderr))
        rc = proc.finish()
    finally:
        if proc.proc.poll() is None:
            proc.kill()
    assert rc == 0, proc.text()[-3000:]
    assert len(answers) >= 3
    for cmd, code, out, err in answers:
        assert code == 0 and b"locked" not in err and b"Traceback" not in err, (cmd, err[-2000:])
        if cmd == "stats":
            s = json.loads(out)
            assert s["tips"] == sum(ns["tips"] for ns in s["namespaces"].values())
            assert s["rated_tips"] == sum(ns["rated"] for ns in s["namespaces"].values())
            assert s["tips"] <= s["capacity"]
        elif cmd == "search":
            hits = [json.loads(line) for line in out.decode().splitlines() if line.strip()]
            assert all(h["similarity"] >= 0.5 for h in hits)
    tips = [json.loads(out)["tips"] for cmd, code, out, err in answers if cmd == "stats"]
    assert tips == sorted(tips)  # a reader never sees the memory go back


# ------------------------------------------------------------------------------------- 2: checkpoints load no code
class _Planted:
    """Unpickling this writes a marker file: what a hostile checkpoint would do, harmlessly."""

    def __init__(self, marker: Path):
        self.marker = str(marker)

    def __reduce__(self):
        return (Path.write_text, (Path(self.marker), "code ran"))


def _run_folder(tmp_path: Path, tiny_model: str) -> Path:
    run = tmp_path / "run"
    (run / "checkpoints" / "iter_000000").mkdir(parents=True)
    cfg = Config.load(REPO / CONFIG, [f"policy.model={tiny_model}", f"train.output_dir={run}", *FAST])
    cfg.save(run / "config.yaml")
    return run


@pytest.mark.slow
def test_a_pickle_in_a_checkpoint_never_runs(tmp_path, tiny_model):
    """A shared run folder with code in its old-format ``state.pt``: ``--resume`` refuses it with one line saying how
    to convert it, and the code does not run. A pickle in ``optimizer.pt`` is refused by ``weights_only`` too."""
    run = _run_folder(tmp_path, tiny_model)
    marker = tmp_path / "marker"
    folder = run / "checkpoints" / "iter_000000"
    torch.save({"iteration": 0, "payload": _Planted(marker)}, folder / "state.pt")
    proc = resume(run)
    assert proc.finish(timeout=300) == 2
    assert proc.last_line() == (f"error: {folder} holds a pickled state.pt from an older empo2, which could run code "
                                "when loaded, so it is not read; if you trust where it came from, convert it with: "
                                f"python -m empo2.rundir.checkpoint --convert {folder}")
    assert not marker.exists() and proc.left_behind() == []

    ckpt.write_state(folder, {"iteration": 0})
    (folder / "state.pt").unlink()
    torch.save({"state": {}, "param_groups": [{"x": _Planted(marker)}]}, folder / "optimizer.pt")
    with pytest.raises(pickle.UnpicklingError):
        ckpt.load_optimizer(folder)
    assert not marker.exists()


def test_old_checkpoint_converts_and_restores_the_same_streams(tmp_path):
    """The older format (everything pickled in ``state.pt``), converted, gives back the same RNG streams and arrays."""
    folder = tmp_path / "iter_000003"
    folder.mkdir()
    random.seed(5), np.random.seed(5), torch.manual_seed(5)
    counts = np.array([3, 1], dtype=np.int64)
    old = {"iteration": 3, "novelty": {"namespaces": {"t": {"counts": counts}}},
           "rng": {"python": random.getstate(), "numpy": np.random.get_state(), "torch": torch.get_rng_state()}}
    torch.save(old, folder / "state.pt")
    torch.save({"state": {}, "param_groups": [{"lr": 1e-4, "params": []}]}, folder / "optimizer.pt")
    expected = (random.random(), np.random.rand(), torch.rand(1).item())
    with pytest.raises(ckpt.CheckpointError, match="--convert"):
        ckpt.load_state(folder)
    res = subprocess.run([sys.executable, "-m", "empo2.rundir.checkpoint", "--convert", str(folder)], cwd=REPO,
                         capture_output=True, text=True)
    assert res.returncode == 0 and res.stdout.strip() == f"converted {folder}", res.stderr
    state = ckpt.load_state(folder)
    assert state["iteration"] == 3 and np.array_equal(state["novelty"]["namespaces"]["t"]["counts"], counts)
    ckpt.set_rng_state(state["rng"])
    assert (random.random(), np.random.rand(), torch.rand(1).item()) == expected
    assert ckpt.load_optimizer(folder)["param_groups"][0]["lr"] == 1e-4 and not (folder / "state.pt").exists()


# -------------------------------------------------------------------------------------- 3: no mixed configs
@pytest.mark.slow
def test_resume_with_another_run_s_settings_exits_2(tmp_path, tiny_model):
    run = _run_folder(tmp_path, tiny_model)
    before = {p: p.read_bytes() for p in run.rglob("*") if p.is_file()}
    proc = resume(run, "algo.num_generations=4", "env.tasks=[find-plant]", "train.iterations=9")
    assert proc.finish(timeout=120) == 2
    line = proc.last_line()
    assert line.startswith(f"error: --resume {run} would change what the run is (algo.num_generations: 2 -> 4, "
                           "env.tasks: ['find-animal'] -> ['find-plant'])"), line
    assert {p: p.read_bytes() for p in run.rglob("*") if p.is_file()} == before
    assert not (run / LOCK_NAME).exists()


@pytest.mark.slow
def test_a_hand_edited_config_and_unused_flags_are_refused_on_resume(tmp_path, tiny_model, capsys):
    """Each checkpoint records a digest of the settings it was trained with: G changed by hand in the run's own
    config.yaml is refused on ``--resume`` like a G override, with one line naming the key, and nothing changes.
    Flags ``--resume`` does not use are refused, not ignored. A checkpoint from a version with fewer config fields
    (no digest, one key fewer) still resumes."""
    run = tmp_path / "run"  # trained in this process: only the resumes below are the cases
    assert main(["train", "--config", CONFIG, f"train.output_dir={run}", f"policy.model={tiny_model}", *FAST,
                 "train.iterations=1"]) == 0
    capsys.readouterr()
    saved = (run / "config.yaml").read_text()
    edited = yaml.safe_load(saved)
    edited["algo"]["num_generations"] = 3
    (run / "config.yaml").write_text(yaml.safe_dump(edited, sort_keys=False))
    before = {p: p.read_bytes() for p in run.rglob("*") if p.is_file()}
    proc = resume(run, "train.iterations=2")
    assert proc.finish(timeout=300) == 2
    assert proc.last_line() == (f"error: {run}/config.yaml no longer matches the settings {run}/checkpoints/iter_000000 "
                                "was trained with (algo.num_generations: 2 -> 3); put the run's settings back, or "
                                "start a new run (another train.output_dir) for other settings")
    assert {p: p.read_bytes() for p in run.rglob("*") if p.is_file()} == before

    (run / "config.yaml").write_text(saved)
    proc = Run("train", "--resume", str(run), "--config", CONFIG, "--algo", "grpo", "--output-dir",
               str(tmp_path / "elsewhere"), "--overwrite", verbose=False)
    assert proc.finish(timeout=300) == 2
    assert proc.last_line() == ("error: --resume continues a run under its own config.yaml and folder; --config, "
                                "--algo, --output-dir, --overwrite would be ignored: leave it out (or start a new run "
                                "without --resume)")
    for flag in (["--config", CONFIG], ["--algo", "empo2"], ["--output-dir", str(run)], ["--overwrite"]):
        assert main(["train", "--resume", str(run), *flag]) == 2
        assert f"; {flag[0]} would be ignored" in capsys.readouterr().err
    assert not (tmp_path / "elsewhere").exists() and (run / "config.yaml").read_text() == saved

    state_file = run / "checkpoints" / "iter_000000" / ckpt.STATE
    state = json.loads(state_file.read_text())
    del state["settings_digest"], state["config"]["policy"]["top_k"]  # as a version without both would write it
    state_file.write_text(json.dumps(state))
    check_checkpoint_settings(Config.load(run / "config.yaml"), run)  # no refusal


def test_which_resume_overrides_are_allowed(tiny_model):
    base = [f"policy.model={tiny_model}", *FAST]
    saved = Config.load(REPO / CONFIG, base)
    allowed = ["train.iterations=12", "train.progress=true", "train.eval_every=2", "train.report_to=none",
               "train.save_every=3", "train.output_dir=/elsewhere", "train.preempt_save=true", "policy.device=cpu"]
    assert changed_keys(saved, Config.load(REPO / CONFIG, [*base, *allowed])) == []
    refused = {"policy.model=smollm2-135m": "policy.model", "algo.num_generations=3": "algo.num_generations",
               "env.tasks=[find-plant]": "env.tasks", "algo.name=grpo": "algo.name", "algo.advantage=gigpo":
               "algo.advantage", "env.max_steps=5": "env.max_steps", "train.learning_rate=0.1": "train.learning_rate",
               "train.seed=7": "train.seed"}
    for override, key in refused.items():
        assert changed_keys(saved, Config.load(REPO / CONFIG, [*base, override])) == [key], override
    fields = {f"{s}.{f}" for s in Config.SECTIONS for f in getattr(Config(), s).__dataclass_fields__}
    assert fields >= RESUME_SAFE
