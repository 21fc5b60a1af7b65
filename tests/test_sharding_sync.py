"""A model sharded with FSDP2 (``train.sharding: fsdp``) written for the vLLM engine by :mod:`empo2.policy.fsdp_save`,
one FSDP unit at a time, and synced into a real engine.

Real pieces: torchrun with 2 gloo ranks, FSDP2's ``fully_shard`` through ``empo2.parallel.sharding.wrap``, the tiny
random Llama of ``conftest.tiny_model`` (tied embeddings), ``from_pretrained`` and peft's loader as the readers, and,
where vllm imports, a real vLLM engine on SmolLM2-135M. Where vllm does not import, the engine tests are SKIPPED: the
sync into an engine is then NOT tested.
"""

from __future__ import annotations

import copy
import importlib.util
import json
import os
import subprocess
import sys
from functools import partial
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

from empo2.policy.sampling import Sampling

WORKER = str(Path(__file__).parent / "helpers" / "sharding_sync_worker.py")
IDS = torch.tensor([[1, 5, 9, 42, 7, 3, 11]])


def _write_sharded(tmp: Path, model: str, lora: bool) -> Path:
    """The worker on 2 ranks: ``tmp/plain`` (rank 0's unsharded save_pretrained) and ``tmp/rank{0,1}`` (fsdp_save)."""
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": str(Path("src").resolve())}
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node=2", WORKER, model,
           str(tmp), "1" if lora else "0"]
    proc = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, (proc.stdout + proc.stderr)[-4000:]
    return tmp


def _safetensors(folder: Path) -> dict[str, dict[str, torch.Tensor]]:
    return {p.name: load_file(str(p)) for p in sorted(folder.glob("*.safetensors"))}


def _tensor_bytes(tensors: dict[str, torch.Tensor]) -> int:
    return sum(t.numel() * t.element_size() for t in tensors.values())


def test_sharded_full_model_is_written_unit_by_unit_as_save_pretrained_would(tmp_path, tiny_model):
    from transformers import AutoModelForCausalLM

    out = _write_sharded(tmp_path, tiny_model, lora=False)
    plain = load_file(str(out / "plain" / "model.safetensors"))
    assert "lm_head.weight" not in plain  # tied to the embeddings: save_pretrained writes one of the two
    original = load_file(str(Path(tiny_model) / "model.safetensors"))
    assert all(not torch.equal(plain[k], original[k]) for k in plain)  # the worker moved every weight
    reference = AutoModelForCausalLM.from_pretrained(str(out / "plain"), dtype=torch.float32).state_dict()
    for rank in (0, 1):  # each rank wrote its own folder
        folder = out / f"rank{rank}"
        files = _safetensors(folder)
        assert len(files) == 4  # embeddings, decoder layer 0, decoder layer 1, final norm
        index = json.loads((folder / "model.safetensors.index.json").read_text())
        assert index["weight_map"] == {k: name for name, ts in files.items() for k in ts}
        assert index["metadata"]["total_size"] == sum(_tensor_bytes(ts) for ts in files.values())
        written = {k: v for ts in files.values() for k, v in ts.items()}
        assert written.keys() == plain.keys()
        for name, tensor in plain.items():
            assert torch.equal(written[name], tensor), name  # a gather is a copy: exactly equal
        for name in ("config.json", "generation_config.json"):
            assert json.loads((folder / name).read_text()) == json.loads((out / "plain" / name).read_text())
        loaded = AutoModelForCausalLM.from_pretrained(str(folder), dtype=torch.float32)
        state = loaded.state_dict()
        assert state.keys() == reference.keys() and loaded.lm_head.weight is loaded.model.embed_tokens.weight
        for name, tensor in reference.items():
            assert torch.equal(state[name], tensor), name
        counts = json.loads((out / f"peak{rank}.json").read_text())
        assert counts["total"] == index["metadata"]["total_size"] and counts["alive"] == 0
        # never more than one file's tensors alive at once: gathering all first would hold the total
        assert counts["peak"] <= max(_tensor_bytes(ts) for ts in files.values()) < counts["total"]
        # the engine generates rollouts: the trainer's model stays sharded for them (HF generation gathers it)
        assert counts["gathered_for"] == {"hf": True, "engine": False}


def _adapter_config(folder: Path) -> dict:
    """adapter_config.json, its target modules as a set (peft writes a set, in each process's string-hash order)."""
    config = json.loads((folder / "adapter_config.json").read_text())
    return {**config, "target_modules": set(config["target_modules"])}


