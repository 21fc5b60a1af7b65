"""Chain packing (empo2.policy.packing): rows whose prompt + response start another row's prompt take their log-probs
from that row's forward, with the log-probs and gradients of rows computed one by one, for fewer forwarded tokens.

Rows are built as ``append``-layout episodes: each step's prompt is the last prompt, its response and a new turn.
"""

from __future__ import annotations

import copy
import dataclasses
import random

import pytest
import torch
from transformers import GPT2Config, GPT2LMHeadModel

from empo2.algo.losses import get_policy_loss
from empo2.parallel.distributed import Dist
from empo2.policy import packing as pk
from empo2.policy import prefix as px
from empo2.policy.logprobs import response_logprobs
from empo2.policy.packing import packed_batches, plan_packing
from empo2.train import update
from empo2.train.rows import UpdateRow
from empo2.train.update import PolicyUpdate, mini_batches, token_batches
from test_prefix_sharing import PAD, Tok, tiny_lm
from test_update import _config, _reference_gradient

UNPACKED = px.ComputeOptions(min_shared_tokens=8, pack_chains=False)


def episodes(seed: int, count: int = 3, steps: int = 3) -> tuple[list[list[int]], list[list[int]], list[int]]:
    """``count`` append-layout episodes of ``steps`` rows on one shared head; returns (prompts, responses, episode
    of each row). The rows of an episode are not adjacent (rows are listed step by step, as rollouts make them)."""
    g = torch.Generator().manual_seed(seed)
    rand = lambda n: torch.randint(3, 256, (n,), generator=g).tolist()  # noqa: E731
    size = lambda lo, hi: int(torch.randint(lo, hi + 1, (1,), generator=g))  # noqa: E731
    head = rand(20)
    last = [(head + rand(size(3, 8)), rand(size(2, 6))) for _ in range(count)]
    prompts, responses, episode = [], [], []
    for t in range(steps):
        for e in range(count):
            if t:
                prompt, response = last[e]
                last[e] = (prompt + response + rand(size(2, 6)), rand(size(1, 6)))
            prompts.append(last[e][0])
            responses.append(last[e][1])
            episode.append(e)
    return prompts, responses, episode


def test_plan_packing_reads_each_episode_off_its_last_row():
    prompts, responses, episode = episodes(0)
    packing = plan_packing(prompts, responses)
    assert packing.packs and len(packing.members) == 3
    for rows in packing.members:
        assert len({episode[r] for r in rows}) == 1 and len(rows) == 3
        carrier = rows[-1]
        full = packing.prompts[packing.sequence_of[carrier]] + packing.continuations[packing.sequence_of[carrier]]
        assert full == prompts[carrier] + responses[carrier]
        for r in rows:  # each member's response sits at its offset in the continuation
            start = len(packing.prompts[packing.sequence_of[r]]) + packing.offsets[r]
            assert full[start: start + len(responses[r])] == responses[r]
    assert packing.prompts[packing.sequence_of[0]] == prompts[0]  # the prompt is cut at the first step's


def test_a_prompt_one_token_off_the_chain_is_not_packed():
    prompts, responses, _ = episodes(1, count=1, steps=2)
    off = list(prompts[1])
    off[len(prompts[0]) + len(responses[0]) - 1] ^= 1  # the first response's last token, as the next prompt holds it
    packing = plan_packing([prompts[0], off], responses)
    assert not packing.packs and packing.members == [[0], [1]]
    assert packing.continuations == responses
    # an empty response chains with nothing; a prompt equal to another's prompt + response covers it
    assert not plan_packing([[5, 6], [5, 6, 7]], [[], [8]]).packs
    assert plan_packing([[5, 6], [5, 6, 7]], [[7], [8]]).members == [[0, 1]]


