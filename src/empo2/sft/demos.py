"""The warm start's demonstrations: gold episodes played through the rollout code, one row per step.

Each gold path is played by :func:`empo2.episodes.rollout.run_episodes` with the gold action as the "generation", so
every prompt is the one a rollout renders at that step (the same builder, task text, demonstration, history window,
hints; mode ``on``, so no tips), and the target is what a rollout's response is: the gold action's tokens, then the
end-of-sequence token that ends a policy's turn (:func:`empo2.episodes.expert.expert_generation`), cut at
``policy.max_completion_length`` as generation cuts it. Only gold paths that reach the goal within the episode's step
cap become demonstrations; a variation whose path does not is skipped for the next one.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

from empo2.envs.actions import replayable_gold
from empo2.envs.base import EnvError
from empo2.episodes.episode import Episode
from empo2.episodes.expert import expert_generation
from empo2.episodes.rollout import ActionSource, RolloutContext, call_worker, run_episodes
from empo2.policy.generate import Generation

RAN_OUT = "look around"
"""The action after a gold path's last one, in an episode it did not end (that episode is not kept)."""


@dataclass(frozen=True)
class DemoRow:
    """One step of a gold episode: the prompt a rollout renders there and the response that plays the gold action."""

    prompt: list[int]
    target: list[int]
    """The gold action's tokens and the end-of-sequence token (cut at ``policy.max_completion_length``)."""
    action: str
    task: str
    variation: int
    episode: int
    """Which demonstration the row belongs to (its index among the kept episodes)."""


@dataclass
class Demos:
    """The kept gold episodes' rows, and what was played to get them."""

    rows: list[DemoRow]
    episodes: list[tuple[str, int, int]]
    """(task, variation, steps) of every kept gold episode."""
    skipped: list[tuple[str, int]]
    """(task, variation) whose gold path did not reach the goal within the step cap."""
    truncated_targets: int = 0
    """Targets longer than ``policy.max_completion_length`` (cut as generation cuts them)."""

    @property
    def count(self) -> int:
        return len(self.episodes)


def gold_actions() -> ActionSource:
    """An action source that plays each episode's gold path (asked of its worker at its first step)."""
    plans: dict[tuple[int, int], list[str]] = {}

    def act(ctx: RolloutContext, active: list[int], episodes: list[Episode],
            prompts: list[list[int]]) -> list[Generation]:
        out = []
        for i, ep in zip(active, episodes):
            key = (ep.group, ep.member)
            if key not in plans:
                try:
                    plans[key] = replayable_gold(list(call_worker(ctx.pool, ep, i, "gold_actions") or []))
                except EnvError:  # no gold path here (WebShop's official data, where search misses the target)
                    plans[key] = []
            plan = plans[key]
            action = plan[len(ep.steps)] if len(ep.steps) < len(plan) else RAN_OUT
            out.append(expert_generation(ctx.tokenizer, action, ctx.policy_cfg.max_completion_length))
        return out

    return act


def interleave(variations: dict[str, list[int]]) -> list[tuple[str, int]]:
    """(task, variation) taking each task's variations in turn: ``{a: [1, 2], b: [7]}`` → a1, b7, a2."""
    order, depth = [], max((len(v) for v in variations.values()), default=0)
    for k in range(depth):
        order += [(task, vs[k]) for task, vs in variations.items() if k < len(vs)]
    return order


def collect(ctx: RolloutContext, tasks: list[str], split: str, wanted: int,
            progress: Callable[[int, int], None] | None = None) -> Demos:
    """Rows of ``wanted`` gold episodes of ``split`` (``train`` for learning, ``dev`` for validation): the first
    variations of ``tasks`` in turn whose gold path succeeds, played ``ctx.pool.size`` at a time."""
    candidates = interleave({t: list(ctx.pool.call(0, "variations", t, split, retries=1)) for t in tasks})
    demos, start = Demos([], [], []), 0
    cap = ctx.policy_cfg.max_completion_length
    while demos.count < wanted and start < len(candidates):
        chunk = candidates[start:start + min(ctx.pool.size, wanted - demos.count)]
        start += len(chunk)
        episodes, _ = run_episodes(ctx, [(t, v, g, "on") for g, (t, v) in enumerate(chunk)], actions=gold_actions())
        for ep in episodes:
            if not ep.success or ep.failed:
                demos.skipped.append((ep.task, ep.variation))
                continue
            index = demos.count
            demos.episodes.append((ep.task, ep.variation, len(ep.steps)))
            for step in ep.steps:
                demos.truncated_targets += len(step.response_ids) > cap
                demos.rows.append(DemoRow(list(step.train_prompt_ids), list(step.response_ids[:cap]), step.raw_action,
                                          ep.task, ep.variation, index))
        if progress is not None:
            progress(demos.count, wanted)
    return demos
