"""TextWorldExpress against the real package (one JVM shared by the module; Java is on every CI machine).

Gold paths win, a random walk plays to its cap, the state follows what the agent does (a move, a door, a take) and
not what it only looks at, a replayed prefix reaches the recorded state in another JVM, bad game parameters are
refused at load with one line naming the valid ones, and the worker pool runs the environment and leaves no JVM
behind.
"""

from __future__ import annotations

import json
import random

import psutil
import pytest

from empo2.config import Config, ConfigError
from empo2.envs.base import EnvError, TextEnv
from empo2.envs.textworld_express import gold
from empo2.envs.textworld_express.env import TextWorldExpressEnv
from empo2.envs.textworld_express.games import GAMES, params_text
from empo2.envs.textworld_express.state import compact_room, twx_state

pytestmark = pytest.mark.slow  # real simulators / end-to-end runs: `pytest -m "not slow"` skips them

SMALL = {"coin": {"numLocations": 6, "includeDoors": 1}, "mapreader": {"numLocations": 4, "maxDistanceApart": 1},
         "twc": {"numLocations": 1, "numItemsToPutAway": 2},
         "cookingworld": {"numLocations": 1, "numIngredients": 1, "numDistractorItems": 0, "includeDoors": 0}}
"""Small games of each kind (the sizes of the shipped presets)."""


@pytest.fixture(autouse=True)
def own_gold_cache(tmp_path, monkeypatch):
    """Every test computes its gold paths itself, in a cache of its own."""
    monkeypatch.setenv("EMPO2_HOME", str(tmp_path / "home"))


@pytest.fixture(scope="module")
def env():
    e = TextWorldExpressEnv(params=SMALL, max_steps=15)
    yield e
    e.close()


@pytest.fixture(scope="module")
def package():
    """The package's own environment, in a JVM of its own: the reference the tests compare with."""
    import textworld_express

    sim = textworld_express.TextWorldExpressEnv(envStepLimit=10**6)
    yield sim
    sim.close()


def alive(pid: int) -> bool:
    try:
        return psutil.Process(pid).status() != psutil.STATUS_ZOMBIE
    except psutil.NoSuchProcess:
        return False


# --------------------------------------------------------------------------------------------------------- games
def test_protocol_folds_and_parameters_of_each_fold(env):
    assert isinstance(env, TextEnv)
    assert env.task_names() == ["coin", "mapreader", "twc", "cookingworld"]
    train, dev, test = (env.variations("coin", s) for s in ("train", "dev", "test"))
    assert (train[0], dev[0], test[0]) == (0, 10000, 20000) and len(train) == len(dev) == len(test) == 1000
    assert env.variations("coin", "eval") == dev
    with pytest.raises(EnvError, match="not a TextWorldExpress seed; valid seeds: train 0-999"):
        env.reset("coin", 5000)
    with pytest.raises(EnvError, match="unknown TextWorldExpress game 'coins'; valid games: coin, mapreader"):
        env.reset("coins", 0)
    ood = TextWorldExpressEnv(params={"coin": {"numLocations": 3}}, eval_params={"coin": {"numLocations": 9}})
    try:
        for seed, rooms in ((0, 3), (10000, 9), (20000, 9)):
            _, info = ood.reset("coin", seed)
            assert ood.generation_properties()["numLocations"] == rooms  # the package's own record
            assert info["params"] == f"numLocations={rooms}"
    finally:
        ood.close()


def test_parameter_table_is_the_packages(package):
    """The names each game takes are the package's own (its error message lists them), and both ends of every range
    load in the package."""
    sim = package
    for game, table in GAMES.items():
        with pytest.raises(ValueError) as info:
            sim.load(game, "noSuchParameter=1")
        known = str(info.value).split("Known properties:")[1].strip(" .").split(", ")
        assert sorted(known) == sorted(table), game
        for name, p in table.items():
            for value in (p.low, p.high):
                sim.load(game, f"{name}={value}")


@pytest.mark.parametrize("game", list(SMALL))
def test_gold_path_wins(env, game):
    for seed in (20000, 20001, 20002):
        obs, info = env.reset(game, seed)
        total, result = 0.0, None
        for action in env.gold_actions():
            result = env.step(action)
            assert result.info["accepted"], (action, result.observation)
            total += result.reward
            if result.done:
                break
        assert result.info["success"] and not result.info["failure"], (game, seed)
        assert result.info["score"] == pytest.approx(100.0) and total == pytest.approx(100.0)


def test_coin_gold_path_is_the_shortest_and_the_same_in_every_jvm(env, package, tmp_path, monkeypatch):
    """The coin's gold path is a shortest route: never longer than any path the package's gold agent draws (a
    random walk to the coin), and the same when a second JVM, with an empty cache, makes it again."""
    seeds = env.variations("coin", "test")[:8]
    ours = {seed: (env.reset("coin", seed), env.gold_actions())[1] for seed in seeds}
    sim = package
    for seed in seeds:
        sim.load("coin", params_text(SMALL["coin"]))
        draws = []
        for _ in range(5):
            sim.reset(seed=seed, gameFold="test", generateGoldPath=True)
            draws.append([a for a in sim.getGoldActionSequence() if a != "look around"])
        assert len(ours[seed]) <= min(len(d) for d in draws), (seed, ours[seed], draws)
    monkeypatch.setenv("EMPO2_HOME", str(tmp_path / "another"))
    with TextWorldExpressEnv(params=SMALL) as other:
        assert {seed: (other.reset("coin", seed), other.gold_actions())[1] for seed in seeds} == ours


