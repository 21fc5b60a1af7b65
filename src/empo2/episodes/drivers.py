"""Rollout drivers by name (``AlgorithmSpec.rollout``): how an iteration's groups are played. ``episodes`` plays G
independent episodes per group (:func:`empo2.episodes.rollout.run_episodes`); ``elpo`` grows each group's tree by
Algorithm 1 of ELPO (:func:`empo2.episodes.elpo_rollout.run_elpo`). Each is called as
``driver(ctx, specs, sampling, cfg, progress, seed) -> (episodes, stats)`` (``sampling``: the rollouts'
:class:`~empo2.policy.sampling.Sampling`; ``seed``: the iteration's sampling seed or ``None``)."""

from __future__ import annotations

from collections.abc import Callable

from empo2.episodes.elpo_rollout import ElpoOptions, run_elpo
from empo2.episodes.rollout import run_episodes


def _episodes(ctx, specs, sampling, cfg, progress, seed=None):
    return run_episodes(ctx, specs, sampling, progress=progress, seed=seed)


def _elpo(ctx, specs, sampling, cfg, progress, seed=None):
    a = cfg.algo
    return run_elpo(ctx, specs, sampling, progress=progress,
                    options=ElpoOptions(a.elpo_b_max, a.elpo_x_min, a.elpo_x_max, a.elpo_beta), seed=seed)


ROLLOUT_DRIVERS: dict[str, Callable] = {"episodes": _episodes, "elpo": _elpo}


def rollout_driver(name: str) -> Callable:
    if name not in ROLLOUT_DRIVERS:
        raise ValueError(f"unknown rollout driver {name!r}; registered: {', '.join(sorted(ROLLOUT_DRIVERS))}")
    return ROLLOUT_DRIVERS[name]
