"""Policy loss: float64 references written out independently, property tests, numerics and the registry."""

from __future__ import annotations

import math

import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from empo2.algo.empo2 import MODES, behaviour_logp_for_ratio, training_prompt_has_tips
from empo2.algo.losses import POLICY_LOSSES, get_policy_loss, policy_loss
from empo2.config import Config, ConfigError
from empo2.config.sections import AlgoConfig

# ---------------------------------------------------------------------------------------------------- reference


def reference(new, old, adv, mask, ref=None, *, lo=0.2, hi=0.3, c=10.0, delta=0.01, gran="token", beta=0.0,
              agg="token_mean", rows=None, kl_rows=None):
    """Loop-by-loop float64 loss and d loss / d new (analytic), straight from the paper's loss, with dual clip and
    k3 KL."""
    B, T = new.shape
    A = adv if adv.ndim == 2 else np.repeat(adv[:, None], T, axis=1)
    rows = range(B) if rows is None else rows
    keep = np.zeros((B, T), dtype=bool)
    for i in range(B):
        row_bad = delta > 0 and gran == "sequence" and any(mask[i, t] and math.exp(old[i, t]) < delta for t in range(T))
        for t in range(T):
            if not mask[i, t] or row_bad:
                continue
            keep[i, t] = not (delta > 0 and gran == "token" and math.exp(new[i, t]) < delta)
    loss_tok = np.zeros((B, T))
    grad_tok = np.zeros((B, T))
    for i in rows:
        for t in range(T):
            if keep[i, t]:
                r, a = math.exp(new[i, t] - old[i, t]), A[i, t]
                unclipped, clipped = r * a, min(max(r, 1 - lo), 1 + hi) * a
                o, g = (unclipped, r * a) if unclipped <= clipped else (clipped, 0.0)
                if c > 0 and a < 0 and c * a > o:
                    o, g = c * a, 0.0
                loss_tok[i, t], grad_tok[i, t] = -o, -g
            if mask[i, t] and ref is not None and beta > 0 and (kl_rows is None or i in kl_rows):
                d = ref[i, t] - new[i, t]
                loss_tok[i, t] += beta * (math.exp(d) - d - 1)
                grad_tok[i, t] += beta * (1 - math.exp(d))
    if agg == "token_mean":
        n = sum(mask[i].sum() for i in rows)
        return sum(loss_tok[i].sum() for i in rows) / n, grad_tok / n, keep
    live = [i for i in rows if mask[i].sum() > 0]
    scale = np.zeros((B, 1))
    for i in live:
        scale[i] = 1.0 / (mask[i].sum() * len(live))
    return sum(loss_tok[i].sum() * scale[i, 0] for i in live), grad_tok * scale, keep


def random_batch(seed, B=6, T=9, adv_2d=False):
    rng = np.random.default_rng(seed)
    new = -rng.exponential(2.0, size=(B, T))  # many tokens below log 0.01 ≈ -4.6, many above
    old = new + rng.uniform(-1.5, 1.5, size=(B, T))  # ratios in [0.22, 4.5]: far outside the clip range
    adv = rng.normal(size=(B, T) if adv_2d else (B,)) * 2  # negative and positive
    mask = rng.random((B, T)) < 0.8
    mask[0] = False  # an empty row
    mask[1, :] = True
    ref = new + rng.normal(scale=0.5, size=(B, T))
    return new, old, adv, mask, ref


def loss_of(new, old, adv, mask, *, logp_ref=None, modes=None, loss=policy_loss, **knobs):
    """A registered loss called as the update calls it: the knobs travel in an ``algo`` section."""
    return loss(new, old, adv, mask, AlgoConfig(**knobs), logp_ref=logp_ref, modes=modes)


def run(new, old, adv, mask, ref=None, **kw):
    t_new = torch.tensor(new, dtype=torch.float64, requires_grad=True)
    t_ref = None if ref is None else torch.tensor(ref)
    loss, metrics = loss_of(t_new, torch.tensor(old), torch.tensor(adv), torch.tensor(mask), logp_ref=t_ref, **kw)
    loss.backward()
    return loss.item(), t_new.grad.numpy(), metrics


# ---------------------------------------------------------------------------------------------------- references

