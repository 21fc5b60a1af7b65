"""Faults in the files a run reads back: tip memories from elsewhere, damaged checkpoints, deeply nested configs,
odd memory paths, a full disk in a checkpoint write, read-only and shared run folders, the process limit.

As in tests/test_faults_cluster.py everything is real: ``empo2`` runs as a subprocess in its own session on real
ScienceWorld JVMs, real SQLite files, real checkpoint folders, a real tmpfs and a real read-only bind mount (the
last two need root; skipped otherwise), with the tiny random model of tests/conftest.py. One tiny run (2 iterations,
2 checkpoints) is trained once for the module; each test damages its own copy of it.
"""

from __future__ import annotations

import json
import os
import resource
import shutil
import sqlite3
import stat
import subprocess
import sys
from pathlib import Path

import psutil
import pytest
import torch

from empo2.rundir import checkpoint as ckpt
from helpers.faults_input import empo2, one_line, tree
from test_faults import corrupt
from test_faults_cluster import CONFIG, FAST, REPO, _unprefixed, iterations, resume, train

MANIFEST = "manifest.json"  # empo2.rundir.manifest.MANIFEST, spelled out so the file runs on older code
BIG_TIP = ("look around the room carefully and then " * 260_000)[:10_000_000]


@pytest.fixture(scope="module")
def trained(tmp_path_factory, tiny_model) -> Path:
    run = tmp_path_factory.mktemp("trained") / "run"
    proc = train(run, tiny_model, "train.iterations=2", verbose=False)
    assert proc.finish() == 0, proc.text()[-3000:]
    assert [p.name for p in ckpt.list_checkpoints(run)] == ["iter_000000", "iter_000001"]
    return run


def copy_of(run: Path, tmp_path: Path) -> Path:
    dest = tmp_path / "run"
    shutil.copytree(run, dest, symlinks=True)
    return dest


def set_tip_texts(db: Path, sql_value: str, params: tuple = ()) -> int:
    """Put ``sql_value`` into the text of every tip of ``db`` (a read-write connection, so its -wal is merged on
    close); the number of tips."""
    conn = sqlite3.connect(db)
    try:
        conn.execute(f"UPDATE tips SET text = {sql_value}", params)
        conn.commit()
        return conn.execute("SELECT count(*) FROM tips").fetchone()[0]
    finally:
        conn.close()


def skipped_line(proc, db: Path, count: int, reason: str) -> None:
    lines = [_unprefixed(line) for line in proc.out if "fail the checks" in line]
    assert lines == [f"{db}: {count} stored tip(s) fail the checks every new tip passes ({reason} {count}); they "
                     "stay in the file but are never retrieved"], proc.out


# --------------------------------------------------------------------------- 3: tips read from a file are bounded
@pytest.mark.slow
@pytest.mark.parametrize("kind", ["10 MB", "invalid UTF-8"])
def test_seed_memory_with_a_huge_or_undecodable_tip_is_skipped(trained, tmp_path, tiny_model, kind):
    """``memory.seed_from`` whose tips are 10 MB each (the trainer then runs under an address-space limit of 1 GiB
    above what it holds when its rollout starts: a 10 MB prompt takes gigabytes to tokenize) or invalid UTF-8: the
    run skips them with one line and trains; no prompt holds them."""
    seed = tmp_path / "seed.sqlite"
    shutil.copyfile(trained / "checkpoints" / "iter_000001" / "memory.sqlite", seed)
    if kind == "10 MB":
        count, reason = set_tip_texts(seed, "?", (BIG_TIP,)), "too_long"
    else:
        count, reason = set_tip_texts(seed, "CAST(X'4c6f6f6bff20617420746865' AS TEXT)"), "invalid_unicode"
    run = tmp_path / "run"
    proc = train(run, tiny_model, "train.iterations=1", f"memory.seed_from={seed}")
    try:
        proc.wait_line("phase: the rollout of iteration 0")  # the JVMs are up: the limit is the trainer's alone
        trainer = psutil.Process(proc.proc.pid)
        limit = trainer.memory_info().vms + (1 << 30)
        trainer.rlimit(resource.RLIMIT_AS, (limit, limit))
        assert proc.finish(timeout=600) == 0, proc.text()[-3000:]
    finally:
        if proc.proc.poll() is None:
            proc.kill()
    skipped_line(proc, run / "memory.sqlite", count, reason)
    samples = (run / "trajectories.jsonl").read_text()
    assert "look around the room carefully and then look around" not in samples and "Look\ufffd" not in samples