def _loss_and_grads(model, prompts, responses, weights, options, per_row: bool):
    """Σ weight·log-prob over every response token, its gradient, and the log-probs ([B, R], float64)."""
    model.zero_grad()
    if per_row:
        parts = [response_logprobs(model, [p], [r], PAD, options=options)[0][0] for p, r in zip(prompts, responses)]
        width = max(len(r) for r in responses)
        logp = torch.stack([torch.nn.functional.pad(x, (0, width - x.shape[0])) for x in parts])
    else:
        logp, _ = response_logprobs(model, prompts, responses, PAD, options=options)
    (logp * weights[:, : logp.shape[1]]).sum().backward()
    return logp.detach().double(), {n: p.grad.clone() for n, p in model.named_parameters()}


def tiny_gpt2():
    torch.manual_seed(0)
    return GPT2LMHeadModel(GPT2Config(vocab_size=256, n_embd=64, n_layer=2, n_head=4, n_positions=256,
                                      bos_token_id=1, eos_token_id=1)).eval()


# Llama's RMSNorm computes in float32 whatever the weights' dtype, so in float64 its gradients carry float32
# roundings, which differ where a position's gradient is summed in one forward or over several; GPT-2 stays float64.
@pytest.mark.parametrize(("make", "dtype", "tol", "grad_tol"), [
    (tiny_gpt2, torch.float64, 1e-10, 1e-10),
    (lambda: tiny_lm(3), torch.float64, 1e-10, 1e-6),
    (lambda: tiny_lm(3), torch.float32, 1e-5, 1e-5),
])
@pytest.mark.parametrize("sharing", [True, False])
def test_packed_logprobs_and_gradients_equal_rows_one_by_one(make, dtype, tol, grad_tol, sharing):
    model = make().to(dtype)
    prompts, responses, _ = episodes(2)
    prompts.append(list(prompts[-1]))  # a duplicate of a last row: two carriers of the same tokens
    responses.append(list(responses[-1]))
    weights = torch.randn(len(prompts), 8, generator=torch.Generator().manual_seed(0))
    options = px.ComputeOptions(prefix_sharing=sharing, min_shared_tokens=8, logprob_chunk_tokens=5)
    want, want_grads = _loss_and_grads(model, prompts, responses, weights, UNPACKED, per_row=True)
    got, grads = _loss_and_grads(model, prompts, responses, weights, options, per_row=False)
    torch.testing.assert_close(got, want, atol=tol, rtol=0)
    assert (got != 0).sum() == sum(map(len, responses))
    for n, g in grads.items():
        scale = float(want_grads[n].abs().max())
        torch.testing.assert_close(g, want_grads[n], atol=grad_tol * max(scale, 1.0), rtol=0, msg=n)


def _forwarded_tokens(model, call) -> int:
    """Token positions (padding included) of every forward ``call`` makes."""
    seen = []
    hook = model.model.embed_tokens.register_forward_hook(lambda _m, inputs, _o: seen.append(inputs[0].numel()))
    try:
        call()
    finally:
        hook.remove()
    return sum(seen)


@pytest.mark.parametrize("sharing", [True, False])
def test_packing_forwards_fewer_tokens(sharing):
    model = tiny_lm(4)
    prompts, responses, _ = episodes(3, count=2, steps=4)
    options = px.ComputeOptions(prefix_sharing=sharing, min_shared_tokens=8)
    unpacked = px.ComputeOptions(prefix_sharing=sharing, min_shared_tokens=8, pack_chains=False)
    with torch.no_grad():
        packed = _forwarded_tokens(model, lambda: response_logprobs(model, prompts, responses, PAD, options=options))
        plain = _forwarded_tokens(model, lambda: response_logprobs(model, prompts, responses, PAD, options=unpacked))
    assert packed < 0.6 * plain, (packed, plain)


def test_a_near_chain_forwards_as_many_tokens_as_unpacked():
    model = tiny_lm(4)
    prompts, responses, _ = episodes(5, count=1, steps=2)
    prompts[1][len(prompts[0])] ^= 1  # the first response's first token, as the next prompt holds it
    with torch.no_grad():
        packed = _forwarded_tokens(model, lambda: response_logprobs(model, prompts, responses, PAD))
        plain = _forwarded_tokens(
            model, lambda: response_logprobs(model, prompts, responses, PAD, options=px.ComputeOptions(pack_chains=False)))
    assert packed == plain


