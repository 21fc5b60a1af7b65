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