def test_stored_tips_are_read_bounded_and_checked(tmp_path):
    """A memory file with a 10 MB tip, a tip in invalid UTF-8, a blob where text belongs and a 10 MB state key
    beside two sound tips: opening it reads the sound ones only (Python never holds the 10 MB values: tracemalloc's
    peak stays far below them) and counts the rest by reason; retrieval never returns them."""
    import tracemalloc

    import numpy as np

    from empo2.memory.store import TipMemory

    db = tmp_path / "memory.sqlite"
    rng = np.random.default_rng(0)
    keys = rng.normal(size=(6, 384))
    with TipMemory(db) as mem:
        mem.bulk_insert("find-animal", [f"tip {i}: look for the animal outside the house" for i in range(6)], keys,
                        rng.normal(size=(6, 384)))
    conn = sqlite3.connect(db)
    conn.execute("UPDATE tips SET text = ? WHERE id = 1", (BIG_TIP,))
    conn.execute("UPDATE tips SET text = CAST(X'4c6f6f6bff' AS TEXT) WHERE id = 2")
    conn.execute("UPDATE tips SET text = X'00ff' WHERE id = 3")
    conn.execute("UPDATE tips SET key_text = ? WHERE id = 4", (BIG_TIP,))
    conn.commit()
    conn.close()
    tracemalloc.start()
    try:
        with TipMemory(db, dim=None, read_only=True) as mem:
            peak = tracemalloc.get_traced_memory()[1]
            assert mem.skipped == {"too_long": 2, "invalid_unicode": 2} and len(mem) == 2
            found = mem.retrieve("find-animal", keys, k=6, threshold=-1.0)
            assert {t.id for hits in found for t in hits} == {5, 6}
    finally:
        tracemalloc.stop()
    assert peak < 2_000_000, peak


@pytest.mark.slow
def test_resume_of_an_old_checkpoint_whose_memory_has_an_undecodable_tip(trained, tmp_path):
    """A run's own memory (live and in its latest checkpoint, one written before checkpoints had a manifest) with a
    tip in invalid UTF-8: the resume loads that checkpoint, skips the tip with one line and finishes."""
    run = copy_of(trained, tmp_path)
    latest = run / "checkpoints" / "iter_000001"
    for folder in run / "checkpoints" / "iter_000000", latest:
        (folder / MANIFEST).unlink(missing_ok=True)  # as an older empo2 wrote them
    for db in run / "memory.sqlite", latest / "memory.sqlite":
        conn = sqlite3.connect(db)
        conn.execute("UPDATE tips SET text = CAST(X'4c6f6f6bff' AS TEXT) WHERE id = (SELECT min(id) FROM tips)")
        conn.commit()
        conn.close()
    proc = resume(run, "train.iterations=3")
    assert proc.finish() == 0, proc.text()[-3000:]
    skipped_line(proc, run / "memory.sqlite", 1, "invalid_unicode")
    assert not [line for line in proc.out if "does not load" in line], proc.out
    assert iterations(run) == [0, 1, 2]


# --------------------------------------------------------------- 6 + 7: a checkpoint is chosen only when all sound
def _flip_adapter_bits(folder: Path) -> None:
    adapter = folder / "model" / "adapter_model.safetensors"
    data = bytearray(adapter.read_bytes())
    for at in range(len(data) - 4000, len(data), 97):  # tensor bytes (the header is at the start): it still parses
        data[at] ^= 0x7F
    adapter.write_bytes(bytes(data))


def _old(folder: Path) -> None:
    """A checkpoint as an empo2 before checksums wrote it."""
    (folder / MANIFEST).unlink(missing_ok=True)


DAMAGE = {
    "memory copy": (lambda f: corrupt(f / "memory.sqlite", "middle"),
                    "ChecksumError: memory.sqlite does not match its checksum in manifest.json"),
    "memory copy, old checkpoint": (lambda f: (_old(f), corrupt(f / "memory.sqlite", "middle")), "MemoryStoreError: "),
    "state {}": (lambda f: (f / "state.json").write_text("{}"),
                 "ChecksumError: state.json does not match its checksum in manifest.json"),
    "state {}, old checkpoint": (lambda f: (_old(f), (f / "state.json").write_text("{}")),
                                 "ValueError: state.json lacks iteration, rng, task_sampler, mode_sampler, novelty"),
    "adapter bits": (_flip_adapter_bits,
                     "ChecksumError: model/adapter_model.safetensors does not match its checksum in manifest.json"),
}


