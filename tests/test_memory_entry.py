"""``memory.entry_format``: entries as the tip alone (default) or in the released code's format (tip + the action of
the step the tip is keyed by + the episode's final score), with the same keys, validation and de-duplication.

Real embedder, real SQLite memory; the last test plays real ScienceWorld with SmolLM2 acting and reflecting (slow)."""

from __future__ import annotations

import copy

import pytest
import torch

from empo2.cli import main
from empo2.config import Config, ConfigError, MemoryConfig, PolicyConfig
from empo2.episodes.episode import Episode, Step
from empo2.episodes.reflection import memory_ops, reflect, write_memory_ops
from empo2.episodes.rollout import RolloutContext
from empo2.memory.store import TipMemory
from empo2.memory.validate import check_tip_text
from empo2.policy.sampling import Sampling


def released(tip: str, action: str, score: str) -> str:
    """The released code's entry, written out here independently of the implementation."""
    return (f"{tip}; At that timestep, the specific action your took was {action}; "
            f"Eventually you got the score {score}/100.")


def test_the_released_wording_exactly():
    from empo2.memory.entry import memory_entry

    assert memory_entry("Look outside for the frog.", "focus on frog", -100, "released") == \
        released("Look outside for the frog.", "focus on frog", "-100.0")
    assert memory_entry(" Open the door. ", "open  door\nto kitchen", 100 / 3, "released") == \
        released("Open the door.", "open door to kitchen", "33.3")
    assert memory_entry("Open the door.", "open door", 8, "tip") == "Open the door."
    assert memory_entry("  ", "open door", 8, "released") == ""  # memory still rejects an empty tip as empty
    with pytest.raises(ValueError):
        memory_entry("Open the door.", "open door", 8, "verbose")


def test_validation_checks_the_tip_not_the_appended_action_and_score():
    words = [f"w{i}x" for i in range(100)]  # 100 distinct words: the longest tip max_words=100 allows
    assert check_tip_text(" ".join(words), 100) is None
    assert check_tip_text(released(" ".join(words), "pick up thermometer", "25.0"), 100) is None
    assert check_tip_text(" ".join(words + ["one", "more"]), 100) == "too_long"
    observation = "This room is called the kitchen. In it, you see: a fridge, a stove, a sink, a cupboard."
    copied = released("In it, you see: a fridge, a stove, a sink, a cupboard.", "look around", "0.0")
    assert check_tip_text(copied, 100, [observation]) == "copy_of_context"
    assert check_tip_text(released("Open the fridge.", "look " * 300, "0.0"), 100) == "too_long"


def _episode(member: int, action: str, score: float) -> Episode:
    ep = Episode(task="find-animal", variation=0, group=0, mode="on_tips", member=member,
                 task_description="Your task is to find an animal.")
    for obs, act in (("This room is called the hallway.", "go to kitchen"),
                     ("This room is called the kitchen. In it, you see: a fridge.", action)):
        ep.steps.append(Step([1], [1], [2], [-1.0], act, act, "It is done.", 0.0, obs))
    ep.score, ep.done = score, True
    return ep


@pytest.mark.parametrize("dedup", [0.95, 0.8])
def test_de_duplication_compares_the_tips(tmp_path, embedder, dedup):
    """The same tip after another action is a duplicate (its released entry is not: cosine ~0.94); two different
    tips after the same action are not duplicates, although their released entries share most of their words."""
    tips = ["Check the fridge.", "Check the fridge.", "Open the door."]
    episodes = [_episode(0, "open fridge", 0.0), _episode(1, "look around", 8.0), _episode(2, "open fridge", 0.0)]
    entries = [released(tip, ep.steps[-1].action, f"{ep.score:.1f}") for tip, ep in zip(tips, episodes)]
    t, e = embedder.encode(tips), embedder.encode(entries)
    assert e[0] @ e[1] < 0.95 and e[0] @ e[2] > 0.8 > t[0] @ t[2]  # what comparing the entries would get wrong
    memory = TipMemory(tmp_path / "memory.sqlite", dim=embedder.dim, dedup_threshold=dedup)
    ctx = RolloutContext(None, None, None, embedder, memory, "scienceworld", PolicyConfig(),
                         MemoryConfig(entry_format="released", dedup_threshold=dedup))
    writes = write_memory_ops(ctx, episodes, memory_ops(ctx, [], episodes, tips))
    assert [ep.tip_rejected for ep in writes.noted_on(episodes)] == [None, "duplicate", None]
    assert sorted(t.text for t in memory.all_tips()) == [entries[0], entries[2]]
    assert {t.key_text for t in memory.all_tips()} == {episodes[0].steps[-1].state_text}
    memory.close()