CASES = [
    dict(),  # defaults: token mask δ=0.01, dual clip 10, token-mean
    dict(low_prob_threshold=0.0),
    dict(low_prob_threshold=0.05, dual_clip=0.0),
    dict(low_prob_threshold=0.01, mask_granularity="sequence"),
    dict(loss_type="sequence_mean"),
    dict(beta=0.1),
    dict(beta=0.04, loss_type="sequence_mean", epsilon=0.1, epsilon_high=0.5, dual_clip=3.0),
]


@pytest.mark.parametrize("seed", [0, 1, 2, 3])
@pytest.mark.parametrize("case", range(len(CASES)))
@pytest.mark.parametrize("adv_2d", [False, True])
def test_loss_and_grad_match_float64_reference(seed, case, adv_2d):
    kw = CASES[case]
    new, old, adv, mask, ref = random_batch(seed, adv_2d=adv_2d)
    loss, grad, metrics = run(new, old, adv, mask, ref, **kw)
    rkw = dict(lo=kw.get("epsilon", 0.2), hi=kw.get("epsilon_high", 0.3), c=kw.get("dual_clip", 10.0),
               delta=kw.get("low_prob_threshold", 0.01), gran=kw.get("mask_granularity", "token"),
               beta=kw.get("beta", 0.0), agg=kw.get("loss_type", "token_mean"))
    ref_loss, ref_grad, keep = reference(new, old, adv, mask, ref, **rkw)
    assert loss == pytest.approx(ref_loss, rel=1e-10, abs=1e-12)
    np.testing.assert_allclose(grad, ref_grad, rtol=1e-10, atol=1e-12)
    # metrics against the reference's mask and ratios
    ratio = np.exp(new - old)
    assert metrics["masked_frac"] == pytest.approx(1 - keep.sum() / mask.sum())
    assert metrics["ratio_mean"] == pytest.approx(ratio[keep].mean())
    assert metrics["ratio_max"] == pytest.approx(ratio[keep].max())
    assert metrics["kl_ref"] == pytest.approx(np.mean((np.exp(ref - new) - (ref - new) - 1)[mask]))
    assert metrics["approx_kl"] == pytest.approx(np.mean((ratio - 1 - np.log(ratio))[keep]))
    A = adv if adv.ndim == 2 else np.repeat(adv[:, None], new.shape[1], 1)
    hi, lo = rkw["hi"], rkw["lo"]
    clipped = ((ratio > 1 + hi) & (A > 0)) | ((ratio < 1 - lo) & (A < 0))
    assert metrics["clip_frac"] == pytest.approx(clipped[keep].mean())
    assert metrics["skipped"] == 0.0


@pytest.mark.parametrize("agg", ["token_mean", "sequence_mean"])
def test_kl_term_leaves_off_tips_rows_out(agg):
    """``off_tips`` tokens were sampled with tips: k3 over them is no estimate of the tip-free KL, so only the other
    rows carry the β term; their policy-gradient terms are unchanged."""
    new, old, adv, mask, ref = random_batch(5)
    modes = ["on", "off_tips", "on_tips", "off_tips", "on", "on"]
    want, want_grad, _ = reference(new, old, adv, mask, ref, beta=0.3, agg=agg, kl_rows={0, 2, 4, 5})
    got, grad, _ = run(new, old, adv, mask, ref, beta=0.3, loss_type=agg, modes=modes)
    assert got == pytest.approx(want, rel=1e-10, abs=1e-12)
    np.testing.assert_allclose(grad, want_grad, rtol=1e-9, atol=1e-12)
    every_row, _, _ = reference(new, old, adv, mask, ref, beta=0.3, agg=agg)
    assert abs(every_row - want) > 1e-3  # the rows left out carry a KL term the test can see


def test_metrics_cover_a_real_mix_of_cases():
    """The random batches really exercise clipping, masking, dual clip and negative advantages."""
    new, old, adv, mask, ref = random_batch(0)
    _, _, m = run(new, old, adv, mask, ref)
    assert 0.1 < m["masked_frac"] < 0.9 and m["clip_frac"] > 0.1 and m["ratio_max"] > 1.3
    assert (adv < 0).any() and (adv > 0).any()
    _, _, m = run(new, old, adv, mask, ref, dual_clip=1.5, low_prob_threshold=0.0)
    assert m["dual_clip_frac"] > 0


