"""Algorithms as registry entries (verl-style): one :class:`AlgorithmSpec` per ``algo.name``.

A spec says everything the trainer needs to know about an algorithm — whether it keeps a tip memory, how its rollout
modes are drawn, which policy loss and which advantage estimator it uses — so the trainer, the config and the CLI never
branch on the algorithm's name. Adding an algorithm is one call::

    register_algorithm(AlgorithmSpec("my_algo", uses_memory=False, loss="grpo", advantage="grpo"))

(plus, if it needs them, a new loss with ``@register_policy_loss`` and a new estimator with ``@register_advantage``).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from empo2.algo import (
    elpo,  # registers the "elpo" advantage estimator and loss
    empo2,
    gigpo,  # registers the "gigpo" advantage estimator
    luffy,  # registers the "luffy" advantage estimator and LUFFY's losses
    proxmo,  # registers the "proxmo" advantage estimator
)
from empo2.algo.empo2 import MODES, mode_probabilities


def on_policy_only(algo_cfg: Any) -> dict[str, float]:
    """Mode probabilities of a memory-free algorithm: always ``on``."""
    return {"on": 1.0, "on_tips": 0.0, "off_tips": 0.0}


def empo2_modes(algo_cfg: Any) -> dict[str, float]:
    """EMPO²'s three modes from ``algo.p_memory`` (on_tips + off_tips) and ``algo.p_off_policy`` (off_tips)."""
    return mode_probabilities(algo_cfg.p_memory, algo_cfg.p_off_policy)


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
    rollout: str = "episodes"
    """Rollout driver (``empo2.episodes.drivers``): ``episodes`` (G independent episodes per group) or ``elpo``."""
    novelty: bool = False
    """The novelty reward is part of the method (EMPO²'s 1/n, SPEC §4). ``compare`` and ``train --algo`` run any
    other algorithm without it, unless its arm name says ``+novelty``, so two arms differ in their method only."""
    official: tuple[str, dict[str, Any]] = ("", {})
    """(source, ``algo`` settings of the method's official runs; ``entropy_coeff``: an entropy bonus, which empo2's
    losses do not have): ``compare`` lists where a run differs from them."""

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
    ALGORITHMS[spec.name] = spec
    return spec


def get_algorithm(name: str) -> AlgorithmSpec:
    if name not in ALGORITHMS:
        raise ValueError(f"unknown algorithm {name!r}; registered: {', '.join(sorted(ALGORITHMS))}")
    return ALGORITHMS[name]


register_algorithm(AlgorithmSpec("empo2", uses_memory=True, loss="empo2", mode_probs=empo2_modes, novelty=True,
                                 official=empo2.OFFICIAL))
register_algorithm(AlgorithmSpec("grpo", uses_memory=False, loss="grpo"))
register_algorithm(AlgorithmSpec("gigpo", uses_memory=False, loss="grpo", advantage="gigpo",
                                 official=gigpo.OFFICIAL))  # Feng et al. 2025
register_algorithm(AlgorithmSpec("proxmo", uses_memory=False, loss="grpo", advantage="proxmo",
                                 official=proxmo.OFFICIAL))  # arXiv 2602.19225
register_algorithm(AlgorithmSpec("luffy", uses_memory=False, loss="luffy", advantage="luffy",
                                 expert_members=1, official=luffy.OFFICIAL))  # Yan et al. 2025
register_algorithm(AlgorithmSpec("empo2_luffy", uses_memory=True, loss="empo2_luffy", mode_probs=empo2_modes,
                                 expert_members=1, novelty=True))  # EMPO² with an expert member: no published method
register_algorithm(AlgorithmSpec("elpo", uses_memory=False, loss="elpo", advantage="elpo",
                                 rollout="elpo", official=elpo.OFFICIAL))  # Liang et al. 2026
register_algorithm(AlgorithmSpec("frozen", uses_memory=False, loss="grpo",
                                 updates_weights=False))  # the policy it starts from, played and evaluated, never updated
