"""Mixed precision: float32 master weights with bfloat16 compute keep lr-1e-6 updates; bf16 weights are refused.

The training run uses the tiny random Llama (``conftest.tiny_model``), full fine-tuning, CPU autocast to bfloat16,
on the real ScienceWorld simulator.
"""

from __future__ import annotations

import json

import pytest
import torch
from safetensors.torch import load_file

from empo2.cli import main

FAST = ["--config", "configs/scienceworld_cpu.yaml", "--algo", "grpo", "env.tasks=[find-animal]", "env.max_steps=2",
        "env.eval_variations=1", "algo.num_generations=2", "policy.few_shot=0", "policy.max_completion_length=8",
        "train.progress=false", "train.tensorboard=false", "algo.intrinsic_weight=1.0", "algo.delta=0.0",
        "train.iterations=2", "train.learning_rate=1.0e-6", "policy.lora=false"]


def test_bf16_weights_would_lose_lr_1e6_updates():
    """Why the check exists: a bf16 weight of typical size does not move by an Adam step of 1e-6."""
    w = torch.full((4,), 0.02, dtype=torch.bfloat16)
    assert torch.equal(w - 1e-6, w)
    assert not torch.equal(w.float() - 1e-6, w.float())


def test_full_finetuning_with_bf16_weights_is_refused(tmp_path, capsys):
    run = tmp_path / "bf16"
    assert main(["train", *FAST, "policy.dtype=bfloat16", f"train.output_dir={run}"]) == 2
    err = capsys.readouterr().err
    assert "full fine-tuning with torch.bfloat16 weights" in err and "policy.autocast=bfloat16" in err
    assert err.count("\n") == 1 and not run.exists()
    assert main(["train", *FAST, "policy.autocast=int8", f"train.output_dir={run}"]) == 2
    assert "policy.autocast must be one of none, bfloat16, float16, got 'int8'" in capsys.readouterr().err


@pytest.mark.slow
def test_bf16_compute_at_lr_1e6_changes_fp32_weights(tmp_path, tiny_model):
    """The paper preset's GPU setting: fp32 weights, bf16 autocast, gradient checkpointing, full fine-tuning."""
    run = tmp_path / "amp"
    assert main(["train", *FAST, f"policy.model={tiny_model}", "policy.dtype=float32", "policy.autocast=bfloat16",
                 "train.gradient_checkpointing=true", f"train.output_dir={run}"]) == 0
    rows = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]
    # iteration 0 may carry no signal (every state is new to the novelty reward); the run must step at least once
    assert sum(r["loss"].get("optimizer_steps", 0) for r in rows) >= 1
    before = load_file(f"{tiny_model}/model.safetensors")
    after = load_file(str(run / "checkpoints" / "iter_000001" / "model" / "model.safetensors"))
    assert all(t.dtype == torch.float32 for t in after.values())  # master weights stay float32
    moved = [(after[k] - before[k]).abs().max().item() for k in before if k in after]
    # an Adam step moves a weight with a non-zero gradient by ~lr: far below bf16 resolution, kept in fp32
    assert 5e-7 < max(moved) < 3e-6
