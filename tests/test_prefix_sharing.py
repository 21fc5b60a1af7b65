"""Shared-prefix generation and log-probs equal the plain (unshared, padded) paths; bfloat16 autocast stays close.

Tiny randomly initialised Llama / GPT-2 models (built from configs, no download) for the numerics, plus the real
SmolLM2 for greedy generation on ScienceWorld-like prompts.
"""

from __future__ import annotations

import numpy as np
import pytest
import torch
from transformers import GPT2Config, GPT2LMHeadModel, LlamaConfig, LlamaForCausalLM

from empo2.policy import prefix as px
from empo2.policy.generate import generate_batch
from empo2.policy.logprobs import response_logprobs

PAD = 0


def tiny_lm(seed=0):
    torch.manual_seed(seed)
    cfg = LlamaConfig(vocab_size=256, hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
                      num_key_value_heads=2, max_position_embeddings=256, pad_token_id=PAD, initializer_range=0.2)
    return LlamaForCausalLM(cfg).eval()


def shared_rows(seed, heads=(30, 22), per_head=3, tail=(1, 12), resp=(0, 9)):
    """Rows in groups sharing a random head (one group's tails include a 1-token tail), random responses."""
    g = torch.Generator().manual_seed(seed)
    rand = lambda n: torch.randint(3, 256, (n,), generator=g).tolist()  # noqa: E731
    prompts, responses = [], []
    for h in heads:
        head = rand(h)
        for k in range(per_head):
            n = 1 if k == 0 else int(torch.randint(tail[0], tail[1] + 1, (1,), generator=g))
            prompts.append(head + rand(n))
            responses.append(rand(int(torch.randint(resp[0], resp[1] + 1, (1,), generator=g))))
    prompts.append(rand(17))  # a row that shares nothing
    responses.append(rand(5))
    return prompts, responses


class Tok:
    """The two tokenizer attributes and the decode that generation uses (a tiny model has no real tokenizer)."""

    pad_token_id, eos_token_id = PAD, 1

    def decode(self, ids, skip_special_tokens=True):
        return " ".join(map(str, ids))


def test_plan_groups_covers_rows_and_heads_are_common():
    prompts, _ = shared_rows(0)
    groups = px.plan_groups(prompts, min_shared=8)
    assert sorted(r for rows, _ in groups for r in rows) == list(range(len(prompts)))
    assert sorted(head for _, head in groups if head) == [22, 30]
    for rows, head in groups:
        assert all(prompts[r][:head] == prompts[rows[0]][:head] and len(prompts[r]) > head for r in rows)
    assert px.plan_groups([[1, 2, 3], [4, 5]], min_shared=1) == [([0], 0), ([1], 0)]


@pytest.mark.parametrize("seed", [0, 1])
def test_shared_logprobs_equal_plain_values_and_grads(seed):
    model = tiny_lm(seed)
    prompts, responses = shared_rows(seed)
    model.zero_grad()
    plain, mask = response_logprobs(model, prompts, responses, PAD, prefix_sharing=False)
    (plain * mask).sum().backward()
    want = {n: p.grad.clone() for n, p in model.named_parameters()}
    model.zero_grad()
    px.attach_options(model, px.ComputeOptions(prefix_sharing=True, min_shared_tokens=8, logprob_chunk_tokens=7))
    shared, mask2 = response_logprobs(model, prompts, responses, PAD)
    assert torch.equal(mask, mask2)
    torch.testing.assert_close(shared, plain, atol=1e-5, rtol=0)
    (shared * mask).sum().backward()
    for n, p in model.named_parameters():  # float32 summation order differs: within 1e-5 of the gradient's scale
        torch.testing.assert_close(p.grad, want[n], atol=1e-5 * float(want[n].abs().max()), rtol=0, msg=n)
    # And both against an independent float64 reference (unpadded single-row forward)
    ref = model.double()
    for i, (p, r) in enumerate(zip(prompts, responses)):
        if r:
            with torch.no_grad():
                lp = torch.log_softmax(ref(torch.tensor([p + r])).logits[0], -1)[len(p) - 1: -1]
            np.testing.assert_allclose(shared[i, : len(r)].detach().numpy(),
                                       lp.gather(-1, torch.tensor(r)[:, None]).squeeze(-1).numpy(), atol=1e-5)


def test_shared_logprobs_gpt2_absolute_positions():
    torch.manual_seed(0)
    gpt2 = GPT2LMHeadModel(GPT2Config(vocab_size=256, n_embd=64, n_layer=2, n_head=4, n_positions=256,
                                      bos_token_id=1, eos_token_id=1)).eval()
    prompts, responses = shared_rows(3)
    with torch.no_grad():
        plain, _ = response_logprobs(gpt2, prompts, responses, PAD, prefix_sharing=False)
        px.attach_options(gpt2, px.ComputeOptions(min_shared_tokens=8))
        shared, _ = response_logprobs(gpt2, prompts, responses, PAD)
    torch.testing.assert_close(shared, plain, atol=1e-5, rtol=0)


def test_shared_greedy_generation_equals_plain_tiny():
    model = tiny_lm(2)
    px.attach_options(model, px.ComputeOptions(min_shared_tokens=8))
    prompts, _ = shared_rows(4)
    shared = generate_batch(model, Tok(), prompts, 12, greedy=True)
    plain = generate_batch(model, Tok(), prompts, 12, greedy=True, prefix_sharing=False)
    assert [s.ids for s in shared] == [p.ids for p in plain]
    for s, p in zip(shared, plain):
        np.testing.assert_allclose(s.logprobs, p.logprobs, atol=1e-5)
    # behaviour log-probs of a sampled run equal a plain forward's (log-softmax of untempered logits)
    sampled = generate_batch(model, Tok(), prompts, 6, temperature=0.7, top_p=0.9, generator_seed=5)
    lp, _ = response_logprobs(model, prompts, [s.ids for s in sampled], PAD, prefix_sharing=False)
    for i, s in enumerate(sampled):
        np.testing.assert_allclose(s.logprobs, lp[i, : len(s.ids)].detach().numpy(), atol=1e-5)
