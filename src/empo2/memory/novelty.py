"""Intrinsic novelty reward (SPEC §4): r_int = 1/n over a store of distinct state embeddings, per namespace.

Definition used here. Each namespace (a task) holds distinct states s_1..s_M (unit-norm embeddings of observations)
and a visit count n_j for each. A batch of visits x_1..x_N is scored against the store AS IT STOOD BEFORE THE BATCH:

    j*(x) = argmax_j cos(x, s_j)
    r(x)  = 1 / (n_{j*} + 1)   if cos(x, s_{j*}) >= threshold
    r(x)  = 1                  otherwise (a state never seen before this batch)

and only then is the store updated: every visit adds 1 to the count of the state it matched, and unmatched visits
become new distinct states (visits of one batch within ``threshold`` of each other share one new state). So the reward
of a visit never depends on the order in which a batch's trajectories are processed: identical trajectories of a
group get identical intrinsic returns, and the group-relative advantage is not manufactured from processing order.
Across batches it decays as 1, 1/2, 1/3 … for a state visited once per batch.
"""

from __future__ import annotations

from typing import Any, Sequence

import numpy as np


class _Store:
    """Distinct states of one namespace: embeddings [M, d] float32 and visit counts [M] int64."""

    def __init__(self, embs: np.ndarray, counts: np.ndarray):
        self.embs, self.counts = embs, counts

    def match(self, x: np.ndarray, threshold: float) -> np.ndarray:
        """x [N, d] -> index of the matching stored state per row, -1 where none is within ``threshold``."""
        if not len(self.counts):
            return np.full(len(x), -1)
        sims = x @ self.embs.T  # [N, M]
        best = sims.argmax(axis=1)  # [N]
        return np.where(sims[np.arange(len(x)), best] >= threshold, best, -1)

    def add_visits(self, x: np.ndarray, matched: np.ndarray, threshold: float) -> None:
        """Count every visit: matched ones on their state, unmatched ones as new states (clustered greedily)."""
        np.add.at(self.counts, matched[matched >= 0], 1)
        new_embs: list[np.ndarray] = []
        new_counts: list[int] = []
        for row in np.flatnonzero(matched < 0):
            sims = [float(x[row] @ e) for e in new_embs]
            if sims and max(sims) >= threshold:
                new_counts[int(np.argmax(sims))] += 1
            else:
                new_embs.append(x[row])
                new_counts.append(1)
        if new_embs:
            self.embs = np.concatenate([self.embs, np.stack(new_embs)]) if len(self.counts) else np.stack(new_embs)
            self.counts = np.concatenate([self.counts, np.asarray(new_counts, dtype=np.int64)])


class NoveltyReward:
    """Per-namespace stores of distinct state embeddings with visit counts. Pure numpy; the caller embeds states."""

    def __init__(self, threshold: float = 0.9):
        self.threshold = float(threshold)
        self._stores: dict[str, _Store] = {}

    def __len__(self) -> int:
        """Distinct states over all namespaces."""
        return sum(len(s.counts) for s in self._stores.values())

    def counts(self, namespace: str = "") -> np.ndarray:
        """Visit count per stored distinct state of ``namespace``, [M] int64 (a copy)."""
        store = self._stores.get(namespace)
        return store.counts.copy() if store else np.zeros(0, dtype=np.int64)

    def reward(self, embs: np.ndarray, namespaces: Sequence[str] | None = None) -> np.ndarray:
        """embs [N, d] (re-normalised here), namespaces N strings (default: one namespace) -> rewards [N] float64
        in (0, 1], scored against the store as it was before this call; then the store is updated."""
        x = np.asarray(embs, dtype=np.float32)
        if x.ndim != 2:
            raise ValueError(f"embeddings must be [N, d], got shape {x.shape}")
        n, d = x.shape
        names = [""] * n if namespaces is None else list(namespaces)
        if len(names) != n:
            raise ValueError(f"{len(names)} namespaces for {n} embeddings")
        if n == 0:
            return np.zeros((0,), dtype=np.float64)
        norms = np.linalg.norm(x, axis=1, keepdims=True)  # [N, 1]
        if not np.all(np.isfinite(x)) or np.any(norms == 0):
            raise ValueError("embeddings must be finite and non-zero")
        x = x / norms  # [N, d]
        rewards = np.empty(n, dtype=np.float64)  # [N]
        for name in dict.fromkeys(names):
            rows = np.array([i for i, ns in enumerate(names) if ns == name])
            store = self._stores.setdefault(name, _Store(np.zeros((0, d), np.float32), np.zeros(0, np.int64)))
            if store.embs.shape[1] != d:
                raise ValueError(f"embedding dim {d} does not match the store's {store.embs.shape[1]}")
            matched = store.match(x[rows], self.threshold)  # [K]
            before = np.where(matched >= 0, store.counts[np.maximum(matched, 0)] if len(store.counts) else 0, 0)
            rewards[rows] = 1.0 / (before + 1.0)
            store.add_visits(x[rows], matched, self.threshold)
        return rewards

    def state_dict(self) -> dict[str, Any]:
        """For a checkpoint: ``threshold`` and per namespace ``embeddings`` [M, d] float32 and ``counts`` [M] int64."""
        return {"threshold": self.threshold,
                "namespaces": {k: {"embeddings": s.embs.copy(), "counts": s.counts.copy()}
                               for k, s in self._stores.items()}}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        stores = {}
        for name, part in state["namespaces"].items():
            embs = np.asarray(part["embeddings"], dtype=np.float32)
            counts = np.asarray(part["counts"], dtype=np.int64)
            if embs.ndim != 2 or counts.shape != (embs.shape[0],):
                raise ValueError(f"bad novelty state for {name!r}: embeddings {embs.shape}, counts {counts.shape}")
            stores[name] = _Store(embs.copy(), counts.copy())
        self.threshold = float(state.get("threshold", self.threshold))
        self._stores = stores
