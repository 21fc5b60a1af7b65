"""Branching from a prefix: a recorded episode is replayed on ANOTHER worker of the pool (its own JVM for ScienceWorld;
a worker process, or a Ray actor) up to step m, and the state there is the recorded one. Real ScienceWorld and the
WebShop fixture; the episodes are recorded through the training rollout (``run_episodes``) with a scripted action
source."""

from __future__ import annotations

import pytest

from empo2.config.sections import MemoryConfig, PolicyConfig
from empo2.envs.base import state_of
from empo2.envs.pool import EnvPool
from empo2.envs.scienceworld import ANSWER
from empo2.episodes.branching import prefix_commands, restore_branches, state_after
from empo2.episodes.rollout import RolloutContext, run_episodes
from empo2.policy.generate import Generation

pytestmark = pytest.mark.slow  # real simulators

# find-animal, variation 0: a misspelling the corrector turns into another command, a rejected input replaced by the
# closest valid one, and ambiguous inputs the simulator asks about (answered with the first reading), one of which
# opens one of two drawers.
SCIENCEWORLD_SCRIPT = ["opne door to kitchen", "open door to kitchen", "look at door", "go to kitchen", "open cupboard",
                       "open drawer", "pick up cup", "go to outside", "pick up egg", "look around"]
WEBSHOP_VARIATION = 3


def scripted(actions):
    def act(ctx, workers, episodes, prompts):
        return [Generation(ids=[], logprobs=[], text=actions[len(ep.steps)]) for ep in episodes]
    return act


def record(pool, env_name, task, variation, actions, on_step=None):
    ctx = RolloutContext(None, None, pool, None, None, env_name, PolicyConfig(few_shot=0), MemoryConfig())
    eps, _ = run_episodes(ctx, [(task, variation, 0, "on")], actions=scripted(actions),
                          on_step=on_step)
    return eps[0]


def state(pool, i):
    return {k: pool.call(i, k) for k in ("look", "inventory")}


def same_up_to_line_order(replayed: str, recorded: str) -> bool:
    """Whether two texts hold the same lines (each stripped), in any order."""
    return sorted(line.strip() for line in replayed.splitlines()) == sorted(
        line.strip() for line in recorded.splitlines())


@pytest.fixture(scope="module", params=["process", "ray"])
def sw_pool(request):
    """Worker processes, and Ray actors (``env.pool=ray``; skipped, so not tested, only where Ray is missing)."""
    kwargs = {"valid_actions_in_info": False, "max_steps": len(SCIENCEWORLD_SCRIPT)}  # the cap ends the script
    if request.param == "process":
        p = EnvPool("scienceworld", kwargs, size=2)
        yield p
        p.close()
        return
    ray = pytest.importorskip("ray")
    from empo2.envs.ray_pool import RayEnvPool

    ray.init(num_cpus=2, include_dashboard=False, log_to_driver=False)
    try:
        p = RayEnvPool("scienceworld", kwargs, size=2, start_timeout=900)  # JVM start-up is slow on a loaded box
        yield p
        p.close()
    finally:
        ray.shutdown()


def test_scienceworld_prefix_replays_to_the_recorded_state(sw_pool):
    # Prefixes ending with an answer (6) and the whole episode (with a rejected input replaced at step 9).
    checked = (6, len(SCIENCEWORLD_SCRIPT))
    recorded = {}  # the room and the inventory after those steps, as worker 0 saw them
    ep = record(sw_pool, "scienceworld", "find-animal", 0, SCIENCEWORLD_SCRIPT, on_step=lambda ep: recorded.update(
        {len(ep.steps): state(sw_pool, 0)} if len(ep.steps) in checked else {}))
    assert ep.done and not ep.success and len(ep.steps) == len(SCIENCEWORLD_SCRIPT)
    commands = prefix_commands(ep, len(ep.steps))
    assert ["opne door to kitchen", "close door to kitchen"] in commands  # the rejected try is replayed too
    assert ["open drawer", ANSWER + "open drawer (in cupboard, in kitchen)"] in commands or [
        "open drawer", ANSWER + "open drawer (in counter, in kitchen)"] in commands  # the answer, by its reading
    # Worker 1 (another JVM) replays them: same room, same inventory, same score as recorded.
    for m in checked:
        branches, metrics = restore_branches(sw_pool, [(1, ep, m)])
        b = branches[1]
        assert b.info["steps"] == m and b.info["done"] == (m == len(ep.steps))
        assert b.info["score"] == sum(s.reward for s in ep.steps[:m]) + b.info["initial_score"]
        for key, text in state(sw_pool, 1).items():
            assert same_up_to_line_order(text, recorded[m][key]), (m, key)
        assert b.state == state_of(b.observation, b.info) and b.matches and b.state == state_after(ep, m)
        assert metrics["replay_branches"] == 1 and metrics["replay_mismatch_branches"] == 0
        assert metrics["replay_ended_branches"] == float(m == len(ep.steps))
    # A branch goes on from the replayed state: after "go to kitchen" (m = 4), open the cupboard as recorded.
    restore_branches(sw_pool, [(1, ep, 4)])
    res = sw_pool.step({1: ep.steps[4].raw_action})[1]
    assert res.info["commands"] == ep.steps[4].commands and res.observation == ep.steps[4].observation

    # Replaying only the final command of each step (no tries, no answers) ends somewhere else: the drawer opened by
    # the answer stays shut. This is what the recorded commands are for.
    for s in ep.steps:
        s.commands = []
    restore_branches(sw_pool, [(1, ep, 6)])
    assert not same_up_to_line_order(sw_pool.call(1, "look"), recorded[6]["look"])




