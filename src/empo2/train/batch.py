"""What one iteration of :meth:`empo2.train.trainer.Trainer.iteration` produced, and the metrics record (one line of
``metrics.jsonl``) made from it."""

from __future__ import annotations

import json
from collections import Counter
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np

from empo2.episodes.episode import Episode, episode_record
from empo2.rundir.metrics import peak_rss_gb


@dataclass
class Batch:
    """What one iteration produced, as :meth:`~empo2.train.trainer.Trainer.iteration` hands it to the record."""

    iteration: int
    modes: list[str]
    """The mode of each group of the global batch (the same on every rank)."""
    specs: list[tuple[str, int, int, str]]
    """This rank's rollouts, G per group: (task, variation, group, mode)."""
    episodes: list[Episode] = field(default_factory=list)
    stats: dict[str, float] = field(default_factory=dict)
    """The rollout's times and token counts (:func:`~empo2.episodes.rollout.run_episodes`); the memory time includes
    the reflection's."""
    intrinsic_weight: float = 0.0
    returns: np.ndarray = field(default_factory=lambda: np.zeros(0))
    """Each episode of :attr:`ran`'s return R = Σ_t (r_t + w·r_int_t) = R_ext + w · R_int [N] float64, computed once
    with the advantages: the sum of the step rewards on its path (:func:`~empo2.algo.advantages.path_rewards`, an
    ELPO branch's prefix included)."""
    advantage_metrics: dict[str, float] = field(default_factory=dict)
    losses: dict[str, float] = field(default_factory=dict)
    seconds: dict[str, float] = field(default_factory=lambda: {"rollout": 0.0, "update": 0.0, "sync": 0.0})
    """Wall time of the rollout (with the reflection or its start), of the update, and of the separate rollout
    engine's weight sync (vLLM)."""

    @property
    def ran(self) -> list[Episode]:
        return ran_episodes(self.episodes)


def ran_episodes(episodes: list[Episode]) -> list[Episode]:
    """The episodes that ran to the end: one lost to a crashed environment worker is left out of the update."""
    return [ep for ep in episodes if not ep.failed]


def iteration_record(batch: Batch, aggregation: str, memory_size: int, env_steps: int,
                     expert_env_steps: int = 0, method_metrics: Callable[[Batch], dict[str, Any]] | None = None,
                     ) -> dict[str, Any]:
    """The metrics record of ``batch`` (the whole batch, on rank 0); ``env_steps`` is the run's running total of the
    policy's environment steps, ``expert_env_steps`` that of the expert members' (algorithms with experts only).
    ``train`` describes the policy's own episodes; ``method_metrics`` (the algorithm's ``AlgorithmSpec.metrics``)
    adds the entries of the method's own, e.g. its expert members' (LUFFY's gold paths) or its searches (ELPO's)."""
    stats = batch.stats
    episodes = [ep for ep in batch.episodes if not ep.expert]
    ran = [(ep, r) for ep, r in zip(batch.ran, batch.returns) if not ep.expert]
    scores = [ep.score for ep in episodes]
    return {
        "iteration": batch.iteration,
        "env_steps": env_steps,
        **({"expert_env_steps": expert_env_steps} if expert_env_steps else {}),
        "modes": batch.modes,
        "mode_counts": dict(Counter(batch.modes)),
        "train": {"score_mean": float(np.mean(scores)), "score_max": float(np.max(scores)),
                  "success_rate": float(np.mean([ep.success for ep in episodes])),
                  "return_mean": mean_or_zero([r for _, r in ran]),
                  "intrinsic_mean": mean_or_zero([ep.intrinsic_return(aggregation) for ep, _ in ran]),
                  "accepted_rate": mean_or_zero([s.accepted for ep in episodes for s in ep.steps]),
                  "intrinsic_weight": batch.intrinsic_weight, "failed_episodes": sum(ep.failed for ep in episodes),
                  "steps_mean": float(np.mean([len(ep.steps) for ep in episodes])),
                  "env_steps": batch_env_steps(batch)},
        "advantage": batch.advantage_metrics,
        "loss": batch.losses,
        "memory": {"size": memory_size,
                   "added": sum(1 for ep in episodes if ep.tip_written),
                   "rejected": sum(1 for ep in episodes if ep.tip_rejected),
                   "rejected_reasons": dict(Counter(ep.tip_rejected for ep in episodes if ep.tip_rejected)),
                   "tips_used_per_step": mean_or_zero([len(s.tip_ids) for ep in episodes for s in ep.steps])},
        "time": {"memory": stats["memory_time"], "generate": stats["gen_time"], "env": stats["env_time"],
                 "rollout": batch.seconds["rollout"], "update": batch.seconds["update"], "sync": batch.seconds["sync"]},
        "tokens_per_s": {"generate": stats["gen_tokens"] / max(stats["gen_time"], 1e-9),
                         "update": batch.losses.get("tokens", 0) / max(batch.seconds["update"], 1e-9)},
        "long_prompts": stats["long_prompts"], "memory_peak_rss_gb": peak_rss_gb(),
        **(method_metrics(batch) if method_metrics is not None else {}),
    }


def no_signal_warnings(batch: Batch, zero_adv_streak: int, train_cfg) -> tuple[int, list[str]]:
    """The warnings to show when the run has no learning signal: zero advantage in every group for
    ``train.zero_adv_warn_iters`` iterations in a row, or an agent that hardly acts. Returns the new streak too."""
    metrics, warnings = batch.advantage_metrics, []
    zero_adv_streak = zero_adv_streak + 1 if metrics["zero_adv_groups"] == metrics["groups"] else 0
    if zero_adv_streak >= train_cfg.zero_adv_warn_iters:
        warnings.append(f"[warning] {zero_adv_streak} iterations in a row with zero advantage in every group: "
                        "no learning signal (all rollouts of each task scored the same). Consider more generations, "
                        "easier tasks, memory rollouts or the intrinsic reward.")
    accepted = mean_or_zero([s.accepted for ep in batch.episodes for s in ep.steps])
    if accepted < 0.5:
        warnings.append(f"[warning] only {accepted:.0%} of this iteration's actions were accepted by the "
                        "environment: the agent hardly acts, so returns carry little signal (see env.action_cutoff).")
    return zero_adv_streak, warnings


def append_samples(path: Path, batch: Batch, n: int, tokenizer) -> None:
    """Append the first ``n`` episodes of ``batch`` to ``trajectories.jsonl`` (prompts and responses as text)."""
    if n <= 0:
        return
    with open(path, "a") as fh:
        for ep in batch.episodes[:n]:
            fh.write(json.dumps({"iteration": batch.iteration, **episode_record(ep, tokenizer)}) + "\n")


def batch_env_steps(batch: Batch) -> int:
    """Environment steps of the batch's sampled episodes (the run's budget this iteration spent); an expert
    member's steps are counted apart (:func:`batch_expert_steps`)."""
    return sum(len(ep.steps) for ep in batch.episodes if not ep.expert)


def batch_expert_steps(batch: Batch) -> int:
    """Environment steps the expert members took, the kept ones and the replays that missed the goal."""
    return int(batch.stats.get("expert_steps", 0) + batch.stats.get("expert_discarded_steps", 0))


def mean_or_zero(values: list[float]) -> float:
    return float(np.mean(values)) if values else 0.0