def test_writing_memory_returns_what_it_did_and_leaves_its_inputs(tmp_path, embedder):
    """The episodes given to ``write_memory_ops`` and its context read the same after the call; what happened comes
    back: the tip written by (group, member), the duplicate's rejection, and the memory clock. Fails when the
    outcome is noted on the episodes in place."""
    episodes = [_episode(0, "open fridge", 0.0), _episode(1, "look around", 8.0)]
    before = copy.deepcopy(episodes)
    memory = TipMemory(tmp_path / "memory.sqlite", dim=embedder.dim, dedup_threshold=0.95)
    ctx = RolloutContext(None, None, None, embedder, memory, "scienceworld", PolicyConfig(),
                         MemoryConfig(dedup_threshold=0.95), step_counter=7)
    writes = write_memory_ops(ctx, episodes, memory_ops(ctx, [], episodes, ["Check the fridge.", "Check the fridge."]))
    assert episodes == before and ctx.step_counter == 7
    assert (writes.written, writes.rejected, writes.step) == ({(0, 0): "Check the fridge."}, {(0, 1): "duplicate"}, 7)
    noted = writes.noted_on(episodes)
    assert [(ep.tip_written, ep.tip_rejected) for ep in noted] == [("Check the fridge.", None), (None, "duplicate")]
    assert noted[0].steps == episodes[0].steps and episodes == before
    assert [t.step for t in memory.all_tips()] == [7]
    memory.close()


@pytest.mark.parametrize("entry_format", ["tip", "released"])
def test_what_each_format_stores(tmp_path, embedder, entry_format):
    """``tip`` (the default) stores the tip alone; ``released`` appends the keyed step's action and the score."""
    assert MemoryConfig().entry_format == "tip"
    memory = TipMemory(tmp_path / "memory.sqlite", dim=embedder.dim)
    ctx = RolloutContext(None, None, None, embedder, memory, "scienceworld", PolicyConfig(),
                         MemoryConfig(entry_format=entry_format))
    episodes = [_episode(0, "open fridge", 25.0)]
    writes = write_memory_ops(ctx, episodes, memory_ops(ctx, [], episodes, ["Check the fridge."]))
    want = "Check the fridge." if entry_format == "tip" else released("Check the fridge.", "open fridge", "25.0")
    assert [t.text for t in memory.all_tips()] == [want] == [ep.tip_written for ep in writes.noted_on(episodes)]
    assert [s.state_embedding for s in episodes[0].steps] == [None, None]  # the key is embedded, the step left as it was
    memory.close()


def test_reflexion_leaves_the_memory_settings_it_was_built_from():
    """``adapt.use_reflexion`` gives the context settings of its own: the config section the context was built from
    (the command's config) reads the same afterwards."""
    from empo2.experiments import adapt

    settings = MemoryConfig()
    ctx = RolloutContext(None, None, None, None, None, "scienceworld", PolicyConfig(), settings)
    adapt.use_reflexion(ctx)
    assert (ctx.memory_cfg.namespace, ctx.memory_cfg.top_k_tips) == ("task_variation", adapt.REFLEXION_BUFFER)
    assert settings == MemoryConfig()