def test_float32_matches_float64():
    new, old, adv, mask, ref = random_batch(5)
    l64, g64, _ = run(new, old, adv, mask, ref, beta=0.1)
    t_new = torch.tensor(new, dtype=torch.float32, requires_grad=True)
    loss, _ = loss_of(t_new, torch.tensor(old).float(), torch.tensor(adv).float(), torch.tensor(mask),
                          logp_ref=torch.tensor(ref).float(), beta=0.1)
    loss.backward()
    assert loss.dtype == torch.float32
    assert loss.item() == pytest.approx(l64, rel=1e-5)
    np.testing.assert_allclose(t_new.grad.numpy(), g64, rtol=1e-4, atol=1e-7)


def test_dual_clip_worked_example():
    # A = -1, ρ = e^3 ≈ 20: unclipped objective -20, dual-clip floor c·A = -10 -> loss 10 with zero gradient
    new = torch.tensor([[0.0]], dtype=torch.float64, requires_grad=True)
    loss, m = loss_of(new, torch.tensor([[-3.0]], dtype=torch.float64), torch.tensor([-1.0], dtype=torch.float64),
                          torch.tensor([[True]]), low_prob_threshold=0.0)
    loss.backward()
    assert loss.item() == pytest.approx(10.0) and new.grad.item() == 0.0 and m["dual_clip_frac"] == 1.0
    loss, _ = loss_of(new.detach(), torch.tensor([[-3.0]], dtype=torch.float64),
                          torch.tensor([-1.0], dtype=torch.float64), torch.tensor([[True]]),
                          low_prob_threshold=0.0, dual_clip=0.0)
    assert loss.item() == pytest.approx(math.exp(3.0))


def test_per_mode_losses():
    new, old, adv, mask, ref = random_batch(7)
    modes = ["on", "on", "off_tips", "on", "off_tips", "off_tips"]
    for agg in ("token_mean", "sequence_mean"):
        _, _, m = run(new, old, adv, mask, ref, modes=modes, loss_type=agg)
        for mode in ("on", "off_tips"):
            rows = [i for i, x in enumerate(modes) if x == mode]
            assert m[f"loss_{mode}"] == pytest.approx(reference(new, old, adv, mask, agg=agg, rows=rows)[0])
        assert "loss_on_tips" not in m


# ---------------------------------------------------------------------------------------------------- properties

batches = st.tuples(st.integers(1, 5), st.integers(1, 8), st.integers(0, 2**31 - 1))


def _tensors(b, t, seed):
    g = torch.Generator().manual_seed(seed)
    logp = -torch.rand(b, t, generator=g, dtype=torch.float64) * 6  # [B, T]
    adv = torch.randn(b, generator=g, dtype=torch.float64)  # [B]
    mask = torch.rand(b, t, generator=g) < 0.7
    mask[0, 0] = True
    return g, logp, adv, mask


@settings(max_examples=60, deadline=None)
@given(batches)
def test_ratio_one_gives_minus_mean_advantage(bt):
    b, t, seed = bt
    _, logp, adv, mask = _tensors(b, t, seed)
    loss, m = loss_of(logp, logp.clone(), adv, mask, low_prob_threshold=0.0)
    expected = -(adv[:, None] * mask).sum() / mask.sum()
    assert loss.item() == pytest.approx(expected.item(), abs=1e-12)
    assert m["clip_frac"] == 0.0 and m["ratio_mean"] == 1.0 and m["approx_kl"] == 0.0


@settings(max_examples=60, deadline=None)
@given(batches, st.sampled_from(["token", "sequence"]), st.sampled_from(["token_mean", "sequence_mean"]),
       st.sampled_from([0.0, 0.01, 0.1]))
def test_clip_frac_zero_when_ratio_is_one(bt, gran, agg, delta):
    b, t, seed = bt
    _, logp, adv, mask = _tensors(b, t, seed)
    _, m = loss_of(logp, logp.clone(), adv, mask, low_prob_threshold=delta, mask_granularity=gran, loss_type=agg)
    assert m["clip_frac"] == 0.0 and m["dual_clip_frac"] == 0.0


