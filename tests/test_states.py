"""The state every consumer reads (tip keys, retrieval, novelty, GiGPO anchors), on the real ScienceWorld."""

from __future__ import annotations

import dataclasses
import random
from types import SimpleNamespace

import pytest

from empo2.config import MemoryConfig
from empo2.config.sections import env_config
from empo2.envs.factory import make_env_kwargs
from empo2.envs.pool import EnvPool
from empo2.envs.scienceworld.text import focused_object, scienceworld_state
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


def test_scienceworld_state_is_progress_inventory_and_room_with_sorted_listings():
    state = scienceworld_state(LOOK, INVENTORY, 8)
    assert state.splitlines()[:4] == ["Task progress: score 8, no focus yet", "In your inventory, you see:",
                                      "a thermometer", "an orange"]
    assert state.splitlines()[4:8] == ["This room is called the kitchen. In it, you see:",
                                       "a chair. On the chair is: nothing.", "a counter.", "a substance called air"]
    assert "\t" not in state
    for seed in range(5):  # listing order and spacing are not part of the state
        assert scienceworld_state(_shuffled(LOOK, seed), _shuffled(INVENTORY, seed + 7).replace("\n", " \n"),
                                  8) == state
    moved = LOOK.replace("\ta counter.\n", "")
    assert scienceworld_state(moved, INVENTORY + "\ta counter\n", 8) != state  # what an action changes is
    # what the task has scored and what the agent focused on are part of it: a focus changes neither listing
    assert scienceworld_state(LOOK, INVENTORY, 58, "the chair").splitlines()[0] == \
        "Task progress: score 58, focused on the chair"
    assert focused_object("You focus on the chair.") == "the chair" and focused_object("The door is open.") is None


def test_the_embedder_reads_the_progress_and_the_inventory_of_a_long_state(embedder):
    """MiniLM keeps its first 256 word pieces: a room with a long listing loses its end, never the progress line or
    the inventory, which come first."""
    room = LOOK.replace("\ta counter.\n", "".join(f"\ta counter number {k} with a glass jar on it.\n" for k in range(40)))
    state = scienceworld_state(room, INVENTORY, 75, "the soap")
    tokenizer, limit = embedder.model.tokenizer, embedder.model.max_seq_length
    pieces = tokenizer(state, add_special_tokens=True)["input_ids"]
    assert limit == 256 and len(pieces) > limit
    kept = tokenizer.decode(pieces[:limit], skip_special_tokens=True)
    assert kept.startswith("task progress : score 75, focused on the soap in your inventory, you see : a thermometer "
                           "an orange this room is called the kitchen")


@pytest.fixture(scope="module")
def played(embedder):
    """One real episode, twice (the second after a reload): in the hallway, then in the kitchen, the same action
    kind gets the same one-line reply."""
    script = ["open door to kitchen", "go to kitchen", "open door to hallway", "look around"]
    pool = EnvPool("scienceworld", make_env_kwargs(env_config(name="scienceworld", max_steps=len(script))), size=1)
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


@pytest.mark.slow
def test_the_step_after_a_focus_has_its_own_anchor_and_is_not_pushed_down():
    """find-non-living-thing variation 0, its gold path (the one a fresh JVM computes: ``open door to kitchen``, ``go
    to kitchen``, ``look around``, ``focus on soap``, ``move soap to red box``) played G = 4 times as one group on the
    real simulator. ``focus on`` scores 50 and changes neither the room nor the inventory, so the winning move answers
    a state of its own only if the state holds the task's progress.

    GiGPO: identical episodes make every anchor group's returns equal, so the move gets 0 (with the move in the
    anchor of the steps before the focus it got −31.3). ProxMO's step baseline softly averages the discounted returns
    of every step of the group by TF-IDF similarity (τ = 0.1, all turns, as its official code): the move has the
    group's smallest discounted return (25, against ≥ 70 for every earlier step), so any weight on an earlier step
    pulls it below 0 whatever the state says; the state decides only whether the earlier steps read as the same
    state. As τ → 0 PSA is GiGPO's exact-match baseline: there the move is no longer pushed down (with the old
    state: −31.3)."""
    from empo2.algo.advantages import AdvantageInput, compute_advantages, step_rewards
    from empo2.algo.proxmo import ProxmoOptions
    from empo2.config import algo_config

    task, group = "find-non-living-thing", 4
    pool = EnvPool("scienceworld", make_env_kwargs(env_config(name="scienceworld", max_steps=12)), size=1)
    try:
        pool.reset([(0, task, 0)])
        gold = pool.call(0, "gold_actions")
        cfg = SimpleNamespace(few_shot=0, history_window=1, max_prompt_length=1024)
        ctx = RolloutContext(None, None, pool, None, None, "scienceworld", cfg, MemoryConfig())
        act = lambda ctx, active, eps, prompts: [Generation([], [], gold[len(e.steps)]) for e in eps]  # noqa: E731
        episodes = []
        for member in range(group):
            [ep] = run_episodes(ctx, [(task, 0, 0, "on")], actions=act)[0]
            episodes.append(dataclasses.replace(ep, member=member))
    finally:
        pool.close()
    focus = next(t for t, a in enumerate(gold) if a.startswith("focus on"))
    move = focus + 1
    assert gold[move].startswith("move ") and all(ep.success and len(ep.steps) == len(gold) for ep in episodes)
    steps = episodes[0].steps
    assert steps[focus].reward == 50 and steps[move].reward == 25
    before = {s.state_text for s in steps[: focus + 1]}
    assert steps[move].state_text not in before  # its own anchor

    inp = AdvantageInput.from_rewards(episodes, step_rewards(episodes, 0.0), algo_config())
    gigpo, _ = compute_advantages("gigpo", inp)
    assert all(a[move] == 0.0 for a in gigpo)
    exact = AdvantageInput.from_rewards(episodes, step_rewards(episodes, 0.0), algo_config(proxmo=ProxmoOptions(tau=1e-3)))
    proxmo, _ = compute_advantages("proxmo", exact)
    assert all(a[move] > -0.01 for a in proxmo), [float(a[move]) for a in proxmo]
