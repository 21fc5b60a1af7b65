"""ELPO's rollout driver (Algorithm 1) on the WebShop fixture, through the real worker pool, with a scripted policy
whose suffixes recover exactly where the test says: the driver must localise that step, wave by wave, within the
budget, and the tree it builds must feed the ``elpo`` estimator."""

from __future__ import annotations

import math

import numpy as np
import pytest

from empo2.algo import elpo_tree
from empo2.algo.advantages import AdvantageInput, compute_advantages, step_rewards
from empo2.algo.elpo import ElpoOptions
from empo2.config.sections import MemoryConfig, PolicyConfig, algo_config
from empo2.envs.pool import EnvPool
from empo2.episodes.elpo_rollout import run_elpo
from empo2.episodes.rollout import RolloutContext
from empo2.policy.generate import Generation

pytestmark = pytest.mark.slow

GOAL = 3  # men's running shoes, product b0fx010000, navy blue, size 9
ASIN = "click[b0fx010000]"
# A failure of K = 7 steps: it leaves the product, comes back, and picks size 10 at step 6 (the critical step).
FAILURE = ["search[men's running shoes with arch support, non slip]", ASIN, "click[navy blue]", "click[< prev]", ASIN,
           "click[10]", "click[buy now]"]
T_CRIT = 6
BUDGET = {0: 8, 1: 7}  # B_max = 2 failures, then 3 probes of X_m = 2 suffixes (zero entropy gap: Eq. 5 gives 2);
# group 1's last probe has 1 rollout left


def scripted(ctx, workers, episodes, prompts):
    """Group 0 recovers from any prefix shorter than T_CRIT steps, but only in every second suffix (odd members):
    one success among a probe's suffixes must be enough. Group 1 never recovers (sparse successes)."""
    out = []
    for ep in episodes:
        if ep.parent is None:
            action = FAILURE[len(ep.steps)]
        else:
            m = ep.parent[1]
            on_results = m in (1, 4)  # the states after steps 1 and 4 are result pages
            fix = ([ASIN] if on_results else []) + ["click[navy blue]", "click[9]", "click[buy now]"]
            suffix = fix if ep.group == 0 and m < T_CRIT and ep.member % 2 else ["click[buy now]"]
            action = suffix[min(len(ep.steps), len(suffix) - 1)]
        out.append(Generation(ids=[], logprobs=[], text=action))
    return out


@pytest.fixture(scope="module")
def pool():
    p = EnvPool("webshop", {}, size=4)  # a wave holds at most B_max = 2 episodes per group
    yield p
    p.close()


def test_driver_localises_the_critical_step_within_the_budget(pool):
    ctx = RolloutContext(None, None, pool, None, None, "webshop", PolicyConfig(few_shot=0), MemoryConfig())
    specs = [("webshop", GOAL, g, "on") for g in (0, 1) for _ in range(BUDGET[g])]
    episodes, stats = run_elpo(ctx, specs, actions=scripted, options=ElpoOptions(b_max=2))
    for g, t_crit in ((0, T_CRIT), (1, 1)):
        mine = [ep for ep in episodes if ep.group == g]
        assert len(mine) == BUDGET[g]  # every full trajectory and every suffix counts against N
        searched = [ep for ep in mine if ep.critical_step is not None]
        assert [ep.critical_step for ep in searched] == [t_crit]
        anchors = sorted({ep.parent[1] for ep in mine if ep.parent is not None})
        assert len(anchors) <= math.ceil(math.log2(len(FAILURE)))
        assert all(ep.parent[0] == searched[0].member for ep in mine if ep.parent is not None)
        assert sum(ep.parent is None for ep in mine) == 2
    assert anchors == [1, 2, 4]  # group 1: nothing recovers, so the search halves down to step 1
    assert stats["elpo_searches"] == 2 and stats["elpo_localised_after_first"] == 1
    assert stats["elpo_probes"] == 6 and stats["elpo_waves"] == 4  # 1 wave of failures + 3 probes, both groups
    assert stats["replay_branches"] == 11 and stats["replay_mismatch_branches"] == 0
    assert stats["replay_ended_branches"] == 0
    group0 = [ep for ep in episodes if ep.group == 0]
    assert [(ep.parent[1], ep.success) for ep in group0 if ep.parent is not None] == [
        (4, False), (4, True), (6, False), (6, False), (5, False), (5, True)]  # L = 5, then R = 6, then L = 6

    # The tree feeds the estimator: each episode's own steps get their node's A_hier (Eq. 10), each leaf scored
    # with its whole path's rewards (WebShop pays at the purchase, so a prefix carries 0 here).
    rewards = step_rewards(episodes, 0.0)
    inp = AdvantageInput.from_rewards(episodes, rewards, algo_config())
    adv, _ = compute_advantages("elpo", inp)
    assert [len(a) for a in adv] == [len(ep.steps) for ep in episodes]
    by_member = {ep.member: i for i, ep in enumerate(group0)}
    parents = [None if ep.parent is None else (by_member[ep.parent[0]], ep.parent[1]) for ep in group0]
    paths = elpo_tree.tree_paths(parents, [len(ep.steps) for ep in group0])
    own = np.concatenate([[s.reward for s in ep.steps] for ep in group0])
    want = elpo_tree.tree_advantages(paths, [float(own[path].sum()) for path in paths]).hier
    for ep, path in zip(group0, paths):
        got = adv[episodes.index(ep)]
        assert got.tolist() == pytest.approx(want[path[len(path) - len(ep.steps):]].tolist(), abs=1e-12)


class EndingReplays:
    """The real WebShop pool, except that every replay of a prefix of ``m`` steps reports that it ended its episode.
    The fixture replays deterministically, so a replay that diverges into the end of its episode (as a ScienceWorld
    reload can, when a recorded step now completes or fails the task) cannot be produced on it; this reports one."""

    def __init__(self, pool, m):
        self.pool, self.m = pool, m

    def __getattr__(self, name):
        return getattr(self.pool, name)

    def restore(self, assignments):
        replies = self.pool.restore(assignments)
        for i, _, _, steps in assignments:
            if len(steps) == self.m:
                obs, info = replies[i]
                replies[i] = (obs, {**info, "done": True})
        return replies


def test_a_branch_whose_replay_ends_its_episode_is_left_out(pool):
    ctx = RolloutContext(None, None, EndingReplays(pool, 4), None, None, "webshop", PolicyConfig(few_shot=0),
                         MemoryConfig())
    specs = [("webshop", GOAL, 0, "on")] * BUDGET[0]
    episodes, stats = run_elpo(ctx, specs, actions=scripted, options=ElpoOptions(b_max=2))
    adv, _ = compute_advantages("elpo", AdvantageInput.from_rewards(episodes, step_rewards(episodes, 0.0),
                                                                    algo_config()))
    assert [len(a) for a in adv] == [len(ep.steps) for ep in episodes]
    # the first anchor (m = 4) never gets a suffix played: the search probes it again until the budget is spent
    assert [ep.parent for ep in episodes] == [None, None] and all(ep.steps for ep in episodes)
    assert [ep.critical_step for ep in episodes] == [1, None]
    assert stats["replay_ended_branches"] == BUDGET[0] - 2 and stats["elpo_probes"] == 0
