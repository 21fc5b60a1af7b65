"""Token log-probs on a tiny causal LM (built from a config, no download), micro-batching, and 3 training steps."""

from __future__ import annotations

import math

import pytest
import torch
from transformers import GPT2Config, GPT2LMHeadModel, LlamaConfig, LlamaForCausalLM

from empo2.algo.losses import policy_loss
from empo2.config.sections import AlgoConfig
from empo2.policy.logprobs import micro_batches, response_logprobs
from empo2.policy.sampling import Sampling

PAD = 0


def tiny_lm(seed=0, initializer_range=0.02):
    torch.manual_seed(seed)
    cfg = LlamaConfig(vocab_size=256, hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
                      num_key_value_heads=2, max_position_embeddings=128, pad_token_id=PAD,
                      initializer_range=initializer_range)
    return LlamaForCausalLM(cfg)


def rows(seed, prompt_lens, response_lens):
    g = torch.Generator().manual_seed(seed)
    prompts = [torch.randint(1, 256, (n,), generator=g).tolist() for n in prompt_lens]
    responses = [torch.randint(1, 256, (n,), generator=g).tolist() for n in response_lens]
    return prompts, responses


def reference_logp(model, prompt, response, temperature=1.0):
    """Unpadded full forward, float64 log-softmax, position by position."""
    with torch.no_grad():
        logits = model(torch.tensor([prompt + response])).logits[0].double() / temperature  # [L, V]
    logp = torch.log_softmax(logits, dim=-1)
    return torch.tensor([logp[len(prompt) - 1 + t, tok].item() for t, tok in enumerate(response)], dtype=torch.float64)


@pytest.fixture(scope="module")
def model():
    return tiny_lm().eval()


@pytest.mark.parametrize("seed", [0, 1])
def test_batched_matches_one_by_one_and_reference(model, seed):
    prompts, responses = rows(seed, [3, 11, 6, 1, 8], [5, 2, 9, 4, 0])
    with torch.no_grad():
        logp, mask = response_logprobs(model, prompts, responses, PAD)
    assert logp.shape == mask.shape == (5, 9) and logp.dtype == torch.float32 and mask.dtype == torch.bool
    assert mask.sum(1).tolist() == [5, 2, 9, 4, 0]
    assert torch.all(logp[~mask] == 0)
    for i, (p, r) in enumerate(zip(prompts, responses)):
        with torch.no_grad():
            single, _ = response_logprobs(model, [p], [r], PAD)
        torch.testing.assert_close(logp[i, : len(r)], single[0, : len(r)], atol=1e-5, rtol=0)
        if r:
            torch.testing.assert_close(logp[i, : len(r)].double(), reference_logp(model, p, r), atol=1e-5, rtol=0)


def test_absolute_position_model_gpt2():
    """GPT-2 has learned absolute positions: left padding is only right if position_ids skip the pads."""
    torch.manual_seed(0)
    gpt2 = GPT2LMHeadModel(GPT2Config(vocab_size=256, n_embd=64, n_layer=2, n_head=4, n_positions=128,
                                      bos_token_id=1, eos_token_id=2)).eval()
    prompts, responses = rows(8, [2, 9, 5], [6, 3, 1])
    with torch.no_grad():
        logp, _ = response_logprobs(gpt2, prompts, responses, PAD)
    for i, (p, r) in enumerate(zip(prompts, responses)):
        torch.testing.assert_close(logp[i, : len(r)].double(), reference_logp(gpt2, p, r), atol=1e-5, rtol=0)


def test_temperature(model):
    prompts, responses = rows(3, [4, 7], [6, 3])
    with torch.no_grad():
        logp, _ = response_logprobs(model, prompts, responses, PAD, temperature=0.4)
    torch.testing.assert_close(logp[1, :3].double(), reference_logp(model, prompts[1], responses[1], 0.4), atol=1e-5,
                               rtol=0)


def test_model_without_logits_to_keep_uses_full_logits(model):
    class Plain(torch.nn.Module):
        def __init__(self, inner):
            super().__init__()
            self.inner = inner

        def forward(self, input_ids, attention_mask, position_ids, use_cache):
            return self.inner(input_ids=input_ids, attention_mask=attention_mask, position_ids=position_ids)

    prompts, responses = rows(4, [5, 2], [3, 7])
    with torch.no_grad():
        a, _ = response_logprobs(model, prompts, responses, PAD)
        b, _ = response_logprobs(Plain(model), prompts, responses, PAD)
    torch.testing.assert_close(a, b, atol=1e-6, rtol=0)


