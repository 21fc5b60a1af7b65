"""The Python API: ``empo2.Trainer`` built in this process from a config and its parts, one iteration at a time.

Real parts throughout: the tiny random Llama (SmolLM2's tokenizer) loaded by the real loader, LoRA from the config,
the real embedder and SQLite memory, and ChecksumRoom (tests/signal_env.py) played in this process through
``env=ChecksumRoom``, an environment factory: its sampled actions score differently, so every group has a signal.
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

import empo2
from empo2.policy.loader import load_model
from signal_env import ChecksumRoom, checksum_room

# EMPO²'s memory modes only, 2 groups of 4 one-step episodes: 8 rows, 4 optimizer steps of 2 rows each
SIGNAL = ["env.name=checksum-room", "algo.name=empo2", "algo.p_memory=1.0", "algo.p_off_policy=0.5",
          "algo.mode_granularity=group", "algo.num_generations=4", "train.tasks_per_batch=2", "train.iterations=2",
          "train.mini_batch_size=2", "train.learning_rate=0.01", "env.eval_variations=1", "policy.few_shot=0",
          "policy.max_completion_length=6", "policy.reflection_max_tokens=8", "train.progress=false",
          "train.report_to=none",
          "algo.delta=0"]  # a random model gives each token p ≈ 1/vocab, which the default δ masks


def trainer_for(tiny_model, embedder, *overrides, **parts):
    cfg = empo2.Config.load(None, [f"policy.model={tiny_model}", *SIGNAL, *overrides])
    return empo2.Trainer(cfg, env=ChecksumRoom, embedder=embedder, **parts)


def test_one_iteration_in_process_moves_every_lora_matrix(tiny_model, embedder):
    """LoRA's B matrices start at zero, and its A matrices get a gradient once B is non-zero: over one iteration of
    4 optimizer steps every A and every B must move. Fails when the update is skipped (e.g. ``updates_weights``
    false, or the optimizer built over no parameter)."""
    model, tokenizer = load_model(tiny_model, device="cpu")
    with checksum_room(), trainer_for(tiny_model, embedder, model=model, tokenizer=tokenizer) as trainer:
        run_dir = trainer.run_dir
        lora = {n: p.detach().clone() for n, p in trainer.model.named_parameters() if "lora_" in n}
        assert {n.split("lora_")[1][0] for n in lora} == {"A", "B"}
        record = trainer.iteration()
        assert trainer.next_iteration == 1
        assert record["iteration"] == 0 and set(record["modes"]) <= {"on_tips", "off_tips"}
        assert record["advantage"]["zero_adv_groups"] == 0  # ChecksumRoom: a signal in every group
        assert record["loss"]["rows"] == 8 and record["loss"]["optimizer_steps"] == 4
        after = dict(trainer.model.named_parameters())
        assert [n for n, before in lora.items() if torch.equal(before, after[n].detach())] == []
        assert trainer.memory is not None and trainer.memory.stats()["tips"] >= 1  # the reflection wrote tips
    assert not run_dir.exists()  # no output_dir: a temporary run folder, gone at close


def test_the_whole_loop_writes_the_run_folder_it_is_given(tmp_path, tiny_model, embedder):
    """``train()`` with an output folder: every iteration's metrics line, its checkpoints and the final evaluation;
    the folder outlives the trainer."""
    run = tmp_path / "run"
    with checksum_room(), trainer_for(tiny_model, embedder, "train.save_every=1", output_dir=run) as trainer:
        final = trainer.train()
    assert final["summary"]["episodes"] >= 1
    assert len((run / "metrics.jsonl").read_text().splitlines()) == 2
    assert sorted(p.name for p in (run / "checkpoints").glob("iter_*")) == ["iter_000000", "iter_000001"]
    assert (run / "eval" / "final.json").is_file() and (run / "memory.sqlite").is_file()


def test_parts_given_stay_the_callers(tiny_model, embedder, tmp_path):
    """A memory passed in is used and left open at close; a bad ``env`` or a model without its tokenizer is refused."""
    from empo2.config import ConfigError
    from empo2.memory.store import TipMemory

    memory = TipMemory(tmp_path / "mine.sqlite", dim=embedder.dim)
    with checksum_room(), trainer_for(tiny_model, embedder, memory=memory) as trainer:
        trainer.iteration()
        assert trainer.memory is memory
    assert memory.stats()["tips"] >= 1  # still open: the trainer closed only what it made
    memory.close()
    with checksum_room():
        with pytest.raises(ConfigError, match="model together with its tokenizer"):
            trainer_for(tiny_model, embedder, model=object())
        with pytest.raises(ConfigError, match="environment factory or a pool"):
            empo2.Trainer(empo2.Config.load(None, [f"policy.model={tiny_model}", *SIGNAL]), env=42, embedder=embedder)


def test_the_package_exports_the_api_without_loading_torch():
    import subprocess
    import sys

    code = "import sys, empo2; assert 'torch' not in sys.modules; print(empo2.Trainer.__module__)"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout
    assert out.strip() == "empo2.train.trainer"
    assert Path(empo2.__file__).parent.name == "empo2"
