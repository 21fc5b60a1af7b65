"""ScienceWorld environment against the real simulator (one JVM shared by the module)."""

from __future__ import annotations

import numpy as np
import pytest

from empo2.envs import make_env
from empo2.envs.actions import clean_action, correct_action
from empo2.envs.base import DEMO_OBS_CHARS, EnvError, TextEnv
from empo2.envs.scienceworld import (
    TASK_SETS,
    ScienceWorldEnv,
    expand_tasks,
    parse_focus_targets,
    step_cap,
)

pytestmark = pytest.mark.slow  # real simulators / end-to-end runs: `pytest -m "not slow"` skips them


@pytest.fixture(scope="module")
def env():
    e = ScienceWorldEnv()
    yield e
    e.close()


def play_gold(env, task, variation):
    obs, info = env.reset(task, variation)
    total, result = float(info["initial_score"]), None
    for action in env.gold_actions():
        result = env.step(action)
        total += result.reward
        if result.done:
            break
    return total, result


def test_protocol_and_task_sets(env):
    assert isinstance(env, TextEnv)
    import scienceworld

    simulator = scienceworld.ScienceWorldEnv("", envStepLimit=10)  # the simulator's own list, from its own JVM
    try:
        sim_names = set(simulator.get_task_names())
    finally:
        simulator.close()
    assert len(env.task_names()) == 30 and set(env.task_names()) == sim_names
    assert len(TASK_SETS["panel18"]) == 18 and set(TASK_SETS["panel18"]) <= sim_names
    topics = ["chemistry", "classification", "biology1", "biology2", "electricity", "measurement"]
    assert sorted(t for topic in topics for t in TASK_SETS[topic]) == sorted(TASK_SETS["panel18"])
    assert expand_tasks(["biology1", "find-animal", "identify-life-stages-1"]) == [
        "identify-life-stages-1", "identify-life-stages-2", "find-animal"]
    assert len(expand_tasks("all")) == 30


@pytest.mark.parametrize("task", ["find-animal", "use-thermometer", "lifespan-longest-lived", "chemistry-mix"])
def test_gold_path_reaches_100(env, task):
    variation = env.variations(task, "train")[1]
    total, result = play_gold(env, task, variation)
    assert result.done and result.info["success"] is True
    assert result.info["score"] == 100 and total == 100  # reward = score delta: initial score + rewards = final score
    assert result.info["steps"] <= env.step_cap(task)
    for key in ("look", "inventory", "valid_actions", "raw_action", "action", "steps"):
        assert key in result.info


def test_invalid_action_gives_zero_reward(env):
    obs, info = env.reset("find-animal", 0)
    env.action_cutoff = 75.0  # nothing is that close to "xyzzy plugh": it is sent as is and rejected
    try:
        result = env.step("xyzzy plugh")
    finally:
        env.action_cutoff = 0.0
    assert result.reward == 0 and not result.done and result.info["score"] == info["initial_score"]
    assert "No known action" in result.observation and result.info["accepted"] is False
    assert result.info["raw_action"] == "xyzzy plugh"


def test_default_cutoff_always_maps_to_a_valid_action(env):
    """Released code (docs/fidelity.md): every output becomes the closest valid action, so the agent always acts."""
    env.reset("find-animal", 0)
    for text in ("xyzzy plugh", "You focus on the bowl. Then you focus on the cupboard", "Rodzisch wow"):
        valid = env.valid_actions()
        result = env.step(text)
        assert result.info["accepted"] is True and "No known action" not in result.observation
        assert result.info["action"] in valid and result.info["raw_action"] == text
        if result.done:
            env.reset("find-animal", 0)


def test_step_cap_is_done_not_success(env):
    obs, info = env.reset("find-animal", 0)
    assert info["max_steps"] == 30
    for n in range(1, 31):
        result = env.step("look around")
        assert result.done == (n == 30)
    assert result.info["success"] is False and result.info["truncated"] is True and result.info["steps"] == 30
    after = env.step("look around")
    assert after.done and after.reward == 0 and after.info["steps"] == 30


def test_step_cap_settings():
    assert step_cap("find-animal") == 30 and step_cap("chemistry-mix") == 60
    assert step_cap("measure-melting-point-known-substance") == 120
    assert step_cap("find-animal", 7, {"chemistry-mix": 9}) == 7
    assert step_cap("chemistry-mix", 7, {"chemistry-mix": 9}) == 9


def test_wrong_focus_ends_episode_with_minus_100(env):
    obs, info = env.reset("find-animal", 0)
    result = env.step("focus on agent")
    assert result.done and result.info["score"] == -100 and result.reward == -100 - info["initial_score"]
    assert result.info["success"] is False


def test_every_step_reports_the_focus_targets_and_the_focus(env):
    """The allowed focus targets reach every prompt's hints, not only the first one's (the released prompt keeps them
    in view), and the state says what the agent focused on once it has."""
    from empo2.agent.prompts import hints_text

    obs, info = env.reset("find-non-living-thing", 0)
    targets = info["focus_targets"]
    assert targets and info["focus"] == ""
    for action in ("open door to kitchen", "go to kitchen", "focus on soap"):
        result = env.step(action)
        assert result.info["focus_targets"] == targets
        assert hints_text(result.info).startswith("Objects you may focus on: " + ", ".join(targets))
    assert result.info["focus"] == "the soap" and result.reward == 50
    assert result.info["state"].splitlines()[0] == "Task progress: score 75, focused on the soap"


