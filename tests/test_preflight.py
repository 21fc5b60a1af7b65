"""The pre-flight memory estimate (empo2.train.preflight) against hand-computed float64 figures for Qwen2.5-7B."""

from __future__ import annotations

import dataclasses
import types

import pytest
import torch

from empo2.config import Config, ConfigError
from empo2.train import preflight
from empo2.train.overlap import overlap_wanted

GB80 = 80e9  # an 80 GB card: total bytes
FREE80 = 79.0 * 2**30  # what such a card reports free before a run
QWEN7B = dict(params=7_615_616_512, hidden=3584, layers=28, intermediate=18944, vocab=152064)


def full_7b(**kw) -> preflight.Footprint:
    """The paper preset: full fine-tuning, float32 masters, bfloat16 autocast, 32k-token micro-batches."""
    base = dict(trainable=QWEN7B["params"], weight_bytes=4, trainable_bytes=4, autocast=True, checkpointing=True,
                micro_batch_tokens=32768, logprob_chunk_tokens=1024, **QWEN7B)
    return preflight.Footprint(**{**base, **kw})


def test_resident_parts_are_sixteen_bytes_per_parameter_over_the_shards():
    P = float(QWEN7B["params"])
    for world, sharded in ((1, False), (8, False), (8, True)):
        parts = preflight.estimate(full_7b(world=world, sharded=sharded), GB80)
        n = world if sharded else 1
        assert parts["weights"] + parts["gradients"] + parts["optimizer"] == pytest.approx(16.0 * P / n, rel=1e-12)
        assert parts["step_temporary"] == pytest.approx(4.0 * P / n, rel=1e-12)


def test_activations_follow_the_layer_arithmetic():
    m, h, L, inter = 32768.0, 3584.0, 28.0, 18944.0
    ckpt = preflight.estimate(full_7b(), GB80)["activations"]
    assert ckpt == pytest.approx(m * L * h * 4.0 + m * (8 * h + 4 * inter) * 2.0, rel=1e-12)  # 13.2 GB inputs + a layer
    stored = preflight.estimate(full_7b(checkpointing=False), GB80)["activations"]
    assert stored == pytest.approx(m * L * (8 * h + 4 * inter) * 4.0, rel=1e-12)
    assert stored / 1e9 > 170  # the preset's comment: ~170 GB without checkpointing


def test_unsharded_7b_full_fine_tune_on_80gb_is_refused_with_a_setting_that_fits():
    line = preflight.verdict(full_7b(world=8), FREE80, GB80, "cuda:0")
    assert line is not None and "\n" not in line
    assert "train.sharding=fsdp" in line and "79.0 GiB is free" in line
    needs = float(line.split("≈ ")[1].split(" GiB")[0])
    assert needs > 16 * QWEN7B["params"] / 2**30  # at least the 16 bytes per parameter
    assert preflight.verdict(full_7b(world=8, sharded=True), FREE80, GB80) is None  # what it advised fits


def test_one_gpu_full_fine_tune_names_the_gpu_count_or_lora():
    line = preflight.verdict(full_7b(world=1), FREE80, GB80)
    assert line is not None and "policy.lora=true" in line
    gpus = int(line.split(" on ")[-1].split(" GPUs")[0])
    assert gpus >= 2 and preflight.verdict(full_7b(world=gpus, sharded=True), FREE80, GB80) is None
    assert preflight.verdict(full_7b(world=gpus // 2, sharded=True), FREE80, GB80) is not None


def test_lora_with_vllm_on_one_80gb_card_fits_only_with_a_bfloat16_base():
    adapter = 40_370_176  # Qwen2.5-7B, rank 16 on all seven projections
    lora = dict(trainable=adapter, trainable_bytes=4, engine_fraction=0.4, hf_generation=False, checkpointing=True)
    fp32 = preflight.estimate(full_7b(**lora), GB80)
    bf16 = preflight.estimate(full_7b(weight_bytes=2, **lora), GB80)
    assert fp32["engine"] == pytest.approx(0.4 * GB80)
    assert bf16["peak"] < fp32["peak"] - 15e9  # the float32 base and residual stream
    assert preflight.verdict(full_7b(weight_bytes=2, **lora), FREE80, GB80) is None


def test_check_on_a_real_model_refuses_a_budget_below_its_weights(tiny_model):
    from empo2.policy.loader import load_model, make_trainable

    cfg = Config.load(None, ["policy.lora=false", "policy.autocast=none", "train.micro_batch_tokens=256"])
    model, _ = load_model(tiny_model, device="cpu", dtype="float32")
    model = make_trainable(model, cfg.policy, False)
    n = sum(p.numel() for p in model.parameters())
    fp = preflight.footprint(model, cfg, world=1, overlap_snapshot=False)
    assert (fp.params, fp.trainable, fp.hidden, fp.layers, fp.weight_bytes) == (n, n, 64, 2, 4)
    with pytest.raises(ConfigError, match="pre-flight"):
        preflight.check(model, cfg, 1, memory=(16.0 * n, 80e9))  # less than weights + gradients + AdamW
    preflight.check(model, cfg, 1, memory=(10 * 2**30, 80e9))
    preflight.check(model, cfg, 1)  # on a CPU nothing is checked


def test_overlapped_reflection_is_off_by_default_for_a_full_fine_tune_on_a_gpu():
    # a stand-in: no CUDA device here, and only the parameter's device type is read
    cuda_param = types.SimpleNamespace(device=torch.device("cuda", 0))
    full = types.SimpleNamespace(parameters=lambda: iter([cuda_param]))
    lora = types.SimpleNamespace(parameters=lambda: iter([cuda_param]), peft_config={})
    assert overlap_wanted(None, full, backend=None) is False
    assert overlap_wanted(None, lora, backend=None) is True


def test_paper_presets_shard_as_written():
    for name in ("scienceworld_paper", "webshop_paper"):
        cfg = Config.load(f"configs/{name}.yaml")
        assert cfg.train.sharding == "fsdp", name
        if not cfg.policy.lora:
            fp = dataclasses.replace(full_7b(world=8, sharded=True), micro_batch_tokens=cfg.train.micro_batch_tokens,
                                     checkpointing=cfg.train.gradient_checkpointing)
            assert preflight.verdict(fp, FREE80, GB80) is None, name
