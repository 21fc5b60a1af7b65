"""GRPO advantages, return combination and the intrinsic-weight schedule against independent references."""

from __future__ import annotations

import statistics

import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from empo2.algo.advantages import (
    ADVANTAGE_ESTIMATORS,
    AdvantageInput,
    compute_advantages,
    register_advantage,
)
from empo2.algo.empo2 import intrinsic_weight
from empo2.config import AlgoConfig, algo_config
from helpers.paper_returns import combine_returns


def grpo(returns, groups, scale_rewards=True, eps=1e-6, lengths=None):
    """GRPO through the step-level contract; checks that every step carries its episode's value, returns [N]."""
    algo = algo_config(scale_rewards=scale_rewards, adv_eps=eps)
    steps, metrics = compute_advantages("grpo", AdvantageInput.from_returns(returns, groups, algo, lengths))
    for a in steps:
        assert a.dtype == np.float64 and np.all(a == a[0])
    return np.array([a[0] for a in steps]), metrics


def reference_grpo(returns, groups, scale=True, eps=1e-6):
    """Per-group loops with the statistics module (sample std, ddof = 1, as torch.std, TRL, verl and the released
    code); a group of one or of equal returns gets 0."""
    out = [0.0] * len(returns)
    for g in set(groups):
        idx = [i for i, x in enumerate(groups) if x == g]
        vals = [float(returns[i]) for i in idx]
        if len(set(vals)) == 1:
            continue
        mu, sd = statistics.fmean(vals), statistics.stdev(vals)
        for i in idx:
            out[i] = (returns[i] - mu) / (sd + eps) if scale else returns[i] - mu
    return np.array(out)


@pytest.mark.parametrize("seed", range(5))
@pytest.mark.parametrize("scale", [True, False])
def test_grpo_matches_reference(seed, scale):
    rng = np.random.default_rng(seed)
    groups = rng.permutation(np.repeat(np.arange(6), 8))  # non-contiguous groups of 8
    returns = rng.normal(size=48) * 50 - 20
    returns[groups == 2] = 7.3  # one group with equal returns
    lengths = rng.integers(1, 6, size=48)  # every step of an episode gets the episode's advantage
    adv, m = grpo(returns, groups, scale, 1e-6, lengths)
    assert adv.shape == (48,)
    np.testing.assert_allclose(adv, reference_grpo(returns, groups.tolist(), scale), rtol=1e-12, atol=1e-12)
    assert m["groups"] == 6 and m["zero_adv_groups"] == 1


def test_sample_std_convention_is_torch_std():
    adv, _ = grpo([0.0, 1.0], [0, 0], eps=0.0)
    assert adv.tolist() == pytest.approx([-0.5 ** 0.5, 0.5 ** 0.5], rel=1e-15)  # std (ddof 1) = 0.7071, not 0.5
    values = torch.tensor([3.0, -1.0, 0.5, 8.0, 2.25], dtype=torch.float64)
    adv, _ = grpo(values, [0] * 5)
    np.testing.assert_allclose(adv, ((values - values.mean()) / (values.std() + 1e-6)).numpy(), rtol=1e-13)
    adv, _ = grpo(torch.tensor([0.0, 1.0, 2.0]), torch.tensor([3, 3, 3]), scale_rewards=False)
    assert adv.tolist() == [-1.0, 0.0, 1.0]


def test_singletons_and_equal_groups_give_exact_zero():
    returns = [0.1, 0.1, 0.1, 5.0, -100.0, 1.0, 2.0]
    groups = [0, 0, 0, 1, 2, 3, 3]
    adv, m = grpo(returns, groups)
    assert adv[:5].tolist() == [0.0] * 5  # exactly 0, even though mean(0.1, 0.1, 0.1) != 0.1 in floating point
    assert adv[5] < 0 < adv[6]
    assert m["groups"] == 4 and m["zero_adv_groups"] == 3 and m["singleton_groups"] == 2


@settings(max_examples=200, deadline=None)
@given(st.lists(st.tuples(st.integers(0, 4), st.floats(-100, 100)), min_size=1, max_size=30),
       st.floats(0.1, 10), st.floats(-50, 50))
def test_properties(rows, scale, shift):
    groups = np.array([g for g, _ in rows])
    returns = np.array([r for _, r in rows])
    adv, _ = grpo(returns, groups, eps=0.0)
    adv2, _ = grpo(returns * scale + shift, groups, eps=0.0)
    assert np.all(np.isfinite(adv)) and np.all(np.isfinite(adv2))
    for g in set(groups.tolist()):
        in_group = groups == g
        a = adv[in_group]
        assert abs(a.sum()) < 1e-3  # centred per group
        if np.ptp(returns[in_group]) > 1e-6:
            assert np.sum(a**2) / (a.size - 1) == pytest.approx(1.0, rel=1e-4)  # unit sample variance
            # invariant to affine rescaling (only where the spread is far above the equality tolerance)
            np.testing.assert_allclose(adv[in_group], adv2[in_group], atol=5e-3)


