"""GiGPO advantages against a float64 reference written from the paper's equations with plain loops, and properties."""

from __future__ import annotations

import math

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from empo2.algo.advantages import AdvantageInput, AdvantageOptions, compute_advantages
from empo2.algo.gigpo import anchor_groups, discounted_step_returns


def _normalise(values, scale, eps):
    """(x − mean) / (pstd + eps) over a list; a group of one or of equal values → zeros."""
    if len(values) < 2 or max(values) == min(values):
        return [0.0] * len(values)
    mu = sum(values) / len(values)
    sd = math.sqrt(sum((v - mu) ** 2 for v in values) / len(values))
    return [(v - mu) / (sd + eps) if scale else v - mu for v in values]


def reference_gigpo(returns, groups, rewards, keys, gamma, omega, scale=True, eps=1e-6):
    """A(a_t^i) = A^E(τ_i) + ω·A^S(a_t^i) (Feng et al. 2025): A^E normalises R(τ) over the episode group; A^S
    normalises R_t = Σ_{k≥t} γ^{k−t} r_k over the steps of that group taken in the same state."""
    n = len(returns)
    a_ep = [0.0] * n
    for g in set(groups):
        members = [i for i in range(n) if groups[i] == g]
        for i, a in zip(members, _normalise([returns[i] for i in members], scale, eps)):
            a_ep[i] = a
    step_ret = [[sum(gamma ** (k - t) * rewards[i][k] for k in range(t, len(rewards[i])))
                 for t in range(len(rewards[i]))] for i in range(n)]
    a_step = [[0.0] * len(rewards[i]) for i in range(n)]
    anchors = {(groups[i], keys[i][t]) for i in range(n) for t in range(len(keys[i]))}
    for g, key in anchors:
        where = [(i, t) for i in range(n) for t in range(len(keys[i])) if groups[i] == g and keys[i][t] == key]
        for (i, t), a in zip(where, _normalise([step_ret[i][t] for i, t in where], scale, eps)):
            a_step[i][t] = a
    return [[a_ep[i] + omega * a for a in a_step[i]] for i in range(n)]


def _random_batch(rng, n_groups=3, group_size=4, n_states=3):
    groups, rewards, keys = [], [], []
    for g in range(n_groups):
        for _ in range(group_size):
            length = int(rng.integers(0, 6))
            groups.append(g)
            rewards.append(rng.choice([0.0, 0.0, 1.0, -1.0, 0.5], size=length) * float(rng.normal(3, 1)))
            # few distinct states so that anchor groups form; the first state is shared within a task group
            keys.append([f"task{g}#0\nstart"] + [f"task{g}#0\nroom {rng.integers(n_states)}" for _ in range(length - 1)]
                        if length else [])
    returns = np.array([r.sum() for r in rewards])
    return returns, np.array(groups), rewards, keys


def _run(returns, groups, rewards, keys, **options):
    return compute_advantages("gigpo", AdvantageInput(returns, groups, rewards, keys, AdvantageOptions(**options)))


@pytest.mark.parametrize("seed", range(6))
@pytest.mark.parametrize("scale", [True, False])
def test_gigpo_matches_reference(seed, scale):
    rng = np.random.default_rng(seed)
    returns, groups, rewards, keys = _random_batch(rng)
    gamma, omega = [0.95, 0.5, 1.0][seed % 3], [1.0, 0.3][seed % 2]
    adv, m = _run(returns, groups, rewards, keys, gamma=gamma, step_advantage_weight=omega, scale_rewards=scale)
    ref = reference_gigpo(returns.tolist(), groups.tolist(), [r.tolist() for r in rewards], keys, gamma, omega, scale)
    assert [len(a) for a in adv] == [len(r) for r in rewards]
    for a, r in zip(adv, ref):
        assert a.dtype == np.float64
        np.testing.assert_allclose(a, r, rtol=1e-10, atol=1e-10)
    assert m["groups"] == 3 and m["step_groups"] >= 3


def test_discounted_returns_and_worked_example():
    np.testing.assert_allclose(discounted_step_returns(np.array([0.0, 0.0, 1.0]), 0.5), [0.25, 0.5, 1.0])
    # two episodes from one start state: A^E = ±1 (pstd), anchor "s" holds R_0 = 0.95·1 and 0 → ±1 as well
    adv, _ = _run(np.array([1.0, 0.0]), np.array([0, 0]), [np.array([0.0, 1.0]), np.array([0.0, 0.0])],
                  [["s", "x"], ["s", "y"]], eps=0.0)
    assert adv[0].tolist() == [2.0, 1.0] and adv[1].tolist() == [-2.0, -1.0]


