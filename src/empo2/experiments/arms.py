"""The paper's ablations as named comparison arms: one :class:`Arm` per name, an algorithm plus the settings it fixes.

``empo2 compare --algos empo2,empo2-no-offpolicy,…`` runs each arm with ``algo.name`` = the arm's algorithm, the
arm's settings and ``algo.arm`` = its name; ``empo2 report`` labels a run by its ``algo.arm``. The table itself and
:func:`check_arm` live in :mod:`empo2.algo.arms`, below the config that checks a config's ``algo.arm`` at load.
"""

from __future__ import annotations

from empo2.algo.arms import ARMS, ESTIMATOR, LUFFY_SETTINGS, Arm, check_arm, novelty_on

__all__ = ["ARMS", "ESTIMATOR", "LUFFY_SETTINGS", "Arm", "arms_help", "check_arm", "describe", "novelty_on"]


def arms_help() -> str:
    return "; ".join(f"{a.name}: {a.what}" for a in ARMS.values())


def describe(names) -> list[str]:
    """A markdown line saying what each ablation arm among ``names`` is (none when there is no ablation)."""
    mine = [ARMS[n] for n in names if n in ARMS]
    return [f"Ablation arms: {'; '.join(f'`{a.name}`: {a.what}' for a in mine)}."] if mine else []
