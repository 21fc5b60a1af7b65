"""EMPO²'s equations (``empo2.algo.empo2``) against float64 references written out here: the modes' probabilities and
prompts, the low-probability mask, the novelty reward and the return."""

from __future__ import annotations

import math

import numpy as np
import pytest
import torch

from empo2.algo import empo2
from empo2.config.sections import AlgoConfig
from helpers.paper_returns import combine_returns


def test_mode_probabilities_split_the_memory_rollouts():
    """p_memory is the share of memory rollouts, p_off_policy the share of all rollouts trained off-policy; the
    released defaults give SPEC's 0.75 / 0.08 / 0.17."""
    algo = AlgoConfig()
    p = empo2.mode_probabilities(algo.p_memory, algo.p_off_policy)
    assert list(p) == list(empo2.MODES)
    assert [p[m] for m in empo2.MODES] == pytest.approx([0.75, 0.08, 0.17], abs=1e-12)
    for pm, po in ((0.4, 0.0), (0.3, 0.3), (1.0, 0.5), (0.0, 0.0)):
        p = empo2.mode_probabilities(pm, po)
        assert math.fsum(p.values()) == pytest.approx(1.0, abs=1e-12)
        assert p["on_tips"] + p["off_tips"] == pytest.approx(pm, abs=1e-12)
        assert p["off_tips"] == po


def test_which_prompt_each_mode_samples_and_trains_on():
    """(samples with tips, trains with tips) per mode, as the paper's three learning modes define them."""
    table = {"on": (False, False), "on_tips": (True, True), "off_tips": (True, False)}
    for mode, (sampled, trained) in table.items():
        assert empo2.rollout_has_tips(mode) is sampled
        assert empo2.training_prompt_has_tips(mode) is trained
        assert empo2.trains_on_rollout_prompt(mode) is (sampled == trained)
        for variant in ("paper", "tip_free"):
            assert empo2.uses_tip_free_old_logp(mode, variant) is (mode == "off_tips" and variant == "tip_free")
    assert set(empo2.MEMORY_MODES) == {m for m, (sampled, _) in table.items() if sampled}
    with pytest.raises(ValueError):
        empo2.rollout_has_tips("offline")


@pytest.mark.parametrize("granularity", ["token", "sequence"])
@pytest.mark.parametrize("delta", [0.0, 0.05, 0.3])
def test_low_probability_mask_matches_a_loop(granularity, delta):
    g = torch.Generator().manual_seed(3)
    new = -5 * torch.rand(5, 7, generator=g, dtype=torch.float64)
    old = -5 * torch.rand(5, 7, generator=g, dtype=torch.float64)
    valid = torch.rand(5, 7, generator=g) > 0.25
    keep = empo2.low_probability_mask(new, old, valid, delta, granularity)
    want = np.zeros((5, 7), dtype=bool)
    for i in range(5):
        row_bad = delta > 0 and granularity == "sequence" and any(
            bool(valid[i, t]) and math.exp(float(old[i, t])) < delta for t in range(7))
        for t in range(7):
            token_low = delta > 0 and granularity == "token" and math.exp(float(new[i, t])) < delta
            want[i, t] = bool(valid[i, t]) and not row_bad and not token_low
    assert keep.numpy().tolist() == want.tolist()
    if delta > 0:
        assert keep.sum() < valid.sum()  # the mask removes something here, so a broken mask is caught


def test_novelty_reward_is_one_over_the_visits():
    visits = np.array([1, 2, 3, 4, 10], dtype=np.int64)
    r = empo2.novelty_reward(visits)
    assert r.dtype == np.float64
    assert r.tolist() == [1.0, 0.5, 1 / 3, 0.25, 0.1]


@pytest.mark.parametrize("aggregation", ["mean", "sum"])
def test_step_rewards_add_up_to_extrinsic_plus_weighted_intrinsic(aggregation):
    extrinsic, novelty, w = [0.0, 5.0, -2.5, 100.0], [1.0, 0.5, 1 / 3, 0.25], 0.8
    steps = empo2.step_rewards_with_novelty(extrinsic, novelty, w, aggregation)
    per_step = w / len(novelty) if aggregation == "mean" else w
    assert steps.dtype == np.float64
    assert steps.tolist() == pytest.approx([e + per_step * n for e, n in zip(extrinsic, novelty)], rel=1e-15)
    r_int = math.fsum(novelty) / len(novelty) if aggregation == "mean" else math.fsum(novelty)
    assert empo2.intrinsic_return(novelty, aggregation) == pytest.approx(r_int, rel=1e-12)
    want = math.fsum(extrinsic) + w * r_int
    assert math.fsum(steps) == pytest.approx(want, rel=1e-12)
    assert combine_returns([math.fsum(extrinsic)], [r_int], w).tolist() == pytest.approx([want], rel=1e-12)
    assert empo2.step_rewards_with_novelty([], [], w, aggregation).shape == (0,)
    assert empo2.intrinsic_return([], aggregation) == 0.0
    with pytest.raises(ValueError):
        empo2.step_rewards_with_novelty([1.0], [], w, aggregation)
