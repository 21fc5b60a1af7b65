"""End-to-end training runs on the real ScienceWorld simulator, through the real CLI.

The EMPO² run uses the default model (SmolLM2-135M). The GRPO run and the kill/resume run use a tiny random model of
the same architecture (Llama, SmolLM2's tokenizer) saved to a folder, because three full-size runs would take most of
the suite's time budget; it exercises the same code (loading by path, LoRA, generation, update, checkpoint).
"""

from __future__ import annotations

import io
import json
import os
import re
import signal
import subprocess
import sys
import time
from pathlib import Path

import psutil
import pytest
import torch
from safetensors.torch import load_file

from empo2.cli import main
from empo2.memory.store import TipMemory

pytestmark = pytest.mark.slow  # real simulators / end-to-end runs: `pytest -m "not slow"` skips them

FAST = ["env.tasks=[find-animal]", "env.max_steps=2", "env.eval_variations=1", "algo.num_generations=2",
        "policy.few_shot=0", "policy.max_completion_length=8", "policy.reflection_max_tokens=16",
        "train.progress=false", "train.report_to=tensorboard", "algo.intrinsic_weight=1.0", "algo.novelty_threshold=1.0"]
# every distinct state text counts as new: in two steps a tiny model rarely leaves its room, and at the default
# 0.9 its states all look alike, which would leave the group no signal


def _group_left(pgid: int, wait: float = 10.0) -> list[str]:
    """Names of live processes still in process group ``pgid`` after ``wait`` seconds."""
    deadline = time.time() + wait
    while True:
        left = []
        for p in psutil.process_iter(["name", "status"]):
            try:
                if os.getpgid(p.pid) == pgid and p.info["status"] != psutil.STATUS_ZOMBIE:
                    left.append(p.info["name"])
            except (ProcessLookupError, psutil.NoSuchProcess):
                pass
        if not left or time.time() > deadline:
            return left
        time.sleep(0.2)


def _metrics(run: Path) -> list[dict]:
    return [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]


def _adapter(run: Path) -> dict[str, torch.Tensor]:
    last = sorted((run / "checkpoints").glob("iter_*"))[-1]
    return load_file(str(last / "model" / "adapter_model.safetensors"))


def test_empo2_run_with_default_model(tmp_path):
    run = tmp_path / "empo2"
    rc = main(["train", "--config", "configs/scienceworld_cpu.yaml", f"train.output_dir={run}",
               "train.iterations=2", "algo.p_memory=1.0", "algo.p_off_policy=0.5", *FAST])
    assert rc == 0
    rows = _metrics(run)
    assert [r["iteration"] for r in rows] == [0, 1]
    # memory gained tips, and at least one memory-mode batch was trained (a loss term for its mode)
    with TipMemory(run / "memory.sqlite") as memory:
        assert len(memory) >= 1
        # every tip is keyed by the state it is about: the room it was written in, not the simulator's reply
        # (the task's progress first, then the inventory and the room)
        assert all(t.key_text.startswith("Task progress: score ") and re.search(r"^This .* is called the ", t.key_text,
                                                                                 re.M) for t in memory.all_tips())
    assert all(set(r["modes"]) <= {"on_tips", "off_tips"} for r in rows)
    # a memory-mode batch was trained whenever there was anything to train
    assert any(("loss_on_tips" in r["loss"]) or ("loss_off_tips" in r["loss"]) for r in rows) == any(
        r["loss"].get("computed_rows", 0) > 0 for r in rows)
    # Every iteration with rows takes its optimizer steps (zero-advantage rows count, as in the paper), but the
    # parameters change exactly when some group had a signal: with order-free novelty two identical-looking rollouts
    # give zero advantage, a zero gradient, and AdamW's zero moments move nothing (a guaranteed update is
    # test_trainer_api.py's job). LoRA's B matrices start at zero: any non-zero entry means they changed.
    assert all(r["loss"]["optimizer_steps"] >= 1 for r in rows if r["loss"].get("rows", 0) > 0)
    signal_seen = any(r["advantage"]["zero_adv_groups"] < r["advantage"]["groups"] for r in rows)
    assert any(t.abs().max() > 0 for name, t in _adapter(run).items() if "lora_B" in name) == signal_seen
    for name in ("scores.png", "modes.png", "memory.png", "trajectories.jsonl", "eval/final.md", "config.yaml"):
        assert (run / name).is_file(), name
    assert list((run / "tb").glob("events.*"))
    sample = json.loads((run / "trajectories.jsonl").read_text().splitlines()[0])
    assert sample["steps"] and "prompt" in sample["steps"][0]


