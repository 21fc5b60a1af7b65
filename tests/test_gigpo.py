"""GiGPO advantages against a float64 reference written from the paper's equations with plain loops, and properties.

The reference: A(a_t^i) = A^E(τ_i) + ω·A^S(a_t^i) (Eq. 8); A^E normalises R(τ) over the episode group (Eq. 3); A^S
normalises G_t = Σ_{k≥t} γ^{k−t} r_k (Eq. 5) over the steps of that group that answered the same observation (Eq. 6,
7). Normalisation ``mean_norm`` = x − mean, ``mean_std_norm`` = (x − mean) / (sample std + ε); a group of one or of
equal values gives 0.
"""

from __future__ import annotations

import math

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from empo2.algo.advantages import AdvantageInput, compute_advantages
from empo2.algo.gigpo import GigpoOptions, build_step_group, discounted_step_returns
from empo2.config import Config, ConfigError, algo_config

MODES = ("mean_norm", "mean_std_norm")


def _normalise(values, mode, eps):
    """Over a list: x − mean, or (x − mean) / (sample std (n − 1) + eps); one value or equal values → zeros."""
    if len(values) < 2 or max(values) == min(values):
        return [0.0] * len(values)
    mu = math.fsum(values) / len(values)
    sd = math.sqrt(math.fsum((v - mu) ** 2 for v in values) / (len(values) - 1))
    return [(v - mu) / (sd + eps) if mode == "mean_std_norm" else v - mu for v in values]


def reference_gigpo(returns, groups, rewards, keys, gamma, omega, mode="mean_norm", eps=1e-6):
    n = len(returns)
    a_ep = [0.0] * n
    for g in set(groups):
        members = [i for i in range(n) if groups[i] == g]
        for i, a in zip(members, _normalise([returns[i] for i in members], mode, eps)):
            a_ep[i] = a
    step_ret = [[math.fsum(gamma ** (k - t) * rewards[i][k] for k in range(t, len(rewards[i])))
                 for t in range(len(rewards[i]))] for i in range(n)]
    a_step = [[0.0] * len(rewards[i]) for i in range(n)]
    anchors = {(groups[i], keys[i][t]) for i in range(n) for t in range(len(keys[i]))}
    for g, key in anchors:
        where = [(i, t) for i in range(n) for t in range(len(keys[i])) if groups[i] == g and keys[i][t] == key]
        for (i, t), a in zip(where, _normalise([step_ret[i][t] for i, t in where], mode, eps)):
            a_step[i][t] = a
    return [[a_ep[i] + omega * a for a in a_step[i]] for i in range(n)]


def _random_batch(rng, n_groups=3, group_size=4, n_states=3):
    """Groups of ``group_size`` plus one group of a single episode; few states, so anchors repeat within episodes."""
    groups, rewards, keys = [], [], []
    for g in range(n_groups + 1):
        for _ in range(group_size if g < n_groups else 1):
            length = int(rng.integers(0, 8))
            groups.append(g)
            rewards.append(rng.choice([0.0, 0.0, 1.0, -1.0, 0.5], size=length) * float(rng.normal(3, 1)))
            keys.append(["start"] + [f"room {rng.integers(n_states)}" for _ in range(length - 1)] if length else [])
    returns = np.array([r.sum() for r in rewards])
    return returns, np.array(groups), rewards, keys


def gigpo_algo(eps=1e-6, scale_rewards=True, **gigpo):
    """An ``algo`` section with GiGPO's options ``algo.gigpo`` (``gamma=0.9`` …) and the shared ``adv_eps``."""
    return algo_config(adv_eps=eps, scale_rewards=scale_rewards, gigpo=GigpoOptions(**gigpo))


def _run(returns, groups, rewards, keys, **options):
    return compute_advantages("gigpo", AdvantageInput(returns, groups, rewards, keys, gigpo_algo(**options)))


def _assert_matches(adv, ref):
    assert [len(a) for a in adv] == [len(r) for r in ref]
    for a, r in zip(adv, ref):
        assert a.dtype == np.float64 and np.all(np.isfinite(a))
        np.testing.assert_allclose(a, r, rtol=1e-12, atol=1e-12)


