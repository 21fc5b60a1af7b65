"""The ``append`` prompt layout and the rollout's kept KV cache: each step's prompt extends the last step's prompt and
response token for token, and generation prefills only the new turn, with the tokens and log-probs of prefilling the
whole prompt again. Real SmolLM2 (float32) and real ScienceWorld episodes."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from empo2.agent.prompts import PromptParts, append_prompt_ids, render_prompt_ids

TASK = "Your task is to find a(n) non-living thing. First, focus on the thing. Then, move it to the orange box."
OBS0 = "This room is called the hallway. In it, you see: a picture, a substance called air. A door to the kitchen."
OBS1 = "You move to the kitchen. This room is called the kitchen. In it, you see: a fork, a table, a sink."


def test_an_append_prompt_is_the_last_prompt_and_response_and_one_user_turn(smollm):
    """Token for token: the first prompt is the window layout's; the next one continues the previous prompt with the
    sampled response ids and a user turn whose text is the chat template's own rendering of that turn."""
    _, tok = smollm
    first = PromptParts(env="scienceworld", task=TASK, observation=OBS0, initial_observation=OBS0,
                        hints="Objects you may focus on: fork, picture")
    p0 = append_prompt_ids(tok, first, 2, 4096)
    assert p0 == render_prompt_ids(tok, first, 2, 4096)
    response = tok("go to kitchen", add_special_tokens=False)["input_ids"] + [tok.eos_token_id]
    second = PromptParts(**{**first.__dict__, "history": [("go to kitchen", OBS1)], "observation": OBS1,
                            "tips": ("Open the box first.",)})
    p1 = append_prompt_ids(tok, second, 2, 4096, previous=(p0, response))
    assert p1[: len(p0) + len(response)] == p0 + response
    want = tok.apply_chat_template(
        [{"role": "system", "content": "x"}, {"role": "user", "content": "y"},
         {"role": "assistant", "content": "go to kitchen"},
         {"role": "user", "content": f"Objects you may focus on: fork, picture\n\nTips from your earlier attempts:\n"
                                     f"- Open the box first.\n\nObservation:\n{OBS1}\n\nYour next action:"}],
        add_generation_prompt=True, tokenize=False)
    turn = tok.decode(p1[len(p0) + len(response) - 1:])  # from the response's end-of-turn token on
    assert want.endswith(turn) and turn.startswith(tok.eos_token + "\n<|im_start|>user\n"), turn
    # a response cut at max_new_tokens gets its end-of-turn token; a prompt over the limit starts over (window layout)
    cut = append_prompt_ids(tok, second, 2, 4096, previous=(p0, response[:-1]))
    assert cut == p1
    assert append_prompt_ids(tok, second, 2, len(p1) - 1, previous=(p0, response)) == \
        render_prompt_ids(tok, second, 2, len(p1) - 1)
    # the tip-free chain of an off_tips step is the same parts without tips
    assert "Tips" not in tok.decode(append_prompt_ids(tok, second.without_tips(), 2, 4096, previous=(p0, response)))