def test_unknown_task_and_variation_errors(env):
    with pytest.raises(EnvError, match="valid tasks: .*find-animal"):
        env.reset("find-unicorn", 0)
    n = env.num_variations("find-animal")
    with pytest.raises(EnvError, match="out of range"):
        env.reset("find-animal", n)
    with pytest.raises(EnvError, match="out of range"):
        env.reset("find-animal", -1)
    with pytest.raises(EnvError, match="out of range"):
        env.reset("find-animal", "3")
    assert env.reset("find-animal", np.int64(2))[1]["variation"] == 2
    env.simplification = "bogus"
    try:
        with pytest.raises(EnvError, match="Unknown simplification"):
            env.reset("find-animal", 0)
    finally:
        env.simplification = "easy"
    with pytest.raises(EnvError, match="panel18"):
        expand_tasks(["panel19"])
    with pytest.raises(EnvError, match="valid splits"):
        env.variations("find-animal", "holdout")
    with pytest.raises(EnvError, match="valid environments"):
        make_env("atari")


def test_splits_come_from_simulator(env):
    train, dev, test = (env.variations("use-thermometer", s) for s in ("train", "dev", "test"))
    assert train and dev and test
    assert not set(train) & set(dev) and not set(dev) & set(test) and not set(train) & set(test)
    assert len(train) + len(dev) + len(test) == env.num_variations("use-thermometer")
    assert env.variations("use-thermometer", "eval") == dev


def test_demonstration_uses_another_variation(env):
    task = "use-thermometer"
    played = env.variations(task, "train")[0]
    other = env.variations(task, "train")[1]
    env.reset(task, other)
    other_gold, other_desc = env.gold_actions(), env.task_description()
    env.reset(task, played)
    played_gold, played_desc = env.gold_actions(), env.task_description()
    assert played_desc != other_desc
    env.step(played_gold[0])
    score = env.step(played_gold[1]).info["score"]
    before = (env.look(), env.inventory(), score)

    demo = env.demonstration(task, played)
    demo_actions = [line[2:] for line in demo.splitlines() if line.startswith("> ")]
    assert demo.startswith(f"Task: {other_desc}") and played_desc not in demo
    assert demo_actions == other_gold[: len(demo_actions)] and demo_actions != played_gold[: len(demo_actions)]
    assert all(len(line) <= DEMO_OBS_CHARS for line in demo.splitlines() if not line.startswith(("Task: ", "> ")))
    # the running episode was restored: same room, same inventory, and its score (a look changes no score)
    look, inventory = env.look(), env.inventory()
    assert (look, inventory, env.step("look around").info["score"]) == before
    two = env.demonstration(task, played, n=2)
    assert two.startswith(demo) and two.count("Task: ") == 2 and played_desc not in two


def test_action_correction_keeps_raw_and_corrected(env):
    obs, info = env.reset("use-thermometer", 0)
    assert "thermometer" in info["focus_targets"] and info["focus_targets"] == env.focus_targets()
    gold = env.gold_actions()
    for action in gold[: gold.index("pick up thermometer")]:
        env.step(action)
    result = env.step("Action: pick up thermometr.")
    assert result.info["raw_action"] == "Action: pick up thermometr."
    assert result.info["action"] == "pick up thermometer"
    assert "thermometer" in result.info["inventory"]

    env.valid_actions_in_info = False  # lean mode: no list in info, correction still sees the full list
    try:
        result = env.step("go to hallwya")
        assert result.info["valid_actions"] == [] and result.info["action"] == "go to hallway"
        assert "hallway" in result.observation and "go to kitchen" in env.valid_actions()
    finally:
        env.valid_actions_in_info = True
    env.action_correction = False
    try:
        result = env.step("pick up thermometr")
        assert result.info["action"] == "pick up thermometr" and "No known action" in result.observation
    finally:
        env.action_correction = True


def test_correct_action_unit():
    valid = ["pick up thermometer", "pick up fire pit", "go to kitchen", "open door to kitchen", "look around"]
    assert correct_action("pick up thermometr", valid) == "pick up thermometer"
    assert correct_action(">  Action:  GO TO   kitchen!", valid) == "go to kitchen"
    assert correct_action("open kitchen door", valid) == "open door to kitchen"
    assert correct_action("xyzzy", valid) == "xyzzy"  # nothing close: left for the simulator to reject
    assert correct_action("pick up thermometr", ["pick up fire pit"]) == "pick up thermometr"
    assert clean_action("\n> Action: look around.\nthen more") == "look around"


def test_focus_targets_parser():
    desc = ("Your task is to measure the melting point of chocolate. First, focus on the thermometer. Next, focus on "
            "the chocolate. If it is above 10, focus on the blue box. Otherwise, focus on the orange box.")
    assert parse_focus_targets(desc) == ["thermometer", "chocolate", "blue box", "orange box"]


def test_missing_java_is_a_clear_error(monkeypatch):
    monkeypatch.setenv("PATH", "/nonexistent")
    with pytest.raises(EnvError, match="apt-get install -y openjdk-17-jre-headless"):
        ScienceWorldEnv()
