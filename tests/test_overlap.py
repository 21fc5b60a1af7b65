"""Reflection overlapped with the update (``memory.overlap_reflection``) writes what the blocking path writes.

The unit test uses the real default model with LoRA, the real embedder and real SQLite memories; it changes the
weights while the reflection runs, as an update would. The run test trains through the real CLI on the real
ScienceWorld, with the tiny random Llama (see tests/test_train.py for why), once per path.
"""

from __future__ import annotations

import json

import numpy as np
import pytest
import torch
from peft import LoraConfig, get_peft_model

from empo2.cli import main
from empo2.config import MemoryConfig, PolicyConfig
from empo2.episodes.episode import Episode, Step
from empo2.episodes.reflection import reflect
from empo2.episodes.rollout import RolloutContext
from empo2.memory.store import TipMemory
from empo2.policy.loader import load_model
from empo2.train.overlap import BackgroundReflection, overlap_wanted

ROOMS = ["This room is called the kitchen. In it, you see: a fridge, a stove, a sink.",
         "This area is called the outside. In it, you see: a fence, a frog, a tree, a bee hive.",
         "This room is called the hallway. In it, you see: a picture, a door to the kitchen.",
         "This room is called the greenhouse. In it, you see: a flower pot, a bee, a shovel."]


def _episodes() -> list[Episode]:
    episodes = []
    for member, (room, score) in enumerate(zip(ROOMS, (0.0, 25.0, 8.0, 100.0))):
        ep = Episode(task="find-animal", variation=0, group=0, mode="on_tips", member=member,
                     task_description="Your task is to find an animal.")
        ep.steps.append(Step(prompt_ids=[1], train_prompt_ids=[1], response_ids=[2], logp_old=[-1.0],
                             raw_action="look around", action="look around", observation=room, reward=score,
                             state_text=ROOMS[2]))
        ep.score, ep.done = score, True
        episodes.append(ep)
    return episodes


def _memory_state(memory: TipMemory) -> list[tuple]:
    return [(t.namespace, t.text, t.key_text, t.score, t.step) for t in memory.all_tips()]


def _perturb(model: torch.nn.Module, scale: float) -> None:
    """What an update does to the policy, only bigger: every LoRA matrix moves."""
    gen = torch.Generator().manual_seed(7)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "lora_" in name:
                p.add_(torch.randn(p.shape, generator=gen) * scale)


@pytest.fixture(scope="module")
def lora_model():
    model, tok = load_model("smollm2-135m", device="cpu")  # its own copy: LoRA layers are injected in place
    return get_peft_model(model, LoraConfig(r=8, lora_alpha=16, target_modules="all-linear", task_type="CAUSAL_LM")), tok


def test_background_reflection_writes_the_tips_of_the_weights_that_played(tmp_path, lora_model, embedder):
    model, tok = lora_model
    reflection = BackgroundReflection(model)  # built once, like the trainer's, before any update
    _perturb(model, 0.05)  # LoRA starts as a no-op; give the policy that plays a LoRA of its own

    def context(name: str) -> RolloutContext:
        memory = TipMemory(tmp_path / f"{name}.sqlite", dim=embedder.dim)
        return RolloutContext(model, tok, None, embedder, memory, "scienceworld",
                              PolicyConfig(reflection_max_tokens=24), MemoryConfig(dedup_threshold=1.01))

    seed = 11  # per-row streams: a row's tip does not depend on the thread or batch it runs in

    blocking = context("blocking")
    episodes = _episodes()
    reflect(blocking, episodes, episodes, seed)

    overlap = context("overlap")
    base = dict(model.named_parameters())
    snap = dict(reflection.snapshot.named_parameters())
    frozen = [n for n, p in base.items() if not p.requires_grad]
    lora = [n for n, p in base.items() if p.requires_grad]
    assert frozen and lora and all("lora_" in n for n in lora)
    assert all(snap[n].data_ptr() == base[n].data_ptr() for n in frozen)  # frozen weights shared …
    assert all(snap[n].data_ptr() != base[n].data_ptr() for n in lora)  # … trainable ones owned
    episodes = _episodes()
    pending = reflection.start(overlap, episodes, episodes, seed)
    _perturb(model, 0.5)  # the update runs while the tips are written
    noted = reflection.finish(overlap, episodes, pending)
    reflection.close()

    expected = _memory_state(blocking.memory)
    assert len(expected) >= 2
    assert _memory_state(overlap.memory) == expected
    assert [ep.tip_written for ep in noted if ep.tip_written] == [t.text for t in overlap.memory.all_tips()]

    # the check can fail: reflecting with the weights after the update writes other tips
    after = context("after")
    episodes = _episodes()
    reflect(after, episodes, episodes, seed)
    assert [t.text for t in after.memory.all_tips()] != [t.text for t in blocking.memory.all_tips()]
    for ctx in (blocking, overlap, after):
        ctx.memory.close()