def test_gold_paths_are_cached(env):
    env.reset("twc", 20003)
    first = env.gold_actions()
    cache = json.loads(gold.cache_path().read_text())
    assert cache["actions"][gold.cache_key("twc", params_text(SMALL["twc"]), 20003)] == first
    assert all(env.gold_actions() == first for _ in range(3))  # the package draws anew; the cache does not


def test_a_random_walk_plays_to_its_cap(env):
    rng = random.Random(0)
    for seed in env.variations("coin", "test")[:10]:
        obs, info = env.reset("coin", seed)
        rewards, result = [], None
        while result is None or not result.done:
            result = env.step(rng.choice(info["valid_actions"] if result is None else result.info["valid_actions"]))
            rewards.append(result.reward)
            assert result.info["accepted"]
        assert len(rewards) <= 15 and sum(rewards) == pytest.approx(result.info["score"])
        assert result.info["success"] == (result.info["score"] == 100) and not result.info["failure"]
        assert result.info["truncated"] == (not result.info["success"]) and (result.info["success"] or len(rewards) == 15)
        assert env.step("look around").info["steps"] == len(rewards)  # an ended episode takes no more steps


def test_failure_ends_the_episode_without_success():
    """CookingWorld: eating an ingredient the recipe needs is the package's task failure."""
    with TextWorldExpressEnv(params=SMALL) as env:
        for seed in range(20000, 20010):
            env.reset("cookingworld", seed)
            gold_path = env.gold_actions()
            take = next((a for a in gold_path if a.startswith("take ") and a not in ("take cookbook", "take knife")),
                        None)
            if take is None:
                continue
            for action in gold_path[:gold_path.index(take) + 1]:
                env.step(action)
            result = env.step("eat " + take[5:])
            assert result.done and result.info["failure"] and not result.info["success"], result.observation
            return
    pytest.fail("no game with an ingredient to take")


def test_an_output_that_is_not_an_action_becomes_the_closest_valid_one(env):
    _, info = env.reset("coin", 20000)
    door = next(a for a in info["valid_actions"] if a.startswith("open door to "))
    said = f"Action: Open the door to the {door.split()[-1]}."
    result = env.step(said)
    assert result.info["raw_action"] == said and result.info["action"] == door and result.info["accepted"]
    exact = TextWorldExpressEnv(params=SMALL, action_cutoff=95)
    try:
        exact.reset("coin", 20000)
        result = exact.step("dance")
        assert result.info["action"] == "dance" and not result.info["accepted"]
        assert result.observation.startswith("Unknown action")
    finally:
        exact.close()


# --------------------------------------------------------------------------------------------------------- state
def test_the_state_follows_moves_doors_and_takes_not_looks(env):
    obs, info = env.reset("coin", 20000)
    start = info["state"]
    assert start.startswith("You are in the kitchen.") and "Your inventory is currently empty." in start
    for look in ("look around", "inventory", "look around"):
        assert env.step(look).info["state"] == start
    gold_path = env.gold_actions()
    env.reset("coin", 20000)
    states = [start]
    for action in gold_path:
        states.append(env.step(action).info["state"])
    assert len(set(states)) == len(states)  # every gold step (a door opened, a move, the coin taken) is progress
    assert "  a coin" in states[-1].split("Inventory")[1] and "  a coin" not in states[-2].split("Inventory")[1]
    # a take that does not end the game: TWC's first object goes from the room to the inventory
    env.reset("twc", 20000)
    take = next(a for a in env.gold_actions() if a.startswith("take "))
    before = env.step("look around").info["state"]
    after = env.step(take).info["state"]
    thing = take[len("take "):]
    assert after != before and thing in after.split("Inventory")[1] and thing not in before.split("Inventory")[1]


def test_the_state_is_canonical():
    """Objects listed in another order, contents in another order, inventory lines in another order: one state.
    The texts are the package's own format (one opening phrase per object, in turn)."""
    look_a = ("You are in the kitchen. In one part of the room you see a stove. There is also a counter that has a "
              "knife, a raw red potato, and a cookbook on it. You also see a coin. \nTo the North you see the corridor. ")
    look_b = ("You are in the kitchen. In one part of the room you see a coin. There is also a stove. You also see a "
              "counter that has a cookbook, a knife, and a raw red potato on it. \nTo the North you see the corridor. ")
    inv_a, inv_b = "Inventory: \n  a map\n  a red apple\n", "Inventory: \n  a red apple\n  a map\n"
    assert twx_state(look_a, inv_a) == twx_state(look_b, inv_b) == (
        "You are in the kitchen.\n  a coin\n  a counter that has a cookbook, a knife, a raw red potato on it\n"
        "  a stove\nTo the North you see the corridor.\nInventory:\n  a map\n  a red apple")
    opened = look_a.replace("To the North you see the corridor.", "Through an open wood door, to the North you see "
                                                                  "the corridor.")
    assert twx_state(opened, inv_a) != twx_state(look_a, inv_a)
    assert compact_room(look_a) == ("You are in the kitchen. To the North you see the corridor.\nYou see: a stove; a "
                                    "counter that has a knife, a raw red potato, and a cookbook on it; a coin.")
    assert compact_room("You take the coin.") == "You take the coin."