# ------------------------------------------------------------------------------------------- the update


def _rows(model, seed: int) -> list[UpdateRow]:
    """On-policy rows (π_old = the model's own log-probs) of append-layout episodes, advantages of both signs."""
    prompts, responses, episode = episodes(seed, count=3, steps=3)
    with torch.no_grad():
        logp, _ = response_logprobs(model.double(), prompts, responses, PAD, options=UNPACKED)
    model.float()
    return [UpdateRow(p, r, logp[i, : len(r)].tolist(), (-1.0) ** episode[i] * (1 + episode[i]), "on")
            for i, (p, r) in enumerate(zip(prompts, responses))]


def _step(model, rows, *overrides, pack: bool = True, loss: str = "grpo",
          metrics: dict | None = None) -> dict[str, torch.Tensor]:
    """How far one SGD(lr=1) update moves each weight (= the update's gradient); the update's metrics go into
    ``metrics`` where given."""
    before = {n: p.detach().clone() for n, p in model.named_parameters()}
    options = px.ComputeOptions(min_shared_tokens=8, pack_chains=pack)
    out = PolicyUpdate(_config(*overrides), model, Tok(), torch.optim.SGD(model.parameters(), lr=1.0),
                       get_policy_loss(loss), Dist(), options)(rows)
    if metrics is not None:
        metrics.update(out)
    return {n: (before[n] - p.detach()).double() for n, p in model.named_parameters()}


@pytest.mark.parametrize("budget", [60, 100_000])
def test_a_packed_update_moves_the_weights_by_the_row_by_row_gradient(budget):
    """One optimizer step over every row, packed and micro-batched by a token budget: the float64 gradient of the
    loss over rows computed one by one, as the update without packing."""
    model = tiny_lm(6)
    rows = _rows(model, 6)
    expected = _reference_gradient(model, rows, count_zero_rows=True)
    scale = max(float(g.abs().max()) for g in expected.values())
    assert scale > 1e-3
    for pack in (True, False):
        moved = _step(copy.deepcopy(model), rows, "train.mini_batch_size=0", f"train.micro_batch_tokens={budget}",
                      pack=pack)
        for n, m in moved.items():
            torch.testing.assert_close(m, expected[n], atol=1e-5 * scale, rtol=1e-4, msg=(pack, n))


def test_token_batches_keep_a_chain_in_one_micro_batch():
    model = tiny_lm(7)
    rows = _rows(model, 7)
    for budget in (1, 100, 10_000):
        batches = token_batches(rows, budget, shared=True, min_shared=8, pack=True)
        assert sorted(id(r) for b in batches for r in b) == sorted(id(r) for r in rows)
        for b in batches:
            members = {id(r) for r in b}
            for rows_of_chain in plan_packing([r.train_prompt for r in rows], [r.response for r in rows]).members:
                inside = {id(rows[i]) in members for i in rows_of_chain}
                assert len(inside) == 1  # all of a chain's rows or none
    packing = plan_packing([r.train_prompt for r in rows], [r.response for r in rows])
    assert packed_batches(packing, lambda p, c: [list(range(len(p)))]) == [[0, 3, 6, 1, 4, 7, 2, 5, 8]]


def test_mini_batches_keep_chains_whole_and_single_rows_shuffle_as_before():
    rows = list(range(10))
    random.seed(1)
    order = list(range(10))
    random.shuffle(order)
    random.seed(1)
    assert mini_batches(rows, [[i] for i in range(10)], 4) == [order[k:k + 4] for k in (0, 4, 8)]
    chains = [[0, 1, 2, 3, 4], [5], [6, 7], [8, 9]]
    for seed in range(5):
        random.seed(seed)
        minis = mini_batches(rows, chains, 4)
        assert sorted(r for m in minis for r in m) == rows
        for chain in chains:
            assert sum(chain[0] in m for m in minis) == 1 and any(set(chain) <= set(m) for m in minis)
        assert all(len(m) <= 4 + 4 for m in minis)


