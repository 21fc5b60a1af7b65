"""EMPO² (Liu, Kim, Luo, Li, Yang, "Exploratory Memory-Augmented LLM Agent via Hybrid On- and Off-Policy
Optimization", ICLR 2026, arXiv 2602.23008), written as its equations.

Each function is tagged with the formula as the paper's Method section writes it and with the section of
docs/fidelity.md (*The loop*, *The loss*, *The novelty reward*) that says where it follows the paper, where the
released code, and where neither.

The three learning modes (the paper's figure of the modes; fidelity *The loop*):

- :data:`MODES`, :func:`mode_probabilities` — ``on``: a ~ π_θ(·|s_t, u); ``on_tips``: a ~ π_θ(·|s_t, u, tips_t),
  trained with the same tips; ``off_tips``: rolled out with tips, trained without them.
- :func:`rollout_has_tips`, :func:`training_prompt_has_tips`, :func:`trains_on_rollout_prompt` — which prompt a mode
  samples on and which it trains on (the tip-free prompt is rendered from parts without the tips,
  :meth:`empo2.agent.prompts.PromptParts.without_tips`, never cut out of a tokenised prompt).

The loss (the paper's masked GRPO objective; fidelity *The loss*)::

    E[ 1/(N·T) Σ_i Σ_t min(ρ A, clip(ρ, 1−ε, 1+ε) A) · 1[π_θ(a_t | s_t, u) ≥ δ] ] − β·D_KL(π_θ(·|u) ‖ π_ref(·|u))

- :func:`behaviour_logp_for_ratio` — the off-policy denominator: ρ = π_θ(a|s,u) / π_θold(a|s,u,tips) for ``off_tips``.
- :func:`low_probability_mask` — 1[π_θ(a_t|s_t,u) ≥ δ] per token (or the released code's whole-response variant).
- :func:`trains_on_rollout_prompt` — the rows whose KL term estimates the KL on their training prompt.

The clip, dual clip, k3 KL estimator and token aggregation are shared with GRPO and the other methods and live in
:func:`empo2.algo.losses.policy_loss` (registered as ``empo2``), which calls the three functions above.

The intrinsic reward and the return (fidelity *The novelty reward*):

- :func:`novelty_reward` — r_int = 1/n, n the visits of the state (:class:`empo2.memory.novelty.NoveltyReward` counts
  them, a whole batch at once).
- :func:`intrinsic_weight` — the weight w of r_int, constant or annealed linearly (0.8 → 0.2).
- :func:`intrinsic_return`, :func:`step_rewards_with_novelty`, :func:`combine_returns` — R = R_ext + w·R_int, with
  each step's reward r_t + w·r_int_t (w / T_i per step when R_int is the mean over the episode's steps).
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from typing import Any

import numpy as np
import torch

OFFICIAL = ("the released EMPO² code", {"epsilon": 0.2, "epsilon_high": 0.3, "dual_clip": 10.0, "beta": 0.0})
"""The loss settings of the authors' released code (docs/fidelity.md, *The loss*): the defaults here."""

# ------------------------------------------------------------------------------------------------- the three modes
MODES = ("on", "on_tips", "off_tips")
"""The paper's three learning modes, in a fixed order (the mode sampler's and the metrics')."""

MEMORY_MODES = ("on_tips", "off_tips")
"""The modes whose rollouts retrieve tips: a ~ π_θ(·|s_t, u, tips_t), tips_t = Retr(s_t; M)."""


def check_mode(mode: str) -> None:
    if mode not in MODES:
        raise ValueError(f"unknown mode {mode!r}; use one of {', '.join(MODES)}")


def mode_probabilities(p_memory: float, p_off_policy: float) -> dict[str, float]:
    """The three modes' probabilities: memory rollouts with probability p_memory, a share p_off_policy of all
    rollouts trained off-policy: p(on) = 1 − p_memory, p(on_tips) = p_memory − p_off_policy, p(off_tips) =
    p_off_policy. The paper gives no numbers; the released defaults 0.25 and 0.17 give 0.75 / 0.08 / 0.17."""
    return {"on": 1 - p_memory, "on_tips": p_memory - p_off_policy, "off_tips": p_off_policy}


