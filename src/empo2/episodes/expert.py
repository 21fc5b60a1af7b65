"""LUFFY's expert member: in each group, the last ``expert_members`` rollouts play the environment's gold path
instead of sampling (the off-policy guidance π_φ of Yan et al. 2025; the equations are :mod:`empo2.algo.luffy`).

The expert plays through the same rollout code as the policy (:func:`empo2.episodes.rollout.run_episodes`): its prompts
are rendered exactly as a sampled member's would be (task, demonstration, history of its own steps, hints, tips in
the memory modes), and its "generation" is the gold action tokenised as the policy would have written it (the action's
tokens, then the end-of-sequence token that ends a policy's turn). Its behaviour log-probs are log 1 = 0 (π_φ = 1,
LUFFY §3.1); the loss never reads them.

Its actions are cut at ``policy.max_completion_length`` tokens as the policy's are. An expert is kept only when it
reaches the goal within the episode's step cap (LUFFY keeps only correct expert traces). Otherwise its slot becomes an ordinary sampled member, played after the first wave, and the (task,
variation) is remembered so later iterations sample that slot from the start. Every expert step counts apart from the
policy's steps in the budget (``expert_*`` rollout stats).
"""

from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np

from empo2.envs.actions import replayable_gold
from empo2.envs.base import EnvError
from empo2.episodes.episode import Episode
from empo2.episodes.rollout import ActionSource, RolloutContext, call_worker, model_actions, run_episodes
from empo2.policy.generate import Generation
from empo2.policy.sampling import Sampling

REFILL_GROUP_OFFSET = 1_000_003
"""Refill rollouts play under group ids shifted by this (then put back), so seeded sampling gives them their own
random streams instead of repeating member 0's."""


def expert_generation(tokenizer, action: str, max_tokens: int | None = None) -> Generation:
    """The gold ``action`` as the policy would have produced it: its tokens, then end-of-sequence; π_φ = 1. Cut at
    ``max_tokens`` (``policy.max_completion_length``) as the policy's generation is, end-of-sequence included: a cut
    action is the decoded text of the tokens kept, which the environment may not accept, so such an expert usually
    misses the goal and its slot is sampled instead."""
    ids = list(tokenizer.encode(action, add_special_tokens=False)) + [tokenizer.eos_token_id]
    if max_tokens is not None and len(ids) > max_tokens:
        ids = ids[:max_tokens]
        action = tokenizer.decode(ids, skip_special_tokens=True)
    return Generation(ids=ids, logprobs=[0.0] * len(ids), text=action)


