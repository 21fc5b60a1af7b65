"""Rollout modes: the three learning modes (``on`` / ``on_tips`` / ``off_tips``; docs/fidelity.md, *The loop*), which
prompt each samples and trains on, the ratio's denominator each takes, and their sampling with configured
probabilities (EMPO²'s, :func:`empo2.algo.empo2.mode_probabilities`; a memory-free method is always ``on``).

Every rollout, row and loss carries a mode, so the vocabulary is shared here rather than owned by one method:

- ``on``: a ~ π_θ(·|s_t, u); ``on_tips``: a ~ π_θ(·|s_t, u, tips_t), trained with the same tips; ``off_tips``: rolled
  out with tips, trained without them (the tip-free prompt is rendered from parts without the tips,
  :meth:`empo2.agent.prompts.PromptParts.without_tips`, never cut out of a tokenised prompt).
- :func:`behaviour_logp_for_ratio` — the off-policy denominator: ρ = π_θ(a|s,u) / π_θold(a|s,u,tips) for ``off_tips``.

The sampler owns a seeded numpy ``PCG64`` stream; its :meth:`ModeSampler.state_dict` stores the stream position,
so a resumed run draws exactly the modes the uninterrupted run would have drawn.
"""

from __future__ import annotations

from typing import Any

import numpy as np
import torch

MODES = ("on", "on_tips", "off_tips")
"""The paper's three learning modes, in a fixed order (the mode sampler's and the metrics')."""

MEMORY_MODES = ("on_tips", "off_tips")
"""The modes whose rollouts retrieve tips: a ~ π_θ(·|s_t, u, tips_t), tips_t = Retr(s_t; M)."""


def check_mode(mode: str) -> None:
    if mode not in MODES:
        raise ValueError(f"unknown mode {mode!r}; use one of {', '.join(MODES)}")


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




class ModeSampler:
    """Draw a mode per batch (one draw, repeated for every group) or per group (one draw each).

    ``probs``: mode -> probability, over a subset of :data:`MODES` (missing modes get 0); must sum to 1 (±1e-6,
    then renormalised). Default config: ``{"on": 0.75, "on_tips": 0.08, "off_tips": 0.17}``
    (:func:`empo2.algo.empo2.mode_probabilities`). ``granularity`` is ``algo.mode_granularity``: ``group`` draws per
    group, anything else once per batch.
    """

    def __init__(self, probs: dict[str, float], seed: int = 0, granularity: str = "batch"):
        unknown = set(probs) - set(MODES)
        if unknown:
            raise ValueError(f"unknown mode(s) {sorted(unknown)}; use {', '.join(MODES)}")
        p = np.array([float(probs.get(m, 0.0)) for m in MODES], dtype=np.float64)  # [3]
        if np.any(p < 0) or not np.all(np.isfinite(p)) or abs(p.sum() - 1.0) > 1e-6:
            raise ValueError(f"mode probabilities must be >= 0 and sum to 1, got {probs}")
        self.probs = {m: float(v) for m, v in zip(MODES, p / p.sum())}
        self.granularity = granularity
        self.seed = int(seed)
        self._cum = np.cumsum(p / p.sum())  # [3]
        self._cum[-1] = np.inf  # u in [0, 1) always lands somewhere; zero-probability modes are never chosen
        self._rng = np.random.Generator(np.random.PCG64(self.seed))

    def _draw(self, n: int) -> list[str]:
        u = self._rng.random(n)  # [n] in [0, 1)
        idx = np.searchsorted(self._cum, u, side="right")  # first mode whose cumulative probability exceeds u
        return [MODES[i] for i in idx]

    def sample(self, num_groups: int) -> list[str]:
        """Modes for the ``num_groups`` groups of one batch -> list of ``num_groups`` strings."""
        if num_groups < 0:
            raise ValueError("num_groups must be >= 0")
        if self.granularity == "group":
            return self._draw(num_groups)
        return self._draw(1) * num_groups

    def state_dict(self) -> dict[str, Any]:
        """JSON-serialisable state: probabilities, granularity, seed, and the position of the random stream."""
        return {"probs": dict(self.probs), "granularity": self.granularity, "seed": self.seed,
                "rng": self._rng.bit_generator.state}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Continue the stream saved by :meth:`state_dict` (probabilities and granularity stay as constructed)."""
        self._rng.bit_generator.state = state["rng"]
