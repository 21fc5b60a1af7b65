"""The training signal is what the paper says it is: sampling is only the configured policy, and tips are keyed by
the state they are about. (Order-free novelty: tests/test_novelty.py; always-acting correction:
tests/test_scienceworld.py; one optimizer step per mini-batch: tests/test_extending.py.)

Real model (SmolLM2-135M or the tiny random Llama), real embedder, a real SQLite tip memory."""

from __future__ import annotations

import pytest
import torch

from empo2.config import MemoryConfig, PolicyConfig
from empo2.episodes.episode import Episode, Step
from empo2.episodes.reflection import reflect
from empo2.episodes.rollout import RolloutContext
from empo2.memory.store import TipMemory
from empo2.policy.generate import generate_batch
from empo2.policy.sampling import Sampling


def test_generation_ignores_the_models_own_sampling_defaults(smollm):
    """A repetition penalty in the model's generation_config (Qwen2.5-Instruct ships one) must not reach sampling:
    the update's log-probs are those of the plain tempered policy."""
    model, tok = smollm
    prompt = list(tok.apply_chat_template([{"role": "user", "content": "Repeat after me: go go go go go go"}],
                                          add_generation_prompt=True, tokenize=True, return_dict=False))
    plain = generate_batch(model, tok, [prompt], Sampling(12, greedy=True))[0].ids
    saved = model.generation_config.repetition_penalty
    model.generation_config.repetition_penalty = 5.0
    try:
        penalised = model.generate(torch.tensor([prompt]), max_new_tokens=12, do_sample=False,
                                   pad_token_id=tok.pad_token_id)[0, len(prompt):].tolist()
        ours = generate_batch(model, tok, [prompt], Sampling(12, greedy=True))[0].ids
    finally:
        model.generation_config.repetition_penalty = saved
    assert penalised[: len(plain)] != plain  # the setting matters for this prompt …
    assert ours == plain  # … and generate_batch does not let it in


def _episode(task: str, observations: list[str], score: float) -> Episode:
    ep = Episode(task=task, variation=0, group=0, mode="on_tips", task_description="Your task is to find an animal.")
    for before, after in zip(observations, observations[1:] + ["The episode ended."]):
        ep.steps.append(Step(prompt_ids=[1], train_prompt_ids=[1], response_ids=[2], logp_old=[-1.0],
                             raw_action="look around", action="look around", observation=after, reward=0.0,
                             state_text=before))
    ep.score, ep.done = score, True
    return ep


def test_tips_are_keyed_by_the_state_where_each_episode_ended(tmp_path, smollm, embedder):
    model, tok = smollm
    memory = TipMemory(tmp_path / "memory.sqlite", dim=embedder.dim)
    ctx = RolloutContext(model, tok, None, embedder, memory, "scienceworld",
                         PolicyConfig(reflection_max_tokens=32), MemoryConfig(dedup_threshold=1.01))
    kitchen = "This room is called the kitchen. In it, you see: a fridge, a stove, a sink."
    outside = "This area is called the outside. In it, you see: a fence, a frog, a tree, a bee hive."
    hallway = "This room is called the hallway. In it, you see: a picture, a door to the kitchen."
    episodes = [_episode("find-animal", [hallway, kitchen], 8.0), _episode("find-animal", [hallway, outside], 25.0)]
    torch.manual_seed(0)
    episodes = reflect(ctx, episodes, episodes)
    tips = {t.key_text: t for t in memory.all_tips()}
    assert set(tips) <= {kitchen, outside} and len(tips) == 2, [e.tip_rejected for e in episodes]
    # retrieval now ranks by the state: a query in the kitchen finds the kitchen tip first, outside the outside tip
    query = embedder.encode(["This room is called the kitchen. You see a fridge and a sink.",
                             "This area is called the outside. You see a frog and a tree."])
    found = memory.retrieve(["find-animal", "find-animal"], query, k=2, threshold=0.0)
    assert found[0][0].key_text == kitchen and found[1][0].key_text == outside
    assert found[0][0].similarity > found[0][1].similarity + 0.05  # not a tie broken by recency
    memory.close()


def test_a_state_is_the_environments_or_the_folded_observation():
    """An environment that defines its state (``info["state"]``) is read as it wrote it; one that does not is known by
    its observation, whitespace folded. The task description is never part of a state (it dominated the keys:
    cosine 0.94–0.99 between different rooms of one task)."""
    from empo2.envs.base import state_of

    assert state_of("  This room is called\nthe kitchen.  ", {}) == "This room is called the kitchen."
    assert state_of("The door is already open.", {"state": "room A\nobject"}) == "room A\nobject"
    assert state_of("a  page", {"state": "  "}) == "a page"
    with pytest.raises(ValueError, match="state"):
        Step([1], [1], [2], [-1.0], "a", "a", "obs", 0.0, "")
