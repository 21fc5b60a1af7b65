"""The update's unit of data: one generated action (a row), with the prompt it is trained on and its advantage."""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any


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
    extras: dict[str, Any] = field(default_factory=dict)
    """What the algorithm's rows carry besides these fields (``AlgorithmSpec.row_extras``: ELPO's ``critical``),
    handed to its loss by keyword."""


def update_rows(episodes, step_advantages: list[list[float]],
                row_extras: Callable[[Any], dict[str, Sequence]] | None = None) -> list[UpdateRow]:
    """One row per generated step of ``episodes``; ``step_advantages[i][t]`` is step t of episode i; ``row_extras``:
    the algorithm's ``episode -> {name: one value per step}``."""
    rows = []
    for ep, advs in zip(episodes, step_advantages):
        extras = row_extras(ep) if row_extras is not None else {}
        for t, (step, a) in enumerate(zip(ep.steps, advs)):
            if step.response_ids:
                rows.append(UpdateRow(step.train_prompt_ids, step.response_ids, list(step.logp_old), float(a),
                                      ep.mode, rollout_prompt=step.prompt_ids, off_policy=ep.expert,
                                      extras={name: values[t].item() if hasattr(values[t], "item") else values[t]
                                              for name, values in extras.items()}))
    return rows
