"""Rollout-mode sampling: the paper's three learning modes (``on`` / ``on_tips`` / ``off_tips``, defined with their
probabilities in :mod:`empo2.algo.empo2`; docs/fidelity.md, *The loop*) drawn with configured probabilities.

The sampler owns a seeded numpy ``PCG64`` stream; its :meth:`ModeSampler.state_dict` stores the stream position,
so a resumed run draws exactly the modes the uninterrupted run would have drawn.
"""

from __future__ import annotations

from typing import Any

import numpy as np

from empo2.algo.empo2 import MODES


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
