"""The paper's ablations as named comparison arms: one :class:`Arm` per name, an algorithm plus the settings it fixes.

``empo2 compare --algos empo2,empo2-no-offpolicy,…`` runs each arm with ``algo.name`` = the arm's algorithm, the
arm's settings and ``algo.arm`` = its name; ``empo2 report`` labels a run by its ``algo.arm``. The table itself and
:func:`check_arm` live in :mod:`empo2.algo.arms`, below the config that checks a config's ``algo.arm`` at load.
"""

from __future__ import annotations

from empo2.algo.arms import ARMS, ESTIMATOR, LUFFY_SETTINGS, Arm, check_arm, novelty_on

__all__ = ["ARMS", "ESTIMATOR", "LUFFY_SETTINGS", "STD_SUFFIX", "Arm", "arm_overrides", "arms_help", "check_arm",
           "describe", "novelty_on", "split_arm"]

STD_SUFFIX = "-std"
"""``NAME-std``: GiGPO's ``mean_std_norm`` normalisation."""


def arms_help() -> str:
    return "; ".join(f"{a.name}: {a.what}" for a in ARMS.values())


def describe(names) -> list[str]:
    """A markdown line saying what each ablation arm among ``names`` is (none when there is no ablation)."""
    mine = [ARMS[n] for n in names if n in ARMS]
    return [f"Ablation arms: {'; '.join(f'`{a.name}`: {a.what}' for a in mine)}."] if mine else []


def split_arm(algo: str) -> tuple[str, str, bool]:
    """``"empo2+gigpo"`` → ``("empo2", "gigpo", False)`` (EMPO² with GiGPO's advantage estimator);
    ``"gigpo-std"`` → ``("gigpo", "", True)`` (GiGPO's ``mean_std_norm``); ``"grpo"`` → ``("grpo", "", False)``."""
    std = algo.endswith(STD_SUFFIX)
    name, _, estimator = algo.removesuffix(STD_SUFFIX).partition("+")
    return name, estimator, std


def arm_overrides(algo: str) -> list[str]:
    """The ``algo`` overrides an arm name stands for, in ``compare --algos`` and ``train --algo`` alike: an ablation
    arm's algorithm and settings (:data:`ARMS`), or ``NAME[+ESTIMATOR][-std]``'s algorithm, estimator and GiGPO
    normalisation, with ``algo.arm`` emptied so a config file's arm cannot label a plain algorithm's run."""
    if algo in ARMS:
        chosen, std = ARMS[algo].overrides(), False
    else:
        name, estimator, std = split_arm(algo)
        chosen = [f"algo.name={name}", "algo.arm="] + ([f"algo.advantage={estimator}"] if estimator else [])
        chosen += ["algo.proxmo_psc=true", "algo.proxmo_psa=true"]  # ProxMO's parts are switched off by arms only
    # always set, so that a config file's choice cannot run under a label that says the other one
    return [*chosen, f"algo.gigpo_normalization={'mean_std_norm' if std else 'mean_norm'}"]