def test_an_unknown_entry_format_is_refused_at_load(tmp_path, capsys):
    assert Config.load(None, ["memory.entry_format=released"]).memory.entry_format == "released"
    assert Config().memory.entry_format == "tip"
    with pytest.raises(ConfigError, match=r"memory\.entry_format must be one of tip, released, got "):
        Config.load(None, ["memory.entry_format=verbose"])
    run = tmp_path / "run"
    assert main(["train", "--config", "configs/scienceworld_cpu.yaml", f"train.output_dir={run}",
                 "memory.entry_format=verbose"]) == 2
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1 and "memory.entry_format must be one of tip, released, got " in err
    assert not run.exists()


@pytest.mark.slow  # real simulators
def test_a_rollout_stores_released_entries_and_retrieval_shows_them(tmp_path, smollm, embedder):
    """SmolLM2 plays 2 steps of find-animal in ScienceWorld and reflects. With ``released`` every stored entry is its
    tip + the last step's action + the episode's score, keyed by the last step's state; the next memory rollout's
    prompt carries the stored text."""
    from empo2.envs.pool import EnvPool
    from empo2.episodes.rollout import run_episodes

    model, tok = smollm
    pcfg = PolicyConfig(reflection_max_tokens=32, max_completion_length=12, max_prompt_length=768, few_shot=0)
    memory = TipMemory(tmp_path / "memory.sqlite", dim=embedder.dim)
    mcfg = MemoryConfig(entry_format="released", dedup_threshold=1.01, similarity_threshold=0.0)
    with EnvPool("scienceworld", {"max_steps": 2}, size=2) as pool:
        ctx = RolloutContext(model, tok, pool, embedder, memory, "scienceworld", pcfg, mcfg)
        torch.manual_seed(0)
        episodes, _ = run_episodes(ctx, [("find-animal", 0, 0, "on_tips")] * 2, Sampling.rollout(pcfg, 1.0), seed=0)
        episodes = reflect(ctx, episodes, episodes, seed=0)
        written = [ep for ep in episodes if ep.tip_written]
        assert written, [ep.tip_rejected for ep in episodes]
        stored = {t.text: t for t in memory.all_tips()}
        assert len(stored) == len(written)
        for ep in written:
            last = ep.steps[-1]
            tip = ep.tip_written.rsplit("; At that timestep, ", 1)[0]
            assert tip and ep.tip_written == released(tip, last.action, f"{round(ep.score, 1)}")
            entry = stored[ep.tip_written]
            assert entry.key_text == last.state_text and entry.score == ep.score

        again, _ = run_episodes(ctx, [("find-animal", 0, 1, "on_tips")], Sampling.rollout(pcfg, 1.0), seed=0)
        first = again[0].steps[0]
        assert first.tips and set(first.tips) <= set(stored)
        assert all(text in tok.decode(first.prompt_ids) for text in first.tips)
    memory.close()


def test_a_rollout_counts_its_waves_and_leaves_the_memory_clock_to_its_caller():
    """Two 3-step episodes played side by side take 3 waves of environment steps (6 steps): the rollout reports the
    waves as ``step_waves`` and leaves ``ctx.step_counter`` where it was, for its caller to advance. Fails when the
    rollout moves the clock itself, or counts every episode's steps."""
    from functools import partial

    from empo2.envs.local_pool import LocalEnvPool
    from empo2.episodes.rollout import run_episodes
    from empo2.policy.generate import Generation
    from helpers.signal_env import ChecksumRoom

    def say_hello(ctx, active, episodes, prompts):
        return [Generation(ids=[], logprobs=[], text="say hello") for _ in active]

    with LocalEnvPool(partial(ChecksumRoom, 3), 2) as pool:
        ctx = RolloutContext(None, None, pool, None, None, "checksum-room", PolicyConfig(few_shot=0), MemoryConfig(),
                             step_counter=7)
        episodes, stats = run_episodes(ctx, [("say", 0, 0, "on"), ("say", 1, 0, "on")], actions=say_hello)
    assert [len(ep.steps) for ep in episodes] == [3, 3]
    assert stats["step_waves"] == 3 and ctx.step_counter == 7
