"""Mixed precision: float32 master weights with bfloat16 compute keep lr-1e-6 updates; bf16 weights are refused;
``policy.autocast: auto`` picks bfloat16 only where the hardware has it, and a run records the choice.

The training run uses the tiny random Llama (``conftest.tiny_model``), full fine-tuning, CPU autocast to bfloat16,
on ChecksumRoom (tests/helpers/signal_env.py), whose groups always carry a signal.
"""

from __future__ import annotations

import pytest
import torch
from safetensors.torch import load_file

from empo2.cli import main
from empo2.policy import precision

FAST = ["--config", "configs/scienceworld_cpu.yaml", "--algo", "grpo", "env.tasks=[find-animal]", "env.max_steps=2",
        "env.eval_variations=1", "algo.num_generations=2", "policy.few_shot=0", "policy.max_completion_length=8",
        "train.progress=false", "train.report_to=none", "algo.intrinsic_weight=1.0", "algo.low_prob_threshold=0.0",
        "train.iterations=2", "train.learning_rate=1.0e-6", "policy.lora=false", "algo.novelty_threshold=1.0"]
# every distinct state text counts as new: in two steps a tiny model rarely leaves its room, and at the default
# 0.9 its states all look alike, which would leave the group no signal


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
    assert "policy.autocast must be one of auto, none, bfloat16, float16, got 'int8'" in capsys.readouterr().err


@pytest.mark.slow
def test_bf16_compute_at_lr_1e6_changes_fp32_weights(tmp_path, tiny_model, embedder):
    """The paper preset's GPU setting: fp32 weights, bf16 autocast, gradient checkpointing, full fine-tuning. Two
    iterations through the Python API in this process, on ChecksumRoom (every group has a signal, so every
    iteration steps), then the checkpoint the trainer writes after them."""
    from empo2 import Config, Trainer
    from helpers.signal_env import ChecksumRoom, checksum_room

    with checksum_room():
        cfg = Config.load(None, ["env.name=checksum-room", "algo.name=grpo", "algo.num_generations=4",
                                 "env.eval_variations=1", "policy.few_shot=0", "policy.max_completion_length=6",
                                 "train.progress=false", "train.report_to=none", "algo.low_prob_threshold=0",
                                 "train.iterations=2", "train.learning_rate=1.0e-6", "policy.lora=false",
                                 f"policy.model={tiny_model}", "policy.dtype=float32", "policy.autocast=bfloat16",
                                 "train.gradient_checkpointing=true"])
        with Trainer(cfg, output_dir=tmp_path / "amp", env=ChecksumRoom, embedder=embedder) as trainer:
            rows = [trainer.iteration() for _ in range(cfg.train.iterations)]
            saved = trainer.save(rows[-1]["iteration"])
    assert saved.name == "iter_000001"
    assert all(r["advantage"]["zero_adv_groups"] == 0 and r["loss"]["optimizer_steps"] >= 1 for r in rows)
    before = load_file(f"{tiny_model}/model.safetensors")
    after = load_file(str(saved / "model" / "model.safetensors"))
    assert all(t.dtype == torch.float32 for t in after.values())  # master weights stay float32
    moved = [(after[k] - before[k]).abs().max().item() for k in before if k in after]
    # an Adam step moves a weight with a non-zero gradient by ~lr: far below bf16 resolution, kept in fp32
    assert 5e-7 < max(moved) < 3e-6


@pytest.mark.parametrize(("device", "flags", "gpu_bf16", "want"), [
    ("cpu", {"avx2", "fma", "amx_bf16", "amx_tile"}, False, "bfloat16"),  # Sapphire Rapids and later
    ("cpu", {"avx2", "avx512f", "avx512_bf16"}, False, "bfloat16"),       # Cooper Lake, Zen 4
    ("cpu", {"avx2", "avx512f", "avx512_vnni"}, False, "none"),           # AVX512 without bf16 instructions
    ("cpu", {"avx2", "fma"}, False, "none"),
    ("cpu", None, False, "none"),                                          # flags unreadable
    ("cuda", None, True, "bfloat16"),
    ("cuda", None, False, "none"),                                         # pre-Ampere GPUs
])
def test_auto_precision_follows_the_hardware(device, flags, gpu_bf16, want):
    decision = precision.decide(device, flags, gpu_bf16)
    assert decision.autocast == want and decision.reason


def test_cpu_flags_read_from_cpuinfo(tmp_path):
    info = tmp_path / "cpuinfo"
    info.write_text("processor\t: 0\nvendor_id\t: GenuineIntel\nflags\t\t: fpu avx2 amx_bf16 avx512_bf16\n\n"
                    "processor\t: 1\nflags\t\t: fpu avx2 amx_bf16 avx512_bf16\n")
    assert precision.cpu_flags(info) == {"fpu", "avx2", "amx_bf16", "avx512_bf16"}
    assert precision.cpu_flags(tmp_path / "absent") is None
    info.write_text("processor\t: 0\n")
    assert precision.cpu_flags(info) is None


def test_auto_is_settled_once_and_an_explicit_choice_is_kept(monkeypatch):
    from empo2.config import Config

    monkeypatch.setenv(precision.OVERRIDE_ENV, "1")
    precision.auto_precision.cache_clear()
    try:
        cfg = Config.load(None)
        assert cfg.policy.autocast == "auto"  # the default; decided when a run starts
        assert precision.settle_autocast(cfg.policy) == "EMPO2_NATIVE_BF16=1"
        assert cfg.policy.autocast == "bfloat16" and precision.settle_autocast(cfg.policy) is None
        explicit = Config.load(None, ["policy.autocast=none"])
        assert precision.settle_autocast(explicit.policy) is None and explicit.policy.autocast == "none"
    finally:
        precision.auto_precision.cache_clear()



@pytest.mark.parametrize(("native", "autocast", "weights", "want"), [
    ("1", "auto", "float32", "bfloat16"),   # a CPU or GPU with native bf16: the engine samples in bf16, as HF computes
    ("0", "auto", "float32", "float32"),    # AVX2 only: float32 on both sides
    ("1", "none", "float32", "float32"),    # an explicit "none" is the weights' dtype, whatever the hardware
    ("0", "none", "bfloat16", "bfloat16"),  # bf16 weights (LoRA on a GPU) without autocast
    ("0", "float16", "float32", "float16"),
])
def test_the_generation_engine_runs_in_the_trainers_compute_dtype(monkeypatch, native, autocast, weights, want):
    monkeypatch.setenv(precision.OVERRIDE_ENV, native)
    precision.auto_precision.cache_clear()
    try:
        assert precision.engine_dtype(autocast, weights) == want
    finally:
        precision.auto_precision.cache_clear()

@pytest.mark.slow
def test_a_run_prints_and_records_the_auto_decision(tmp_path, tiny_model, monkeypatch, capsys):
    """The banner names the decision and its reason; config.yaml records the precision itself, so a resume on
    another machine computes as the run started."""
    monkeypatch.setenv(precision.OVERRIDE_ENV, "1")  # as on a CPU with AMX: bf16 autocast, fp32 master weights
    precision.auto_precision.cache_clear()
    run = tmp_path / "auto"
    try:
        assert main(["train", *FAST, f"policy.model={tiny_model}", "train.iterations=1", "policy.autocast=auto",
                     f"train.output_dir={run}"]) == 0
    finally:
        precision.auto_precision.cache_clear()
    assert "autocast=bfloat16 (auto: EMPO2_NATIVE_BF16=1)" in capsys.readouterr().out
    from empo2.config import Config

    assert Config.load(run / "config.yaml").policy.autocast == "bfloat16"
