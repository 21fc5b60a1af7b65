"""Gold path lengths (``empo2.envs.gold``, ``empo2.envs.scienceworld.gold``) on the real simulators, and the reachability guard of eval and compare.

The lengths are checked against the ``scienceworld`` package driven directly (its own ``step``, no code of ours); the
cache test makes a second JVM impossible by replacing our environment's constructor with one that raises.
"""

from __future__ import annotations

import json

import pytest

from empo2.cli import main
from empo2.config import Config
from empo2.envs import gold
from empo2.envs.base import EnvError
from empo2.envs.scienceworld import gold as sw_gold


def _simulator_steps(task: str, variation: int) -> int | None:
    """Reference: the package's own gold path played with its own ``step``; a bare ``0`` (the answer to an ambiguity
    prompt) is sent but belongs to the step before it, as in our environment. ``None``: never completed."""
    from scienceworld import ScienceWorldEnv as Simulator

    sim = Simulator("", envStepLimit=10**9)
    try:
        sim.load(task, variation, "easy", generateGoldPath=True)
        sim.reset()
        steps = 0
        for action in sim.get_gold_action_sequence():
            steps += action.strip() != "0"
            _, _, completed, info = sim.step(action)
            if completed:
                return steps if info["score"] >= 100 else None
        return None
    finally:
        sim.close()


def test_gold_lengths_match_the_simulator_and_a_second_call_starts_no_jvm(tmp_path, monkeypatch):
    import empo2.envs.scienceworld as sw

    monkeypatch.setenv("EMPO2_HOME", str(tmp_path))
    env_cfg = Config.load(None, ["env.max_steps=12"]).env
    first = gold.reachability(env_cfg, ["find-animal"], "test", 1, say=lambda _: None)
    assert [(p.task, p.cap, p.fits) for p in first] == [("find-animal", 12, p.steps <= 12) for p in first]
    assert [p.steps for p in first] == [_simulator_steps(p.task, p.variation) for p in first]
    cached = json.loads(sw_gold.cache_path().read_text())
    assert cached["splits"]["find-animal"]["test"][0] == first[0].variation
    assert cached["paths"][f"find-animal|{first[0].variation}|easy"]["java"][:2].isdigit()  # e.g. 17.0.15

    def no_jvm(*args, **kwargs):
        raise AssertionError("a JVM was started although every gold path was cached")

    monkeypatch.setattr(sw.ScienceWorldEnv, "__init__", no_jvm)
    assert gold.reachability(env_cfg, ["find-animal"], "test", 1) == first
    with pytest.raises(AssertionError, match="a JVM was started"):  # the guard bites on a variation not cached
        gold.reachability(env_cfg, ["find-animal"], "test", 2)


def test_a_gold_path_does_not_depend_on_what_the_jvm_played_before(tmp_path, monkeypatch):
    """The simulator chooses a find task's object by shuffling a set ordered by Java identity hashes, so its own gold
    path of a variation changes after other episodes in the same JVM (shown here on the package alone). Ours is the
    one a fresh JVM computes, whatever our environment's JVM played before: as gold actions and as a demonstration."""
    from scienceworld import ScienceWorldEnv as Simulator

    from empo2.envs.scienceworld import DEFAULT_JAVA_OPTIONS, ScienceWorldEnv

    monkeypatch.setenv("EMPO2_HOME", str(tmp_path))  # nothing cached: computed in this test
    task = "find-non-living-thing"
    with ScienceWorldEnv(simplification="easy") as env:
        shown, other = env.variations(task, "train")[:2]
        # the JVM's options change its threads, and so its identity hashes: the reference runs under our options
        monkeypatch.setenv("JAVA_TOOL_OPTIONS", DEFAULT_JAVA_OPTIONS)
        sim = Simulator("", envStepLimit=10**9)
        try:
            sim.load(task, shown, "easy", generateGoldPath=True)  # the first load of a fresh JVM
            fresh = list(sim.get_gold_action_sequence())
            sim.load(task, shown, "easy", generateGoldPath=True)
            assert list(sim.get_gold_action_sequence()) != fresh  # the same JVM asked again chooses another object
        finally:
            sim.close()
        for variation in env.variations(task, "test")[:3]:
            env.reset(task, variation)
            env.step("look around")
        env.reset(task, shown)
        assert env.gold_actions() == fresh
        demo = env.demonstration(task, other)  # the gold path of the first other train variation: ``shown``
        assert [line[2:] for line in demo.splitlines() if line.startswith("> ")] == fresh