def rollout_has_tips(mode: str) -> bool:
    """Whether the mode samples its actions on the memory-augmented prompt π_θ(·|s_t, u, tips_t)."""
    check_mode(mode)
    return mode in MEMORY_MODES


def training_prompt_has_tips(mode: str) -> bool:
    """Whether ``logp_new`` for a row of this mode is computed on a prompt WITH tips (only ``on_tips``): ``off_tips``
    rows train the tip-free policy π_θ(·|s_t, u) on actions sampled with tips (the knowledge-internalising update)."""
    check_mode(mode)
    return mode == "on_tips"


def trains_on_rollout_prompt(mode: str) -> bool:
    """Whether the mode trains on the prompt it sampled from (``on``, ``on_tips``). Only then does the k3 estimate
    over its sampled tokens estimate D_KL(π_θ ‖ π_ref) on the training prompt; ``off_tips`` tokens were sampled with
    tips, so the KL term leaves those rows out."""
    return rollout_has_tips(mode) == training_prompt_has_tips(mode)


# ------------------------------------------------------------------------------------------------- the loss
def uses_tip_free_old_logp(mode: str, variant: str) -> bool:
    """Whether the ratio's denominator is the old policy on the tip-free prompt: ``off_tips`` rows under the
    pre-release variant (``algo.off_policy_ratio = tip_free``); those old log-probs must be recomputed."""
    check_mode(mode)
    return mode == "off_tips" and variant == "tip_free"


def behaviour_logp_for_ratio(
    mode: str,
    logp_old_with_tips: torch.Tensor,
    logp_old_tip_free: torch.Tensor | None = None,
    variant: str = "paper",
) -> torch.Tensor:
    """The denominator log-probs π_old(a|·) of the ratio for one row (or rows) of ``mode``. Shapes [T] or [B, T].

    The paper's off-policy ratio ρ = π_θ(a_t | s_t, u) / π_θold(a_t | s_t, u, tips_t): the numerator is
    always the training prompt's (:func:`training_prompt_has_tips`), the denominator the rollout prompt's.

    ``logp_old_with_tips`` are the behaviour log-probs recorded at rollout on the rollout prompt (which has tips for
    ``on_tips``/``off_tips``; for ``on`` it is simply the tip-free rollout prompt). ``logp_old_tip_free`` are
    old-policy log-probs of the same tokens recomputed on the tip-free prompt (needed only for ``off_tips`` with
    ``variant="tip_free"``). ``variant`` is ``algo.off_policy_ratio``.

    - ``on`` / ``on_tips``: rollout prompt == training prompt -> ``logp_old_with_tips``.
    - ``off_tips``, ``paper``:    ρ = π_θ(a|s,u) / π_old(a|s,u,tips) -> ``logp_old_with_tips``.
    - ``off_tips``, ``tip_free``: ρ = π_θ(a|s,u) / π_old(a|s,u)      -> ``logp_old_tip_free``.
    """
    if uses_tip_free_old_logp(mode, variant):
        if logp_old_tip_free is None:
            raise ValueError("variant 'tip_free' needs logp_old_tip_free for off_tips rows")
        return logp_old_tip_free
    return logp_old_with_tips


def low_probability_mask(logp_new: torch.Tensor, logp_old: torch.Tensor, valid: torch.Tensor, delta: float,
                         granularity: str = "token") -> torch.Tensor:
    """The paper's mask 1[π_θ(a_t | s_t, u) ≥ δ]: keep [B, T] bool, the valid tokens whose surrogate counts.

    logp_new, logp_old [B, T]; valid [B, T] bool; δ = ``algo.low_prob_threshold`` (0: no mask).

    - ``token`` (the paper): a token is kept when π_θ(a_t) ≥ δ on the row's training prompt (tip-free for ``on`` and
      ``off_tips``); π_θ is detached, the mask carries no gradient.
    - ``sequence`` (the released code's variant, shipped off there): a whole row is dropped when ANY valid token has
      an old log-prob below log δ (the released code's fixed −5.0 ≈ log 0.0067).
    """
    if delta <= 0:
        return valid
    if granularity == "token":
        return valid & (logp_new.detach() >= math.log(delta))  # π_θ(a_t) ≥ δ
    bad_row = (valid & ~(logp_old >= math.log(delta))).any(dim=1, keepdim=True)  # [B, 1]
    return valid & ~bad_row


