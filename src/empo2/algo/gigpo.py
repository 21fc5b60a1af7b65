"""GiGPO advantages (Feng et al., 2025, "Group-in-Group Policy Optimization for LLM Agent Training", arXiv 2505.10978).

Two nested groups, in the named stages of the authors' ``gigpo/core_gigpo.py`` (equation numbers of the paper):

1. :func:`episode_norm_reward` (Eq. 3) — episode relative advantage: each trajectory's return normalised in its
   episode group (same task and variation), A^E(τ_i) = (R(τ_i) − mean_j R(τ_j)) / F_norm({R(τ_j)}).
2. :func:`discounted_step_returns` (Eq. 5) — the step return R_t^(i) = r_t^(i) + γ·R_{t+1}^(i).
3. :func:`build_step_group` (Eq. 6) — anchor-state groups: the steps of one episode group whose actions answered the
   same state (its text, :func:`empo2.envs.base.state_of`: exact; optionally at least ``step_similarity`` alike).
4. :func:`step_norm_reward` (Eq. 7) — step relative advantage: R_t^(i) normalised in its anchor-state group.
5. :func:`gigpo_advantages` (Eq. 8) — A(a_t^(i)) = A^E(τ_i) + ω · A^S(a_t^(i)), ω = ``step_advantage_weight``.

Its settings are :class:`GigpoOptions`, ``algo.gigpo.*`` of the config. F_norm is chosen by ``normalization``:
``mean_norm`` (F_norm = 1: subtract the group mean; the reference's default) or ``mean_std_norm`` (F_norm = sample std,
ddof 1, + ε). At both levels a group of one, or a group whose values are all equal, gets exactly 0 (the rule GRPO uses
in :mod:`empo2.algo.advantages`).
"""

from __future__ import annotations

from dataclasses import dataclass
from difflib import SequenceMatcher
from typing import ClassVar, Literal

import numpy as np

from empo2.algo.advantages import AdvantageInput, group_normalise, register_advantage
from empo2.algo.registry import AlgorithmSpec, register_algorithm
from empo2.bounds import bounded

OFFICIAL = ("verl-agent's GiGPO scripts (KL loss 0.01, low_var_kl) on verl's actor defaults",
            {"beta": 0.01, "epsilon": 0.2, "epsilon_high": 0.2, "dual_clip": 3.0, "entropy_coeff": 0.001})
"""The loss settings of the reference runs (``examples/gigpo_trainer/run_*.sh``; clip 0.2/0.2, dual clip 3 and entropy
0.001 are verl's actor defaults as verl-agent's forks ship them). An arm that runs the comparison's shared loss
lists where it differs (:func:`empo2.algo.arms.official_differences`)."""

NORMALIZATIONS = ("mean_norm", "mean_std_norm")
"""The values of ``algo.gigpo.normalization`` (the reference code's ``mode`` names)."""


@dataclass(frozen=True)
class GigpoOptions:
    """GiGPO's settings, ``algo.gigpo.*``: read wherever its estimator runs (``algo.name=gigpo``, or
    ``algo.advantage=gigpo`` under EMPO²)."""

    key: ClassVar[str] = "gigpo"

    normalization: Literal["mean_norm", "mean_std_norm"] = "mean_norm"
    """Normalisation of episode and step returns in their groups: ``mean_norm`` (default; the reference code's
    default and the stronger "GiGPO w/o std" of the EMPO² paper's WebShop table) subtracts the group mean;
    ``mean_std_norm`` also divides by the group's sample std (ddof 1) + ``algo.adv_eps``. Compare and report label
    the runs ``gigpo`` / ``gigpo-std``."""
    gamma: float = bounded(0.95, 0, 1)
    """Discount of the step return R_t = Σ_{k≥t} γ^{k−t} r_k (the paper: 0.95)."""
    step_advantage_weight: float = bounded(1.0, 0, 1e6)
    """ω in A = A_episode + ω·A_step (the paper: 1.0)."""
    step_similarity: float | None = bounded(None, 0, 1, open_low=True)
    """``None`` = anchor states grouped by their exact state text (the reference default); a ratio in (0, 1] puts a
    state in the first anchor group whose first state is at least this similar (difflib ratio; the reference's option
    uses 0.95)."""


def _divides_by_std(mode: str) -> bool:
    if mode not in NORMALIZATIONS:
        raise ValueError(f"unknown GiGPO normalization {mode!r}; use {' or '.join(NORMALIZATIONS)}")
    return mode == "mean_std_norm"