@pytest.mark.slow
def test_a_rollout_with_the_kept_cache_equals_prefilling_every_prompt_again(smollm):
    """Three real ScienceWorld episodes (three variations), greedy, float32, ``append`` layout, played with each
    row's KV kept from one step to the next. Each step's prompts are then generated again with nothing kept (every
    prompt prefilled whole): the same tokens and behaviour log-probs. The rollout prefilled only each step's new turn.
    (The replay reuses the rollout's own prompts: the simulator's text may differ between two loads of a game.)"""
    from empo2.config import MemoryConfig, PolicyConfig, env_config
    from empo2.envs.factory import make_env_kwargs
    from empo2.envs.pool import EnvPool
    from empo2.episodes.rollout import RolloutContext, run_episodes
    from empo2.policy import prefix as px
    from empo2.policy.generate import generate_batch
    from empo2.policy.sampling import Sampling

    model, tok = smollm
    fed = []
    hook = model.model.embed_tokens.register_forward_hook(lambda _m, inputs, _o: fed.append(inputs[0].shape))
    policy = PolicyConfig(prompt_layout="append", max_completion_length=10, few_shot=0, history_window=2,
                          max_prompt_length=4096)
    try:
        with EnvPool("scienceworld", make_env_kwargs(env_config(max_steps=4)), size=3) as pool:
            ctx = RolloutContext(model, tok, pool, None, None, "scienceworld", policy, MemoryConfig())
            episodes, _ = run_episodes(ctx, [("find-non-living-thing", v, v, "on") for v in range(3)],
                                       Sampling(10, greedy=True))
        kept_fed = [s for s in fed if s[1] > 1]  # forwards of more than one token a row: prefills
    finally:
        hook.remove()
    assert all(not ep.failed for ep in episodes), [ep.error for ep in episodes]
    turns = max(len(ep.steps) for ep in episodes)
    assert turns >= 2
    for t in range(turns):  # the same prompts again, batched as the rollout batched them, nothing kept
        rows = [ep.steps[t] for ep in episodes if len(ep.steps) > t]
        again = generate_batch(model, tok, [s.prompt_ids for s in rows], Sampling(10, greedy=True),
                               options=px.DEFAULT_OPTIONS)
        for step, gen in zip(rows, again):
            assert gen.ids == step.response_ids, (t, tok.decode(gen.ids), tok.decode(step.response_ids))
            np.testing.assert_allclose(gen.logprobs, step.logp_old, atol=1e-4)
    for ep in episodes:  # append layout: each prompt extends the last prompt and response
        for prev, step in zip(ep.steps, ep.steps[1:]):
            assert step.prompt_ids[: len(prev.prompt_ids) + len(prev.response_ids)] == \
                prev.prompt_ids + prev.response_ids
    # Prefilled: the first step's prompts, then per row what follows its kept prompt and fed response (its new turn,
    # and the response's last token where it was never fed), never a whole prompt again.
    prefilled = sum(s[0] * s[1] for s in kept_fed)
    new_turns = sum(len(step.prompt_ids) - len(prev.prompt_ids) - len(prev.response_ids) + 1
                    for ep in episodes for prev, step in zip(ep.steps, ep.steps[1:]))
    first = sum(len(ep.steps[0].prompt_ids) for ep in episodes)
    assert prefilled <= first + new_turns, (prefilled, first, new_turns)
    whole = sum(len(s.prompt_ids) for ep in episodes for s in ep.steps)
    assert prefilled < 0.6 * whole, (prefilled, whole)


def test_kept_rows_let_an_extended_prompt_prefill_only_its_new_tokens():
    """A tiny random Llama: a second call whose prompts extend the first call's prompts and sampled responses runs
    only the new tokens, with the greedy tokens and log-probs of a fresh computation."""
    from transformers import LlamaConfig, LlamaForCausalLM

    from empo2.policy import prefix as px
    from empo2.policy.generate import generate_batch
    from empo2.policy.sampling import Sampling

    class Tok:
        pad_token_id, eos_token_id = 0, 1

        def decode(self, ids, skip_special_tokens=True):
            return " ".join(map(str, ids))

    torch.manual_seed(3)
    model = LlamaForCausalLM(LlamaConfig(vocab_size=256, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                                         num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=256,
                                         pad_token_id=0, initializer_range=0.2)).eval()
    g = torch.Generator().manual_seed(3)
    rand = lambda n: torch.randint(3, 256, (n,), generator=g).tolist()  # noqa: E731
    head = rand(30)
    step0 = [head + rand(6), head + rand(9), rand(25)]
    options = px.ComputeOptions(min_shared_tokens=8)
    fed = []
    model.model.embed_tokens.register_forward_hook(lambda _m, inputs, _o: fed.append(int(inputs[0].numel())))

    def play(keep: bool):
        memo = px.HeadMemo()
        with memo.reuse(options if keep else px.ComputeOptions(reuse_heads=False)):
            first = generate_batch(model, Tok(), step0, Sampling(5, greedy=True), options=options, heads=memo)
            step1 = [p + gen.ids + ([] if gen.ids[-1:] == [1] else [1]) + extra
                     for p, gen, extra in zip(step0, first, (rand(4), rand(7), rand(5)))]
            fed.clear()
            second = generate_batch(model, Tok(), step1, Sampling(5, greedy=True), options=options, heads=memo)
        return first, second, step1, sum(fed)

    state = g.get_state()
    first_k, second_k, step1_k, fed_k = play(True)
    g.set_state(state)
    first_f, second_f, step1_f, fed_f = play(False)
    assert step1_k == step1_f
    for a, b in zip(first_k + second_k, first_f + second_f):
        assert a.ids == b.ids
        np.testing.assert_allclose(a.logprobs, b.logprobs, atol=1e-5)
    # each row's own head is its prompt but the last token; known: the first call's prompt + the fed response tokens
    fed_response = [min(len(gen.ids), max(len(x.ids) for x in first_k) - 1) for gen in first_k]
    known = [len(p) + n for p, n in zip(step0, fed_response)]
    decode_fed = sum(len(step1_k) for _ in range(max(len(x.ids) for x in second_k) - 1))
    tail = len(step1_k)  # one last prompt token per row, batched
    assert fed_k == sum(len(p) - 1 - k for p, k in zip(step1_k, known)) + tail + decode_fed, fed_k
    assert fed_k < fed_f
