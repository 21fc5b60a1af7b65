"""Helpers of the hostile-input tests (tests/test_faults_input.py, tests/test_faults_folders.py): ``empo2`` run as a
real subprocess, the one line a user reads, and the files of a folder with their digests."""

from __future__ import annotations

import hashlib
import subprocess
import sys
from pathlib import Path

import numpy as np

from empo2.memory.store import TipMemory
from helpers.processes import cli_env

REPO = Path(__file__).resolve().parents[2]
CPU = "configs/scienceworld_cpu.yaml"
FAST = ["env.tasks=[find-animal]", "env.max_steps=2", "env.eval_variations=1", "algo.num_generations=2",
        "policy.few_shot=0", "policy.max_completion_length=8", "policy.reflection_max_tokens=16",
        "train.progress=false", "train.report_to=none", "algo.p_memory=1.0"]


def empo2(*args, env: dict | None = None, timeout: float = 300, **kw) -> subprocess.CompletedProcess:
    """Run ``python -m empo2.cli ARGS`` to the end."""
    if "stdout" not in kw:
        kw["capture_output"] = True
    return subprocess.run([sys.executable, "-m", "empo2.cli", *map(str, args)], timeout=timeout, cwd=REPO,
                          env=cli_env(**(env or {})), **kw)


def one_line(res: subprocess.CompletedProcess) -> str:
    """The message a user reads: stderr is one short line, without a traceback."""
    err = res.stderr.decode("utf-8", "replace")
    assert "Traceback" not in err and len(err) < 1000, err[-3000:]
    lines = err.strip().splitlines()
    assert len(lines) == 1, err
    return lines[0]


def sha(path: Path) -> str:
    return hashlib.sha256(Path(path).read_bytes()).hexdigest()


def tree(folder: Path) -> dict[str, str]:
    """Every file below ``folder`` (hidden ones included) with its sha256: 'nothing was deleted or changed'."""
    return {str(p.relative_to(folder)): sha(p) for p in sorted(folder.rglob("*")) if p.is_file()}


def memory_file(path: Path, tips: int = 30) -> Path:
    rng = np.random.default_rng(0)
    with TipMemory(path) as mem:
        mem.bulk_insert("find-animal", [f"tip {i}: look for the animal outside" for i in range(tips)],
                        rng.normal(size=(tips, 384)), rng.normal(size=(tips, 384)))
    return path