def test_grad_enabled_and_no_grad(model):
    prompts, responses = rows(5, [4, 6], [3, 5])
    with torch.no_grad():
        logp, _ = response_logprobs(model, prompts, responses, PAD)
    assert logp.grad_fn is None
    logp, mask = response_logprobs(model, prompts, responses, PAD)
    (logp * mask).sum().backward()
    grads = [p.grad for p in model.parameters()]
    assert all(g is not None for g in grads) and any(g.abs().sum() > 0 for g in grads)
    model.zero_grad(set_to_none=True)


def test_peft_lora_model():
    from peft import LoraConfig, get_peft_model

    base = tiny_lm(seed=1)
    prompts, responses = rows(6, [4, 9], [5, 2])
    with torch.no_grad():
        want, _ = response_logprobs(base, prompts, responses, PAD)
    lora = get_peft_model(base, LoraConfig(r=4, lora_alpha=8, target_modules=["q_proj", "v_proj"]))
    got, _ = response_logprobs(lora, prompts, responses, PAD)  # LoRA B = 0 at init: same values, grad to adapters
    torch.testing.assert_close(got.detach(), want, atol=1e-6, rtol=0)
    got.sum().backward()
    assert any(p.grad is not None for n, p in lora.named_parameters() if "lora_" in n)


def test_argument_checks(model):
    with pytest.raises(ValueError):
        response_logprobs(model, [[1], [2]], [[3]], PAD)
    with pytest.raises(ValueError):
        response_logprobs(model, [[]], [[3]], PAD)
    logp, mask = response_logprobs(model, [[1, 2]], [[]], PAD)
    assert logp.shape == mask.shape == (1, 0)


def test_micro_batches_respect_budget_and_cover_rows():
    prompts, responses = rows(7, [3, 40, 12, 7, 1, 25, 9, 9], [10, 2, 30, 1, 5, 8, 0, 16])
    for sort in (True, False):
        for budget in (1, 50, 120, 10_000):
            batches = list(micro_batches(prompts, responses, budget, sort=sort))
            assert sorted(i for b in batches for i in b) == list(range(8))
            for b in batches:
                cost = len(b) * (max(len(prompts[i]) for i in b) + max(len(responses[i]) for i in b))
                assert cost <= budget or len(b) == 1
        assert len(list(micro_batches(prompts, responses, 10_000, sort=sort))) == 1
    assert list(micro_batches(prompts, responses, 1, sort=False)) == [[i] for i in range(8)]
    with pytest.raises(ValueError):
        list(micro_batches(prompts, responses, 0))


# ------------------------------------------------------------------------------------------------ training steps


def _greedy(model, prompt, n, pick):
    ids, out = list(prompt), []
    with torch.no_grad():
        for _ in range(n):
            tok = int(pick(model(torch.tensor([ids])).logits[0, -1, 1:])) + 1  # never the pad id
            out.append(tok)
            ids.append(tok)
    return out


def _train(adv_masked_row, delta, steps=3):
    """3 AdamW steps on [likely response (A=+1), unlikely response (A=adv_masked_row)]; returns the trajectory."""
    model = tiny_lm(seed=0, initializer_range=0.2)  # peaked: greedy tokens p > 0.04, argmin tokens p < 1e-4
    prompt = [5, 17, 42, 99, 3]
    likely, unlikely = _greedy(model, prompt, 6, torch.argmax), _greedy(model, prompt, 6, torch.argmin)
    prompts, responses = [prompt, prompt], [likely, unlikely]
    with torch.no_grad():
        logp_old, mask = response_logprobs(model, prompts, responses, PAD)
    adv = torch.tensor([1.0, adv_masked_row])
    opt = torch.optim.AdamW(model.parameters(), lr=3e-3, weight_decay=0.0)
    history, grads_on_unlikely = [logp_old.sum(1)], []
    for _ in range(steps):
        logp, _ = response_logprobs(model, prompts, responses, PAD)
        logp.retain_grad()
        loss, metrics = policy_loss(logp, logp_old, adv, mask, AlgoConfig(low_prob_threshold=delta))
        opt.zero_grad()
        loss.backward()
        grads_on_unlikely.append(logp.grad[1].clone())
        opt.step()
        with torch.no_grad():
            history.append(response_logprobs(model, prompts, responses, PAD)[0].sum(1))
        assert metrics["skipped"] == 0.0
        if delta > 0:
            assert metrics["masked_frac"] == 0.5  # the unlikely row (6 of 12 tokens) stays masked at every step
    return torch.stack(history), torch.stack(grads_on_unlikely), logp_old


