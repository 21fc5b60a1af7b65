"""Playing a recorded episode again from the middle: put a worker into the state after the first m steps of an
:class:`~empo2.episodes.episode.Episode` (the environments' ``restore_prefix``, through the pool's ``restore``), and
check the replay against the record.

Neither simulator has a state snapshot, so the way back is to reload the task and replay what the environment ran
(``Step.commands``). The check compares the state the replay reached with the state the source episode was in after
step m (:func:`state_after`), the environment's own state (:func:`empo2.envs.base.state_of`: on ScienceWorld the
task's progress, the inventory and the room, listings sorted), not the one-line replies, which read alike in
different places. A branch whose state differs is counted, and goes on from the replayed state, since that is the
state the simulator is really in; a branch whose replay ended its episode has no step left to play
(:attr:`Branch.ended`).
"""

from __future__ import annotations

import time
from dataclasses import dataclass
from typing import Any

from empo2.envs.base import state_of
from empo2.episodes.episode import Episode


def prefix_commands(ep: Episode, m: int) -> list[list[str]]:
    """The commands that replay the first ``m`` steps of ``ep``, one list per step."""
    if not 0 <= m <= len(ep.steps):
        raise ValueError(f"prefix of {m} steps asked of an episode of {len(ep.steps)}")
    return [list(s.commands) or [s.action] for s in ep.steps[:m]]


def state_after(ep: Episode, m: int) -> str:
    """The state ``ep`` was in after its first ``m`` steps: the state step m + 1 answered, or the last one reached."""
    if not 0 <= m <= len(ep.steps):
        raise ValueError(f"the state after {m} steps asked of an episode of {len(ep.steps)}")
    return ep.steps[m].state_text if m < len(ep.steps) else ep.final_state


@dataclass
class Branch:
    """A worker put back into the state after ``m`` steps of ``source``."""

    source: Episode
    m: int
    observation: str
    info: dict[str, Any]
    state: str
    """The state the replay reached (:func:`empo2.envs.base.state_of`)."""
    matches: bool
    """Whether :attr:`state` is the source's state after step m (:func:`state_after`)."""

    @property
    def ended(self) -> bool:
        """The replay ended the episode (a recorded step that now completes or fails the task, or reaches the cap):
        there is nothing left to sample from here."""
        return bool(self.info.get("done"))


def restore_branches(pool, requests: list[tuple[int, Episode, int]]) -> tuple[dict[int, Branch | Any], dict[str, float]]:
    """Restore worker ``i`` to the state after ``m`` steps of ``episode`` for each ``(i, episode, m)``, in parallel.

    Returns per worker a :class:`Branch` (or the pool's failure for a worker that crashed) and the metrics
    ``replay_branches``, ``replay_mismatch_branches`` (branches whose replayed state differs from the source's
    state after step m), ``replay_ended_branches`` (replays that ended their episode) and ``replay_time`` (seconds).
    """
    t0 = time.perf_counter()
    replies = pool.restore([(i, ep.task, ep.variation, prefix_commands(ep, m)) for i, ep, m in requests])
    out: dict[int, Branch | Any] = {}
    mismatched = ended = 0
    for i, ep, m in requests:
        reply = replies[i]
        if not isinstance(reply, tuple):
            out[i] = reply
            continue
        obs, info = reply
        state = state_of(obs, info)
        branch = Branch(ep, m, obs, info, state, state == state_after(ep, m))
        mismatched += not branch.matches
        ended += branch.ended
        out[i] = branch
    metrics = {"replay_branches": float(len(requests)), "replay_mismatch_branches": float(mismatched),
               "replay_ended_branches": float(ended), "replay_time": time.perf_counter() - t0}
    return out, metrics