def test_pack_episodes_keeps_each_episode_in_one_optimizer_step():
    """Mini-batches of 3 rows over 3 episodes of 3 steps: each optimizer step (one micro-batch here) sees one
    episode's rows, told apart by their advantages."""
    model = tiny_lm(8)
    rows = _rows(model, 8)
    seen, loss = [], get_policy_loss("grpo")

    def recording_loss(logp_new, logp_old, adv, mask, *args, **kwargs):
        seen.append(sorted(adv.tolist()))
        return loss(logp_new, logp_old, adv, mask, *args, **kwargs)

    random.seed(0)
    cfg = _config("train.mini_batch_size=3", "train.pack_episodes=true", "train.micro_batch_tokens=100000")
    PolicyUpdate(cfg, model, Tok(), torch.optim.SGD(model.parameters(), lr=1.0), recording_loss, Dist(),
                 px.ComputeOptions(min_shared_tokens=8))(rows)
    assert sorted(seen) == [[-2.0] * 3, [1.0] * 3, [3.0] * 3]


def count_plans(monkeypatch, *modules) -> list[int]:
    """The row count of every :func:`plan_packing` call, by the name in ``modules`` and in its own module (where
    :func:`packed_batches` and :func:`response_logprobs` reach it)."""
    calls: list[int] = []
    for module in (pk, *modules):
        monkeypatch.setattr(module, "plan_packing", lambda p, r: calls.append(len(p)) or plan_packing(p, r))
    return calls


def test_the_update_plans_the_packing_once_per_step(monkeypatch):
    """The step's shared heads and its micro-batches come from one plan of its rows (one per mini-batch and epoch);
    with a budget of one token each micro-batch is one packed sequence, whose forward plans its own 3 rows."""
    calls = count_plans(monkeypatch, update)
    model = tiny_lm(9)
    rows = _rows(model, 9)
    _step(model, rows, "train.mini_batch_size=0", "train.ppo_epochs=2", "train.micro_batch_tokens=1")
    assert calls == ([len(rows)] + [3] * 3) * 2


@pytest.mark.parametrize("pack", [True, False])
def test_tokens_forwarded_count_a_packed_episode_once(pack):
    """``tokens`` counts each row's prompt and response, ``tokens_forwarded`` what the forwards took: packed, an
    append-layout episode's last row alone (it holds every earlier step); unpacked, every row."""
    model = tiny_lm(10)
    rows = _rows(model, 10)
    metrics: dict = {}
    _step(model, rows, "train.mini_batch_size=0", "train.ppo_epochs=2", pack=pack, metrics=metrics)
    logical = 2 * sum(len(r.train_prompt) + len(r.response) for r in rows)
    last_rows = rows[-3:]  # rows are listed step by step: the last three are the episodes' last steps
    assert metrics["tokens"] == logical
    if pack:
        assert metrics["tokens_forwarded"] == 2 * sum(len(r.train_prompt) + len(r.response) for r in last_rows)
        assert metrics["tokens_forwarded"] < 0.6 * logical
    else:
        assert metrics["tokens_forwarded"] == logical


# ------------------------------------------------------------------------------- EMPO²'s off-policy rows

TIPS = [250, 251, 252, 253]
HEAD = 20  # the shared head :func:`episodes` starts every prompt with


def _off_policy_rows(model, seed: int, count: int = 3) -> list[UpdateRow]:
    """EMPO²'s ``off_tips`` rows: append-layout episodes sampled with tips in each user turn (``rollout_prompt``) and
    trained on the same turns without them (``train_prompt``, the tip-free chain); ``logp_old`` is the model's
    float64 log-probs on the prompt with tips, as the sampling engine recorded them."""
    prompts, responses, episode = episodes(seed, count=count, steps=3)
    tipped = []
    for i, p in enumerate(prompts):
        if i < count:  # a first step: tips after the head
            tipped.append(p[:HEAD] + TIPS + p[HEAD:])
        else:  # the last step's prompt with tips, its response, then the tips and the new turn
            last = i - count
            tipped.append(tipped[last] + responses[last] + TIPS + p[len(prompts[last]) + len(responses[last]):])
    with torch.no_grad():
        logp, _ = response_logprobs(model.double(), tipped, responses, PAD, options=UNPACKED)
    model.float()
    return [UpdateRow(p, r, logp[i, : len(r)].tolist(), (-1.0) ** episode[i] * (1 + episode[i]), "off_tips",
                      rollout_prompt=tipped[i]) for i, (p, r) in enumerate(zip(prompts, responses))]