def test_sharded_lora_adapter_is_written_as_peft_would(tmp_path, tiny_model):
    from peft import PeftModel
    from transformers import AutoModelForCausalLM

    out = _write_sharded(tmp_path, tiny_model, lora=True)
    plain = load_file(str(out / "plain" / "adapter_model.safetensors"))
    assert plain and all("lora_" in k for k in plain)
    base = AutoModelForCausalLM.from_pretrained(tiny_model, dtype=torch.float32).eval()
    with torch.no_grad():
        bare = base(input_ids=IDS).logits
        want = PeftModel.from_pretrained(copy.deepcopy(base), str(out / "plain")).eval()(input_ids=IDS).logits
    assert (want - bare).abs().max() > 1e-4  # the adapter changes the logits: the comparison below can fail
    for rank in (0, 1):
        folder = out / f"rank{rank}"
        written = load_file(str(folder / "adapter_model.safetensors"))
        assert written.keys() == plain.keys()
        for name, tensor in plain.items():
            assert torch.equal(written[name], tensor), name
        assert _adapter_config(folder) == _adapter_config(out / "plain")
        with torch.no_grad():
            got = PeftModel.from_pretrained(copy.deepcopy(base), str(folder)).eval()(input_ids=IDS).logits
        assert torch.equal(got, want)


# ------------------------------------------------------------------------------------------------ a real engine
LORA_RANK = 8
needs_vllm = pytest.mark.skipif(importlib.util.find_spec("vllm") is None, reason="vllm is not installed: the sync "
                                "of FSDP-sharded weights into a vLLM engine is NOT tested")


@pytest.fixture(scope="module")
def engine():
    """As in the trainer: the model is sharded (over a group of one) before the engine starts. The engine has LoRA
    enabled, so it serves both the full-weight and the adapter syncs."""
    from empo2.config import Config
    from empo2.parallel import distributed as dp
    from empo2.parallel import sharding
    from empo2.policy.backend import BackendError
    from empo2.policy.loader import load_model, resolve_model_path
    from empo2.policy.vllm_backend import VLLMBackend

    model, tok = load_model("smollm2-135m", device="cpu", dtype="float32")
    changed = copy.deepcopy(model)
    with torch.no_grad():
        changed.model.norm.weight.neg_()  # every logit flips sign: a very different policy
    ours = not torch.distributed.is_initialized()
    wrap = partial(sharding.wrap, cfg=Config.load(None, ["train.sharding=fsdp", "policy.autocast=none"]),
                   dist=dp.init_from_env())
    sharded, _ = wrap(copy.deepcopy(changed))
    try:
        backend = VLLMBackend(resolve_model_path("smollm2-135m"), tok, lora_rank=LORA_RANK, seed=0)
    except (BackendError, RuntimeError, OSError) as exc:  # e.g. a CPU without AVX2: vLLM cannot serve it
        backend = None
        reason = f"vLLM cannot start here, so the sync of sharded weights into it is NOT tested: {exc}"
    if backend is not None:
        yield backend, tok, model, (sharded, changed), wrap
        backend.close()
    if ours and torch.distributed.is_initialized():  # the group of one wrap made
        torch.distributed.destroy_process_group()
    if backend is None:
        pytest.skip(reason)


def _prompts(tok) -> list[list[int]]:
    chats = ["Name one animal.", "You are in a kitchen. What do you do next? Answer with one action."]
    return [list(tok.apply_chat_template([{"role": "user", "content": c}], add_generation_prompt=True,
                                         tokenize=True, return_dict=True)["input_ids"]) for c in chats]


def _hf_greedy(model, tok, prompts, n) -> list[list[int]]:
    from empo2.policy.generate import generate_batch
    from empo2.policy.prefix import ComputeOptions

    padded = ComputeOptions(prefix_sharing=False)
    return [g.ids for g in generate_batch(model.eval(), tok, prompts, Sampling(n, greedy=True), options=padded)]