# ------------------------------------------------------------------------------------------------ restore, config
def test_restore_from_a_prefix_reproduces_the_state_in_another_jvm(env):
    rng = random.Random(3)
    for game in SMALL:
        obs, info = env.reset(game, 20004)
        steps, observations, states = [], [], []
        for _ in range(6):
            result = env.step(rng.choice(env.valid_actions()))
            steps.append(result.info["commands"])
            observations.append(result.observation)
            states.append(result.info["state"])
            if result.done:
                break
        with TextWorldExpressEnv(params=SMALL, max_steps=15) as other:
            for m in (1, len(steps)):
                obs, info = other.restore_prefix(game, 20004, steps[:m])
                assert info["observations"] == observations[:m] and obs == observations[m - 1]
                assert info["state"] == states[m - 1] and info["steps"] == m
            assert other.valid_actions() == env.valid_actions() and info["done"] == result.done


@pytest.mark.parametrize("override, message", [
    ("env.textworld_express.params={coin: {numRooms: 5}}", "coin has no parameter 'numRooms' in "
     "env.textworld_express.params; valid parameters of coin: numLocations (1-11), numDistractorItems (0-10), "
     "includeDoors (0-1), limitInventorySize (0-1)"),
    ("env.textworld_express.params={coin: {numLocations: 12}}",
     "coin numLocations=12 in env.textworld_express.params is out of range"),
    ("env.textworld_express.eval_params={twc: {numLocations: 4}}", "valid parameters of twc: numLocations (1-3)"),
    ("env.textworld_express.params={kitchen: {numLocations: 4}}", "unknown TextWorldExpress game 'kitchen' in "
     "env.textworld_express.params; valid games: coin, mapreader, twc, cookingworld"),
    ("env.tasks=[coin,sorting]", "unknown TextWorldExpress game 'sorting'"),
])
def test_bad_game_parameters_are_refused_at_load(override, message, tmp_path, capsys):
    from empo2.cli import main

    with pytest.raises(ConfigError, match="^env: ") as info:
        Config.load("configs/twx_coin_cpu.yaml", [override])
    assert message in str(info.value) and "\n" not in str(info.value)
    run = tmp_path / "run"
    assert main(["train", "--config", "configs/twx_coin_cpu.yaml", override, f"train.output_dir={run}"]) == 2
    err = capsys.readouterr().err
    assert message in err and len(err.strip().splitlines()) == 1 and not run.exists()


def test_reachability_of_the_coin_preset():
    from empo2.envs.gold import check_reachable

    cfg = Config.load("configs/twx_coin_cpu.yaml")
    said = []
    check_reachable(cfg, "test", 10, "evaluation", allow=False, say=said.append)
    assert said[-1].startswith("reachable: 10/10 test variations (100%) have a gold path within the step cap (15)")


# ---------------------------------------------------------------------------------------------------- pool, play
def test_the_pool_runs_it_and_leaves_no_jvm():
    from empo2.envs.pool import EnvPool

    pool = EnvPool("textworld_express", {"params": SMALL, "max_steps": 15}, size=2)
    started = pool.started_pids()
    javas = list(pool.java_pids().values())
    try:
        assert len(set(javas)) == 2 and all(alive(p) and "java" in psutil.Process(p).name() for p in javas)
        resets = pool.reset([(0, "coin", 20000), (1, "mapreader", 20000)])
        assert resets[0][1]["state"].startswith("You are in the kitchen.")
        gold_path = pool.call(0, "gold_actions")
        for action in gold_path:
            result = pool.step({0: action, 1: "look around"})
        assert result[0].info["success"] and not result[1].done
        restored = pool.restore([(1, "coin", 20000, [[a] for a in gold_path[:-1]])])
        assert restored[1][1]["state"] == pool.step({1: "look around"})[1].info["state"]
    finally:
        pool.close()
    assert not any(alive(p) for p in started + javas)


def test_play_gold_wins_and_random_plays(capsys):
    from empo2.cli import main

    assert main(["play", "--env", "textworld_express", "--task", "coin", "--policy", "gold"]) == 0
    result = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    assert result["success"] and result["score"] == 100
    assert main(["play", "--env", "textworld_express", "--task", "coin", "--policy", "random", "--max-steps", "8"]) == 0
    result = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    assert result["steps"] <= 8 and result["success"] == (result["score"] == 100)