@pytest.mark.slow
@pytest.mark.parametrize("damage", sorted(DAMAGE))
def test_damaged_latest_checkpoint_falls_back_to_the_previous(trained, tmp_path, damage):
    """The latest checkpoint damaged in one part (its memory copy, its state, flipped bits in its adapter that still
    parse; with and without a manifest): the resume says so in one line, resumes from the previous checkpoint with
    that checkpoint's memory (the live one kept beside it) and finishes; nothing repeated."""
    run = copy_of(trained, tmp_path)
    latest, previous = run / "checkpoints" / "iter_000001", run / "checkpoints" / "iter_000000"
    damage_it, reason = DAMAGE[damage]
    damage_it(latest)
    proc = resume(run)
    assert proc.finish() == 0, proc.text()[-3000:]
    warnings = [_unprefixed(line) for line in proc.out if "does not load" in line]
    assert len(warnings) == 1 and warnings[0].startswith(f"checkpoint {latest} does not load ({reason}"), proc.out
    assert warnings[0].endswith(f"resuming from {previous}")
    assert "Traceback" not in proc.text()
    assert iterations(run) == [0, 1]
    assert (run / "memory.sqlite.ahead-of-iter_000000").is_file()
    assert ckpt.load_state(run / "checkpoints" / "iter_000001")["iteration"] == 1  # written again, whole


@pytest.mark.slow
def test_eval_and_export_of_a_damaged_checkpoint_fall_back_or_refuse(trained, tmp_path):
    """``eval --run`` and ``export`` read the newest checkpoint whose files match its manifest: with flipped bits in
    the latest adapter (it still parses, and both used to evaluate or write it out) they say so in one warning line
    and use the previous checkpoint; with every checkpoint damaged they exit 2 with one line and write nothing."""
    from safetensors.torch import load_file

    run = copy_of(trained, tmp_path)
    latest, previous = run / "checkpoints" / "iter_000001", run / "checkpoints" / "iter_000000"
    _flip_adapter_bits(latest)
    warning = (f"warning: iter_000001: model/adapter_model.safetensors does not match its checksum in {MANIFEST}; "
               f"using {previous}, the newest checkpoint that matches its manifest")
    res = empo2("eval", "--run", run, "--split", "dev", "--variations", "1", "--batch", "1", "--max-steps", "1",
                "--allow-unreachable")
    assert res.returncode == 0, res.stderr[-3000:]
    assert one_line(res) == warning
    assert json.loads(res.stdout.decode().strip().splitlines()[-1])["episodes"] == 1
    out = tmp_path / "exported"
    res = empo2("export", run, out)
    assert res.returncode == 0, res.stderr[-3000:]
    assert one_line(res) == warning
    assert json.loads(res.stdout)["checkpoint"] == str(previous) and (out / "model.safetensors").is_file()
    only_previous = tmp_path / "only-previous"
    shutil.copytree(trained, only_previous, symlinks=True)
    shutil.rmtree(only_previous / "checkpoints" / "iter_000001")
    assert empo2("export", only_previous, tmp_path / "reference").returncode == 0
    got, want = load_file(str(out / "model.safetensors")), load_file(str(tmp_path / "reference" / "model.safetensors"))
    assert got.keys() == want.keys() and all(torch.equal(got[k], want[k]) for k in got)  # iter_000000's weights

    _flip_adapter_bits(previous)
    before = tree(run)
    for args in (["eval", "--run", run, "--split", "dev", "--variations", "1", "--batch", "1", "--max-steps", "1",
                  "--allow-unreachable"], ["export", run, tmp_path / "again"]):
        res = empo2(*args)
        assert res.returncode == 2
        assert one_line(res).startswith(f"error: no checkpoint of {run} matches its manifest (iter_000001: "), res
        assert res.stdout == b""
    assert not (tmp_path / "again").exists() and tree(run) == before