def test_grpo_run_has_no_memory(tmp_path, tiny_model, capsys):
    run = tmp_path / "grpo"
    rc = main(["train", "--config", "configs/scienceworld_cpu.yaml", "--algo", "grpo", f"train.output_dir={run}",
               "train.iterations=2", f"policy.model={tiny_model}", *FAST, "train.progress=true"])
    assert rc == 0
    # output to a file (here a capture), not a terminal: progress comes as plain lines, every stage's end included
    out = capsys.readouterr().out
    for line in ("iter 0: rollouts: 2/2", "iter 1: rollouts: 2/2", "update: ", "eval final: 1/1"):
        assert f"  {line}" in out, line
    rows = _metrics(run)
    assert [r["iteration"] for r in rows] == [0, 1]
    assert all(r["modes"] == ["on"] for r in rows)
    assert not (run / "memory.sqlite").exists()
    # as in the EMPO² run: the weights move exactly when some group had a signal (a guaranteed update is
    # test_trainer_api.py's job)
    signal_seen = any(r["advantage"]["zero_adv_groups"] < r["advantage"]["groups"] for r in rows)
    assert all(r["loss"]["optimizer_steps"] >= 1 for r in rows)
    assert any(t.abs().max() > 0 for name, t in _adapter(run).items() if "lora_B" in name) == signal_seen

    # `empo2 eval` on the run's last checkpoint writes a JSON and a markdown table
    assert main(["eval", "--run", str(run), "--split", "dev", "--variations", "2", "--batch", "2",
                 "--max-steps", "2", "--allow-unreachable"]) == 0  # no gold path fits 2 steps
    result = json.loads((run / "eval" / "eval_dev.json").read_text())
    assert result["summary"]["episodes"] == 2 and result["per_task"]["find-animal"]["episodes"] == 2
    assert all(len(e["actions"]) == e["steps"] >= 1 and all(e["actions"]) for e in result["episodes"])
    assert "| find-animal | 2 |" in (run / "eval" / "eval_dev.md").read_text()



def test_a_start_evaluation_leaves_the_training_after_it_as_it_was(tmp_path, tiny_model):
    """The start evaluation plays held-out variations on the workers that the training then uses; nothing it leaves
    there may reach the training. With and without it, iteration 0 plays the same prompts (the demonstration in them
    included, a gold path the simulator would choose differently after other episodes) and the same actions. The one
    train variation's demonstration shows the second train variation, which the evaluation's demonstrations (the
    first train variation) never showed: it is written after the evaluation's episodes."""
    played = {}
    for start in ("true", "false"):
        run = tmp_path / f"start-{start}"
        assert main(["train", "--config", "configs/scienceworld_cpu.yaml", "--algo", "grpo", f"train.output_dir={run}",
                     "train.iterations=1", f"policy.model={tiny_model}", *FAST, "env.tasks=[find-non-living-thing]",
                     "env.train_variations=1", "env.eval_variations=2", "env.max_steps=3", "policy.few_shot=1",
                     f"train.eval_at_start={start}"]) == 0
        played[start] = [json.loads(line) for line in (run / "trajectories.jsonl").read_text().splitlines()]
    assert (tmp_path / "start-true" / "eval" / "start.json").is_file()
    assert not (tmp_path / "start-false" / "eval" / "start.json").exists()
    assert "Example of a solved episode" in played["true"][0]["steps"][0]["prompt"]
    assert played["true"] == played["false"]


