"""Data-parallel training on CPU: 2 gloo ranks launched by torchrun against the plain single-process run.

Real pieces throughout: the torchrun launcher, gloo collectives, ScienceWorld JVMs, SQLite memory files. The model is
the tiny random Llama of ``conftest.tiny_model`` (same code path as SmolLM2, a fraction of the time).

Both runs use ``policy.seeded_sampling=true``: every rollout samples from its own stream seeded by (seed, iteration,
group, member, turn), so rank 1 playing group 1 samples what the single process samples for group 1.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

from empo2.cli import main
from empo2.memory.store import TipMemory
from helpers.processes import kill_tree

ARGS = ["--config", "configs/scienceworld_cpu.yaml", "env.tasks=[find-animal]", "env.max_steps=2",
        "env.eval_variations=1", "algo.num_generations=2", "train.tasks_per_batch=2", "policy.few_shot=0",
        "policy.max_completion_length=8", "policy.reflection_max_tokens=16", "train.progress=false",
        "train.report_to=none", "algo.intrinsic_weight=1.0", "algo.p_memory=1.0", "algo.p_off_policy=0.5",
        "policy.seeded_sampling=true", "train.keep_checkpoints=5", "algo.low_prob_threshold=0.0"]


def _torchrun(args: list[str], **kwargs) -> subprocess.Popen:
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": str(Path("src").resolve())}
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node=2",
           "-m", "empo2.cli", "train", *args]
    return subprocess.Popen(cmd, env=env, start_new_session=True, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                            text=True, **kwargs)


def _finish(proc: subprocess.Popen, timeout: float = 900) -> str:
    out, _ = proc.communicate(timeout=timeout)
    assert proc.returncode == 0, out[-4000:]
    return out


def _metrics(run: Path) -> list[dict]:
    return [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]


def _weights(run: Path, it: int) -> dict[str, torch.Tensor]:
    return load_file(str(run / "checkpoints" / f"iter_{it:06d}" / "model" / "adapter_model.safetensors"))


def _tips(path: Path) -> list[tuple]:
    with TipMemory(path) as memory:
        return [(t.id, t.namespace, t.text, t.score, t.step, t.use_count, t.last_use_step, t.utility)
                for t in memory.all_tips()]


@pytest.mark.slow
def test_two_ranks_match_one_rank(tmp_path, tiny_model):
    one, two = tmp_path / "one", tmp_path / "two"
    common = [*ARGS, f"policy.model={tiny_model}", "train.iterations=2"]
    proc = _torchrun([*common, f"train.output_dir={two}"])  # runs while the single process runs
    assert main(["train", *common, f"train.output_dir={one}"]) == 0
    _finish(proc)

    for it in (0, 1):
        w1, w2 = _weights(one, it), _weights(two, it)
        assert w1.keys() == w2.keys()
        for name in w1:
            # float32 sums in another order (micro-batches split by rank) and π_old from generation batches of
            # another composition; on some CPUs Adam turns a near-zero gradient's noise into part of a step, so the
            # bound is a twentieth of one Adam step (lr 1e-4), far below what a missed or doubled row would move
            torch.testing.assert_close(w2[name], w1[name], rtol=0, atol=5e-6, msg=name)
    assert any(t.abs().max() > 0 for n, t in _weights(two, 1).items() if "lora_B" in n)  # it did learn
    assert _tips(two / "memory.sqlite") == _tips(one / "memory.sqlite") != []
    m1, m2 = _metrics(one), _metrics(two)
    assert [r["iteration"] for r in m2] == [0, 1]
    for r1, r2 in zip(m1, m2):  # rank 0's metrics cover both ranks' episodes, as the single process's do
        assert r2["modes"] == r1["modes"]
        assert r2["train"]["score_mean"] == r1["train"]["score_mean"]
        assert r2["advantage"]["groups"] == r1["advantage"]["groups"] == 2
        assert r2["memory"] == r1["memory"]  # incl. tips retrieved per step: rank 1 read the same memory
        assert r2["loss"]["rows"] == r1["loss"]["rows"]
        assert r2["loss"]["optimizer_steps"] == r1["loss"]["optimizer_steps"]
    assert m2[-1]["loss"]["optimizer_steps"] == 1
    assert m2[1]["memory"]["tips_used_per_step"] > 0  # iteration 1 retrieved what iteration 0 wrote
    assert json.loads((two / "eval" / "final.json").read_text())["summary"]["episodes"] == 1


@pytest.mark.slow
def test_two_ranks_killed_then_resumed(tmp_path, tiny_model):
    run = tmp_path / "killed"
    proc = _torchrun([*ARGS, f"policy.model={tiny_model}", "train.iterations=3", f"train.output_dir={run}"])
    deadline = time.time() + 600
    while not (run / "checkpoints" / "iter_000000").is_dir():
        assert proc.poll() is None and time.time() < deadline, proc.stdout.read()[-4000:] if proc.poll() else "slow"
        time.sleep(0.2)
    time.sleep(1.0)  # now inside iteration 1
    kill_tree(proc.pid)  # the launcher, both ranks and their JVMs, as a crash would
    proc.wait()
    tips_before = {t[0] for t in _tips(run / "memory.sqlite")}
    assert tips_before

    _finish(_torchrun(["--resume", str(run)]))
    assert [r["iteration"] for r in _metrics(run)] == [0, 1, 2]  # continued, nothing repeated or lost
    assert tips_before <= {t[0] for t in _tips(run / "memory.sqlite")}
    assert (run / "checkpoints" / "iter_000002" / "model" / "adapter_model.safetensors").is_file()
