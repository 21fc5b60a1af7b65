"""Hostile input and data loss, the run folder's part: a folder that is not the run folder a run expects (a project,
the user's files, another tool's or trainer's run, a run without the marker, a read-only one, one another command
holds) is refused with one line before anything in it is written or deleted, and ``--overwrite`` empties only what a
marked run folder owns. The rest of the hostile-input tests is in tests/test_faults_input.py, in the same style:
``empo2`` runs as a real subprocess on real files; most cases use ``fake_model`` (a folder with a ``config.json`` and
nothing else), which a run that got past the check would fail to load.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time

from empo2.config import Config
from empo2.rundir.runlock import LOCK_NAME, RUN_MARKER
from helpers.faults_input import CPU, FAST, REPO, empo2, memory_file, one_line, tree
from helpers.processes import cli_env


# ------------------------------------------------------------------------------------- 1: --overwrite, data loss
def test_overwrite_refuses_a_folder_that_is_not_a_run(tmp_path, fake_model):
    """A project folder (config.yaml next to .git and src) is not a run: refused, nothing deleted."""
    project = tmp_path / "project"
    (project / ".git").mkdir(parents=True)
    (project / "src").mkdir()
    (project / ".git" / "HEAD").write_text("ref: refs/heads/main\n")
    (project / "src" / "main.py").write_text("print('mine')\n")
    (project / "config.yaml").write_text("not: a run\n")
    before = tree(project)
    for extra in (["--overwrite"], []):  # without --overwrite the run would overwrite its config.yaml
        res = empo2("train", "--config", CPU, "--output-dir", project, *extra, f"policy.model={fake_model}")
        assert res.returncode == 2, res.stderr[-2000:]
        msg = one_line(res)
        assert f"{project} is not an empo2 run folder (it holds .git, src)" in msg and "nothing was deleted" in msg
        assert tree(project) == before


def test_overwrite_empties_a_run_folder_by_its_marker_only(tmp_path, fake_model):
    """A run made before the marker existed is not emptied by its names (another tool's folder can hold the same):
    a fresh run there is refused, with and without --overwrite, nothing deleted. Once marked (``--resume`` marks such
    a run), --overwrite empties what the marker lists and keeps the rest."""
    from empo2.rundir.runlock import RUN_LAYOUT, mark_run_folder

    run = tmp_path / "old-run"
    (run / "checkpoints" / "iter_000000").mkdir(parents=True)
    (run / "config.yaml").write_text("train: {iterations: 1}\n")
    (run / "metrics.jsonl").write_text('{"iteration": 0}\n')
    (run / "scores.png").write_bytes(b"png")
    before = tree(run)
    for extra in ([], ["--overwrite"]):
        res = empo2("train", "--config", CPU, "--output-dir", run, *extra, f"policy.model={fake_model}")
        assert res.returncode == 2
        assert one_line(res) == (f"error: {run} holds a run without the .empo2-run marker (a run of an empo2 from "
                                 "before the marker, or files of another tool named alike); nothing was deleted or "
                                 f"written — continue an empo2 run with --resume {run}, or choose another "
                                 "train.output_dir")
        assert tree(run) == before and (run / "checkpoints" / "iter_000000").is_dir()
    mark_run_folder(run, RUN_LAYOUT)  # what --resume of such a run does before it trains
    res = empo2("train", "--config", CPU, "--output-dir", run, f"policy.model={fake_model}")
    assert res.returncode == 2 and "already holds a run" in one_line(res)
    assert (run / "metrics.jsonl").exists()
    res = empo2("train", "--config", CPU, "--output-dir", run, "--overwrite", f"policy.model={fake_model}")
    assert res.returncode == 2 and "cannot load the tokenizer" in res.stderr.decode()  # cleared, then the model
    assert sorted(p.name for p in run.iterdir()) == sorted([LOCK_NAME, RUN_MARKER])
    owns = json.loads((run / RUN_MARKER).read_text())["owns"]  # what the new run may delete: all it writes
    assert {"config.yaml", "metrics.jsonl", "checkpoints", "eval", "tb", "wandb"} <= set(owns)
    (run / "notes.txt").write_text("a file of mine in a marked run folder\n")
    (run / "data").mkdir()
    (run / "metrics.jsonl").write_text('{"iteration": 0}\n')
    res = empo2("train", "--config", CPU, "--output-dir", run, "--overwrite", f"policy.model={fake_model}")
    assert res.returncode == 2 and not (run / "metrics.jsonl").exists()  # the run's own files go
    assert (run / "notes.txt").is_file() and (run / "data").is_dir()  # a marked folder's other files stay


def test_a_folder_named_like_a_run_but_unmarked_is_never_emptied_or_written(tmp_path, fake_model):
    """A folder of another tool that holds only names a run writes (``config.yaml``, ``trajectories.jsonl``,
    ``checkpoints/x.ckpt``) and no marker: --overwrite deletes nothing (it used to empty the folder) and a plain run
    replaces nothing (it used to write its own ``config.yaml`` and ``trajectories.jsonl`` over them)."""
    folder = tmp_path / "F"
    (folder / "checkpoints").mkdir(parents=True)
    (folder / "config.yaml").write_text("trainer: {epochs: 3}\n")
    (folder / "trajectories.jsonl").write_text('{"episode": 1, "reward": 0.5}\n')
    (folder / "checkpoints" / "x.ckpt").write_bytes(b"weights of another tool")
    before = tree(folder)
    for extra in (["--overwrite"], []):
        res = empo2("train", "--config", CPU, "--output-dir", folder, *extra, f"policy.model={fake_model}")
        assert res.returncode == 2, res.stderr[-2000:]
        assert one_line(res).startswith(f"error: {folder} holds a run without the .empo2-run marker")
        assert tree(folder) == before and sorted(p.name for p in folder.iterdir()) == [
            "checkpoints", "config.yaml", "trajectories.jsonl"]


def test_an_empty_checkpoints_folder_is_no_other_tools_run(tmp_path, fake_model):
    """A scratch folder that holds only an empty ``checkpoints/`` (a mount point made ready for the run) is as good as
    empty: the run starts there (here it gets as far as loading the model) and owns ``checkpoints/``, so a later
    --overwrite clears what the run wrote into it."""
    folder = tmp_path / "scratch"
    (folder / "checkpoints").mkdir(parents=True)
    res = empo2("train", "--config", CPU, "--output-dir", folder, f"policy.model={fake_model}")
    assert res.returncode == 2 and "cannot load the tokenizer" in res.stderr.decode(), res.stderr[-2000:]
    assert "checkpoints" in json.loads((folder / RUN_MARKER).read_text())["owns"]
    (folder / "checkpoints" / "stale").write_text("x")
    (folder / "checkpoints" / "nonempty").mkdir()
    (folder / "checkpoints" / "nonempty" / "f").write_text("y")
    res = empo2("train", "--config", CPU, "--output-dir", folder, "--overwrite", f"policy.model={fake_model}")
    assert res.returncode == 2 and "cannot load the tokenizer" in res.stderr.decode()
    assert not (folder / "checkpoints").exists()  # the run's own folder, emptied as the run's
    other = tmp_path / "other"
    (other / "checkpoints").mkdir(parents=True)
    (other / "checkpoints" / "x.ckpt").write_bytes(b"w")  # not empty: someone's
    res = empo2("train", "--config", CPU, "--output-dir", other, "--overwrite", f"policy.model={fake_model}")
    assert res.returncode == 2 and f"{other} is not an empo2 run folder (it holds checkpoints)" in one_line(res)
    assert (other / "checkpoints" / "x.ckpt").read_bytes() == b"w"


def test_a_folder_of_the_users_files_is_refused_before_anything_is_written(tmp_path, fake_model):
    """A folder of the user's own files is no run folder: neither a plain run nor --overwrite writes or deletes
    anything in it (a run there would mark it, and a later --overwrite would treat it as a run's)."""
    folder = tmp_path / "mine"
    (folder / "data").mkdir(parents=True)
    (folder / "data" / "x.csv").write_text("1,2\n")
    (folder / "notes.txt").write_text("mine\n")
    before = tree(folder)
    for extra in ([], ["--overwrite"]):
        res = empo2("train", "--config", CPU, "--output-dir", folder, *extra, f"policy.model={fake_model}")
        assert res.returncode == 2 and f"{folder} is not an empo2 run folder (it holds data, notes.txt)" in one_line(res)
        assert tree(folder) == before and sorted(p.name for p in folder.iterdir()) == ["data", "notes.txt"]


def test_another_trainers_run_folder_is_never_written_or_deleted(tmp_path, fake_model):
    """A Lightning or TRL run folder holds the names every trainer writes (config.yaml, checkpoints/, eval/, tb/,
    wandb/), none that only empo2 writes: a plain run, --overwrite and --resume each exit 2 with one line before
    anything is written, and every file of the other tool's run is still there, byte for byte."""
    other = tmp_path / "lightning-run"
    (other / "checkpoints").mkdir(parents=True)
    (other / "checkpoints" / "epoch=9-step=5000.ckpt").write_bytes(b"\x80\x02 weights of another trainer")
    (other / "config.yaml").write_text("trainer: {max_epochs: 10}\nmodel: {learning_rate: 0.001}\n")
    (other / "eval").mkdir()
    (other / "eval" / "results.csv").write_text("step,accuracy\n5000,0.91\n")
    (other / "tb").mkdir()
    (other / "tb" / "events.out.tfevents.1733300000.node7.1234.0").write_bytes(b"\x00\x01 events")
    (other / "wandb" / "run-20241204_120000-abc123" / "files").mkdir(parents=True)
    (other / "wandb" / "run-20241204_120000-abc123" / "files" / "config.yaml").write_text("wandb_version: 1\n")
    before = tree(other)
    names = sorted(p.name for p in other.iterdir())
    for extra in ([], ["--overwrite"]):
        res = empo2("train", "--config", CPU, "--output-dir", other, *extra, f"policy.model={fake_model}")
        assert res.returncode == 2, res.stderr[-2000:]
        assert one_line(res) == (f"error: {other} is not an empo2 run folder (it holds checkpoints, config.yaml, eval, "
                                 "tb, wandb); nothing was deleted or written — choose another train.output_dir (a new "
                                 "run starts in an empty folder or an empo2 run folder)")
        assert tree(other) == before and sorted(p.name for p in other.iterdir()) == names
    res = empo2("train", "--resume", other)
    assert res.returncode == 2
    assert one_line(res).startswith(f"error: {other} is not an empo2 run folder (no .empo2-run")
    assert tree(other) == before and sorted(p.name for p in other.iterdir()) == names


# ------------------------------------------------------------------------------ 2: text is taken literally
def test_output_dir_with_a_hash_is_that_folder(tmp_path, fake_model):
    """``--output-dir ".../exp #2"`` names ``exp #2``; ``exp`` (an unrelated run) is not the one overwritten."""
    other = tmp_path / "exp"
    (other / "checkpoints").mkdir(parents=True)
    (other / "config.yaml").write_text("train: {iterations: 1}\n")
    (other / "metrics.jsonl").write_text('{"iteration": 0}\n')
    target = tmp_path / "exp #2"
    (target / ".git").mkdir(parents=True)
    (target / "config.yaml").write_text("mine\n")
    before = tree(tmp_path)
    for args in (["--output-dir", target], [f"train.output_dir={target}"]):
        res = empo2("train", "--config", CPU, *args, "--overwrite", f"policy.model={fake_model}")
        assert res.returncode == 2
        assert f"{target} is not an empo2 run folder (it holds .git)" in one_line(res)
        assert tree(tmp_path) == before


# ------------------------------------------------------------------------------------------- read-only, in use
def test_memory_stats_in_a_read_only_run_folder(read_only):
    source, view = read_only
    memory_file(source / "memory.sqlite", tips=30)
    assert sorted(p.name for p in source.iterdir()) == ["memory.sqlite"]  # WAL mode, closed cleanly
    for args in (["stats", "--json"], ["stats", "--check", "--json"]):
        res = empo2("memory", *args, "--db", view)
        assert res.returncode == 0, res.stderr.decode()[-2000:]
        assert json.loads(res.stdout)["tips"] == 30
    assert sorted(p.name for p in source.iterdir()) == ["memory.sqlite"]


def test_resume_in_a_read_only_run_folder_is_one_line(read_only, fake_model):
    source, view = read_only
    Config.load(CPU, [f"policy.model={fake_model}", f"train.output_dir={view}"]).save(source / "config.yaml")
    memory_file(source / "memory.sqlite")
    before = tree(source)
    res = empo2("train", "--resume", view)
    assert res.returncode == 2
    assert one_line(res) == f"error: cannot write {view}: Read-only file system"
    assert tree(source) == before


def test_second_compare_on_one_folder_is_refused(tmp_path, tiny_model):
    out = tmp_path / "cmp"
    first = subprocess.Popen([sys.executable, "-m", "empo2.cli", "compare", "--allow-unreachable", "--config", CPU, "--algos", "grpo",
                              "--seeds", "1", "--out", str(out), f"policy.model={tiny_model}", *FAST,
                              "train.iterations=3"], cwd=REPO, env=cli_env(), stdout=subprocess.DEVNULL,
                             stderr=subprocess.PIPE, start_new_session=True)
    try:
        deadline = time.time() + 120
        lock = out / LOCK_NAME
        while not (lock.exists() and lock.read_text()):
            assert first.poll() is None and time.time() < deadline, "the first compare never held its folder"
            time.sleep(0.1)
        res = empo2("compare", "--allow-unreachable", "--config", CPU, "--algos", "grpo", "--seeds", "1", "--out", out,
                    f"policy.model={tiny_model}", *FAST, "train.iterations=3", timeout=120)
        assert res.returncode == 2
        msg = one_line(res)
        assert f"{out} is in use by pid {first.pid} on " in msg and "(empo2 compare " in msg, msg
        assert first.poll() is None  # the first one goes on
    finally:
        if first.poll() is None:
            os.killpg(first.pid, signal.SIGINT)
        try:
            first.wait(timeout=120)
        except subprocess.TimeoutExpired:
            os.killpg(first.pid, signal.SIGKILL)
            first.wait()