@pytest.fixture(scope="module")
def ws_pool():
    p = EnvPool("webshop", {}, size=2)
    yield p
    p.close()


def test_webshop_prefix_replays_the_session(ws_pool):
    _, fresh = ws_pool.call(0, "restore_prefix", "webshop", WEBSHOP_VARIATION, [])  # an empty prefix = a reset
    assert fresh["steps"] == 0 and fresh["observations"] == []
    ws_pool.reset([(0, "webshop", WEBSHOP_VARIATION)])
    actions = ws_pool.call(0, "gold_actions")
    # Free-form text the corrector turns into a search, and a click the corrector maps to a product, before the
    # gold path: the replay must run what the environment ran, not what was written.
    script = ["I should look for " + actions[0][len("search["):-1], "click[nothing here]"] + actions
    ep = record(ws_pool, "webshop", "webshop", WEBSHOP_VARIATION, script)
    assert ep.success and [s.commands for s in ep.steps[:2]] != [[a] for a in script[:2]]
    for m in range(1, len(ep.steps)):
        branches, metrics = restore_branches(ws_pool, [(1, ep, m)])
        b = branches[1]
        assert b.observation == ep.steps[m - 1].observation and b.matches and not b.ended
        assert b.info["valid_actions"] == ws_pool.call(1, "valid_actions")
        assert metrics["replay_mismatch_branches"] == 0
    # Continue the last branch to the end: the same purchase, reward 1.
    res = ws_pool.step({1: ep.steps[-1].action})[1]
    assert res.done and res.info["success"] and res.reward == pytest.approx(ep.steps[-1].reward)


def test_the_replay_is_checked_by_its_state_not_its_replies(ws_pool):
    ws_pool.reset([(0, "webshop", 0)])
    actions = ws_pool.call(0, "gold_actions")
    ep = record(ws_pool, "webshop", "webshop", 0, actions)
    ep.steps[0].observation += "\nan extra line the replay will not show"  # a reply: not what the check reads
    branches, metrics = restore_branches(ws_pool, [(1, ep, 2)])
    assert branches[1].matches and metrics["replay_mismatch_branches"] == 0
    ep.steps[2].state_text += "\na state the replay will not reach"  # the state after step 2
    branches, metrics = restore_branches(ws_pool, [(1, ep, 2)])
    assert not branches[1].matches and metrics["replay_mismatch_branches"] == 1
    with pytest.raises(ValueError):
        prefix_commands(ep, len(ep.steps) + 1)
    with pytest.raises(ValueError):
        state_after(ep, len(ep.steps) + 1)


def test_a_replay_that_ends_its_episode_says_so_instead_of_raising(ws_pool):
    """A record whose prefix runs past the episode's end (as a replay that diverges into a purchase would): the
    environment stops at the end and reports it; nothing raises."""
    ws_pool.reset([(0, "webshop", 1)])
    ep = record(ws_pool, "webshop", "webshop", 1, ws_pool.call(0, "gold_actions"))
    assert ep.success
    ep.steps.append(ep.steps[-1])  # one more step after the purchase
    branches, metrics = restore_branches(ws_pool, [(1, ep, len(ep.steps))])
    b = branches[1]
    assert b.ended and b.info["steps"] == len(ep.steps) - 1 and metrics["replay_ended_branches"] == 1


class _Simulator:
    """Stands in for the JVM where the real one cannot be made to repeat itself: the order in which ScienceWorld
    lists the readings of an ambiguous input changes between loads at random."""

    def __init__(self, question):
        self.question, self.sent = question, []
        self.server = self

    def step(self, command):
        self.sent.append(command)
        return self.question if command == "open drawer" else f"ran {command}"


def test_an_answer_is_replayed_by_its_reading_not_its_position():
    from empo2.envs.scienceworld import ScienceWorldEnv
    from empo2.envs.scienceworld.text import readings_of

    head = "Ambiguous request: Please enter the number for the action you intended (or blank to cancel):\n"
    first = head + "0:\topen drawer (in cupboard, in kitchen)\n1:\topen drawer (in counter, in kitchen)\n"
    later = head + "0:\topen drawer (in counter, in kitchen)\n1:\topen drawer (in cupboard, in kitchen)\n"
    assert readings_of(first) == ["open drawer (in cupboard, in kitchen)", "open drawer (in counter, in kitchen)"]
    env = ScienceWorldEnv.__new__(ScienceWorldEnv)
    env._sim = _Simulator(later)
    question = env._run("open drawer", "")
    env._run(ANSWER + "open drawer (in cupboard, in kitchen)", question)
    assert env._sim.sent == ["open drawer", "1"]
    env._run(ANSWER + "a reading no longer offered", question)
    assert env._sim.sent[-1] == "0"