@dataclass
class ExpertPlayer:
    """Plays the expert slots of every group (``group_size`` rollouts per group, the last ``members`` of them
    experts). Holds the (task, variation) pairs whose gold path did not reach the goal, across iterations."""

    group_size: int
    members: int = 1
    state_key = "expert_unreachable"
    """The name of :meth:`state_dict` in a checkpoint (:mod:`empo2.episodes.drivers`)."""
    unreachable: set = field(default_factory=set)
    """(task, variation) whose gold replay failed: their expert slots are sampled from the start. Part of every
    checkpoint (:meth:`state_dict`), so that a resumed run plays its expert slots as the uninterrupted run would."""
    cut_actions: int = 0
    """Gold actions cut at ``policy.max_completion_length`` in the current :meth:`play`."""

    @classmethod
    def for_run(cls, cfg, spec) -> ExpertPlayer:
        """The run's driver (``AlgorithmSpec.rollout``): ``spec.expert_members`` experts in each group of
        ``algo.num_generations``."""
        return cls(cfg.algo.num_generations, spec.expert_members)

    def __call__(self, ctx, specs, sampling, cfg, progress, seed=None) -> tuple[list[Episode], dict[str, float]]:
        return self.play(ctx, specs, sampling, progress=progress, seed=seed)

    def state_dict(self) -> list[list]:
        return sorted([task, variation] for task, variation in self.unreachable)

    def load_state_dict(self, state: list[list]) -> None:
        self.unreachable = {(task, int(variation)) for task, variation in state}

    def is_slot(self, ep: Episode) -> bool:
        return ep.member >= self.group_size - self.members

    def actions(self, policy: ActionSource) -> ActionSource:
        """An action source that plays the gold path in expert slots and asks ``policy`` for every other row."""
        plans: dict[tuple[int, int], list[str]] = {}

        def act(ctx: RolloutContext, active: list[int], episodes: list[Episode],
                prompts: list[list[int]]) -> list[Generation]:
            out: list[Generation | None] = [None] * len(active)
            for r, (i, ep) in enumerate(zip(active, episodes)):
                if not ep.steps and self.is_slot(ep) and (ep.task, ep.variation) not in self.unreachable:
                    gold = self._gold(ctx, ep, i)
                    if gold:
                        ep.expert, plans[(ep.group, ep.member)] = True, gold
                if ep.expert:
                    plan = plans[(ep.group, ep.member)]
                    # a gold path that ran out before the episode ended has failed; the episode plays out its cap
                    action = plan[len(ep.steps)] if len(ep.steps) < len(plan) else "look around"
                    out[r] = expert_generation(ctx.tokenizer, action, ctx.policy_cfg.max_completion_length)
                    self.cut_actions += out[r].text != action
            rows = [r for r, g in enumerate(out) if g is None]
            if rows:
                sampled = policy(ctx, [active[r] for r in rows], [episodes[r] for r in rows], [prompts[r] for r in rows])
                for r, g in zip(rows, sampled):
                    out[r] = g
            return out

        return act

    def _gold(self, ctx: RolloutContext, ep: Episode, worker: int) -> list[str]:
        try:
            gold = call_worker(ctx.pool, ep, worker, "gold_actions")
        except EnvError:  # e.g. WebShop's official data, where search misses the target: no expert for this goal
            self.unreachable.add((ep.task, ep.variation))
            return []
        return replayable_gold(list(gold or []))

    def play(self, ctx: RolloutContext, specs: list[tuple[str, int, int, str]], sampling: Sampling,
             progress=None, seed: int | None = None) -> tuple[list[Episode], dict[str, float]]:
        """:func:`run_episodes` of ``specs`` with the expert slots played by the gold path; failed experts are
        replaced by sampled members. Returns the episodes in ``specs`` order and the rollout stats, with
        ``expert_slots`` / ``expert_kept`` / ``expert_fallback`` / ``expert_steps`` / ``expert_discarded_steps`` /
        ``expert_cut_actions``."""
        self.cut_actions = 0
        episodes, stats = run_episodes(ctx, specs, sampling, progress=progress,
                                       actions=self.actions(model_actions(sampling, seed=seed)))
        slots = [k for k, ep in enumerate(episodes) if self.is_slot(ep)]
        failed = [k for k in slots if episodes[k].expert and not episodes[k].success and not episodes[k].failed]
        stats["expert_discarded_steps"] = sum(len(episodes[k].steps) for k in failed)
        for k in failed:
            self.unreachable.add((episodes[k].task, episodes[k].variation))
        if failed:  # the slot becomes an ordinary sampled member
            refill_specs = [(t, v, g + REFILL_GROUP_OFFSET, m) for t, v, g, m in (specs[k] for k in failed)]
            refills, more = run_episodes(ctx, refill_specs, sampling, seed=seed)
            for k, ep in zip(failed, refills):
                ep.group, ep.member = episodes[k].group, episodes[k].member
                episodes[k] = ep
            for key, value in more.items():
                stats[key] += value
        kept = [k for k in slots if episodes[k].expert]
        stats.update(expert_slots=len(slots), expert_kept=len(kept), expert_fallback=len(slots) - len(kept),
                     expert_steps=sum(len(episodes[k].steps) for k in kept), expert_cut_actions=self.cut_actions)
        return episodes, stats


def expert_metrics(batch) -> dict:
    """LUFFY's part of the iteration record (``AlgorithmSpec.metrics``): the expert members of the whole ``batch``,
    their slots, replays and environment steps, apart from the policy's episodes (which the shared ``train`` block
    describes). Empty where the rollout played no expert slot."""
    stats = batch.stats
    if "expert_slots" not in stats:
        return {}
    played = [ep for ep in batch.episodes if ep.expert]
    return {"expert": {"slots": int(stats["expert_slots"]), "kept": int(stats["expert_kept"]),
                       "fallback": int(stats["expert_fallback"]),
                       "fallback_rate": stats["expert_fallback"] / max(stats["expert_slots"], 1),
                       "env_steps": int(stats["expert_steps"] + stats["expert_discarded_steps"]),
                       "discarded_env_steps": int(stats["expert_discarded_steps"]),
                       "cut_actions": int(stats.get("expert_cut_actions", 0)),
                       "score_mean": _mean([ep.score for ep in played]),
                       "success_rate": _mean([ep.success for ep in played]),
                       "rows": int(batch.losses.get("expert_rows", 0))}}


def _mean(values: list[float]) -> float:
    return float(np.mean(values)) if values else 0.0