@pytest.mark.slow  # grow-plant's gold path is 70 actions long
def test_ambiguity_answers_and_steps_after_success_are_not_counted(tmp_path, monkeypatch):
    monkeypatch.setenv("EMPO2_HOME", str(tmp_path))
    env_cfg = Config.load(None, []).env
    # grow-plant's gold path holds a bare "0" (an ambiguity answer) and trailing waits after the task completes
    (path,) = gold.reachability(env_cfg, ["grow-plant"], "test", 1, say=lambda _: None)
    assert path.steps == _simulator_steps("grow-plant", path.variation)
    raw = json.loads(sw_gold.cache_path().read_text())["paths"][f"grow-plant|{path.variation}|easy"]["gold"]
    assert raw > path.steps + 1


def test_a_comparison_whose_cap_is_below_the_gold_paths_is_refused_in_one_line(tmp_path, capsys):
    out = tmp_path / "cmp"
    # the evidence preset's cap of 8 steps against the first 3 test variations of find-animal (gold 16, 12, 14)
    args = ["--config", "configs/scienceworld_evidence_cpu.yaml", "--algos", "grpo", "--seeds", "0", "--out", str(out),
            "env.tasks=[find-animal]", "env.eval_variations=3"]
    assert main(["compare", *args]) == 2
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1, err
    assert "comparison refused" in err and "0/3 test variations (0%)" in err and "--allow-unreachable" in err, err
    assert not out.exists()
    assert main(["eval", "--model", "smollm2-135m", "--tasks", "find-animal", "--split", "test", "--variations", "3",
                 "--max-steps", "8", "--out", str(out)]) == 2  # refused before the model loads
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1 and "evaluation refused" in err, err
    assert not out.exists()


def test_the_guard_passes_reachable_caps_and_warns_when_allowed():
    said: list[str] = []
    cfg = Config.load("configs/scienceworld_evidence_cpu.yaml", ["env.tasks=[find-animal]", "env.max_steps=16"])
    gold.check_reachable(cfg, "test", 3, "comparison", allow=False, say=said.append)
    said = [line for line in said if not line.startswith("gold paths:")]  # computed here if no other test did
    assert said == ["reachable: 3/3 test variations (100%) have a gold path within the step cap (16)"]
    cfg.set("env.max_steps", "14")  # the first variation's gold path takes 16 steps: 2/3 is under the threshold
    with pytest.raises(EnvError, match="2/3 test variations"):
        gold.check_reachable(cfg, "test", 3, "comparison", allow=False, say=said.append)
    gold.check_reachable(cfg, "test", 3, "comparison", allow=True, say=said.append)
    gold.check_reachable(cfg, "test", 3, "training", allow=False, refuse=False, say=said.append)
    assert [s.startswith("warning: reachable: 2/3") for s in said[1:]] == [True, True]
    assert "--allow-unreachable: running anyway" in said[1] and "running anyway" not in said[2]


def test_gold_lists_a_tasks_splits(capsys):
    assert main(["gold", "find-animal", "--split", "test", "--variations", "3", "--caps", "8,16"]) == 0
    out = capsys.readouterr().out
    assert "225:16 226:12 227:14" in out and "within 8: 0/3 (0%) · within 16: 3/3 (100%)" in out
    assert json.loads(out.splitlines()[-1])["steps"] == {"find-animal": {"test": {"225": 16, "226": 12, "227": 14}}}
    assert main(["gold", "find-animal", "--caps", "8,x"]) == 2


def test_webshop_gold_lengths_are_the_gold_paths_played_to_buy_now(capsys):
    from empo2.envs.webshop.env import TASK, WebShopEnv

    assert main(["gold", "webshop", "--env", "webshop", "--split", "test", "--variations", "4"]) == 0
    listed = json.loads(capsys.readouterr().out.splitlines()[-1])["steps"][TASK]["test"]
    env = WebShopEnv()
    expected = {}
    for goal in env.variations(TASK, "test")[:4]:  # every gold action is one step; the last one buys the product
        env.reset(TASK, goal)
        expected[str(goal)] = len(env.gold_actions())
    assert listed == expected
