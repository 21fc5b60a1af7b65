"""Playing a recorded episode again from the middle: put a worker into the state after the first m steps of an
:class:`~empo2.episodes.episode.Episode` (the environments' ``restore_prefix``, through the pool's ``restore``), and
check the replay against the record.

Neither simulator has a state snapshot, so the way back is to reload the task and replay what the environment ran
(``Step.commands``). ScienceWorld's text is not byte-identical across loads (object listing order, some readings):
a replayed observation that differs from the recorded one beyond the order of its lines is counted, and the branch
goes on from the replayed state, since that is the state the simulator is really in.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from typing import Any

from empo2.episodes.episode import Episode


def prefix_commands(ep: Episode, m: int) -> list[list[str]]:
    """The commands that replay the first ``m`` steps of ``ep``, one list per step."""
    if not 0 <= m <= len(ep.steps):
        raise ValueError(f"prefix of {m} steps asked of an episode of {len(ep.steps)}")
    return [list(s.commands) or [s.action] for s in ep.steps[:m]]


def same_up_to_line_order(replayed: str, recorded: str) -> bool:
    """Whether two observations hold the same lines (each stripped), in any order."""
    return sorted(line.strip() for line in replayed.splitlines()) == sorted(
        line.strip() for line in recorded.splitlines())


@dataclass
class Branch:
    """A worker put back into the state after ``m`` steps of ``source``."""

    source: Episode
    m: int
    observation: str
    info: dict[str, Any]
    mismatched_steps: list[int] = field(default_factory=list)
    """1-based steps whose replayed observation differs from the recorded one beyond line order."""


def restore_branches(pool, requests: list[tuple[int, Episode, int]]) -> tuple[dict[int, Branch | Any], dict[str, float]]:
    """Restore worker ``i`` to the state after ``m`` steps of ``episode`` for each ``(i, episode, m)``, in parallel.

    Returns per worker a :class:`Branch` (or the pool's failure for a worker that crashed) and the metrics
    ``replay_branches``, ``replay_mismatch_branches`` (branches with at least one differing step),
    ``replay_mismatch_steps`` and ``replay_time`` (seconds).
    """
    t0 = time.perf_counter()
    replies = pool.restore([(i, ep.task, ep.variation, prefix_commands(ep, m)) for i, ep, m in requests])
    out: dict[int, Branch | Any] = {}
    mismatch_branches = mismatch_steps = 0
    for i, ep, m in requests:
        reply = replies[i]
        if not isinstance(reply, tuple):
            out[i] = reply
            continue
        obs, info = reply
        replayed = info.get("observations", [])
        bad = [t + 1 for t, (a, b) in enumerate(zip(replayed, (s.observation for s in ep.steps[:m])))
               if not same_up_to_line_order(a, b)]
        mismatch_branches += bool(bad)
        mismatch_steps += len(bad)
        out[i] = Branch(ep, m, obs, info, bad)
    metrics = {"replay_branches": float(len(requests)), "replay_mismatch_branches": float(mismatch_branches),
               "replay_mismatch_steps": float(mismatch_steps), "replay_time": time.perf_counter() - t0}
    return out, metrics
