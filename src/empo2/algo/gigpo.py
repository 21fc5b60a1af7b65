"""GiGPO advantages (Feng et al., 2025, "Group-in-Group Policy Optimization for LLM Agent Training").

Two nested groups, in named stages like the authors' ``core_gigpo.py``:

1. :func:`episode_advantages` — episode relative advantage: the GRPO-normalised return of each trajectory in its
   group, A^E(τ_i) = (R(τ_i) − mean_j R(τ_j)) / F_norm({R(τ_j)}), with F_norm = std (ddof 0) + ε or 1.
2. :func:`discounted_step_returns` — the step return R_t^(i) = Σ_{k=t}^{T_i} γ^{k−t} r_k^(i).
3. :func:`anchor_groups` — anchor-state groups: the steps of one episode group's trajectories whose actions were taken
   in the same environment state (exact match of the state key; optionally keys at least ``step_similarity`` alike).
4. :func:`step_advantages` — step relative advantage: R_t^(i) normalised within its anchor group,
   A^S = (R_t − mean_anchor R) / F_norm(anchor), a group of one (or all-equal returns) → 0.
5. Combined: A(a_t^(i)) = A^E(τ_i) + ω · A^S(a_t^(i)), ω = ``step_advantage_weight``.

Degenerate groups get exactly 0 at both levels (the same rule as GRPO in :mod:`empo2.algo.advantages`).
"""

from __future__ import annotations

from difflib import SequenceMatcher

import numpy as np

from empo2.algo.advantages import AdvantageInput, group_normalise, register_advantage


def episode_advantages(inp: AdvantageInput) -> tuple[np.ndarray, dict[str, float]]:
    """Stage 1: A^E [N] float64 (and the episode-group metrics)."""
    o = inp.options
    return group_normalise(inp.returns, inp.group_ids, scale_rewards=o.scale_rewards, eps=o.eps)


def discounted_step_returns(rewards: np.ndarray, gamma: float) -> np.ndarray:
    """Stage 2: rewards [T] -> R_t [T] with R_t = r_t + γ·R_{t+1}."""
    out = np.zeros(len(rewards), dtype=np.float64)
    running = 0.0
    for t in range(len(rewards) - 1, -1, -1):
        running = float(rewards[t]) + gamma * running
        out[t] = running
    return out


def anchor_groups(group_ids: np.ndarray, state_keys: list[list[str]],
                  similarity: float | None = None) -> list[np.ndarray]:
    """Stage 3: an anchor-group id per step (N int arrays [T_i]); groups never span two episode groups.

    ``similarity=None``: one anchor group per distinct (episode group, key). Otherwise a step joins the first anchor
    group of its episode group whose first key has a ``difflib`` ratio ≥ ``similarity`` (order-dependent by nature).
    """
    ids: dict[tuple[int, str], int] = {}
    reps: dict[int, list[tuple[str, int]]] = {}  # episode group -> [(representative key, anchor id)]
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


def step_advantages(inp: AdvantageInput) -> tuple[list[np.ndarray], dict[str, float]]:
    """Stages 2–4: A^S per step (N arrays [T_i] float64) and anchor-group metrics."""
    o = inp.options
    lengths = [len(r) for r in inp.step_rewards]
    step_returns = np.concatenate([discounted_step_returns(r, o.gamma) for r in inp.step_rewards] or [np.zeros(0)])
    anchors = anchor_groups(inp.group_ids, inp.state_keys, o.step_similarity)
    flat_anchor = np.concatenate(anchors or [np.zeros(0, dtype=np.int64)])  # [ΣT]
    flat, m = group_normalise(step_returns, flat_anchor, scale_rewards=o.scale_rewards, eps=o.eps)  # [ΣT]
    metrics = {"step_groups": m["groups"], "step_singleton_groups": m["singleton_groups"],
               "step_adv_abs_mean": m["adv_abs_mean"]}
    return np.split(flat, np.cumsum(lengths)[:-1]) if lengths else [], metrics


@register_advantage("gigpo")
def gigpo_advantages(inp: AdvantageInput) -> tuple[list[np.ndarray], dict[str, float]]:
    """Stage 5: A = A^E + ω·A^S per step. ``zero_adv_groups`` counts episode groups whose every step gets 0."""
    a_ep, metrics = episode_advantages(inp)  # [N]
    a_step, step_metrics = step_advantages(inp)
    w = inp.options.step_advantage_weight
    adv = [a_ep[i] + w * a_step[i] for i in range(len(a_ep))]
    silent: dict[int, bool] = {}
    for g, a in zip(inp.group_ids.tolist(), adv):
        silent[g] = silent.get(g, True) and not np.any(a != 0.0)
    metrics.update(step_metrics, zero_adv_groups=float(sum(silent.values())))
    metrics["adv_abs_mean"] = float(np.abs(np.concatenate(adv)).mean()) if adv and sum(map(len, adv)) else 0.0
    return adv, metrics