@pytest.mark.parametrize("seed", range(8))
@pytest.mark.parametrize("mode", MODES)
def test_gigpo_matches_reference(seed, mode):
    rng = np.random.default_rng(seed)
    returns, groups, rewards, keys = _random_batch(rng)
    assert any(len(set(k)) < len(k) for k in keys)  # a state repeated within one episode
    gamma, omega = [0.95, 0.5, 1.0, 0.0][seed % 4], [1.0, 0.3, 2.5][seed % 3]
    adv, m = _run(returns, groups, rewards, keys, gamma=gamma, step_advantage_weight=omega, normalization=mode)
    _assert_matches(adv, reference_gigpo(returns.tolist(), groups.tolist(), [r.tolist() for r in rewards], keys,
                                         gamma, omega, mode))
    # the episode group of one gets A^E = 0; a state its one episode repeats still forms an anchor group
    assert m["groups"] == 4 and m["singleton_groups"] == 1 and m["step_groups"] >= 4


def test_discounted_returns_and_worked_examples():
    np.testing.assert_allclose(discounted_step_returns(np.array([0.0, 0.0, 1.0]), 0.5), [0.25, 0.5, 1.0])
    # two episodes from one start state, returns (1, 0): A^E = ±0.5 (mean_norm) or ±0.5/0.7071 = ±0.7071 (ddof 1);
    # anchor "s" holds G_0 = 0.95 and 0 → ±0.475 or ±0.7071; the second steps are anchors of one → 0
    inputs = (np.array([1.0, 0.0]), np.array([0, 0]), [np.array([0.0, 1.0]), np.array([0.0, 0.0])],
              [["s", "x"], ["s", "y"]])
    adv, _ = _run(*inputs, eps=0.0)
    np.testing.assert_allclose(np.concatenate(adv), [0.975, 0.5, -0.975, -0.5], rtol=1e-15)
    adv, _ = _run(*inputs, eps=0.0, normalization="mean_std_norm")
    r = 1 / math.sqrt(2)
    np.testing.assert_allclose(np.concatenate(adv), [2 * r, r, -2 * r, -r], rtol=1e-15)


@pytest.mark.parametrize("mode", MODES)
def test_groups_of_one_and_equal_groups_give_zero_not_nan(mode):
    """One episode in its group, anchors of one step, identical trajectories: exactly 0, never NaN (n − 1 = 0)."""
    adv, m = _run(np.array([2.0]), np.array([0]), [np.array([1.0, 1.0])], [["a", "b"]], normalization=mode)
    assert adv[0].tolist() == [0.0, 0.0] and m["zero_adv_groups"] == 1
    rewards, keys = [np.array([0.0, 0.5, 1.0])] * 4, [["a", "b", "c"]] * 4
    adv, m = _run(np.array([1.5] * 4), np.zeros(4, dtype=int), rewards, keys, normalization=mode)
    assert all(a.tolist() == [0.0, 0.0, 0.0] for a in adv) and m["zero_adv_groups"] == 1


@pytest.mark.parametrize("mode, scale", [("mean_norm", False), ("mean_std_norm", True)])
def test_anchor_groups_of_one_leave_the_episode_advantage(mode, scale):
    """With every anchor group of one step, GiGPO is GRPO with the matching normalisation (both ddof 1)."""
    returns, groups, rewards, keys = _random_batch(np.random.default_rng(7))
    unique = [[f"ep{i} step{t}" for t in range(len(k))] for i, k in enumerate(keys)]
    gigpo, m = _run(returns, groups, rewards, unique, normalization=mode)
    grpo, _ = compute_advantages("grpo", AdvantageInput(returns, groups, rewards, unique,
                                                        gigpo_algo(scale_rewards=scale)))
    for a, b in zip(gigpo, grpo):
        assert a.tolist() == b.tolist()
    assert m["step_groups"] == m["step_singleton_groups"] == sum(map(len, keys))


@settings(max_examples=50, deadline=None)
@given(st.integers(0, 10_000), st.randoms(use_true_random=False), st.sampled_from(MODES))
def test_permuting_episodes_permutes_the_output(seed, rnd, mode):
    returns, groups, rewards, keys = _random_batch(np.random.default_rng(seed))
    adv, _ = _run(returns, groups, rewards, keys, normalization=mode)
    order = list(range(len(returns)))
    rnd.shuffle(order)
    perm, _ = _run(returns[order], groups[order], [rewards[i] for i in order], [keys[i] for i in order],
                   normalization=mode)
    for k, i in enumerate(order):
        np.testing.assert_allclose(perm[k], adv[i], rtol=1e-12, atol=1e-12)