@pytest.mark.slow
@needs_vllm
def test_engine_samples_from_synced_sharded_full_weights(engine, monkeypatch):
    backend, tok, model, (sharded, changed), _ = engine
    prompts = _prompts(tok)
    before = [g.ids for g in backend.generate(prompts, Sampling(12, greedy=True))]
    reloaded, rpc = [], backend.llm.collective_rpc

    def seen(method, *args, kwargs=None, **rest):  # the folder the engine reloads, as it is when it reads it
        reloaded.append(sorted(p.name for p in Path(kwargs["weights_path"]).iterdir()))
        return rpc(method, *args, kwargs=kwargs, **rest)

    monkeypatch.setattr(backend.llm, "collective_rpc", seen)
    backend.sync_weights(sharded)
    assert "model.safetensors.index.json" in reloaded[0]
    assert sum(name.endswith(".safetensors") for name in reloaded[0]) == 32  # embeddings, 30 layers, final norm
    after = [g.ids for g in backend.generate(prompts, Sampling(12, greedy=True))]
    assert after == _hf_greedy(changed, tok, prompts, 12)
    assert all(a != b for a, b in zip(after, before))
    backend.sync_weights(model)  # the unsharded model, saved as ever: the engine's weights as they started
    assert [g.ids for g in backend.generate(prompts, Sampling(12, greedy=True))] == before


@pytest.mark.slow
@needs_vllm
def test_engine_samples_from_synced_sharded_lora_adapter(engine):
    from peft import LoraConfig, get_peft_model

    backend, tok, model, _, wrap = engine
    prompts = _prompts(tok)
    peft = get_peft_model(copy.deepcopy(model), LoraConfig(r=LORA_RANK, lora_alpha=16, lora_dropout=0.0,
                                                           target_modules=["q_proj", "v_proj", "o_proj"]))
    gen = torch.Generator().manual_seed(1)
    with torch.no_grad():  # lora_B starts at zero (a no-op adapter); a trained one is not
        for name, p in peft.named_parameters():
            if "lora_B" in name:
                p.copy_(torch.randn(p.shape, generator=gen) * 0.05)
    reference = copy.deepcopy(peft)
    backend.sync_weights(wrap(peft)[0])
    gens = [g.ids for g in backend.generate(prompts, Sampling(12, greedy=True))]
    assert gens == _hf_greedy(reference, tok, prompts, 12)
    assert gens != _hf_greedy(model, tok, prompts, 12)


@pytest.mark.slow
@needs_vllm
def test_one_rank_fsdp_run_samples_from_the_synced_engine(engine, tmp_path, monkeypatch):
    """The CLI's training loop under ``train.sharding=fsdp`` (a group of one) with ``policy.backend=vllm``: its own
    engine (the module's is closed first: one engine at a time) takes the sharded LoRA weights at the start and
    after every update, while the trainer's model stays sharded. The trainer recomputes π_old with its sharded model
    over the engine's samples (``algo.old_logprobs=auto``) and they agree; what a sync writes is checked above."""
    from empo2.cli import main
    from empo2.policy import fsdp_save
    from empo2.policy.vllm_backend import VLLMBackend

    engine[0].close()
    syncs, sync = [], VLLMBackend.sync_weights
    monkeypatch.setattr(VLLMBackend, "sync_weights", lambda self, m: (syncs.append(fsdp_save.is_fsdp(m)), sync(self, m)))
    run = tmp_path / "run"
    rc = main(["train", "--config", "configs/scienceworld_cpu.yaml", f"train.output_dir={run}", "train.iterations=1",
               "algo.p_memory=1.0", "policy.backend=vllm", "train.sharding=fsdp", "policy.autocast=none",
               "env.tasks=[find-animal]", "env.max_steps=2", "env.eval_variations=1",
               "policy.few_shot=0", "policy.max_completion_length=8", "policy.reflection_max_tokens=16",
               "train.progress=false", "train.report_to=none", "algo.intrinsic_weight=1.0",
               "algo.novelty_threshold=1.0", "algo.num_generations=4"])  # every new state counts: a group with a signal
    assert rc == 0
    rows = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]
    assert [r["iteration"] for r in rows] == [0]
    steps = sum(1 for r in rows if r["loss"].get("optimizer_steps"))
    assert steps >= 1 and syncs == [True] * steps  # after every update (a fresh run's engine starts from its weights)
    gaps = [r["loss"]["old_logp_gap_mean"] for r in rows if r["loss"].get("computed_rows")]
    print(f"\nengine/trainer |Δ log π| per update: {gaps}")
    assert gaps and all(0 <= g < 1e-3 for g in gaps)
    assert (run / "checkpoints" / "iter_000000" / "sharded" / ".metadata").is_file()