def test_overlap_is_on_where_generation_has_its_own_weights(lora_model):
    model, _ = lora_model
    assert overlap_wanted(None, model, backend=None) is False  # CPU: both halves want the same cores
    assert overlap_wanted(None, model, backend=object()) is True
    assert overlap_wanted(True, model, backend=None) is True and overlap_wanted(False, model, object()) is False


@pytest.mark.slow
def test_a_run_with_overlap_ends_with_the_blocking_runs_memory(tmp_path, tiny_model):
    """Same memory, same updates. The first update moves the weights (no token mask, a large learning rate, a failed
    episode in the group), so a memory written after the update, or a checkpoint saved before the memory, would show
    up here too."""
    fast = ["env.tasks=[find-animal]", "env.max_steps=3", "env.eval_variations=1", "algo.num_generations=4",
            "policy.few_shot=0", "policy.max_completion_length=8", "policy.reflection_max_tokens=12",
            "train.progress=false", "train.iterations=2", "algo.p_memory=1.0", "policy.seeded_sampling=true",
            "train.learning_rate=0.05", "algo.low_prob_threshold=0", "algo.intrinsic_weight=1.0",
            "memory.dedup_threshold=1.01", "train.eval_at_start=false", f"policy.model={tiny_model}"]
    states, losses, added, written = {}, {}, {}, {}
    for overlap in ("false", "true"):
        run = tmp_path / overlap
        assert main(["train", "--config", "configs/scienceworld_cpu.yaml", f"train.output_dir={run}",
                     f"memory.overlap_reflection={overlap}", *fast]) == 0
        last = max((run / "checkpoints").glob("iter_*"))
        with TipMemory(last / "memory.sqlite") as memory:  # the checkpoint holds the iteration's tips
            stats = {k: v for k, v in memory.stats().items() if k != "path"}  # uses, utilities, rejections
            states[overlap] = _memory_state(memory) + [json.dumps(stats, sort_keys=True)]
        records = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]
        losses[overlap] = [r["loss"] for r in records]
        added[overlap] = ([r["memory"]["added"] for r in records], stats["tips"])
        samples = [json.loads(line) for line in (run / "trajectories.jsonl").read_text().splitlines()]
        written[overlap] = [s["tip_written"] for s in samples]
    assert len(states["false"]) > 4  # tips were written in both iterations
    assert all(r["optimizer_steps"] >= 1 for r in losses["false"])
    # the first update moves the weights, so the second iteration's rollouts and tips depend on when it ran
    assert losses["false"][0]["computed_rows"] > 0 and losses["false"][0]["masked_frac"] < 1
    assert states["true"] == states["false"]
    # the metrics line and the samples see the tips of both paths (the overlapped ones land in the sync step)
    assert added["true"] == added["false"] and sum(added["false"][0]) == added["false"][1] > 4
    assert written["true"] == written["false"] and sum(w is not None for w in written["false"]) > 4
    assert [sorted(r) for r in losses["true"]] == [sorted(r) for r in losses["false"]]
    for ours, theirs in zip(losses["true"], losses["false"]):
        np.testing.assert_allclose([ours[k] for k in sorted(ours)], [theirs[k] for k in sorted(theirs)], rtol=1e-5)
