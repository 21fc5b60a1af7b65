"""The GPU paths' logic that a CPU can run: which device and process-group backend each rank takes, the vLLM
engine's arguments and adapter ranks, no autocast around a separate engine, the KL reference's options under
gradient checkpointing, checkpoint RNG and optimizer loading, and the in-process weight stream."""

from __future__ import annotations

from contextlib import nullcontext

import pytest
import torch

from empo2.algo.losses import get_policy_loss
from empo2.config import Config
from empo2.parallel import sharding
from empo2.parallel.distributed import Dist, process_group_backend
from empo2.policy import fsdp_save
from empo2.policy.backend import VLLM_LORA_RANKS, check_lora_rank
from empo2.policy.backend_error import BackendError
from empo2.policy.vllm_backend import engine_kwargs
from empo2.rundir import checkpoint as ckpt
from empo2.train import update as update_module
from empo2.train.overlap import BackgroundReflection
from empo2.train.rows import UpdateRow
from test_prefix_sharing import shared_rows, tiny_lm


def test_each_rank_engine_runs_on_its_own_gpu_under_a_launcher():
    one = engine_kwargs(0.4, None, env={}, cuda=True)
    assert one == {"gpu_memory_utilization": 0.4, "dtype": "bfloat16"}  # one process: vLLM's own executor
    ranks = engine_kwargs(0.4, "bfloat16", env={"WORLD_SIZE": "2", "LOCAL_RANK": "1", "RANK": "1"}, cuda=True)
    assert ranks["distributed_executor_backend"] == "external_launcher"
    cpu = engine_kwargs(0.4, None, env={"WORLD_SIZE": "2"}, cuda=False)
    assert "distributed_executor_backend" not in cpu and cpu["dtype"] == "float32"


def test_process_group_backend_follows_the_model_device_not_cuda_presence():
    assert process_group_backend("cpu", cuda_available=True) == "gloo"
    assert process_group_backend("auto", cuda_available=True) == "nccl"
    assert process_group_backend("cuda:1", cuda_available=True) == "nccl"
    assert process_group_backend("auto", cuda_available=False) == "gloo"


def test_vllm_adapter_ranks_are_checked_before_the_engine_is_imported():
    for rank in VLLM_LORA_RANKS + (0,):
        check_lora_rank(rank)
    with pytest.raises(BackendError, match="policy.lora_r=12"):
        check_lora_rank(12)
    from empo2.policy.backend import check_backend

    with pytest.raises(BackendError, match="policy.lora_r=4"):  # refused even where vLLM is not installed
        check_backend("vllm", lora_rank=4)


def test_a_separate_engine_generates_outside_the_trainer_autocast():
    model = tiny_lm(0)
    with sharding.generating(model, "bfloat16", backend=None):
        assert torch.is_autocast_enabled("cpu")  # HF generation: the trainer's compute dtype
    with sharding.generating(model, "bfloat16", backend=object()):
        assert not torch.is_autocast_enabled("cpu")
    reflection = BackgroundReflection(model, backend=object(), autocast=lambda: pytest.fail("entered"))
    assert reflection.autocast is nullcontext
    reflection.close()


def test_kl_reference_under_gradient_checkpointing_uses_the_trained_forward_options(monkeypatch, tiny_model):
    """transformers' checkpointed layers drop a shared head's KV cache in train mode (5.17-5.19), so the reference
    pass must run without prefix sharing exactly when the trained forward does."""
    from empo2.policy.loader import load_model, make_trainable
    from empo2.train.update import PolicyUpdate

    cfg = Config.load("configs/scienceworld_cpu.yaml", ["algo.name=grpo", "algo.beta=0.05", "algo.low_prob_threshold=0",
                                                        "train.gradient_checkpointing=true", "policy.autocast=none"])
    model, tok = load_model(tiny_model, device="cpu", dtype="float32")
    model = make_trainable(model, cfg.policy, True)
    seen = []
    real = update_module.response_logprobs

    def spy(*args, **kwargs):
        seen.append((torch.is_grad_enabled(), kwargs["options"].prefix_sharing))
        return real(*args, **kwargs)

    monkeypatch.setattr(update_module, "response_logprobs", spy)
    prompts, responses = shared_rows(1, resp=(2, 6))
    rows = [UpdateRow(p, r, [-1.0] * len(r), 1.0 - i % 2, "on") for i, (p, r) in enumerate(zip(prompts, responses))]
    update = PolicyUpdate(cfg, model, tok, torch.optim.SGD([p for p in model.parameters() if p.requires_grad],
                                                           lr=1e-3), get_policy_loss("grpo"), Dist())
    update(rows)
    reference = [shared for grad, shared in seen if not grad]
    assert reference and not any(reference)  # every reference pass unshared, as the checkpointed trained pass
    assert not any(shared for grad, shared in seen if grad)


