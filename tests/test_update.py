"""The policy update's normaliser and mini-batch cut: zero-advantage rows count (the paper's 1/(N·T)).

A tiny random Llama stands in for the policy (the loss and the mini-batching do not depend on the model's size);
the update is the trainer's own ``PolicyUpdate`` with its real micro-batching and prefix sharing.
"""

from __future__ import annotations

import copy
import random

import pytest
import torch

from empo2.algo.losses import get_policy_loss
from empo2.config import Config
from empo2.parallel.distributed import Dist
from empo2.policy.logprobs import shared_micro_batches
from empo2.train.rows import UpdateRow
from empo2.train.update import PolicyUpdate, token_batches
from test_prefix_sharing import SHARED, Tok, shared_rows, tiny_lm


def _config(*overrides: str) -> Config:
    # δ = 0: a random 256-token model gives every token p ≈ 1/256, which the default mask would drop
    return Config.load("configs/scienceworld_cpu.yaml", ["algo.name=grpo", "algo.low_prob_threshold=0", "algo.beta=0",
                                                         "train.max_grad_norm=1000000000.0",
                                                         "train.micro_batch_tokens=120", *overrides])


def _rows(model, advantages: list[float]) -> list[UpdateRow]:
    """Rows whose behaviour log-probs are the model's own (an on-policy first step: every ratio is 1)."""
    prompts, responses = shared_rows(5, resp=(2, 9))
    rows = []
    with torch.no_grad():
        for p, r, a in zip(prompts, responses, advantages):
            logits = model(torch.tensor([p + r])).logits[0, len(p) - 1:-1].double()  # [R, V]
            logp = torch.log_softmax(logits, -1).gather(-1, torch.tensor(r)[:, None])[:, 0]
            rows.append(UpdateRow(p, r, logp.tolist(), a, "on"))
    return rows


def _reference_gradient(model, rows: list[UpdateRow], count_zero_rows: bool) -> dict[str, torch.Tensor]:
    """float64: ∇ of −Σ_rows Σ_t A·ρ_t / (response tokens of the rows counted), at ρ = 1, by plain autograd."""
    ref = copy.deepcopy(model).double()
    counted = [r for r in rows if count_zero_rows or r.advantage != 0.0]
    tokens = sum(len(r.response) for r in counted)
    loss = torch.zeros((), dtype=torch.float64)
    for r in rows:
        logits = ref(torch.tensor([r.train_prompt + r.response])).logits[0, len(r.train_prompt) - 1:-1]  # [R, V]
        logp = torch.log_softmax(logits, -1).gather(-1, torch.tensor(r.response)[:, None])[:, 0]  # [R]
        ratio = torch.exp(logp - torch.tensor(r.logp_old, dtype=torch.float64))
        loss = loss - (r.advantage * ratio).sum() / tokens
    loss.backward()
    return {n: p.grad.clone() for n, p in ref.named_parameters()}


@pytest.mark.parametrize("drop", [False, True])
def test_zero_advantage_rows_stay_in_the_token_mean(drop):
    """One step over all rows with SGD(lr=1): the weights move by exactly the reference gradient, whose denominator
    counts the zero-advantage rows' tokens (or, with ``drop_zero_advantage_rows``, leaves them out)."""
    model = tiny_lm(4)
    advantages = [0.0, 1.5, 0.0, -0.7, 0.0, 0.0, 2.0]
    rows = _rows(model, advantages)
    expected = _reference_gradient(model, rows, count_zero_rows=not drop)
    before = {n: p.detach().clone() for n, p in model.named_parameters()}
    cfg = _config("train.mini_batch_size=0", f"algo.drop_zero_advantage_rows={drop}")
    update = PolicyUpdate(cfg, model, Tok(), torch.optim.SGD(model.parameters(), lr=1.0), get_policy_loss("grpo"),
                          Dist(), SHARED)
    metrics = update(rows)
    assert metrics["optimizer_steps"] == 1
    assert metrics["rows"] == (3 if drop else len(rows)) and metrics["computed_rows"] == 3
    scale = max(float(g.abs().max()) for g in expected.values())
    assert scale > 1e-3  # the step is not trivially zero
    for n, p in model.named_parameters():
        moved = (before[n] - p.detach()).double()  # SGD, lr 1: −Δw = the gradient
        torch.testing.assert_close(moved, expected[n], atol=1e-5 * scale, rtol=1e-4, msg=n)