def test_three_steps_raise_positive_response_and_mask_freezes_its_row():
    hist, grads, logp_old = _train(adv_masked_row=+1.0, delta=0.01)
    assert torch.all(logp_old[0].exp() > 0.01) and torch.all(logp_old[1].exp() < 0.01)  # the setup is as intended
    assert torch.all(hist[1:, 0] > hist[:-1, 0])  # the positive-advantage response's log-prob rises every step
    assert hist[-1, 0] - hist[0, 0] > 0.1
    assert torch.all(grads == 0)  # the masked row's tokens receive exactly zero gradient
    # Its advantage has no effect at all: with the opposite advantage, training is identical, bit for bit.
    hist_neg, _, _ = _train(adv_masked_row=-1.0, delta=0.01)
    torch.testing.assert_close(hist, hist_neg, atol=0, rtol=0)


def test_without_mask_the_same_row_moves_with_its_advantage():
    """Control: with δ = 0 the unlikely row's advantage does move its log-prob (so the test above can fail)."""
    hist_pos, grads, _ = _train(adv_masked_row=+1.0, delta=0.0)
    hist_neg, _, _ = _train(adv_masked_row=-1.0, delta=0.0)
    assert torch.all(grads[0] != 0)  # (later steps: its ratio has left the clip range, so PPO clipping zeroes it)
    assert hist_pos[-1, 1] - hist_neg[-1, 1] > 1.0
    assert math.isfinite(hist_pos[-1, 1].item())


# ------------------------------------------------------------------------------------- sampling temperature (TRL's)


class Tok:
    """The tokenizer attributes generation and the update read (a tiny model has no real tokenizer)."""

    pad_token_id, eos_token_id = PAD, 1

    def decode(self, ids, skip_special_tokens=True):
        return " ".join(map(str, ids))


def _shared_prompts(seed=11):
    """Two groups of prompts sharing a 30- and a 20-token head, and one row that shares nothing."""
    g = torch.Generator().manual_seed(seed)
    rand = lambda n: torch.randint(2, 256, (n,), generator=g).tolist()  # noqa: E731
    prompts = []
    for head_len in (30, 20):
        head = rand(head_len)
        prompts += [head + rand(n) for n in (1, 4, 7)]
    return prompts + [rand(13)]


@pytest.mark.parametrize("shared, seeded", [(False, False), (True, False), (False, True), (True, True)],
                         ids=["plain", "shared-head", "seeded", "seeded-shared-head"])
def test_behaviour_logprobs_are_of_the_tempered_distribution(shared, seeded):
    """At T = 0.7 every generation path returns log-softmax(logits / 0.7) of the sampled tokens, as a float64
    reference from a plain forward pass computes it; greedy decoding returns the untempered log-softmax."""
    from empo2.policy import prefix as px
    from empo2.policy.generate import generate_batch

    model = tiny_lm(seed=3, initializer_range=0.2).eval()  # peaked logits: T = 0.7 and T = 1 differ by ~0.1-1
    options = px.ComputeOptions(prefix_sharing=shared, min_shared_tokens=8)
    prompts = _shared_prompts()
    assert px.plan_layout(prompts, 8) is not None  # with sharing on, the rows do share heads
    seeds = list(range(40, 40 + len(prompts))) if seeded else None
    gens = generate_batch(model, Tok(), prompts, Sampling(8, temperature=0.7), generator_seed=5, row_seeds=seeds, options=options)
    greedy = generate_batch(model, Tok(), prompts, Sampling(8, greedy=True), options=options)
    moved = 0.0
    for p, g, gg in zip(prompts, gens, greedy):
        want = reference_logp(model, p, g.ids, temperature=0.7)
        torch.testing.assert_close(torch.tensor(g.logprobs, dtype=torch.float64), want, atol=1e-5, rtol=0)
        moved = max(moved, float((want - reference_logp(model, p, g.ids)).abs().max()))
        torch.testing.assert_close(torch.tensor(gg.logprobs, dtype=torch.float64), reference_logp(model, p, gg.ids),
                                   atol=1e-5, rtol=0)
    assert moved > 0.05  # the test can tell the two temperatures apart


