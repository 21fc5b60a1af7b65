"""The paper's ablations as named comparison arms: one :class:`Arm` per name, an algorithm plus the settings it fixes.

``empo2 compare --algos empo2,empo2-no-offpolicy,…`` runs each arm with ``algo.name`` = the arm's algorithm, the
arm's settings and ``algo.arm`` = its name; ``empo2 report`` labels a run by its ``algo.arm``. The table itself and
:func:`check_arm` live in :mod:`empo2.algo.arms`, below the config that checks a config's ``algo.arm`` at load.

Any other arm is ``NAME[+ESTIMATOR][-std][+novelty]``: an algorithm, EMPO² with another estimator, GiGPO's
``mean_std_norm``, and the novelty bonus. The bonus is EMPO²'s: an algorithm whose method has none runs with
``algo.intrinsic_weight=0`` unless its name ends in ``+novelty`` (``gigpo+novelty``), which keeps the config's bonus.
"""

from __future__ import annotations

from empo2.algo.arms import (
    ARMS,
    ESTIMATOR,
    LUFFY_SETTINGS,
    NO_NOVELTY,
    Arm,
    arm_settings,
    check_arm,
    novelty_on,
    settings_line,
)
from empo2.algo.registry import ALGORITHMS

__all__ = ["ARMS", "ESTIMATOR", "LUFFY_SETTINGS", "NOVELTY_SUFFIX", "STD_SUFFIX", "Arm", "arm_overrides",
           "arm_settings", "arms_help", "check_arm", "describe", "novelty_on", "settings_line", "split_arm",
           "wants_novelty"]

STD_SUFFIX = "-std"
"""``NAME-std``: GiGPO's ``mean_std_norm`` normalisation."""
NOVELTY_SUFFIX = "+novelty"
"""``NAME+novelty``: an algorithm without a novelty bonus of its own, run with the config's."""


def arms_help() -> str:
    return "; ".join(f"{a.name}: {a.what}" for a in ARMS.values())


def describe(names) -> list[str]:
    """A markdown line saying what each ablation arm among ``names`` is (none when there is no ablation)."""
    mine = [ARMS[n] for n in names if n in ARMS]
    return [f"Ablation arms: {'; '.join(f'`{a.name}`: {a.what}' for a in mine)}."] if mine else []


def wants_novelty(algo: str) -> bool:
    """Whether the arm name asks for the config's novelty bonus on an algorithm that has none (``gigpo+novelty``)."""
    return algo not in ARMS and algo.endswith(NOVELTY_SUFFIX)


def split_arm(algo: str) -> tuple[str, str, bool]:
    """``"empo2+gigpo"`` → ``("empo2", "gigpo", False)`` (EMPO² with GiGPO's advantage estimator);
    ``"gigpo-std"`` → ``("gigpo", "", True)`` (GiGPO's ``mean_std_norm``); ``"grpo"`` → ``("grpo", "", False)``;
    a ``+novelty`` ending is not part of it (``"gigpo-std+novelty"`` → ``("gigpo", "", True)``)."""
    algo = algo.removesuffix(NOVELTY_SUFFIX) if wants_novelty(algo) else algo
    std = algo.endswith(STD_SUFFIX)
    name, _, estimator = algo.removesuffix(STD_SUFFIX).partition("+")
    return name, estimator, std


def arm_overrides(algo: str) -> list[str]:
    """The ``algo`` overrides an arm name stands for, in ``compare --algos`` and ``train --algo`` alike: an ablation
    arm's algorithm and settings (:data:`ARMS`), or ``NAME[+ESTIMATOR][-std][+novelty]``'s algorithm, estimator,
    GiGPO normalisation and novelty bonus (off unless the method has one or the name ends in ``+novelty``), with
    ``algo.arm`` emptied so a config file's arm cannot label a plain algorithm's run."""
    if algo in ARMS:
        chosen, std = ARMS[algo].overrides(), False
    else:
        name, estimator, std = split_arm(algo)
        chosen = [f"algo.name={name}", "algo.arm="] + ([f"algo.advantage={estimator}"] if estimator else [])
        chosen += ["algo.proxmo.psc=true", "algo.proxmo.psa=true"]  # ProxMO's parts are switched off by arms only
        spec = ALGORITHMS.get(name)
        if spec is not None and not spec.novelty and not wants_novelty(algo):
            chosen += [f"algo.{k}={v}" for k, v in NO_NOVELTY.items()]
    # always set, so that a config file's choice cannot run under a label that says the other one
    return [*chosen, f"algo.gigpo.normalization={'mean_std_norm' if std else 'mean_norm'}"]
