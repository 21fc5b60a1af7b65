"""The Python API: ``empo2.Trainer`` built in this process from a config and its parts, one iteration at a time.

Real parts throughout: the tiny random Llama (SmolLM2's tokenizer) loaded by the real loader, LoRA from the config,
the real embedder and SQLite memory, and ChecksumRoom (tests/helpers/signal_env.py) played in this process through
``env=ChecksumRoom``, an environment factory: its sampled actions score differently, so every group has a signal.
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

import empo2
from empo2.envs.local_pool import LocalEnvPool
from empo2.policy.loader import load_model
from helpers.signal_env import ChecksumRoom, checksum_room

# EMPO²'s memory modes only, 2 groups of 4 one-step episodes: 8 rows, 4 optimizer steps of 2 rows each
SIGNAL = ["env.name=checksum-room", "algo.name=empo2", "algo.p_memory=1.0", "algo.p_off_policy=0.5",
          "algo.mode_granularity=group", "algo.num_generations=4", "train.tasks_per_batch=2", "train.iterations=2",
          "train.mini_batch_size=2", "train.learning_rate=0.01", "env.eval_variations=1", "policy.few_shot=0",
          "policy.max_completion_length=6", "policy.reflection_max_tokens=8", "train.progress=false",
          "train.report_to=none",
          "algo.low_prob_threshold=0"]  # a random model gives each token p ≈ 1/vocab, which the default δ masks


def trainer_for(tiny_model, embedder, *overrides, **parts):
    cfg = empo2.Config.load(None, [f"policy.model={tiny_model}", *SIGNAL, *overrides])
    return empo2.Trainer(cfg, **{"env": ChecksumRoom, "embedder": embedder, **parts})


def _lora(trainer) -> dict[str, torch.Tensor]:
    """A copy of the trainer's LoRA matrices now."""
    return {n: p.detach().clone() for n, p in trainer.model.named_parameters() if "lora_" in n}


@pytest.mark.slow  # end-to-end training, as test_train.py's runs
def test_one_iteration_in_process_moves_every_lora_matrix(tiny_model, embedder):
    """LoRA's B matrices start at zero, and its A matrices get a gradient once B is non-zero: over one iteration of
    4 optimizer steps every A and every B must move, and over the next one every matrix moves again. Fails when the
    update is skipped, or takes a single optimizer step (A unmoved: checked with ``train.mini_batch_size=8``)."""
    model, tokenizer = load_model(tiny_model, device="cpu")  # a model given to the trainer: LoRA put on it
    with checksum_room(), trainer_for(tiny_model, embedder, model=model, tokenizer=tokenizer) as trainer:
        run_dir = trainer.run_dir
        snapshots, records = [_lora(trainer)], []
        for _ in range(2):
            records.append(trainer.iteration())
            snapshots.append(_lora(trainer))
        assert trainer.next_iteration == 2 and trainer.memory.stats()["tips"] >= 1  # the reflection wrote tips
        assert sum(r["memory"]["added"] for r in records) == trainer.memory.stats()["tips"]  # and the records count them
    assert {n.split("lora_")[1][0] for n in snapshots[0]} == {"A", "B"}
    assert [r["iteration"] for r in records] == [0, 1]
    for r in records:
        assert set(r["modes"]) <= {"on_tips", "off_tips"} and all(f"loss_{m}" in r["loss"] for m in r["modes"])
        assert r["advantage"]["zero_adv_groups"] == 0 and r["advantage"]["adv_abs_mean"] > 0  # a signal everywhere
        assert r["loss"]["rows"] == 8 and r["loss"]["optimizer_steps"] == 4 and r["loss"]["skipped_steps"] == 0
    for before, after in zip(snapshots, snapshots[1:]):
        assert [n for n in before if torch.equal(before[n], after[n])] == []
    assert not run_dir.exists()  # no output_dir: a temporary run folder, gone at close


@pytest.mark.slow
def test_train_writes_the_run_folder_it_is_given_and_leaves_the_callers_parts_open(tmp_path, tiny_model, embedder):
    """``train()`` with an output folder and a memory of the caller's: the metrics line, the checkpoint and the final
    evaluation are in the folder, the tips in the caller's memory, which stays open after ``close``."""
    from empo2.config import ConfigError
    from empo2.memory.store import TipMemory

    run = tmp_path / "run"
    memory = TipMemory(tmp_path / "mine.sqlite", dim=embedder.dim)
    with checksum_room():
        with trainer_for(tiny_model, embedder, "train.iterations=1", "train.eval_at_start=false", memory=memory, output_dir=run) as trainer:
            final = trainer.train()
            assert trainer.memory is memory
        with pytest.raises(ConfigError, match="model together with its tokenizer"):
            trainer_for(tiny_model, embedder, model=object())
        with pytest.raises(ConfigError, match="environment factory or a pool"):
            trainer_for(tiny_model, embedder, env=42)
        with pytest.raises(ConfigError, match="the pool given has 1 workers; .* needs 8"):  # 2 groups of 4
            trainer_for(tiny_model, embedder, env=LocalEnvPool(ChecksumRoom, 1))
    assert final["summary"]["episodes"] >= 1 and (run / "eval" / "final.json").is_file()
    assert len((run / "metrics.jsonl").read_text().splitlines()) == 1
    assert [p.name for p in (run / "checkpoints").glob("iter_*")] == ["iter_000000"]
    assert memory.stats()["tips"] >= 1 and not (run / "memory.sqlite").exists()  # the caller's memory, still open
    memory.close()


def test_the_package_exports_the_api_without_loading_torch():
    import subprocess
    import sys

    code = "import sys, empo2; assert 'torch' not in sys.modules; print(empo2.Trainer.__module__)"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout
    assert out.strip() == "empo2.train.trainer"
    assert Path(empo2.__file__).parent.name == "empo2"


def test_the_callers_config_is_left_as_it_was(tiny_model, embedder):
    """The trainer settles ``auto`` settings and the linear schedule's length on a copy of its own: the config the
    caller passed reads the same afterwards (a caller reusing it for a second run must not inherit this machine's
    decisions), while ``trainer.cfg`` holds them. Fails when the trainer writes its decisions into ``config``."""
    with checksum_room():
        cfg = empo2.Config.load(None, [f"policy.model={tiny_model}", *SIGNAL, "policy.autocast=auto",
                                       "policy.backend=auto", "algo.intrinsic_schedule=linear"])
        before = cfg.to_dict()
        trainer = empo2.Trainer(cfg, env=ChecksumRoom, embedder=embedder)
    with trainer:
        assert cfg.to_dict() == before
        settled = trainer.cfg
        assert settled is not cfg and settled.policy is not cfg.policy
        assert settled.policy.autocast != "auto" and settled.policy.backend != "auto"
        assert settled.algo.intrinsic_schedule_iterations == cfg.train.iterations == 2
    assert cfg.to_dict() == before
