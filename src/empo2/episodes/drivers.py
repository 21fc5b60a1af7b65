"""Rollout drivers (``AlgorithmSpec.rollout``): how an iteration's groups are played. ``episodes`` plays G independent
episodes per group (:func:`empo2.episodes.rollout.run_episodes`); a method with a rollout of its own names its driver
in its registry entry, as a function or as the ``"module:function"`` path of one (ELPO's tree,
:func:`empo2.episodes.elpo_rollout.drive`), so this module names no method. Each is called as
``driver(ctx, specs, sampling, cfg, progress, seed) -> (episodes, stats)`` (``sampling``: the rollouts'
:class:`~empo2.policy.sampling.Sampling`; ``seed``: the iteration's sampling seed or ``None``)."""

from __future__ import annotations

import importlib
from collections.abc import Callable

from empo2.episodes.rollout import run_episodes


def _episodes(ctx, specs, sampling, cfg, progress, seed=None):
    return run_episodes(ctx, specs, sampling, progress=progress, seed=seed)


ROLLOUT_DRIVERS: dict[str, Callable] = {"episodes": _episodes}


def rollout_driver(name: str | Callable) -> Callable:
    """The driver an ``AlgorithmSpec.rollout`` names: a registered name, a function, or ``"module:function"``."""
    if callable(name):
        return name
    if name in ROLLOUT_DRIVERS:
        return ROLLOUT_DRIVERS[name]
    module, _, function = name.partition(":")
    if function:
        try:
            return getattr(importlib.import_module(module), function)
        except (ImportError, AttributeError) as exc:
            raise ValueError(f"rollout driver {name!r} cannot be loaded: {exc}") from None
    raise ValueError(f"unknown rollout driver {name!r}; registered: {', '.join(sorted(ROLLOUT_DRIVERS))}, "
                     "or a 'module:function' path")
