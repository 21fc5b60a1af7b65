"""The return every advantage estimator reads: each step's reward r_t + w·r_int_t, the environment's reward plus the
weighted novelty reward (docs/fidelity.md, *The novelty reward*).

The novelty bonus is EMPO²'s (its ``AlgorithmSpec.novelty``), and any other arm may run with it (``+novelty``), so
the return's terms are shared here; :mod:`empo2.algo.empo2` writes them as the paper's equations.

- :func:`novelty_reward` — r_int = 1/n, n the visits of the state (:class:`empo2.memory.novelty.NoveltyReward` counts
  them, a whole batch at once).
- :func:`intrinsic_weight` — the weight w of r_int, constant or annealed linearly (0.8 → 0.2).
- :func:`intrinsic_return`, :func:`step_rewards_with_novelty` — R = R_ext + w·R_int, with each step's reward
  r_t + w·r_int_t (w / T_i per step when R_int is the mean over the episode's steps).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import numpy as np


def novelty_reward(visits: np.ndarray) -> np.ndarray:
    """The paper's r_intrinsic = 1/n with n the number of similar states: visits [N] (each visit's n: the
    visits of its state before the batch plus those in it, every visit of a batch counted together) -> [N] float64
    in (0, 1]. A state's first visit earns 1, and repeats earn less."""
    return 1.0 / np.asarray(visits, dtype=np.float64)


def intrinsic_weight(algo: Any, iteration: int, total_iterations: int) -> float:
    """The weight w of the intrinsic reward at ``iteration`` (0-based) of ``total_iterations``, from an
    ``AlgoConfig``: constant, or annealed over training (0.8 → 0.2 by default).

    - ``algo.intrinsic_schedule = constant``: ``algo.intrinsic_weight`` (0 = intrinsic reward off).
    - ``linear``: ``algo.intrinsic_weight_start`` at iteration 0, ``algo.intrinsic_weight_end`` at iteration
      ``n - 1`` and after, linear in between (``algo.intrinsic_weight`` is ignored), where n is
      ``algo.intrinsic_schedule_iterations``, or ``total_iterations`` where that is 0.
    """
    schedule = algo.intrinsic_schedule
    if schedule == "constant":
        return float(algo.intrinsic_weight)
    if schedule == "linear":
        start, end = algo.intrinsic_weight_start, algo.intrinsic_weight_end
        span = max(int(getattr(algo, "intrinsic_schedule_iterations", 0) or total_iterations) - 1, 1)
        frac = min(max(iteration / span, 0.0), 1.0)
        return float(start + (end - start) * frac)
    raise ValueError(f"unknown intrinsic schedule {schedule!r}; use 'constant' or 'linear'")


def intrinsic_return(novelty: Sequence[float], aggregation: str = "mean") -> float:
    """R_int of one episode from its steps' novelty rewards: the mean (``algo.intrinsic_aggregation``, the default:
    a long episode is not paid for its length) or the sum; 0 for an episode without steps."""
    if not len(novelty):
        return 0.0
    return float(np.mean(novelty) if aggregation == "mean" else np.sum(novelty))


def step_rewards_with_novelty(extrinsic: Sequence[float], novelty: Sequence[float], weight: float,
                              aggregation: str = "mean") -> np.ndarray:
    """One episode's step rewards r_t + w_t·r_int_t [T] float64, the return's terms: they sum to
    R_ext + w·R_int (R_int: :func:`intrinsic_return`), so w_t = w / T under ``mean``
    aggregation and w under ``sum``. extrinsic [T] (the environment's step rewards), novelty [T]."""
    if len(extrinsic) != len(novelty):
        raise ValueError(f"{len(extrinsic)} step rewards but {len(novelty)} novelty rewards")
    w = weight / max(len(extrinsic), 1) if aggregation == "mean" else weight
    return np.array([r + w * n for r, n in zip(extrinsic, novelty)], dtype=np.float64)