def test_optimizer_state_is_loaded_onto_the_host(monkeypatch, tmp_path):
    opt = torch.optim.AdamW([torch.nn.Parameter(torch.ones(3))])
    opt.param_groups[0]["params"][0].grad = torch.ones(3)
    opt.step()
    torch.save(opt.state_dict(), tmp_path / "optimizer.pt")
    calls = []
    real = torch.load
    monkeypatch.setattr(torch, "load", lambda *a, **k: calls.append(k) or real(*a, **k))
    state = ckpt.load_optimizer(tmp_path)
    assert calls[0].get("map_location") == "cpu" and calls[0]["weights_only"] is True
    assert state["state"][0]["exp_avg"].device.type == "cpu"


def test_rng_state_round_trip_through_the_checkpoint_format(tmp_path):
    torch.manual_seed(5)
    state = ckpt.rng_state()
    assert ("cuda" in state) == torch.cuda.is_available()
    state["cuda"] = torch.stack([torch.arange(16, dtype=torch.uint8)] * 2)  # as two GPUs' generators are stored
    ckpt.write_state(tmp_path, {"rng": state})
    back = ckpt.load_state(tmp_path)["rng"]
    assert torch.equal(back["cuda"], state["cuda"])
    want = torch.rand(4)
    torch.rand(7)
    ckpt.set_rng_state(back)  # without a GPU the CUDA part is kept in the file and not applied
    assert torch.equal(torch.rand(4), want)


def test_weight_items_stream_what_save_pretrained_writes(tmp_path, tiny_model):
    from safetensors.torch import load_file

    from empo2.policy.loader import load_model

    model, _ = load_model(tiny_model, device="cpu", dtype="float32")
    model.save_pretrained(tmp_path)
    saved = {}
    for f in tmp_path.glob("*.safetensors"):
        saved.update(load_file(str(f)))
    streamed = dict(fsdp_save.weight_items(model, torch.bfloat16))
    assert sorted(streamed) == sorted(saved)  # the tied output layer left out, as on disk
    for name, tensor in streamed.items():
        assert tensor.dtype == torch.bfloat16
        assert torch.equal(tensor, saved[name].to(torch.bfloat16)), name


def test_auto_engine_follows_the_measured_table():
    import json
    from pathlib import Path

    from empo2.policy.engine_choice import MEASURED, choose, settle_backend

    # Per measured CPU feature: the committed engines.py results (file, arm) of HF and of the other engine
    compared = {"avx2": (("engines_avx2", "hf_fp32"), ("engines_avx2", "vllm"), "vllm"),
                "avx512_bf16": (("engines_avx512_bf16", "hf_auto"), ("engines_avx512_bf16", "vllm_auto"), "vllm"),
                "amx_bf16": (("engines_reach_amx_bf16", "hf_fp32"), ("engines_reach_merged_amx_bf16", "merged_bf16"),
                             "merged")}
    assert sorted(MEASURED) == sorted(compared)
    results = Path(__file__).parents[1] / "records/benchmarks"
    summary = lambda file, arm: json.loads((results / f"{file}.json").read_text())["arms"][arm]["summary"]  # noqa: E731
    for flag, (hf_at, other_at, other) in compared.items():
        hf, vllm = summary(*hf_at), summary(*other_at)
        steps, iteration = vllm["steps_per_s"] / hf["steps_per_s"], hf["iteration_s"] / vllm["iteration_s"]
        engine, why = MEASURED[flag]
        assert engine == (other if iteration > 1 else "hf"), flag  # the shorter iteration of the measurement
        assert f"{steps:.2f}×" in why and f"{iteration:.2f}×" in why, (flag, why)
    assert choose("cpu", {"avx2", "fma"}) == (MEASURED["avx2"][0], f"avx2: {MEASURED['avx2'][1]}")
    bf16 = choose("cpu", {"avx2", "avx512f", "avx512_bf16"})
    assert bf16 == (MEASURED["avx512_bf16"][0], f"avx512_bf16: {MEASURED['avx512_bf16'][1]}")
    assert choose("cpu", {"avx2", "avx512f", "avx512_bf16", "amx_bf16"})[1].startswith("amx_bf16: ")
    engine, reason = choose("cpu", {"avx2", "avx512f"})
    assert engine == MEASURED["avx2"][0] and reason.startswith("avx512f not measured; nearest measured, avx2")
    assert choose("cuda", None)[0] == "hf"
    cfg = Config.load("configs/webshop_cpu.yaml", ["policy.backend=auto", "policy.device=cpu"])
    assert settle_backend(cfg.policy) and cfg.policy.backend in ("hf", "vllm")
    assert settle_backend(cfg.policy) is None  # a named engine stays


def test_training_in_float16_is_refused_without_a_gradient_scaler():
    from empo2.policy.loader import ModelLoadError, check_precision

    check_precision("float32", "cpu", True, "bfloat16")
    for dtype, autocast in (("float32", "float16"), ("float16", "none")):
        with pytest.raises(ModelLoadError, match="gradient scaler"):
            check_precision(dtype, "cpu", True, autocast)