def episode_norm_reward(inp: AdvantageInput) -> tuple[np.ndarray, dict[str, float]]:
    """Eq. 3: A^E [N] float64, one value per trajectory (the mean and std run over the group's trajectories, each
    counted once), and the episode-group metrics."""
    return group_normalise(inp.returns, inp.group_ids, scale_rewards=_divides_by_std(inp.algo.gigpo.normalization),
                           eps=inp.algo.adv_eps)


def discounted_step_returns(rewards: np.ndarray, gamma: float) -> np.ndarray:
    """Eq. 5: rewards [T] -> R_t [T] with R_t = r_t + γ·R_{t+1} (R_T = 0 after the last step)."""
    out = np.zeros(len(rewards), dtype=np.float64)
    running = 0.0
    for t in range(len(rewards) - 1, -1, -1):
        running = float(rewards[t]) + gamma * running
        out[t] = running
    return out


def build_step_group(group_ids: np.ndarray, state_keys: list[list[str]],
                     similarity: float | None = None) -> list[np.ndarray]:
    """Eq. 6: an anchor-group id per step (N int arrays [T_i]); a group never spans two episode groups.

    ``similarity=None``: one anchor group per distinct (episode group, state text), compared exactly. Otherwise
    a state joins the first anchor group of its episode group (in episode, then step order) whose first
    state has a ``difflib.SequenceMatcher`` ratio ≥ ``similarity`` with it, as the reference's similarity option
    does; so the grouping depends on that order.
    """
    ids: dict[tuple[int, str], int] = {}
    reps: dict[int, list[tuple[str, int]]] = {}  # episode group -> [(first state of an anchor group, its id)]
    out = []
    for g, keys in zip(group_ids.tolist(), state_keys):
        row = np.zeros(len(keys), dtype=np.int64)
        for t, key in enumerate(keys):
            if (g, key) not in ids:
                ids[(g, key)] = _similar_anchor(reps.setdefault(g, []), key, similarity, len(ids))
            row[t] = ids[(g, key)]
        out.append(row)
    return out


def _similar_anchor(reps: list[tuple[str, int]], key: str, similarity: float | None, fresh: int) -> int:
    if similarity is not None:
        for rep, anchor in reps:
            if SequenceMatcher(None, rep, key).ratio() >= similarity:
                return anchor
    reps.append((key, fresh))  # fresh = number of keys seen so far: larger than every anchor id handed out
    return fresh


def step_norm_reward(inp: AdvantageInput) -> tuple[list[np.ndarray], dict[str, float]]:
    """Eq. 7 (with Eq. 5 and 6): A^S per step (N arrays [T_i] float64) and the anchor-group metrics."""
    o = inp.algo.gigpo
    lengths = [len(r) for r in inp.step_rewards]
    step_returns = np.concatenate([discounted_step_returns(r, o.gamma) for r in inp.step_rewards] or [np.zeros(0)])
    anchors = build_step_group(inp.group_ids, inp.state_keys, o.step_similarity)
    flat_anchor = np.concatenate(anchors or [np.zeros(0, dtype=np.int64)])  # [ΣT]
    flat, m = group_normalise(step_returns, flat_anchor, scale_rewards=_divides_by_std(o.normalization),
                              eps=inp.algo.adv_eps)  # [ΣT]
    metrics = {"step_groups": m["groups"], "step_singleton_groups": m["singleton_groups"],
               "step_adv_abs_mean": m["adv_abs_mean"]}
    return np.split(flat, np.cumsum(lengths)[:-1]) if lengths else [], metrics


@register_advantage("gigpo")
def gigpo_advantages(inp: AdvantageInput) -> tuple[list[np.ndarray], dict[str, float]]:
    """Eq. 8: A = A^E + ω·A^S per step. ``zero_adv_groups`` counts episode groups whose every step gets 0."""
    a_ep, metrics = episode_norm_reward(inp)  # [N]
    a_step, step_metrics = step_norm_reward(inp)
    w = inp.algo.gigpo.step_advantage_weight
    adv = [a_ep[i] + w * a_step[i] for i in range(len(a_ep))]
    silent: dict[int, bool] = {}
    for g, a in zip(inp.group_ids.tolist(), adv):
        silent[g] = silent.get(g, True) and not np.any(a != 0.0)
    metrics.update(step_metrics, zero_adv_groups=float(sum(silent.values())))
    metrics["adv_abs_mean"] = float(np.abs(np.concatenate(adv)).mean()) if adv and sum(map(len, adv)) else 0.0
    return adv, metrics


register_algorithm(AlgorithmSpec("gigpo", uses_memory=False, loss="grpo", advantage="gigpo",
                                 official=OFFICIAL, options=GigpoOptions))  # Feng et al. 2025