def test_identical_trajectories_give_zero_everywhere():
    rewards = [np.array([0.0, 0.5, 1.0])] * 4
    keys = [["a", "b", "c"]] * 4
    adv, m = _run(np.array([1.5] * 4), np.zeros(4, dtype=int), rewards, keys)
    assert all(a.tolist() == [0.0, 0.0, 0.0] for a in adv)
    assert m["zero_adv_groups"] == 1


def test_anchor_groups_of_one_leave_the_episode_advantage():
    rng = np.random.default_rng(7)
    returns, groups, rewards, keys = _random_batch(rng)
    unique = [[f"ep{i} step{t}" for t in range(len(k))] for i, k in enumerate(keys)]
    gigpo, m = _run(returns, groups, rewards, unique)
    grpo, _ = compute_advantages("grpo", AdvantageInput(returns, groups, rewards, unique))
    for a, b in zip(gigpo, grpo):
        assert a.tolist() == b.tolist()
    assert m["step_groups"] == m["step_singleton_groups"] == sum(map(len, keys))


def test_step_weight_zero_is_grpo():
    returns, groups, rewards, keys = _random_batch(np.random.default_rng(3))
    gigpo, _ = _run(returns, groups, rewards, keys, step_advantage_weight=0.0)
    grpo, _ = compute_advantages("grpo", AdvantageInput(returns, groups, rewards, keys))
    for a, b in zip(gigpo, grpo):
        np.testing.assert_array_equal(a, b)


@settings(max_examples=50, deadline=None)
@given(st.integers(0, 10_000), st.randoms(use_true_random=False))
def test_permuting_episodes_permutes_the_output(seed, rnd):
    returns, groups, rewards, keys = _random_batch(np.random.default_rng(seed))
    adv, _ = _run(returns, groups, rewards, keys)
    order = list(range(len(returns)))
    rnd.shuffle(order)
    perm, _ = _run(returns[order], groups[order], [rewards[i] for i in order], [keys[i] for i in order])
    for k, i in enumerate(order):
        np.testing.assert_allclose(perm[k], adv[i], rtol=1e-12, atol=1e-12)


def test_anchor_groups_stay_inside_episode_groups_and_similarity_merges():
    groups = np.array([0, 0, 1])
    keys = [["kitchen", "hall"], ["kitchen"], ["kitchen"]]
    exact = anchor_groups(groups, keys)
    assert exact[0][0] == exact[1][0] != exact[2][0] and exact[0][1] != exact[0][0]
    near = anchor_groups(np.array([0, 0]), [["You are in the kitchen."], ["You are in the kitchen!"]], similarity=0.9)
    assert near[0][0] == near[1][0]
    far = anchor_groups(np.array([0, 0]), [["You are in the kitchen."], ["A hallway."]], similarity=0.9)
    assert far[0][0] != far[1][0]


@pytest.mark.parametrize("aggregation", ["mean", "sum"])
def test_input_from_episodes_step_rewards_add_up_to_the_return(aggregation):
    """The trainer's conversion: step rewards (with the weighted novelty reward) sum to the episode's return, and
    state keys are namespaced by task and variation (the same observation in two variations is two anchors)."""
    from empo2.algo.advantages import combine_returns
    from empo2.train.rollout import Episode, Step

    def step(obs, reward, intrinsic):
        return Step([1], [1], [2], [-0.5], "a", "a", "next", reward, obs, intrinsic=intrinsic)

    eps = [Episode("t", 0, 0, "on", steps=[step("hall", 0.0, 1.0), step("room", 5.0, 0.5)]),
           Episode("t", 1, 0, "on", steps=[step("hall", 1.0, 0.25)])]
    w = 0.4
    intrinsic = [ep.intrinsic_return(aggregation) for ep in eps]
    returns = combine_returns([ep.extrinsic_return for ep in eps], intrinsic, w)
    inp = AdvantageInput.from_episodes(eps, returns, w, AdvantageOptions(), aggregation)
    for r, R in zip(inp.step_rewards, returns):
        assert r.sum() == pytest.approx(R, rel=1e-12)
    assert inp.state_keys == [["t#0\nhall", "t#0\nroom"], ["t#1\nhall"]]
    assert inp.group_ids.tolist() == [0, 0]