def test_mini_batches_are_cut_over_all_rows_and_each_takes_its_step():
    """Mini-batches of 2 over 6 rows, 4 of them with advantage 0: 3 optimizer steps (also for a mini-batch of zero
    rows alone, whose zero gradient still moves AdamW's moments), as if every row had been computed."""
    model = tiny_lm(5)
    rows = _rows(model, [0.0, 1.0, 0.0, 0.0, -1.0, 0.0])
    random.seed(0)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3, weight_decay=0.0)
    metrics = PolicyUpdate(_config("train.mini_batch_size=2"), model, Tok(), optimizer, get_policy_loss("grpo"),
                           Dist(), SHARED)(rows)
    assert metrics["optimizer_steps"] == 3 and metrics["rows"] == 6 and metrics["computed_rows"] == 2
    assert metrics["response_tokens"] == sum(len(r.response) for r in rows)
    assert {int(optimizer.state[p]["step"]) for p in model.parameters()} == {3}

    dropped = PolicyUpdate(_config("train.mini_batch_size=2", "algo.drop_zero_advantage_rows=true"), model, Tok(),
                           torch.optim.AdamW(model.parameters(), lr=1e-3), get_policy_loss("grpo"), Dist(),
                           SHARED)(rows)
    assert dropped["optimizer_steps"] == 1 and dropped["rows"] == 2


def test_a_batch_without_signal_changes_nothing_on_a_fresh_optimizer():
    """All advantages 0 on a fresh AdamW: the steps are taken, but zero moments move no weight."""
    model = tiny_lm(6)
    rows = _rows(model, [0.0] * 7)
    before = {n: p.detach().clone() for n, p in model.named_parameters()}
    optimizer = torch.optim.AdamW(model.parameters(), weight_decay=0.0)
    metrics = PolicyUpdate(_config("train.mini_batch_size=0"), model, Tok(), optimizer, get_policy_loss("grpo"),
                           Dist(), SHARED)(rows)
    assert metrics["optimizer_steps"] == 1 and metrics["computed_rows"] == 0 and metrics["tokens"] == 0
    assert all(torch.equal(before[n], p) for n, p in model.named_parameters())


# ------------------------------------------------------------------------------------------- micro-batches


def _row(prompt_len: int, response_len: int) -> UpdateRow:
    return UpdateRow(list(range(1, prompt_len + 1)), [7] * response_len, [0.0] * response_len, 1.0, "on")


def _padded_cost(batch: list[UpdateRow]) -> int:
    """What ``response_logprobs`` computes without sharing: rows × (longest prompt + longest response)."""
    return len(batch) * (max(len(r.train_prompt) for r in batch) + max(len(r.response) for r in batch))


def test_token_batches_known_split():
    """A long prompt and a long response cost their two maxima together (2 × 200 tokens), not the longest row."""
    rows = [_row(100, 1), _row(1, 100), _row(50, 50), _row(10, 10)]
    ids = lambda batches: [[rows.index(r) for r in b] for b in batches]  # noqa: E731
    assert ids(token_batches(rows, 202)) == [[0], [1], [2, 3]]
    assert ids(token_batches(rows, 400)) == [[0, 1], [2, 3]]
    assert ids(token_batches(rows, 10_000)) == [[0, 1, 2, 3]]
    assert ids(token_batches(rows, 1)) == [[0], [1], [2], [3]]
    assert token_batches([], 100) == []


@pytest.mark.parametrize("seed", range(20))
def test_token_batches_keep_order_fit_the_budget_and_fill_greedily(seed):
    """Every row once and in order, each micro-batch within budget (or a row alone), and each next row would have
    overflowed the micro-batch before it."""
    rng = random.Random(seed)
    rows = [_row(rng.randint(1, 120), rng.randint(0, 40)) for _ in range(rng.randint(1, 30))]
    budget = rng.choice([1, 50, 150, 400, 2000])
    batches = token_batches(rows, budget)
    assert [id(r) for b in batches for r in b] == [id(r) for r in rows]
    assert all(b and (_padded_cost(b) <= budget or len(b) == 1) for b in batches)
    assert all(_padded_cost(a + [b[0]]) > budget for a, b in zip(batches, batches[1:]))


