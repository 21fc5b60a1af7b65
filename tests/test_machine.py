"""The run folder's machine record (``machine.jsonl``): what it says about this machine agrees with ``lscpu``, and
each start or resume appends one line."""

from __future__ import annotations

import shutil
import subprocess

import pytest
import torch

from empo2 import machine


def test_the_vector_flags_agree_with_lscpu():
    if shutil.which("lscpu") is None:
        pytest.skip("lscpu missing: the flags were not compared (not tested)")
    out = subprocess.run(["lscpu"], capture_output=True, text=True, check=True).stdout
    flags = next(line.split(":", 1)[1].split() for line in out.splitlines() if line.startswith("Flags:"))
    me = machine.describe()
    assert me["isa"] == [f for f in machine.ISA_FLAGS if f in flags]
    assert me["torch_threads"] == torch.get_num_threads() and me["torch"] == torch.__version__
    assert me["cpus"] >= 1
    assert me["gpu"] == (torch.cuda.get_device_name(0) if torch.cuda.is_available() else None)


def test_each_start_and_resume_appends_one_line(tmp_path):
    first = machine.record(tmp_path, "start")
    second = machine.record(tmp_path, "resume")
    lines = machine.read(tmp_path)
    assert lines == [first, second] and [m["event"] for m in lines] == ["start", "resume"]
    assert machine.read(tmp_path / "no-such-run") == []
    widest = first["isa"][-1] if first["isa"] else "no-avx2"
    gpu = f" + {first['gpu']}" if first["gpu"] else ""
    assert machine.short(first) == f"{first['cpu'] or '?'} {widest} ×{torch.get_num_threads()}{gpu}"
