"""The state every consumer reads (tip keys, retrieval, novelty, GiGPO anchors), on the real ScienceWorld."""

from __future__ import annotations

import dataclasses
import random
from types import SimpleNamespace

import pytest

from empo2.config import MemoryConfig
from empo2.config_sections import EnvConfig
from empo2.envs.factory import make_env_kwargs
from empo2.envs.pool import EnvPool
from empo2.envs.scienceworld_text import scienceworld_state
from empo2.episodes.reflection import memory_ops, write_memory_ops
from empo2.episodes.rollout import RolloutContext, run_episodes
from empo2.memory.novelty import NoveltyReward
from empo2.memory.store import TipMemory
from empo2.policy.generate import Generation
from empo2.train.intrinsic import novelty_rewards

LOOK = ("This room is called the kitchen. In it, you see: \n\tthe agent\n\ta substance called air\n\ta chair. On the "
        "chair is: nothing.\n\ta counter.\nYou also see:\n\tA door to the hallway (that is open)\n\tA door to the "
        "outside (that is open)\n")
INVENTORY = "In your inventory, you see:\n\tan orange\n\ta thermometer\n"


def _shuffled(text: str, seed: int) -> str:
    """The same text with each indented listing in another order, as a reload lists a room's objects."""
    rng, out, block = random.Random(seed), [], []
    for line in text.splitlines():
        if line.startswith("\t"):
            block.append(line)
            continue
        rng.shuffle(block)
        out += block + [line]
        block = []
    rng.shuffle(block)
    return "\n".join(out + block) + "\n"


def test_scienceworld_state_is_the_room_and_inventory_with_sorted_listings():
    state = scienceworld_state(LOOK, INVENTORY)
    assert state.splitlines()[0] == "This room is called the kitchen. In it, you see:"
    assert state.splitlines()[1:4] == ["a chair. On the chair is: nothing.", "a counter.", "a substance called air"]
    assert "In your inventory, you see:\na thermometer\nan orange" in state and "\t" not in state
    for seed in range(5):  # listing order and spacing are not part of the state
        assert scienceworld_state(_shuffled(LOOK, seed), _shuffled(INVENTORY, seed + 7).replace("\n", " \n")) == state
    moved = LOOK.replace("\ta counter.\n", "")
    assert scienceworld_state(moved, INVENTORY + "\ta counter\n") != state  # what an action changes is


@pytest.fixture(scope="module")
def played(embedder):
    """One real episode, twice (the second after a reload): in the hallway, then in the kitchen, the same action
    kind gets the same one-line reply."""
    script = ["open door to kitchen", "go to kitchen", "open door to hallway", "look around"]
    pool = EnvPool("scienceworld", make_env_kwargs(EnvConfig(name="scienceworld", max_steps=len(script))), size=1)
    cfg = SimpleNamespace(few_shot=0, history_window=1, max_prompt_length=1024)
    ctx = RolloutContext(None, None, pool, embedder, None, "scienceworld", cfg, MemoryConfig())
    act = lambda ctx, active, eps, prompts: [Generation([], [], script[len(e.steps)]) for e in eps]  # noqa: E731
    try:
        runs = [run_episodes(ctx, [("find-animal", 0, 0, "on")], actions=act)[0][0] for _ in range(2)]
    finally:
        pool.close()
    return ctx, runs


@pytest.mark.slow
def test_two_rooms_with_the_same_reply_are_two_states(played, embedder, tmp_path):
    ctx, (ep, replayed) = played
    hall, kitchen = ep.steps[0], ep.steps[2]
    assert not ep.failed and len(ep.steps) == 4
    assert hall.observation == kitchen.observation == "The door is already open."  # one reply, two places
    assert "called the hallway" in hall.state_text and "called the kitchen" in kitchen.state_text
    assert ep.reached_states()[0] == hall.state_text and ep.reached_states()[2] == kitchen.state_text

    # tip keys: an episode ending with each of the two steps writes its tip under its own room
    memory = TipMemory(tmp_path / "memory.sqlite", dim=embedder.dim)
    ctx = dataclasses.replace(ctx, memory=memory)
    endings = [dataclasses.replace(ep, member=0, steps=ep.steps[:1]), dataclasses.replace(ep, member=1, steps=ep.steps[:3])]
    write_memory_ops(ctx, endings, memory_ops(ctx, [], endings, ["Go to the kitchen first.", "Look for the animal outside."]))
    keys = sorted(t.key_text for t in memory.all_tips())
    memory.close()
    assert keys == sorted([hall.state_text, kitchen.state_text]) and keys[0] != keys[1]

    # novelty: the hallway is reached once (reward 1), the kitchen three times (1/3 each): the two replies that read
    # the same are counted apart
    [rewarded] = novelty_rewards(NoveltyReward(0.9), embedder, [ep])
    assert [s.intrinsic for s in rewarded.steps] == pytest.approx([1.0, 1 / 3, 1 / 3, 1 / 3], rel=1e-12)

    # a reload lists objects in another order; the replayed states read the same
    assert [s.state_text for s in replayed.steps] == [s.state_text for s in ep.steps]
    assert replayed.final_state == ep.final_state