@settings(max_examples=60, deadline=None)
@given(batches, st.sampled_from(["token", "sequence"]), st.sampled_from(["token_mean", "sequence_mean"]),
       st.sampled_from([float("nan"), float("inf"), -float("inf"), 1e30]))
def test_masked_tokens_get_exactly_zero_gradient(bt, gran, agg, junk):
    b, t, seed = bt
    g, logp, adv, mask = _tensors(b, t, seed)
    old = logp + torch.randn(b, t, generator=g, dtype=torch.float64)
    new = torch.where(mask, logp, junk).requires_grad_(True)  # padding holds junk: it must never leak
    old = torch.where(mask, old, junk)
    ref = torch.where(mask, logp + 0.3, junk)
    loss, m = loss_of(new, old, adv, mask, logp_ref=ref, beta=0.1, low_prob_threshold=0.05, mask_granularity=gran,
                          loss_type=agg)
    loss.backward()
    assert torch.isfinite(loss) and m["skipped"] == 0.0
    assert torch.all(new.grad[~mask] == 0)
    # low-probability-masked tokens: zero gradient from the surrogate (β = 0 so nothing else touches them)
    new2 = torch.where(mask, logp, junk).requires_grad_(True)
    loss2, m2 = loss_of(new2, old, adv, mask, low_prob_threshold=0.05, mask_granularity=gran, loss_type=agg)
    loss2.backward()
    lowp = mask & (logp < math.log(0.05)) if gran == "token" else mask & (
        (mask & (old < math.log(0.05))).any(1, keepdim=True))
    assert torch.all(new2.grad[lowp] == 0) and torch.all(new2.grad[~mask] == 0)
    assert m2["masked_frac"] == pytest.approx(lowp.sum().item() / mask.sum().item())


@settings(max_examples=60, deadline=None)
@given(st.floats(-3, -0.01), st.floats(-3, -0.01), st.floats(-3, -0.01), st.floats(0.1, 3))
def test_off_policy_ratio_numerator_tip_free_denominator_tips(new_tip_free, old_tips, old_tip_free, a):
    """For an off_tips row the gradient is -A·ρ (unclipped): recover ρ and check which log-probs made it."""
    new = torch.tensor([[new_tip_free]], dtype=torch.float64, requires_grad=True)
    adv = torch.tensor([a], dtype=torch.float64)
    with_tips = torch.tensor([[old_tips]], dtype=torch.float64)
    tip_free = torch.tensor([[old_tip_free]], dtype=torch.float64)
    for variant, denom in (("paper", old_tips), ("tip_free", old_tip_free)):
        new.grad = None
        old = behaviour_logp_for_ratio("off_tips", with_tips, tip_free, variant)
        loss, m = loss_of(new, old, adv, torch.tensor([[True]]), modes=["off_tips"], low_prob_threshold=0.0,
                              epsilon=0.999, epsilon_high=1e9)  # effectively unclipped
        loss.backward()
        rho = math.exp(new_tip_free - denom)
        assert m["ratio_mean"] == pytest.approx(rho, rel=1e-9)
        assert new.grad.item() == pytest.approx(-a * rho, rel=1e-9)
        assert m["loss_off_tips"] == pytest.approx(-a * rho, rel=1e-9)
    for mode in ("on", "on_tips"):  # rollout prompt == training prompt: always the recorded behaviour log-probs
        assert behaviour_logp_for_ratio(mode, with_tips, tip_free, "tip_free") is with_tips


def test_training_prompt_and_variant_checks():
    assert [training_prompt_has_tips(m) for m in MODES] == [False, True, False]
    x = torch.zeros(1, 1)
    with pytest.raises(ValueError):
        behaviour_logp_for_ratio("off_tips", x, None, "tip_free")
    with pytest.raises(ValueError):
        behaviour_logp_for_ratio("offline", x, x)


# -------------------------------------------------------------------------------------------- numerics, registry