def test_on_policy_update_ratio_is_one_at_the_sampling_temperature():
    """Rollouts sampled at policy.temperature = 0.7, then the update: before any step its logp_new equals the
    rollout's logp_old (ratio 1 within 1e-5) and a float64 log-softmax(logits / 0.7); the KL reference (LoRA off,
    B = 0 at init: the same weights) and the tip-free recomputed old log-probs are at 0.7 too."""
    from peft import LoraConfig, get_peft_model

    from empo2.algo.losses import get_policy_loss
    from empo2.config import Config
    from empo2.parallel.distributed import Dist
    from empo2.policy import prefix as px
    from empo2.policy.generate import generate_batch
    from empo2.train.rows import UpdateRow
    from empo2.train.update import PolicyUpdate

    base = tiny_lm(seed=4, initializer_range=0.2).eval()
    options = px.ComputeOptions(min_shared_tokens=8)
    prompts = _shared_prompts(seed=12)
    tips = [7, 8, 9, 10, 11]  # the "tips" an off_tips row's rollout prompt has and its training prompt lacks
    gens = generate_batch(base, Tok(), prompts, Sampling(6, temperature=0.7), generator_seed=2, options=options)
    off = generate_batch(base, Tok(), [tips + prompts[0]], Sampling(6, temperature=0.7), generator_seed=3, options=options)[0]
    model = get_peft_model(base, LoraConfig(r=4, lora_alpha=8, target_modules=["q_proj", "v_proj"]))
    cfg = Config.load("configs/scienceworld_cpu.yaml", [
        "algo.name=empo2", "policy.temperature=0.7", "algo.beta=0.04", "algo.off_policy_ratio=tip_free",
        "train.mini_batch_size=0", "train.ppo_epochs=1", "train.micro_batch_tokens=100000"])
    rows = [UpdateRow(p, g.ids, list(g.logprobs), (-1.0) ** i, "on") for i, (p, g) in enumerate(zip(prompts, gens))]
    rows.append(UpdateRow(prompts[0], off.ids, list(off.logprobs), 1.0, "off_tips"))
    want = {id(r): reference_logp(base, r.train_prompt, r.response, temperature=0.7) for r in rows}  # before the step
    seen = []
    loss = get_policy_loss("empo2")

    def spy(logp_new, logp_old, adv, mask, algo, **kwargs):
        seen.append((logp_new.detach().clone(), logp_old.clone(), kwargs["logp_ref"].clone(), mask.clone()))
        return loss(logp_new, logp_old, adv, mask, algo, **kwargs)

    optimizer = torch.optim.SGD([p for p in model.parameters() if p.requires_grad], lr=0.1)
    metrics = PolicyUpdate(cfg, model, Tok(), optimizer, spy, Dist(), options)(rows)
    assert metrics["optimizer_steps"] == 1 and len(seen) == 1  # one micro-batch, before the only step
    new, old, ref, mask = seen[0]
    assert float(((new - old).exp()[mask] - 1).abs().max()) < 1e-5
    torch.testing.assert_close(ref[mask], old[mask], atol=1e-5, rtol=0)
    seen_old = [old[j][mask[j].bool()].double() for j in range(old.shape[0])]  # the loss's rows, in its order
    assert len(seen_old) == len(rows)
    for r in rows:  # the old log-probs (sampled, or recomputed tip-free for off_tips) are log-softmax(logits / 0.7)
        assert any(len(o) == len(want[id(r)]) and torch.allclose(o, want[id(r)], atol=1e-5, rtol=0) for o in seen_old)
    assert rows[-1].logp_old == list(off.logprobs)  # recomputed into a new row: the caller's rows stay as they were
    assert float((want[id(rows[-1])] - torch.tensor(off.logprobs).double()).abs().max()) > 1e-3  # recomputed
