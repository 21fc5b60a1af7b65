"""The run folder's machine record (``machine.jsonl``): what it says about this machine agrees with ``lscpu``, and
each start or resume appends one line."""

from __future__ import annotations

import os
import shutil
import subprocess

import pytest
import torch

from empo2 import machine


def test_the_vector_flags_agree_with_lscpu():
    out = subprocess.run(["lscpu"], capture_output=True, text=True, env={**os.environ, "LC_ALL": "C"}) \
        if shutil.which("lscpu") else None
    flags = [line.split(":", 1)[1].split() for line in (out.stdout if out else "").splitlines()
             if line.startswith("Flags:")]
    if not flags:
        pytest.skip("lscpu missing or without a Flags line: the flags were not compared (not tested)")
    me = machine.describe()
    assert me["isa"] == [f for f in machine.ISA_FLAGS if f in flags[0]]
    assert me["torch_threads"] == torch.get_num_threads() and me["torch"] == torch.__version__
    assert me["cpus"] >= 1
    assert me["gpu"] == (torch.cuda.get_device_name(0) if torch.cuda.is_available() else None)


def test_each_start_and_resume_appends_one_line(tmp_path):
    first = machine.record(tmp_path, "start")
    second = machine.record(tmp_path, "resume")
    lines = machine.read(tmp_path)
    assert lines == [first, second] and [m["event"] for m in lines] == ["start", "resume"]
    assert machine.read(tmp_path / "no-such-run") == []


def test_a_table_cell_names_the_widest_vector_flag_and_the_gpu():
    cpu = {"cpu": "AMD EPYC", "isa": ["avx2", "avx512f", "avx512_bf16"], "torch_threads": 1, "gpu": None}
    assert machine.short(cpu) == "AMD EPYC avx512_bf16 ×1"
    assert machine.short({**cpu, "isa": [], "cpu": None, "gpu": "NVIDIA H200", "torch_threads": 16}) == \
        "? no-avx2 ×16 + NVIDIA H200"


def _git_repo(root, package_dir):
    package_dir.mkdir(parents=True)
    (package_dir / "__init__.py").write_text("")
    env = {**os.environ, "GIT_AUTHOR_NAME": "t", "GIT_AUTHOR_EMAIL": "t@t", "GIT_COMMITTER_NAME": "t",
           "GIT_COMMITTER_EMAIL": "t@t"}
    for args in (["init", "-q"], ["add", "."], ["commit", "-q", "-m", "x"]):
        subprocess.run(["git", *args], cwd=root, check=True, env=env, capture_output=True)
    return subprocess.run(["git", "rev-parse", "--short", "HEAD"], cwd=root, capture_output=True,
                          text=True).stdout.strip()


@pytest.mark.skipif(shutil.which("git") is None, reason="git missing: the commit record was not tested")
def test_the_commit_is_recorded_only_for_this_projects_own_checkout(tmp_path):
    own = tmp_path / "checkout"
    head = _git_repo(own, own / "src" / "empo2")
    assert machine.source_commit(own / "src" / "empo2") == head
    (own / "src" / "empo2" / "new.py").write_text("")
    assert machine.source_commit(own / "src" / "empo2") == head + "+changes"
    # A wheel installed into a virtual environment that lives inside some other project's checkout.
    other = tmp_path / "project"
    _git_repo(other, other / ".venv" / "lib" / "python3.11" / "site-packages" / "empo2")
    assert machine.source_commit(other / ".venv" / "lib" / "python3.11" / "site-packages" / "empo2") is None
    assert machine.source_commit(tmp_path / "checkout" / "src") is None