def test_checkpoint_files_are_readable_as_the_umask_allows(trained):
    """Checkpoints are shared with a team: folders and files get the modes ``mkdir`` and ``open`` would give them
    (a temporary folder is 0700 and safetensors writes 0600 whatever the umask); the manifest lists every file."""
    mask = os.umask(0o022)
    os.umask(mask)
    for folder in ckpt.list_checkpoints(trained):
        for path in [folder, *folder.rglob("*")]:
            wanted = 0o777 if path.is_dir() else 0o666
            assert stat.S_IMODE(path.stat().st_mode) & ~0o111 == wanted & ~mask & ~0o111, (path, oct(mask))
        listed = json.loads((folder / MANIFEST).read_text())["files"]
        assert sorted(listed) == sorted(p.relative_to(folder).as_posix() for p in folder.rglob("*")
                                        if p.is_file() and p.name != MANIFEST)


# ----------------------------------------------------------------------------- 7: one line where a traceback was
def test_deeply_nested_yaml_is_one_line(trained, tmp_path):
    """A config or a run's own config.yaml nested 5,000 levels deep: one line, exit 2, nothing written."""
    deep = tmp_path / "deep.yaml"
    deep.write_text("env:\n  tasks: " + "[" * 5000 + "]" * 5000 + "\n")
    res = empo2("train", "--config", deep, f"train.output_dir={tmp_path / 'new'}")
    assert res.returncode == 2
    assert one_line(res).startswith(f"error: malformed YAML in {deep}: lists or mappings nested deeper than 64 "
                                    "levels are not accepted in a config")
    assert not (tmp_path / "new").exists()
    run = copy_of(trained, tmp_path)
    (run / "config.yaml").write_text("train:\n" + "".join("  " * i + "k:\n" for i in range(1, 200)))
    before = tree(run)
    res = empo2("train", "--resume", run)
    assert res.returncode == 2 and "nested deeper than 64 levels" in one_line(res)
    assert tree(run) == before


def test_memory_path_that_is_a_folder_on_resume(trained, tmp_path):
    run = copy_of(trained, tmp_path)
    db = run / "memory.sqlite"
    db.unlink()
    db.mkdir()
    before = tree(run)
    res = empo2("train", "--resume", run)
    assert res.returncode == 2
    assert one_line(res) == (f"error: {db} is a folder; a tip memory must be a regular file: move it away, or point "
                             "the run elsewhere")
    assert tree(run) == before and db.is_dir()


@pytest.mark.slow
def test_memory_linked_to_dev_null_on_a_fresh_run(tmp_path, tiny_model):
    """SQLite would write ``/dev/null-journal`` (as root) and report a disk error; refused with one line instead."""
    journal = Path("/dev/null-journal")
    existed = journal.exists()
    run = tmp_path / "run"
    run.mkdir()
    (run / "memory.sqlite").symlink_to("/dev/null")
    try:
        res = empo2("train", "--config", CONFIG, f"train.output_dir={run}", f"policy.model={tiny_model}", *FAST,
                    "train.iterations=1")
        assert res.returncode == 2, res.stderr[-3000:]
        line = res.stderr.decode().strip().splitlines()[-1]
        assert "Traceback" not in res.stderr.decode() and str(run) in line, res.stderr[-3000:]
        assert existed or not journal.exists()
    finally:
        if not existed:
            journal.unlink(missing_ok=True)


@pytest.fixture()
def tiny_checkpoint_disk(tmp_path):
    """A run folder whose ``checkpoints/`` is a 64 KiB tmpfs (root only): smaller than one checkpoint. The folder is
    marked as an empo2 run's that owns ``checkpoints/``, as a user who mounts scratch space there would mark it."""
    from empo2.rundir.runlock import RUN_LAYOUT, mark_run_folder

    run = tmp_path / "run"
    (run / "checkpoints").mkdir(parents=True)
    if subprocess.run(["mount", "-t", "tmpfs", "-o", "size=64k", "tmpfs", str(run / "checkpoints")],
                      capture_output=True).returncode:
        pytest.skip("mounting a tmpfs needs root")
    mark_run_folder(run, ours=RUN_LAYOUT)
    yield run
    subprocess.run(["umount", "-l", str(run / "checkpoints")], check=False)


@pytest.mark.slow
def test_full_disk_during_the_checkpoint_write_is_one_line(tiny_checkpoint_disk, tiny_model):
    """The disk fills while the weights are written (safetensors and torch report it in their own words)."""
    run = tiny_checkpoint_disk
    proc = train(run, tiny_model, "train.iterations=1", verbose=False)
    assert proc.finish() == 2, proc.text()[-3000:]
    line = proc.last_line()
    assert line.startswith(f"error: cannot write {run / 'checkpoints'}: No space left on device ("), line
    assert line.endswith("KiB free); no checkpoint was written yet"), line
    assert list((run / "checkpoints").iterdir()) == []  # the partial checkpoint gave its space back