def test_step_groups_stay_inside_episode_groups_and_similarity_merges():
    groups = np.array([0, 0, 1])
    keys = [["kitchen", "hall"], ["kitchen"], ["kitchen"]]
    exact = build_step_group(groups, keys)
    assert exact[0][0] == exact[1][0] != exact[2][0] and exact[0][1] != exact[0][0]
    near = build_step_group(np.array([0, 0]), [["You are in the kitchen."], ["You are in the kitchen!"]], 0.9)
    assert near[0][0] == near[1][0]
    far = build_step_group(np.array([0, 0]), [["You are in the kitchen."], ["A hallway."]], similarity=0.9)
    assert far[0][0] != far[1][0]


# ------------------------------------------------------------------------------- the trainer's anchor key
LONG = "You are in the kitchen. " + "A counter holds many things. " * 40  # > 1000 characters
NEAR_IDENTICAL = [
    ("You are in the kitchen.  A door leads north.", "You are in the kitchen. A door leads north."),  # whitespace
    (LONG + "A red bulb.", LONG + "A blue bulb."),  # differ only after character 1000
]


def _episodes(first: str, second: str):
    """Three rollouts of one group: all start in "start"; the second step answers ``first`` (A, C) or ``second``
    (B) and pays 1, 0 and 0.5, so merging the two observations changes every second-step advantage."""
    from empo2.episodes.episode import Episode, Step

    def step(obs, reward):
        return Step([1], [1], [2], [-0.5], "a", "a", "next", reward, obs)

    return [Episode("t", 0, 0, "on", steps=[step("start", 0.0), step(obs, r)])
            for obs, r in ((first, 1.0), (second, 0.0), (first, 0.5))]


@pytest.mark.parametrize("first, second", NEAR_IDENTICAL)
@pytest.mark.parametrize("mode", MODES)
def test_near_identical_observations_are_distinct_anchors_unless_similarity_is_asked(first, second, mode):
    assert first != second
    eps = _episodes(first, second)
    returns = np.array([ep.extrinsic_return for ep in eps])
    rewards = [[s.reward for s in ep.steps] for ep in eps]
    exact_keys = [["start", first], ["start", second], ["start", first]]
    merged_keys = [["start", "same"]] * 3
    for similarity, keys in ((None, exact_keys), (0.95, merged_keys)):
        algo = gigpo_algo(gamma=0.9, step_advantage_weight=0.7, step_similarity=similarity, normalization=mode)
        inp = AdvantageInput.from_episodes(eps, returns, 0.0, algo)
        adv, m = compute_advantages("gigpo", inp)
        _assert_matches(adv, reference_gigpo(returns.tolist(), [0, 0, 0], rewards, keys, 0.9, 0.7, mode))
        assert m["step_groups"] == (3 if similarity is None else 2)
    other = reference_gigpo(returns.tolist(), [0, 0, 0], rewards, merged_keys, 0.9, 0.7, mode)
    assert not np.allclose(np.concatenate(compute_advantages("gigpo", AdvantageInput.from_episodes(
        eps, returns, 0.0, gigpo_algo(gamma=0.9, step_advantage_weight=0.7, normalization=mode)))[0]),
        np.concatenate(other))  # the two groupings give different advantages, so the test tells them apart


@pytest.mark.parametrize("aggregation", ["mean", "sum"])
def test_input_from_episodes_step_rewards_add_up_to_the_return(aggregation):
    """The trainer's conversion: step rewards (with the weighted novelty reward) sum to the episode's return, and
    the state keys are the states the steps answered, verbatim."""
    from empo2.episodes.episode import Episode, Step
    from helpers.paper_returns import combine_returns

    def step(obs, reward, intrinsic):
        return Step([1], [1], [2], [-0.5], "a", "a", "next", reward, obs, intrinsic=intrinsic)

    eps = [Episode("t", 0, 0, "on", steps=[step("hall", 0.0, 1.0), step("a  room\n", 5.0, 0.5)]),
           Episode("t", 1, 1, "on", steps=[step("hall", 1.0, 0.25)])]
    w = 0.4
    intrinsic = [ep.intrinsic_return(aggregation) for ep in eps]
    returns = combine_returns([ep.extrinsic_return for ep in eps], intrinsic, w)
    inp = AdvantageInput.from_episodes(eps, returns, w, algo_config(), aggregation)
    for r, R in zip(inp.step_rewards, returns):
        assert r.sum() == pytest.approx(R, rel=1e-12)
    assert inp.state_keys == [["hall", "a  room\n"], ["hall"]]
    assert inp.group_ids.tolist() == [0, 1]


