"""Intrinsic novelty reward (SPEC §4): r_int = 1/n over a store of distinct state embeddings.

Definition used here. The store holds distinct states s_1..s_M (unit-norm embeddings) and a visit count n_j for each.
For a new state x:

    j*  = argmax_j cos(x, s_j)
    if M == 0 or cos(x, s_{j*}) < threshold:   store x as s_{M+1} with n = 1;   r = 1
    else:                                     n_{j*} += 1;                     r = 1 / n_{j*}

So n is the number of visits so far (this one included) to the stored distinct state that x is most similar to.
A state identical to one seen k−1 times before gets 1/k (1, 1/2, 1/3, …); a state unlike everything stored gets 1.
States of one :meth:`NoveltyReward.reward` call are processed in order: the i-th sees the store as left by states
0..i−1 of the same call. Similarities are two matrix products (new × stored, new × new); only the cheap per-state
bookkeeping is a Python loop.
"""

from __future__ import annotations

from typing import Any

import numpy as np


class NoveltyReward:
    """Store of distinct state embeddings with visit counts. Pure numpy; embeddings are supplied by the caller."""

    def __init__(self, threshold: float = 0.9):
        self.threshold = float(threshold)
        self._embs = np.zeros((0, 0), dtype=np.float32)  # [M, d]
        self._counts = np.zeros((0,), dtype=np.int64)  # [M]

    def __len__(self) -> int:
        return int(self._counts.shape[0])

    @property
    def counts(self) -> np.ndarray:
        """Visit count per stored distinct state, [M] int64 (a copy)."""
        return self._counts.copy()

    def reward(self, embs: np.ndarray) -> np.ndarray:
        """embs [N, d] (re-normalised to unit L2 norm here) -> rewards [N] float64 in (0, 1]; updates the store."""
        x = np.asarray(embs, dtype=np.float32)
        if x.ndim != 2:
            raise ValueError(f"embeddings must be [N, d], got shape {x.shape}")
        n, d = x.shape
        if n == 0:
            return np.zeros((0,), dtype=np.float64)
        if len(self) and d != self._embs.shape[1]:
            raise ValueError(f"embedding dim {d} does not match the store's {self._embs.shape[1]}")
        norms = np.linalg.norm(x, axis=1, keepdims=True)  # [N, 1]
        if not np.all(np.isfinite(x)) or np.any(norms == 0):
            raise ValueError("embeddings must be finite and non-zero")
        x = x / norms  # [N, d]

        m = len(self)
        if m:
            sim_old = x @ self._embs.T  # [N, M]
            best_old = sim_old.argmax(axis=1)  # [N]
            best_old_sim = sim_old[np.arange(n), best_old]  # [N]
        sim_new = x @ x.T  # [N, N]
        counts = list(self._counts)  # running visit counts, old states then this call's new ones
        added: list[int] = []  # indices (into x) of states stored during this call
        rewards = np.empty(n, dtype=np.float64)  # [N]
        for i in range(n):
            j, s = -1, -np.inf  # best stored state so far (index into counts) and its similarity
            if m:
                j, s = int(best_old[i]), float(best_old_sim[i])
            if added:
                sims = sim_new[i, added]  # [K]
                k = int(sims.argmax())
                if sims[k] > s:
                    j, s = m + k, float(sims[k])
            if j >= 0 and s >= self.threshold:
                counts[j] += 1
                rewards[i] = 1.0 / counts[j]
            else:
                added.append(i)
                counts.append(1)
                rewards[i] = 1.0
        if added:
            new = x[added]  # [K, d]
            self._embs = new.copy() if m == 0 else np.concatenate([self._embs, new], axis=0)
        self._counts = np.asarray(counts, dtype=np.int64)
        return rewards

    def state_dict(self) -> dict[str, Any]:
        """Arrays for a checkpoint: ``embeddings`` [M, d] float32, ``counts`` [M] int64, ``threshold``."""
        return {"threshold": self.threshold, "embeddings": self._embs.copy(), "counts": self._counts.copy()}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        embs = np.asarray(state["embeddings"], dtype=np.float32)
        counts = np.asarray(state["counts"], dtype=np.int64)
        if embs.ndim != 2 or counts.shape != (embs.shape[0],):
            raise ValueError(f"bad novelty state: embeddings {embs.shape}, counts {counts.shape}")
        self.threshold = float(state.get("threshold", self.threshold))
        self._embs = embs.copy()
        self._counts = counts.copy()