def test_progress_lines_come_at_a_stages_start_and_end_and_at_most_once_a_minute_between():
    from rich.console import Console

    from empo2.progress import LINE_EVERY_S, ProgressBar

    out, now = io.StringIO(), [0.0]
    with ProgressBar(Console(file=out, width=200), True, clock=lambda: now[0]) as progress:
        for t, done in [(0, 0), (1, 1), (LINE_EVERY_S + 0.5, 2), (LINE_EVERY_S + 1, 3), (LINE_EVERY_S + 2, 4)]:
            now[0] = t
            progress("iter 0: rollouts", done, 4)
        now[0] = 100.0
        progress("update", 1, 2)
    assert out.getvalue().splitlines() == ["  iter 0: rollouts: 0/4 (0 s)", "  iter 0: rollouts: 2/4 (60 s)",
                                           "  iter 0: rollouts: 4/4 (62 s)", "  update: 1/2 (0 s)"]
    coloured_log = Console(file=io.StringIO(), force_terminal=True)  # as FORCE_COLOR makes it in a CI log
    with ProgressBar(coloured_log, True) as progress:
        assert progress.__name__ == "line"
    main_end, other_end = os.openpty()  # a real terminal device
    with open(other_end, "w") as tty:
        terminal = Console(file=tty)
        with ProgressBar(terminal, True) as progress:
            assert progress.__name__ == "update"  # a live bar where someone watches
        with ProgressBar(terminal, False) as progress:
            assert progress is None
    os.close(main_end)

def test_adapt_updates_memory_only(tmp_path, tiny_model):
    out = tmp_path / "adapt"
    assert main(["adapt", "--model", tiny_model, "--tasks", "find-animal", "--trials", "2", "--variations", "2",
                 "--batch", "2", "--max-steps", "2", "--out", str(out)]) == 0
    report = json.loads((out / "adapt.json").read_text())
    assert len(report["trials"]) == 2 and report["best"] == max(report["scores"])
    assert report["trials"][1]["per_task"]["find-animal"]["episodes"] == 2 and report["weights_unchanged"]
    assert (out / "adapt.png").is_file() and (out / "adapt.md").is_file()
    with TipMemory(out / "memory.sqlite") as memory:
        assert len(memory) + sum(memory.rejections().values()) >= 2  # every episode reflected


def test_webshop_fixture_trains_both_algorithms(tmp_path, tiny_model):
    for algo in ("empo2", "grpo"):
        run = tmp_path / algo
        assert main(["train", "--config", "configs/webshop_cpu.yaml", "--algo", algo, f"train.output_dir={run}",
                     "train.iterations=1", f"policy.model={tiny_model}", "env.max_steps=2", "env.eval_variations=1",
                     "algo.num_generations=2", "policy.max_completion_length=8", "policy.reflection_max_tokens=8",
                     "train.progress=false", "algo.p_memory=1.0"]) == 0
        result = json.loads((run / "eval" / "final.json").read_text())
        assert result["label"] == "webshop-fixture"  # the fixture is never reported as WebShop
        assert (run / "memory.sqlite").exists() == (algo == "empo2")