def test_token_batches_with_prefix_sharing_cover_every_row_once():
    """With ``shared`` the rows are regrouped by prompt head (the cost is ``shared_micro_batches``'s, tested in
    test_prefix_sharing.py); each row still appears exactly once."""
    prompts, responses = shared_rows(3, heads=(40, 25), per_head=4)
    rows = [UpdateRow(p, r, [0.0] * len(r), 1.0, "on") for p, r in zip(prompts, responses)]
    for budget in (1, 150, 10_000):
        batches = token_batches(rows, budget, shared=True, min_shared=8)
        assert sorted(id(r) for b in batches for r in b) == sorted(id(r) for r in rows)
        want = shared_micro_batches(prompts, responses, budget, 8, step_heads=True)
        assert [[rows.index(r) for r in b] for b in batches] == want
    assert len(token_batches(rows, 10_000, shared=True, min_shared=8)) == 1


def _true_logp(model, prompt: list[int], response: list[int]) -> torch.Tensor:
    """float64 log π(response | prompt) of a float64 copy of ``model`` (kept in the graph)."""
    logits = model(torch.tensor([prompt + response])).logits[0, len(prompt) - 1:-1]  # [R, V]
    return torch.log_softmax(logits, -1).gather(-1, torch.tensor(response)[:, None])[:, 0]  # [R]


@pytest.mark.parametrize(("source", "cap"), [("trainer", 2.0), ("trainer", 0.0), ("engine", 0.0)])
def test_old_logprobs_from_the_trainer_start_the_ratio_at_one_and_tis_reweights_tokens(source, cap):
    """Rows whose recorded ("engine") log-probs are the model's own plus a known per-token error δ, as when another
    engine or precision sampled them; one row was sampled with tips (``off_tips``: its π_old conditions on the tip
    prompt). ``trainer`` replaces π_old by the model's forward on the sampling prompt, so every ratio is 1, and with
    a cap each token's advantage is weighted by min(exp(−δ), cap); ``engine`` keeps the recorded ones. One SGD(lr=1)
    step moves the weights by the float64 reference gradient of −Σ A·w·π_θ/π_old / tokens."""
    model = tiny_lm(8)
    prompts, responses = shared_rows(9, resp=(2, 9))
    tips = [17, 18, 19, 20, 21]
    g = torch.Generator().manual_seed(3)
    rows, deltas, model64 = [], [], copy.deepcopy(model).double()
    with torch.no_grad():
        for i, (p, r) in enumerate(zip(prompts, responses)):
            off = i == 1
            sampled_on = tips + p if off else p
            delta = (torch.rand(len(r), generator=g, dtype=torch.float64) - 0.5) * 3.0  # [R] in (−1.5, 1.5)
            engine = _true_logp(model64, sampled_on, r) + delta
            rows.append(UpdateRow(p, r, engine.tolist(), (-1.0) ** i * (1 + i / 4), "off_tips" if off else "on",
                                  rollout_prompt=sampled_on))
            deltas.append(delta)

    ref = model64
    tokens = sum(len(r.response) for r in rows)
    loss, ratios = torch.zeros((), dtype=torch.float64), []
    for row, delta in zip(rows, deltas):
        logp = _true_logp(ref, row.train_prompt, row.response)
        behaviour = torch.tensor(row.logp_old, dtype=torch.float64)
        if source == "trainer":  # π_old on the sampling prompt, at the step's weights
            behaviour = _true_logp(ref, row.rollout_prompt, row.response).detach()
        weight = torch.exp(-delta).clamp(max=cap) if cap else torch.ones_like(delta)
        ratio = torch.exp(logp - behaviour)
        ratios.append(ratio.detach())
        clipped = torch.clamp(ratio, 0.8, 1.28)  # the config's ε and ε_high; inactive where the ratio is 1
        loss = loss - torch.minimum(ratio * row.advantage * weight, clipped * row.advantage * weight).sum() / tokens
    loss.backward()
    expected = {n: p.grad for n, p in ref.named_parameters()}

    before = {n: p.detach().clone() for n, p in model.named_parameters()}
    cfg = _config("train.mini_batch_size=0", "train.micro_batch_tokens=100000", "policy.temperature=1.0",
                  f"algo.old_logprobs={source}",
                  f"algo.tis_cap={cap}", "algo.epsilon=0.2", "algo.epsilon_high=0.28")
    update = PolicyUpdate(cfg, model, Tok(), torch.optim.SGD(model.parameters(), lr=1.0), get_policy_loss("grpo"),
                          Dist(), SHARED)
    metrics = update(rows)
    assert metrics["optimizer_steps"] == 1
    assert metrics["ratio_mean"] == pytest.approx(float(torch.cat(ratios).mean()), abs=1e-5)  # one micro-batch
    if source == "trainer":  # on-policy rows start at ratio 1; the off_tips row's is π(a|s)/π(a|s,tips)
        assert all(torch.allclose(q, torch.ones_like(q), atol=1e-6) for q, r in zip(ratios, rows) if r.mode == "on")
        gap = torch.cat(deltas).abs()
        assert metrics["old_logp_gap_mean"] == pytest.approx(float(gap.mean()), abs=1e-5)
        assert metrics["old_logp_gap_max"] == pytest.approx(float(gap.max()), abs=1e-5)
        if cap:
            want = float(torch.cat([torch.exp(-d).clamp(max=cap) for d in deltas]).mean())
            assert metrics["tis_weight_mean"] == pytest.approx(want, abs=1e-5)
        else:
            assert "tis_weight_mean" not in metrics
    else:
        assert "old_logp_gap_mean" not in metrics and "tis_weight_mean" not in metrics
    scale = max(float(v.abs().max()) for v in expected.values())
    assert scale > 1e-3
    for n, p in model.named_parameters():
        moved = (before[n] - p.detach()).double()
        torch.testing.assert_close(moved, expected[n], atol=1e-5 * scale, rtol=1e-4, msg=n)