def test_eval_into_a_read_only_run_folder_fails_before_evaluating(trained, read_only):  # noqa: F811
    """``eval --run`` of a read-only run with the default output (RUN/eval): one line, exit 2, before the model or
    any environment starts (it used to fail with PermissionError after the whole evaluation)."""
    source, view = read_only
    shutil.copytree(trained, source, dirs_exist_ok=True, symlinks=True)
    res = empo2("eval", "--run", view, "--variations", "1", "--batch", "1")
    assert res.returncode == 2
    assert one_line(res) == (f"error: cannot write {view / 'eval'}: Read-only file system; give a writable folder "
                             "with --out")
    assert res.stdout == b""


NOBODY = 65534


def as_a_user(command: list[str]) -> list[str]:
    """``command`` run by an ordinary user (nobody), who is held to ``ulimit -u``, when this process is root: with
    ``setpriv`` and the one capability to read root's files (the interpreter and the checkout), nothing else."""
    if os.getuid() != 0:
        return command
    if shutil.which("setpriv") is None:
        pytest.skip("setpriv missing: the process limit of an ordinary user was not tested")
    return ["setpriv", f"--reuid={NOBODY}", f"--regid={NOBODY}", "--clear-groups", "--inh-caps=+dac_read_search",
            "--ambient-caps=+dac_read_search", *command]


def threads_of(uid: int) -> int:
    return sum(p.info["num_threads"] or 0 for p in psutil.process_iter(["uids", "num_threads"])
               if p.info["uids"] is not None and p.info["uids"].real == uid)


def test_pool_beyond_the_process_limit_is_refused_before_forking(tmp_path, tiny_model):
    """``ulimit -u`` lower than 8 workers need (each a Python process and a JVM with its threads), for an ordinary
    user: one line, exit 2, nothing forked or written (``BlockingIOError`` half-way through the pool before)."""
    run = tmp_path / "run"
    uid = NOBODY if os.getuid() == 0 else os.getuid()
    limit = threads_of(uid) + 60

    def low_limit():
        resource.setrlimit(resource.RLIMIT_NPROC, (limit, limit))

    command = [sys.executable, "-m", "empo2.cli", "train", "--config", CONFIG, f"train.output_dir={run}",
               f"policy.model={tiny_model}", *FAST, "algo.num_generations=8", "env.max_workers=8"]
    res = subprocess.run(as_a_user(command), capture_output=True, cwd=REPO, timeout=300, preexec_fn=low_limit)
    assert res.returncode == 2, res.stderr[-3000:]
    assert one_line(res).startswith("error: train.tasks_per_batch × algo.num_generations = 8 environment workers "
                                    "need about ")
    assert "process limit (ulimit -u)" in one_line(res) and not run.exists()


def test_root_is_not_held_to_the_process_limit():
    """The kernel exempts root (of the initial user namespace) from ``ulimit -u``: under a limit that 8 workers would
    not pass, the check lets root's pool start (it refused before, counting root's threads against a limit that does not
    apply), and root forks 140 processes where the limit leaves room for 60."""
    if os.getuid() != 0:
        pytest.skip("not root: root's exemption was not tested")
    limit = threads_of(0) + 60
    probe = ("import os, resource, sys, time\n"
             f"resource.setrlimit(resource.RLIMIT_NPROC, ({limit}, {limit}))\n"
             "from empo2.config.bounds_check import check_process_limit\n"
             "check_process_limit(8, 'train.tasks_per_batch × algo.num_generations')\n"
             "children = []\n"
             "for _ in range(140):\n"
             "    pid = os.fork()\n"
             "    if pid == 0:\n"
             "        time.sleep(3)\n"
             "        os._exit(0)\n"
             "    children.append(pid)\n"
             "for pid in children:\n"
             "    os.waitpid(pid, 0)\n"
             "print(len(children))\n")
    res = subprocess.run([sys.executable, "-c", probe], capture_output=True, cwd=REPO, timeout=120)
    assert res.returncode == 0, res.stderr[-3000:]
    assert res.stdout.decode().split() == ["140"]