# ------------------------------------------------------------------------------------------------- novelty, return
def novelty_reward(visits: np.ndarray) -> np.ndarray:
    """The paper's r_intrinsic = 1/n with n the number of similar states: visits [N] (each visit's n: the
    visits of its state before the batch plus those in it, every visit of a batch counted together) -> [N] float64
    in (0, 1]. A state's first visit earns 1, and repeats earn less."""
    return 1.0 / np.asarray(visits, dtype=np.float64)


def intrinsic_weight(algo: Any, iteration: int, total_iterations: int) -> float:
    """The weight w of the intrinsic reward at ``iteration`` (0-based) of ``total_iterations``, from an
    ``AlgoConfig``: constant, or annealed over training (0.8 → 0.2 by default).

    - ``algo.intrinsic_schedule = constant``: ``algo.intrinsic_weight`` (0 = intrinsic reward off).
    - ``linear``: ``algo.intrinsic_weight_start`` at iteration 0, ``algo.intrinsic_weight_end`` at iteration
      ``n - 1`` and after, linear in between (``algo.intrinsic_weight`` is ignored), where n is
      ``algo.intrinsic_schedule_iterations``, or ``total_iterations`` where that is 0.
    """
    schedule = algo.intrinsic_schedule
    if schedule == "constant":
        return float(algo.intrinsic_weight)
    if schedule == "linear":
        start, end = algo.intrinsic_weight_start, algo.intrinsic_weight_end
        span = max(int(getattr(algo, "intrinsic_schedule_iterations", 0) or total_iterations) - 1, 1)
        frac = min(max(iteration / span, 0.0), 1.0)
        return float(start + (end - start) * frac)
    raise ValueError(f"unknown intrinsic schedule {schedule!r}; use 'constant' or 'linear'")


def intrinsic_return(novelty: Sequence[float], aggregation: str = "mean") -> float:
    """R_int of one episode from its steps' novelty rewards: the mean (``algo.intrinsic_aggregation``, the default:
    a long episode is not paid for its length) or the sum; 0 for an episode without steps."""
    if not len(novelty):
        return 0.0
    return float(np.mean(novelty) if aggregation == "mean" else np.sum(novelty))


def step_rewards_with_novelty(extrinsic: Sequence[float], novelty: Sequence[float], weight: float,
                              aggregation: str = "mean") -> np.ndarray:
    """One episode's step rewards r_t + w_t·r_int_t [T] float64, the return's terms: they sum to
    R_ext + w·R_int (:func:`combine_returns` with :func:`intrinsic_return`), so w_t = w / T under ``mean``
    aggregation and w under ``sum``. extrinsic [T] (the environment's step rewards), novelty [T]."""
    if len(extrinsic) != len(novelty):
        raise ValueError(f"{len(extrinsic)} step rewards but {len(novelty)} novelty rewards")
    w = weight / max(len(extrinsic), 1) if aggregation == "mean" else weight
    return np.array([r + w * n for r, n in zip(extrinsic, novelty)], dtype=np.float64)


def combine_returns(extrinsic, intrinsic_returns, weight: float) -> np.ndarray:
    """R = R_ext + w · R_int, the return the advantage estimators normalise in their groups (the paper adds the
    intrinsic reward to the extrinsic one; the released code computes one and never adds it).

    extrinsic [N], intrinsic_returns [N] (each episode's :func:`intrinsic_return`), weight w -> R [N] float64.
    """
    ext = _as_numpy(extrinsic)  # [N]
    intr = _as_numpy(intrinsic_returns)  # [N]
    if ext.shape != intr.shape:
        raise ValueError(f"extrinsic {ext.shape} and intrinsic_returns {intr.shape} must have the same length")
    return ext + float(weight) * intr


def _as_numpy(x) -> np.ndarray:
    if isinstance(x, torch.Tensor):
        x = x.detach().cpu().numpy()
    return np.asarray(x, dtype=np.float64).reshape(-1)
