"""A trajectory as plain data: an :class:`Episode` of :class:`Step`, which the update, the metrics, the memory and
the sample writer read, and the key its states are known by (:func:`state_text`)."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import numpy as np

MEMORY_MODES = ("on_tips", "off_tips")
"""The modes whose rollouts retrieve tips (the paper's memory-augmented rollouts)."""


@dataclass
class Step:
    prompt_ids: list[int]
    """The prompt the action was sampled with (with tips in memory modes)."""
    train_prompt_ids: list[int]
    """The prompt the update trains on: tip-free for ``off_tips``, else the same as ``prompt_ids``."""
    response_ids: list[int]
    logp_old: list[float]
    """Behaviour log-probs of ``response_ids`` under ``prompt_ids``."""
    raw_action: str
    action: str
    observation: str
    reward: float
    state_text: str
    """The observation the action answered (:func:`state_text`): the retrieval query and a tip's key."""
    state_observation: str = ""
    """The observation the action answered, verbatim: GiGPO's anchor-state key (``state_text`` is folded and cut)."""
    state_embedding: np.ndarray | None = None
    """Embedding of ``state_text`` where one was computed (memory rollouts embed every state to retrieve)."""
    tip_ids: list[int] = field(default_factory=list)
    tips: list[str] = field(default_factory=list)
    intrinsic: float = 0.0
    accepted: bool = True
    """Whether the environment accepted the action (after correction)."""
    commands: list[str] = field(default_factory=list)
    """What the environment ran for this step (``info['commands']``: ScienceWorld's rejected tries, corrections and
    automatic answers included), so that the episode can be replayed up to here; empty = just ``action``."""


@dataclass
class Episode:
    task: str
    variation: int
    group: int
    mode: str
    member: int = 0
    """Index of this rollout within its group: (group, member) orders a batch's episodes across ranks."""
    task_description: str = ""
    steps: list[Step] = field(default_factory=list)
    score: float = 0.0
    success: bool = False
    done: bool = False
    failed: bool = False
    error: str = ""
    tip_written: str | None = None
    tip_rejected: str | None = None
    parent: tuple[int, int] | None = None
    """A branch (ELPO): (member of the episode of the same group it branched from, m); it shares that episode's first
    m steps, which it does not hold, and its ``steps`` are the ones after them."""
    critical_step: int | None = None
    """A searched failure (ELPO): t_crit, the first irrecoverable step (1-based) the binary search localised."""

    @property
    def extrinsic_return(self) -> float:
        return float(sum(s.reward for s in self.steps))

    def intrinsic_return(self, aggregation: str = "mean") -> float:
        """The episode's novelty reward: mean over its steps (a long episode is not paid for its length) or sum."""
        values = [s.intrinsic for s in self.steps]
        if not values:
            return 0.0
        return float(np.mean(values) if aggregation == "mean" else np.sum(values))

    @property
    def accepted_rate(self) -> float:
        """Fraction of this episode's actions the environment accepted."""
        return float(np.mean([s.accepted for s in self.steps])) if self.steps else 1.0

    def summary(self) -> dict[str, Any]:
        return {"task": self.task, "variation": self.variation, "mode": self.mode, "score": self.score,
                "success": self.success, "steps": len(self.steps), "failed": self.failed}


def namespace_of(task: str, variation: int, scheme: str) -> str:
    return f"{task}#{variation}" if scheme == "task_variation" else task


def state_text(observation: str) -> str:
    """The key of a state for retrieval, tips and novelty: the observation alone. Memory and novelty are already
    namespaced by task, and a key that also held the task description made every state of a task look alike
    (cosine 0.94–0.99), so retrieval fell back to ranking ties."""
    return " ".join(observation.split())[:1000]



def episode_record(ep: Episode, tokenizer, max_steps: int = 50) -> dict[str, Any]:
    """A JSON-able sample of an episode for ``trajectories.jsonl``: prompts as text, actions, rewards, tips."""
    return {
        **ep.summary(), "task_description": ep.task_description, "tip_written": ep.tip_written,
        "tip_rejected": ep.tip_rejected, "error": ep.error,
        "steps": [{
            "prompt": tokenizer.decode(s.prompt_ids), "raw_action": s.raw_action, "action": s.action,
            "accepted": s.accepted, "observation": s.observation, "reward": s.reward, "intrinsic": s.intrinsic,
            "tips": s.tips,
        } for s in ep.steps[:max_steps]],
    }