def test_off_policy_rows_pack_among_themselves_with_the_log_probs_and_gradients_of_single_rows():
    """The tip-free prompts chain per episode, as do the prompts with tips, and no tip-free row is read off a
    forward with tips (or the other way round); packed log-probs and gradients equal the rows' one by one."""
    model = tiny_lm(11)
    rows = _off_policy_rows(model, 11)
    model.double()
    train = [r.train_prompt for r in rows]
    sampled = [r.rollout_prompt for r in rows]
    responses = [r.response for r in rows]
    episodes_of = [[e, e + 3, e + 6] for e in range(3)]
    assert plan_packing(train, responses).members == episodes_of
    assert plan_packing(sampled, responses).members == episodes_of
    both = plan_packing(train + sampled, responses + responses)
    assert all(len({r < len(rows) for r in m}) == 1 for m in both.members) and len(both.members) == 6
    weights = torch.randn(len(rows), 8, generator=torch.Generator().manual_seed(1))
    options = px.ComputeOptions(min_shared_tokens=8)
    for prompts in (train, sampled):
        want, want_grads = _loss_and_grads(model, prompts, responses, weights, UNPACKED, per_row=True)
        got, grads = _loss_and_grads(model, prompts, responses, weights, options, per_row=False)
        torch.testing.assert_close(got, want, atol=1e-10, rtol=0)
        for n, g in grads.items():
            torch.testing.assert_close(g, want_grads[n], atol=1e-6 * max(float(want_grads[n].abs().max()), 1.0),
                                       rtol=0, msg=n)


@pytest.mark.parametrize("old_logprobs", ["engine", "trainer"])
def test_a_packed_off_policy_update_moves_the_weights_by_the_tip_free_gradient(old_logprobs):
    """``algo.off_policy_ratio=tip_free``: the ratio's π_old is recomputed on the tip-free prompt, so at the first
    step every ratio is 1 and the weights move by the float64 gradient of the rows' tip-free log-probs, packed or
    not; with ``algo.old_logprobs=trainer`` the prompts with tips are forwarded packed too, and agree with the
    recorded log-probs."""
    model = tiny_lm(12)
    rows = _off_policy_rows(model, 12)
    with torch.no_grad():
        tip_free, _ = response_logprobs(copy.deepcopy(model).double(), [r.train_prompt for r in rows],
                                        [r.response for r in rows], PAD, options=UNPACKED)
    reference = [dataclasses.replace(r, logp_old=tip_free[i, : len(r.response)].tolist()) for i, r in enumerate(rows)]
    expected = _reference_gradient(model, reference, count_zero_rows=True)
    with_tips = _reference_gradient(model, rows, count_zero_rows=True)  # the ratio's denominator left with tips
    scale = max(float(g.abs().max()) for g in expected.values())
    assert max(float((with_tips[n] - g).abs().max()) for n, g in expected.items()) > 1e-2 * scale
    for pack in (True, False):
        metrics: dict = {}
        moved = _step(copy.deepcopy(model), rows, "algo.name=empo2", "algo.off_policy_ratio=tip_free",
                      f"algo.old_logprobs={old_logprobs}", "train.mini_batch_size=0", "train.micro_batch_tokens=80",
                      pack=pack, loss="empo2", metrics=metrics)
        for n, m in moved.items():
            torch.testing.assert_close(m, expected[n], atol=1e-5 * scale, rtol=1e-4, msg=(pack, n))
        if old_logprobs == "trainer":
            assert metrics["old_logp_gap_max"] < 1e-4
