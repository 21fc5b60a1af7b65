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
- :func:`empo2_loss` — the registered ``empo2`` loss: the clipped surrogate with all three.

The intrinsic reward and the return (fidelity *The novelty reward*):

- :func:`novelty_reward` — r_int = 1/n, n the visits of the state (:class:`empo2.memory.novelty.NoveltyReward` counts
  them, a whole batch at once).
- :func:`intrinsic_weight` — the weight w of r_int, constant or annealed linearly (0.8 → 0.2).
- :func:`intrinsic_return`, :func:`step_rewards_with_novelty` — R = R_ext + w·R_int, with
  each step's reward r_t + w·r_int_t (w / T_i per step when R_int is the mean over the episode's steps).

Every rollout, row and loss of any method carries a mode, every arm may add the novelty bonus, and GRPO, LUFFY and ELPO
share the clipped surrogate with the mask switched off; so those functions are defined in the shared modules they
serve (:mod:`empo2.algo.modes`, :mod:`empo2.algo.returns`, :mod:`empo2.algo.losses`) and imported here, the very
functions training runs. What only EMPO² has, its mode probabilities, its loss's registration and its registry entry,
is defined below.
"""

from __future__ import annotations

from typing import Any

from empo2.algo.losses import clipped_surrogate_settings, low_probability_mask, policy_loss, register_policy_loss
from empo2.algo.modes import (
    MEMORY_MODES,
    MODES,
    behaviour_logp_for_ratio,
    check_mode,
    rollout_has_tips,
    training_prompt_has_tips,
    trains_on_rollout_prompt,
    uses_tip_free_old_logp,
)
from empo2.algo.registry import AlgorithmSpec, register_algorithm
from empo2.algo.returns import intrinsic_return, intrinsic_weight, novelty_reward, step_rewards_with_novelty

__all__ = ["MEMORY_MODES", "MODES", "OFFICIAL", "behaviour_logp_for_ratio", "check_mode",
           "empo2_loss", "empo2_modes", "intrinsic_return", "intrinsic_weight", "low_probability_mask",
           "mode_probabilities", "novelty_reward", "rollout_has_tips", "step_rewards_with_novelty",
           "training_prompt_has_tips", "trains_on_rollout_prompt", "uses_tip_free_old_logp"]

OFFICIAL = ("the released EMPO² code", {"epsilon": 0.2, "epsilon_high": 0.3, "dual_clip": 10.0, "beta": 0.0})
"""The loss settings of the authors' released code (docs/fidelity.md, *The loss*): the defaults here."""


def mode_probabilities(p_memory: float, p_off_policy: float) -> dict[str, float]:
    """The three modes' probabilities: memory rollouts with probability p_memory, a share p_off_policy of all
    rollouts trained off-policy: p(on) = 1 − p_memory, p(on_tips) = p_memory − p_off_policy, p(off_tips) =
    p_off_policy. The paper gives no numbers; the released defaults 0.25 and 0.17 give 0.75 / 0.08 / 0.17."""
    return {"on": 1 - p_memory, "on_tips": p_memory - p_off_policy, "off_tips": p_off_policy}


def empo2_modes(algo_cfg: Any) -> dict[str, float]:
    """EMPO²'s three modes from ``algo.p_memory`` (on_tips + off_tips) and ``algo.p_off_policy`` (off_tips)."""
    return mode_probabilities(algo_cfg.p_memory, algo_cfg.p_off_policy)


# ------------------------------------------------------------------------------------------------- the loss
empo2_loss = register_policy_loss("empo2", settings=clipped_surrogate_settings)(policy_loss)
"""The ``empo2`` loss: :func:`empo2.algo.losses.policy_loss` with every knob of the ``algo`` section, the
low-probability mask included."""


register_algorithm(AlgorithmSpec("empo2", uses_memory=True, loss="empo2", mode_probs=empo2_modes, novelty=True,
                                 official=OFFICIAL))
