"""Rollout drivers (``AlgorithmSpec.rollout``): how an iteration's groups are played. ``episodes`` plays G independent
episodes per group (:func:`empo2.episodes.rollout.run_episodes`); a method with a rollout of its own names its driver
in its registry entry, as a function or as the ``"module:function"`` path of one (ELPO's tree,
:func:`empo2.episodes.elpo_rollout.drive`), so this module names no method. Each is called as
``driver(ctx, specs, sampling, cfg, progress, seed) -> (episodes, stats)`` (``sampling``: the rollouts'
:class:`~empo2.policy.sampling.Sampling`; ``seed``: the iteration's sampling seed or ``None``).

A driver that remembers something across iterations is a class instead (LUFFY's expert members,
:class:`empo2.episodes.expert.ExpertPlayer`): :func:`make_driver` builds it once per run with its classmethod
``for_run(cfg, spec)``, and its instances are called as a function driver is. Where it has a state to keep, it has
``state_key`` (the state's name in a checkpoint), ``state_dict() -> list`` and ``load_state_dict(list)``; the list's
items are facts any rank may learn, so the trainer gathers every rank's list after each rollout
(:func:`share_state`)."""

from __future__ import annotations

from collections.abc import Callable

from empo2.algo.registry import load_hook
from empo2.episodes.rollout import run_episodes


def _episodes(ctx, specs, sampling, cfg, progress, seed=None):
    return run_episodes(ctx, specs, sampling, progress=progress, seed=seed)


ROLLOUT_DRIVERS: dict[str, Callable] = {"episodes": _episodes}


def rollout_driver(name: str | Callable) -> Callable:
    """The driver (or driver class) an ``AlgorithmSpec.rollout`` names: a registered name, a function or class, or
    ``"module:function"``."""
    if callable(name):
        return name
    if name in ROLLOUT_DRIVERS:
        return ROLLOUT_DRIVERS[name]
    if ":" not in name:
        raise ValueError(f"unknown rollout driver {name!r}; registered: {', '.join(sorted(ROLLOUT_DRIVERS))}, "
                         "or a 'module:function' path")
    return load_hook(name, "rollout driver")


def make_driver(spec, cfg) -> Callable:
    """The run's driver of the algorithm ``spec``: its function, or an instance of its driver class."""
    driver = rollout_driver(spec.rollout)
    return driver.for_run(cfg, spec) if isinstance(driver, type) else driver


def has_state(driver) -> bool:
    return hasattr(driver, "state_dict")


def share_state(driver, all_gather: Callable[[list], list[list]]) -> None:
    """Every rank's driver learns what the others learnt this iteration (as one process would; rank 0 checkpoints
    it)."""
    if has_state(driver):
        driver.load_state_dict([item for part in all_gather(driver.state_dict()) for item in part])