@pytest.mark.parametrize("returns", [(0.0, 2.04e-209), (0.0, 9.3e-20), (1.0, 1.0 + 9.3e-20), (5.0, 5.0 + 1e-12)])
def test_returns_equal_up_to_tolerance_give_exact_zero(returns):
    """Regression: Hypothesis once drew (0, 2.04e-209) -> [-inf, inf] and (0, 9.3e-20) -> [-1, 1] (while the same
    returns shifted by 1 gave [0, 0])."""
    for eps in (0.0, 1e-6):
        adv, m = grpo(list(returns), [0, 0], eps=eps)
        assert adv.tolist() == [0.0, 0.0] and m["zero_adv_groups"] == 1


@pytest.mark.parametrize("returns", [(-1e300, 1e300), (0.0, 1e-7), (1e-300, 1.0)])
def test_extreme_but_distinct_returns_stay_finite(returns):
    adv, _ = grpo(list(returns), [0, 0], eps=0.0)
    assert adv.tolist() == pytest.approx([-0.5 ** 0.5, 0.5 ** 0.5], rel=1e-6)


def test_registry_and_errors():
    algo = algo_config()
    assert {"grpo", "gigpo"} <= set(ADVANTAGE_ESTIMATORS)
    with pytest.raises(ValueError, match="unknown advantage estimator"):
        compute_advantages("not-an-estimator", AdvantageInput.from_returns([1.0], [0], algo))
    with pytest.raises(ValueError):
        compute_advantages("grpo", AdvantageInput.from_returns([1.0, 2.0], [0], algo))
    with pytest.raises(ValueError):
        compute_advantages("grpo", AdvantageInput.from_returns([1.0, float("nan")], [0, 0], algo))
    bad_keys = AdvantageInput.from_returns([1.0, 2.0], [0, 0], algo, [2, 1])
    bad_keys.state_keys[0] = ["only one"]
    with pytest.raises(ValueError, match="one state key per step"):
        compute_advantages("grpo", bad_keys)
    with pytest.raises(ValueError):
        register_advantage("grpo")(lambda inp: None)

    @register_advantage("test_zero")
    def zero(inp):
        return [np.zeros(len(r)) for r in inp.step_rewards], {"groups": 0.0, "zero_adv_groups": 0.0}

    try:
        adv, _ = compute_advantages("test_zero", AdvantageInput.from_returns([1.0, 2.0], [0, 0], algo, [3, 0]))
        assert [a.tolist() for a in adv] == [[0.0, 0.0, 0.0], []]
    finally:
        del ADVANTAGE_ESTIMATORS["test_zero"]


def test_combine_returns():
    out = combine_returns(np.array([100.0, -100.0, 0.0]), torch.tensor([1.5, 0.0, 3.0]), 0.5)
    assert out.tolist() == [100.75, -100.0, 1.5]
    assert combine_returns([1.0], [9.0], 0.0).tolist() == [1.0]
    with pytest.raises(ValueError):
        combine_returns([1.0, 2.0], [1.0], 1.0)


def test_intrinsic_weight_schedules():
    assert intrinsic_weight(AlgoConfig(intrinsic_weight=0.4), 3, 10) == 0.4
    assert intrinsic_weight(AlgoConfig(), 0, 10) == 0.0
    linear = AlgoConfig(intrinsic_schedule="linear", intrinsic_weight_start=0.8, intrinsic_weight_end=0.2)
    ws = [intrinsic_weight(linear, i, 7) for i in range(9)]
    assert ws[0] == pytest.approx(0.8) and ws[3] == pytest.approx(0.5) and ws[6] == pytest.approx(0.2)
    assert ws[7] == ws[8] == pytest.approx(0.2)  # stays at the end value
    assert all(a > b for a, b in zip(ws[:6], ws[1:7]))
    assert intrinsic_weight(AlgoConfig(intrinsic_schedule="linear"), 0, 1) == pytest.approx(0.8)
    with pytest.raises(ValueError):
        intrinsic_weight(AlgoConfig(intrinsic_schedule="cosine"), 0, 10)


def test_linear_schedule_keeps_its_horizon_when_a_resume_extends_the_run():
    """The horizon recorded at the run's start (``algo.intrinsic_schedule_iterations``) fixes every weight: a resume
    that raises ``train.iterations`` from 7 to 20 leaves the first 7 weights as planned and the rest at the end."""
    linear = dict(intrinsic_schedule="linear", intrinsic_weight_start=0.8, intrinsic_weight_end=0.2)
    planned = [intrinsic_weight(AlgoConfig(**linear), i, 7) for i in range(7)]
    recorded = AlgoConfig(**linear, intrinsic_schedule_iterations=7)
    assert [intrinsic_weight(recorded, i, 20) for i in range(7)] == planned
    assert [intrinsic_weight(recorded, i, 20) for i in range(7, 20)] == [pytest.approx(0.2)] * 13
    assert intrinsic_weight(recorded, 3, 20) == pytest.approx(0.5)