def test_kill_mid_iteration_then_resume(tmp_path, tiny_model):
    run = tmp_path / "killed"
    args = [sys.executable, "-m", "empo2.cli", "train", "--config", "configs/scienceworld_cpu.yaml",
            f"train.output_dir={run}", "train.iterations=3", "algo.p_memory=1.0", f"policy.model={tiny_model}", *FAST]
    proc = subprocess.Popen(args, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, start_new_session=True)
    deadline = time.time() + 300
    while not (run / "checkpoints" / "iter_000000").is_dir():
        assert proc.poll() is None and time.time() < deadline, "the run never wrote its first checkpoint"
        time.sleep(0.2)
    time.sleep(1.0)  # now inside iteration 1
    os.killpg(proc.pid, signal.SIGKILL)  # the trainer and its environment workers, as a crash would
    proc.wait()
    assert _group_left(proc.pid) == []  # no worker or JVM outlives the crash
    with TipMemory(run / "memory.sqlite") as memory:
        tips_before = {t.id for t in memory.all_tips()}
    assert tips_before

    rc = main(["train", "--resume", str(run)])
    assert rc == 0
    iterations = [r["iteration"] for r in _metrics(run)]
    assert iterations == [0, 1, 2]  # continued, no iteration repeated or lost
    with TipMemory(run / "memory.sqlite") as memory:
        assert tips_before <= {t.id for t in memory.all_tips()}  # no committed tip lost


def test_unknown_key_and_task_write_nothing(tmp_path, capsys):
    run = tmp_path / "bad"
    assert main(["train", "--config", "configs/scienceworld_cpu.yaml", f"train.output_dir={run}", "algo.betaa=1"]) == 2
    assert "unknown config key 'algo.betaa'" in capsys.readouterr().err
    assert main(["train", "--config", "configs/scienceworld_cpu.yaml", f"train.output_dir={run}",
                 "env.tasks=[find-unicorn]"]) == 2
    assert "unknown ScienceWorld task" in capsys.readouterr().err
    assert main(["train", "--config", "configs/scienceworld_cpu.yaml", f"train.output_dir={run}",
                 "policy.model=not-a-model"]) == 2
    assert "unknown model" in capsys.readouterr().err
    assert not run.exists()


def test_a_resume_with_more_iterations_drops_the_old_final_eval(tmp_path, tiny_model, monkeypatch):
    """A finished run extended by ``--resume … train.iterations=2`` that crashes before its new last checkpoint keeps
    no final eval from before: nothing may read the folder as finished (``compare`` skips finished runs)."""
    from empo2.train.trainer import Trainer

    run = tmp_path / "run"
    assert main(["train", "--config", "configs/webshop_cpu.yaml", "--algo", "grpo", f"train.output_dir={run}",
                 "train.iterations=1", f"policy.model={tiny_model}", "env.max_steps=2", "env.eval_variations=1",
                 "algo.num_generations=2", "policy.max_completion_length=8", "train.progress=false"]) == 0
    assert (run / "eval" / "final.json").is_file()

    def crash(self, it):
        raise RuntimeError("the machine went away before the checkpoint")

    monkeypatch.setattr(Trainer, "save", crash)
    try:
        rc = main(["train", "--resume", str(run), "train.iterations=2"])
    except RuntimeError:
        rc = 1
    assert rc != 0
    assert [r["iteration"] for r in _metrics(run)] == [0, 1]  # iteration 1 ran, its checkpoint never came
    assert not (run / "eval" / "final.json").exists() and not (run / "eval" / "final.md").exists()


def test_overwrite_starts_a_fresh_run(tmp_path, tiny_model):
    run = tmp_path / "again"
    args = ["train", "--config", "configs/scienceworld_cpu.yaml", f"train.output_dir={run}", "train.iterations=1",
            f"policy.model={tiny_model}", "algo.p_memory=1.0", *FAST]
    assert main(args) == 0
    assert main(args) == 2  # a folder holding a run is never silently reused
    (run / "eval" / "stale.md").write_text("from the first run")  # inside what a run writes: cleared
    (run / "notes.txt").write_text("the user's")  # not a run's file: kept
    assert main(args + ["--overwrite"]) == 0
    assert not (run / "eval" / "stale.md").exists() and (run / "notes.txt").read_text() == "the user's"
    assert [r["iteration"] for r in _metrics(run)] == [0]
