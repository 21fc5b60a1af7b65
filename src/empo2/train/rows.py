"""The update's unit of data: one generated action (a row), with the prompt it is trained on and its advantage."""

from __future__ import annotations

from dataclasses import dataclass

from empo2.algo.elpo import critical_steps


@dataclass
class UpdateRow:
    train_prompt: list[int]
    """Prompt token ids the update conditions on (tip-free for ``off_tips``)."""
    response: list[int]
    """The sampled action's token ids."""
    logp_old: list[float]
    """Behaviour log-probs of ``response`` (recorded at rollout on the rollout prompt)."""
    advantage: float
    """This step's advantage (an episode-level estimator gives every step of an episode the same value)."""
    mode: str
    """``on`` / ``on_tips`` / ``off_tips``."""
    rollout_prompt: list[int] | None = None
    """The prompt the action was sampled on (with tips in the memory modes); ``None``: ``train_prompt``."""
    token_weights: list[float] | None = None
    """Per-token importance weights on the advantage (truncated engine/trainer ratios); ``None``: all 1."""
    off_policy: bool = False
    """An expert's action (the gold path, not sampled from π_old): the loss shapes it instead of taking a ratio."""
    critical: bool = False
    """The step is a searched failure's critical step or after it (ELPO widens its lower clip bound there)."""


def update_rows(episodes, step_advantages: list[list[float]]) -> list[UpdateRow]:
    """One row per generated step of ``episodes``; ``step_advantages[i][t]`` is step t of episode i."""
    rows = []
    for ep, advs in zip(episodes, step_advantages):
        critical = critical_steps(len(ep.steps), ep.critical_step)  # ELPO's Eq. 11 scope
        for step, a, crit in zip(ep.steps, advs, critical):
            if step.response_ids:
                rows.append(UpdateRow(step.train_prompt_ids, step.response_ids, list(step.logp_old), float(a),
                                      ep.mode, rollout_prompt=step.prompt_ids, off_policy=ep.expert,
                                      critical=bool(crit)))
    return rows