def test_auto_old_logprobs_follow_the_backend_and_the_compute_dtype():
    """``auto`` recomputes π_old in the trainer wherever sampling and training can round differently: a separate
    engine, or any engine in 16 bits; only the HF engine in float32 keeps its own log-probs."""
    from empo2.config.sections import PolicyConfig
    from empo2.train.update import compute_dtype, old_logprobs_source

    assert old_logprobs_source("auto", "hf", "float32") == "engine"
    assert old_logprobs_source("auto", "hf", "bfloat16") == "trainer"
    assert old_logprobs_source("auto", "hf", "float16") == "trainer"
    assert old_logprobs_source("auto", "vllm", "float32") == "trainer"
    assert old_logprobs_source("engine", "vllm", "bfloat16") == "engine"
    assert old_logprobs_source("trainer", "hf", "float32") == "trainer"
    assert compute_dtype(PolicyConfig(device="cpu", autocast="bfloat16")) == "bfloat16"
    assert compute_dtype(PolicyConfig(device="cpu", autocast="none")) == "float32"
    assert compute_dtype(PolicyConfig(device="cpu", autocast="none", dtype="bfloat16")) == "bfloat16"
    with pytest.raises(Exception, match=r"algo.tis_cap must be in \[1, 1000000\] \(or 0 to disable\), got 0.5"):
        _config("algo.tis_cap=0.5")


def test_the_runs_compute_is_decided_once_from_its_config():
    """``decide`` settles ``auto`` (here: float32, as the suite fixes ``EMPO2_NATIVE_BF16=0``, and the HF engine, the
    only one measured on a CPU) in a new config, leaves the one given as it was, says why, and derives every option
    from the settled values: a settled config decides the same again, with nothing left to explain."""
    import dataclasses

    from empo2.policy.prefix import ComputeOptions
    from empo2.train.compute import decide

    cfg = _config("policy.device=cpu", "policy.autocast=auto", "policy.backend=auto", "algo.old_logprobs=auto",
                  "train.logprob_chunk_tokens=256", "policy.prefix_sharing=false")
    before = cfg.to_dict()
    settled, compute = decide(cfg)
    assert cfg.to_dict() == before and cfg.policy.autocast == "auto"
    assert (settled.policy.autocast, settled.policy.backend) == (compute.autocast, compute.backend) == ("none", "hf")
    assert set(compute.why) == {"autocast", "backend"} and "EMPO2_NATIVE_BF16=0" in compute.why["autocast"]
    assert (compute.dtype, compute.old_logprobs) == ("float32", "engine")  # HF in float32 keeps its own π_old
    assert compute.options == compute.update_options == ComputeOptions(prefix_sharing=False, compute_dtype="float32",
                                                                       logprob_chunk_tokens=256)
    assert compute.engine_dtype("bfloat16") == "bfloat16"  # no autocast: an engine computes in the weights' dtype
    assert decide(settled) == (settled, dataclasses.replace(compute, why={}))
    bf16 = decide(_config("policy.device=cpu", "policy.autocast=bfloat16"))[1]
    assert (bf16.dtype, bf16.old_logprobs, bf16.options.compute_dtype, bf16.engine_dtype("float32")) == \
        ("bfloat16", "trainer", "bfloat16", "bfloat16")