def test_non_finite_valid_value_skips_with_zero_gradient():
    new, old, adv, mask, _ = random_batch(3)
    new[1, 2] = np.nan  # row 1 is fully valid
    t_new = torch.tensor(new, requires_grad=True)
    loss, m = loss_of(t_new, torch.tensor(old), torch.tensor(adv), torch.tensor(mask), low_prob_threshold=0.0)
    loss.backward()
    assert m["skipped"] == 1.0 and loss.item() == 0.0 and loss.requires_grad
    assert torch.all(t_new.grad == 0)
    adv[2] = np.inf
    loss, m = loss_of(torch.tensor(old), torch.tensor(old), torch.tensor(adv), torch.tensor(mask))
    assert m["skipped"] == 1.0 and loss.item() == 0.0


def test_extreme_ratio_stays_finite():
    new = torch.tensor([[0.0, -1.0]], dtype=torch.float32, requires_grad=True)
    loss, m = loss_of(new, torch.tensor([[-200.0, -1.0]]), torch.tensor([-1.0]), torch.ones(1, 2, dtype=torch.bool),
                          low_prob_threshold=0.0, dual_clip=0.0)
    loss.backward()
    assert torch.isfinite(loss) and m["skipped"] == 0.0 and torch.isfinite(new.grad).all()


def test_registry():
    assert set(POLICY_LOSSES) >= {"grpo", "empo2"}
    assert get_policy_loss("empo2") is policy_loss
    new, old, adv, mask, _ = random_batch(4)
    args = (torch.tensor(new), torch.tensor(old), torch.tensor(adv), torch.tensor(mask))
    grpo, mg = loss_of(*args, loss=get_policy_loss("grpo"), low_prob_threshold=0.3)
    plain, _ = loss_of(*args, low_prob_threshold=0.0)
    masked, _ = loss_of(*args, low_prob_threshold=0.3)
    assert grpo.item() == plain.item() != masked.item() and mg["masked_frac"] == 0.0
    with pytest.raises(ValueError):
        get_policy_loss("ppo")


def test_argument_checks():
    x = torch.zeros(2, 3)
    m = torch.ones(2, 3, dtype=torch.bool)
    with pytest.raises(ValueError):
        loss_of(x, x, torch.zeros(3), m)
    with pytest.raises(ValueError):
        loss_of(x, x[:, :2], torch.zeros(2), m)
    with pytest.raises(ValueError):
        loss_of(x, x, torch.zeros(2), m, modes=["on"])
    with pytest.raises(ValueError):
        loss_of(x, x, torch.zeros(2), m, modes=["on", "bogus"])
    # the knobs are checked once, when the config loads
    with pytest.raises(ConfigError, match=r"algo.dual_clip must be in \(1, 1000000\] \(or 0 to disable\), got 0.5"):
        Config.load(None, ["algo.dual_clip=0.5"])
    with pytest.raises(ConfigError, match="algo.loss_type must be one of token_mean, sequence_mean, dr_grpo, got 'sum'"):
        Config.load(None, ["algo.loss_type=sum"])


def test_each_loss_reads_its_knobs_from_the_algo_section():
    """A registered loss takes the ``algo`` section and reads every knob there; ``grpo`` takes δ as 0 without
    touching the run's section."""
    new, old, adv, mask, ref = random_batch(6)
    section = AlgoConfig(epsilon=0.1, epsilon_high=0.5, dual_clip=3.0, low_prob_threshold=0.05,
                         mask_granularity="sequence", beta=0.04, loss_type="sequence_mean")
    t_new = torch.tensor(new, requires_grad=True)
    loss, _ = policy_loss(t_new, torch.tensor(old), torch.tensor(adv), torch.tensor(mask), section,
                          logp_ref=torch.tensor(ref))
    want, _, _ = reference(new, old, adv, mask, ref, lo=0.1, hi=0.5, c=3.0, delta=0.05, gran="sequence", beta=0.04,
                           agg="sequence_mean")
    assert loss.item() == pytest.approx(want, rel=1e-10)
    grpo, _ = get_policy_loss("grpo")(t_new, torch.tensor(old), torch.tensor(adv), torch.tensor(mask), section,
                                      logp_ref=torch.tensor(ref))
    want, _, _ = reference(new, old, adv, mask, ref, lo=0.1, hi=0.5, c=3.0, delta=0.0, beta=0.04, agg="sequence_mean")
    assert grpo.item() == pytest.approx(want, rel=1e-10) and section.low_prob_threshold == 0.05