# ------------------------------------------------------------------------------------------- configuration
@pytest.mark.parametrize("overrides", [["algo.name=gigpo"], ["algo.name=empo2", "algo.advantage=gigpo"]])
def test_default_is_the_reference_mean_norm(overrides):
    """``algo.name=gigpo`` (and GiGPO under EMPO²) subtracts the group mean only, as the reference's default does."""
    cfg = Config.load(None, overrides)
    assert cfg.algorithm.estimator(cfg.algo) == "gigpo" and cfg.algo.gigpo.normalization == "mean_norm"
    returns, groups, rewards, keys = _random_batch(np.random.default_rng(11))
    adv, _ = compute_advantages("gigpo", AdvantageInput(returns, groups, rewards, keys, cfg.algo))
    g = cfg.algo.gigpo
    _assert_matches(adv, reference_gigpo(returns.tolist(), groups.tolist(), [r.tolist() for r in rewards], keys,
                                         g.gamma, g.step_advantage_weight, "mean_norm", cfg.algo.adv_eps))
    std = Config.load(None, [*overrides, "algo.gigpo.normalization=mean_std_norm"])
    adv, _ = compute_advantages("gigpo", AdvantageInput(returns, groups, rewards, keys, std.algo))
    _assert_matches(adv, reference_gigpo(returns.tolist(), groups.tolist(), [r.tolist() for r in rewards], keys,
                                         g.gamma, g.step_advantage_weight, "mean_std_norm", cfg.algo.adv_eps))


def test_unknown_normalization_is_one_line_and_exit_2(tmp_path, capsys):
    from empo2.cli import main

    with pytest.raises(ConfigError, match="algo.gigpo.normalization must be one of mean_norm, mean_std_norm"):
        Config.load(None, ["algo.gigpo.normalization=std"])
    out = tmp_path / "run"
    assert main(["train", "--config", "configs/webshop_cpu.yaml", "--output-dir", str(out),
                 "algo.name=gigpo", "algo.gigpo.normalization=std"]) == 2
    err = capsys.readouterr().err.strip()
    assert "algo.gigpo.normalization" in err and len(err.splitlines()) == 1 and not out.exists()


# ---------------------------------------------------------------------------------------- the real rollout
@pytest.mark.slow
def test_rollout_records_the_state_each_action_answered():
    """Real WebShop workers (bundled fixture catalog): each step's anchor key is the state (the page) its action was
    chosen in: the reset page first, then the previous step's result; the episode keeps the state it ended in."""
    from types import SimpleNamespace

    from empo2.config.sections import env_config
    from empo2.envs.factory import make_env_kwargs
    from empo2.envs.pool import EnvPool
    from empo2.episodes.rollout import RolloutContext, run_episodes
    from empo2.policy.generate import Generation

    kwargs = make_env_kwargs(env_config(name="webshop", max_steps=3))
    pool = EnvPool("webshop", kwargs, size=2)
    try:
        first = {i: r[0] for i, r in pool.reset([(0, "webshop", 0), (1, "webshop", 0)]).items()}
        cfg = SimpleNamespace(few_shot=0, history_window=1, max_prompt_length=1024)
        ctx = RolloutContext(None, None, pool, None, None, "webshop", cfg, None)
        script = ["search[shirt]", "click[next >]", "click[< prev]"]
        act = lambda ctx, active, eps, prompts: [Generation([], [], script[len(e.steps)]) for e in eps]  # noqa: E731
        episodes, _ = run_episodes(ctx, [("webshop", 0, 0, "on")] * 2, actions=act)
    finally:
        pool.close()
    for i, ep in enumerate(episodes):
        assert not ep.failed and len(ep.steps) >= 2
        assert ep.steps[0].state_text == " ".join(first[i].split())
        for prev, s in zip(ep.steps, ep.steps[1:]):
            assert s.state_text == " ".join(prev.observation.split())
        assert ep.final_state == " ".join(ep.steps[-1].observation.split())
