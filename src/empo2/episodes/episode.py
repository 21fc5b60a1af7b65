"""A trajectory as plain data: an :class:`Episode` of :class:`Step`, which the update, the metrics, the memory and
the sample writer read. A step's state is the environment's (:func:`empo2.envs.base.state_of`)."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import numpy as np

from empo2.algo.returns import intrinsic_return


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
    """The state the action answered, as the environment defines it (:func:`empo2.envs.base.state_of`): the
    retrieval query, a tip's key, and the anchor GiGPO and ProxMO group steps by. Never empty."""
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

    @property
    def raw_valid(self) -> bool:
        """Whether the environment ran the model's own output as written (no correction replaced it)."""
        return self.accepted and " ".join(self.action.lower().split()) == " ".join(self.raw_action.lower().split())

    def __post_init__(self) -> None:
        if not isinstance(self.state_text, str) or not self.state_text.strip():
            # An empty state would put every such step of a group into one anchor and one memory key.
            raise ValueError("a Step needs the state its action answered (state_text), got an empty one")


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
    expert: bool = False
    """Played the environment's gold path instead of sampling (LUFFY's off-policy member, :mod:`empo2.episodes.expert`)."""
    initial_observation: str = ""
    """The observation the episode started with (its prompts show it)."""
    final_state: str = ""
    """The state the last step reached (the state each earlier step reached is the next step's ``state_text``)."""

    def reached_states(self) -> list[str]:
        """The state each step's action led to: what the novelty reward counts."""
        if self.steps and not self.final_state.strip():
            raise ValueError("an episode with steps needs the state its last step reached (final_state)")
        return [s.state_text for s in self.steps[1:]] + ([self.final_state] if self.steps else [])

    @property
    def extrinsic_return(self) -> float:
        return float(sum(s.reward for s in self.steps))

    def intrinsic_return(self, aggregation: str = "mean") -> float:
        """The episode's novelty reward R_int (:func:`empo2.algo.empo2.intrinsic_return`): mean or sum."""
        return intrinsic_return([s.intrinsic for s in self.steps], aggregation)

    @property
    def accepted_rate(self) -> float:
        """Fraction of this episode's actions the environment accepted."""
        return float(np.mean([s.accepted for s in self.steps])) if self.steps else 1.0

    def summary(self) -> dict[str, Any]:
        return {"task": self.task, "variation": self.variation, "mode": self.mode, "score": self.score,
                "success": self.success, "steps": len(self.steps), "failed": self.failed}


def namespace_of(task: str, variation: int, scheme: str) -> str:
    return f"{task}#{variation}" if scheme == "task_variation" else task



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
