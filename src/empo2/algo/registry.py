"""Algorithms as registry entries (verl-style): one :class:`AlgorithmSpec` per ``algo.name``.

A spec says everything the trainer needs to know about an algorithm — whether it keeps a tip memory, how its rollout
modes are drawn, which policy loss and which advantage estimator it uses — so the trainer, the config and the CLI never
branch on the algorithm's name. Adding an algorithm is one call::

    register_algorithm(AlgorithmSpec("my_algo", uses_memory=False, loss="grpo", advantage="grpo"))

(plus, if it needs them, a new loss with ``@register_policy_loss`` and a new estimator with ``@register_advantage``;
and, if it has settings of its own, an ``options`` class: :attr:`AlgorithmSpec.options`).
Each method's file makes that call for its own algorithm (:mod:`empo2.algo.elpo` …), and :mod:`empo2.algo` imports
the method files, one line each; this module names no method, only the two that have no file of their own: ``grpo``
(the shared estimator and loss) and ``frozen`` (no update).
"""

from __future__ import annotations

import importlib
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

from empo2.algo.modes import MODES
from empo2.bounds import check_options


def on_policy_only(algo_cfg: Any) -> dict[str, float]:
    """Mode probabilities of a memory-free algorithm: always ``on``."""
    return {"on": 1.0, "on_tips": 0.0, "off_tips": 0.0}


@dataclass(frozen=True)
class AlgorithmSpec:
    name: str
    uses_memory: bool
    """Keep a tip memory: retrieve tips in memory modes and reflect after episodes."""
    loss: str
    """Policy-loss registry name (``empo2.algo.losses``)."""
    advantage: str | None = None
    """Advantage-estimator registry name; ``None`` = the config's ``algo.advantage``."""
    mode_probs: Callable[[Any], dict[str, float]] = on_policy_only
    """``AlgoConfig -> {mode: probability}`` over ``on`` / ``on_tips`` / ``off_tips``."""
    updates_weights: bool = True
    """``False`` for memory-only baselines (no optimizer step is ever taken)."""
    expert_members: int = 0
    """Members of each group that play the environment's gold path instead of sampling (LUFFY's off-policy
    guidance, :mod:`empo2.episodes.expert`); their rows are marked off-policy for the loss."""
    rollout: str | Callable = "episodes"
    """How its groups are played (:func:`empo2.episodes.drivers.make_driver`): ``episodes`` (G independent
    episodes per group), a driver ``(ctx, specs, sampling, cfg, progress, seed) -> (episodes, stats)`` (the stats
    keys of :func:`empo2.episodes.rollout.run_episodes`, ``step_waves`` among them), or the ``"module:function"`` path
    of one, for a driver that lives above ``algo`` (ELPO's tree, in
    :mod:`empo2.episodes.elpo_rollout`). A driver that keeps state across iterations is a class, built once per run
    (LUFFY's expert members, :class:`empo2.episodes.expert.ExpertPlayer`)."""
    row_extras: Callable[[Any], dict[str, Sequence]] | None = None
    """``episode -> {name: one value per step}``: what its update rows carry besides the shared fields, handed to its
    loss by keyword as a [B] tensor (ELPO's ``critical``); a name no row of a micro-batch sets true is left out."""
    metrics: str | Callable | None = None
    """``batch -> {name: value}``: what the iteration record (one line of ``metrics.jsonl``) holds for this method
    besides the shared fields, from the whole batch's ``episodes``, rollout ``stats`` and ``losses``
    (:class:`empo2.train.batch.Batch`); a function or the ``"module:function"`` path of one (ELPO's searches, LUFFY's
    expert members, beside the rollout stats they read)."""
    reward_note: str = ""
    """What its rollout changes about the return, for ``compare``'s description of an arm (ELPO's path returns)."""
    novelty: bool = False
    """The novelty reward is part of the method (EMPO²'s 1/n, SPEC §4). ``compare`` and ``train --algo`` run any
    other algorithm without it, unless its arm name says ``+novelty``, so two arms differ in their method only."""
    official: tuple[str, dict[str, Any]] = ("", {})
    """(source, the ``algo`` settings of the method's official runs by their name under ``algo``: ``beta``,
    ``luffy.clip``; ``entropy_coeff``: an entropy bonus, which empo2's losses do not have): ``compare`` lists where a
    run differs from them."""
    options: type | None = None
    """Its own settings: a frozen dataclass whose class attribute ``key`` names its place in the ``algo`` section
    (``algo.<key>.<field>``), each field with its default, its bounds (:func:`empo2.bounds.bounded`) and its
    docstring, as the config's own fields have. Every ``algo`` section holds the options of every registered
    algorithm (:func:`method_options`), so an estimator finds its own wherever it runs (``algo.gigpo`` under
    ``algo.name=empo2 algo.advantage=gigpo``); two algorithms may share one class (``luffy`` and ``empo2_luffy``)."""

    def estimator(self, algo_cfg: Any) -> str:
        return self.advantage or algo_cfg.advantage

    def modes(self, algo_cfg: Any) -> dict[str, float]:
        probs = self.mode_probs(algo_cfg)
        unknown = set(probs) - set(MODES)
        if unknown:
            raise ValueError(f"algorithm {self.name!r} names unknown modes {sorted(unknown)}")
        return probs


ALGORITHMS: dict[str, AlgorithmSpec] = {}


def register_algorithm(spec: AlgorithmSpec) -> AlgorithmSpec:
    if spec.name in ALGORITHMS:
        raise ValueError(f"algorithm {spec.name!r} is already registered")
    if spec.options is not None:
        check_options(spec.options, f"algorithm {spec.name!r}", "algo", method_options())
    ALGORITHMS[spec.name] = spec
    return spec


def method_options() -> dict[str, type]:
    """``{key: options class}`` of every registered algorithm with options of its own (``{"gigpo": GigpoOptions,
    …}``): the settings the ``algo`` section holds besides its shared fields."""
    return {spec.options.key: spec.options for spec in ALGORITHMS.values() if spec.options is not None}


def load_hook(hook: str | Callable, what: str) -> Callable:
    """The function a spec's hook names: itself, or the ``"module:function"`` it points to (a module above ``algo``,
    imported only when the hook is used). ``what`` names the hook in the error."""
    if callable(hook):
        return hook
    module, _, function = hook.partition(":")
    if not function:
        raise ValueError(f"{what} {hook!r} is neither a function nor a 'module:function' path")
    try:
        return getattr(importlib.import_module(module), function)
    except (ImportError, AttributeError) as exc:
        raise ValueError(f"{what} {hook!r} cannot be loaded: {exc}") from None


def get_algorithm(name: str) -> AlgorithmSpec:
    if name not in ALGORITHMS:
        raise ValueError(f"unknown algorithm {name!r}; registered: {', '.join(sorted(ALGORITHMS))}")
    return ALGORITHMS[name]


register_algorithm(AlgorithmSpec("grpo", uses_memory=False, loss="grpo"))
register_algorithm(AlgorithmSpec("frozen", uses_memory=False, loss="grpo",
                                 updates_weights=False))  # the policy it starts from, played and evaluated, never updated
