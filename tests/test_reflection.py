"""The reflection prompt and the tip parser."""

from __future__ import annotations

import pytest

from empo2.agent.reflection_prompt import parse_tip, reflection_messages


def test_messages_show_task_score_and_recent_steps_only():
    traj = [(f"action-{i}", f"observation-{i} " + "long text " * 100) for i in range(25)]
    msgs = reflection_messages("boil some water", traj, final_score=0.375, max_words=80)
    assert [m["role"] for m in msgs] == ["system", "user"]
    user = msgs[1]["content"]
    assert "boil some water" in user and "0.375" in user and "80 words" in user
    assert "ONE tip" in user and "one line" in user and "how far" in user
    assert "action-24" in user and "action-15" in user and "action-14" not in user  # last 10 steps
    assert "steps 1-15 omitted" in user and "after 25 steps" in user
    assert all(len(line) <= 220 for line in user.splitlines() if line.startswith("   "))
    assert len(user) < 3500  # fits a small context


def test_messages_for_empty_and_short_trajectories():
    user = reflection_messages("find an animal", [], final_score=0)[1]["content"]
    assert "no actions were taken" in user and "Final score: 0" in user
    user = reflection_messages("t", [("look", "a room")], final_score=1.0)[1]["content"]
    assert "1. > look" in user and "omitted" not in user


@pytest.mark.parametrize("raw,tip", [
    ("Tip: open the door first.", "open the door first."),
    ("  \n**Tip 1:** \"Go to the kitchen, then activate the stove.\"\nSecond line", "Go to the kitchen, then activate the stove."),
    ("- Advice: use the thermometer on the ice", "use the thermometer on the ice"),
    ("“Focus on the red bulb; it is not in this room.”", "Focus on the red bulb; it is not in this room."),
    ("```\nmove the seed to the pot\n```", "move the seed to the pot"),
    ("1. pick up the key", "pick up the key"),
    ("Lesson learned — water the plant daily", "water the plant daily"),
    ("Tipping the cow is not allowed", "Tipping the cow is not allowed"),
    ("Note-taking helps: write the code down", "Note-taking helps: write the code down"),
    ("**Bold** start and __more__ words", "Bold start and more words"),
    ("", ""),
    ("   \n  \n", ""),
    ("Tip:", ""),
])
def test_parse_tip(raw, tip):
    assert parse_tip(raw) == tip


def test_reflection_caps_tips_at_the_configured_word_limit(smollm):
    """The memory's ``max_tip_words`` (not a fixed 100) bounds what the reflection keeps."""
    from empo2.config import MemoryConfig, PolicyConfig
    from empo2.episodes.episode import Episode, Step
    from empo2.episodes.reflection import reflection_job
    from empo2.episodes.rollout import RolloutContext
    from empo2.policy.generate import Generation

    _, tok = smollm
    ep = Episode("find-animal", 0, 0, "on_tips", task_description="Find an animal.",
                 steps=[Step([1], [1], [2], [-1.0], "look around", "look around", "a room", 0.0, "a room")])
    for limit in (5, 150):
        ctx = RolloutContext(None, tok, None, None, None, "scienceworld", PolicyConfig(),
                             MemoryConfig(max_tip_words=limit))
        job = reflection_job(ctx, [ep])
        tips = job(lambda prompts, sampling, seeds: [Generation([], [], "word " * 200)] * len(prompts))
        assert len(tips[0].split()) == limit


def test_parse_tip_caps_words_and_keeps_unicode():
    long = "Tip: " + " ".join(f"w{i}" for i in range(150))
    out = parse_tip(long, max_words=100)
    assert out.split() == [f"w{i}" for i in range(100)]
    assert parse_tip("Hinweis: 先に鍵を取る 🔑 dann Tür öffnen") == "Hinweis: 先に鍵を取る 🔑 dann Tür öffnen"
