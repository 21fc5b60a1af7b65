"""The counts behind the intrinsic novelty reward: a store of distinct state embeddings with visit counts, per
namespace. The reward itself, r_int = 1/n of the count n this store gives each visit, is
:func:`empo2.algo.empo2.novelty_reward`.

Definition used here. Each namespace (a task) holds distinct states s_1..s_M (unit-norm embeddings of observations)
and a visit count n_j for each. A batch of visits x_1..x_N is counted as a whole, together with the counts from before
it:

1. Each visit is assigned to a state. A visit within ``threshold`` (cosine) of a stored state is assigned to the most
   similar one, j*(x) = argmax_j cos(x, s_j). The other visits form new states: they are taken in lexicographic order
   of their embedding values, and each joins the most similar new state found so far if it is within ``threshold``,
   else it starts a new state of its own (its embedding is the one stored).
2. With n_before_j the count of state j before the batch (0 for a new state) and n_batch_j the number of this batch's
   visits assigned to j, every visit assigned to j counts n(x) = n_before_j + n_batch_j and earns

       r(x) = 1 / n(x) = 1 / (n_before_j + n_batch_j)

   and the store's count becomes n_before_j + n_batch_j.

So a state visited 4 times in a batch and never before earns 1/4 at each visit, a state visited once earns 1, and a
state visited once per batch earns 1, 1/2, 1/3 … across batches. Nothing depends on the order in which a batch's
visits (or trajectories) arrive: the assignment to stored states is per visit, the new states depend only on the
multiset of unmatched embeddings (the lexicographic order is the same for every permutation), and the counts are sums.
Identical embeddings always get identical rewards, so identical trajectories of a group get identical intrinsic
returns and the group-relative advantage is not manufactured from processing order.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

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

    def count_batch(self, x: np.ndarray, threshold: float) -> np.ndarray:
        """Assign every visit of x [N, d] to a state (new states appended), add the batch's visits to the counts and
        return each visit's state index [N]."""
        state = self.match(x, threshold)  # [N]
        unmatched = np.flatnonzero(state < 0)
        # Leaders are picked in an order fixed by the embedding values alone, never by the visits' order in the batch.
        ordered = unmatched[np.lexsort(x[unmatched].T[::-1])]
        leaders: list[int] = []  # rows of x that start a new state, in the order the states are appended
        lead = np.empty((len(ordered), x.shape[1]), dtype=x.dtype)  # their embeddings, filled as they appear
        for row in ordered:
            sims = lead[: len(leaders)] @ x[row]  # [L]
            if len(sims) and sims.max() >= threshold:
                state[row] = len(self.counts) + int(sims.argmax())
            else:
                state[row] = len(self.counts) + len(leaders)
                lead[len(leaders)] = x[row]
                leaders.append(int(row))
        if leaders:
            self.embs = np.concatenate([self.embs, lead[: len(leaders)]])
            self.counts = np.concatenate([self.counts, np.zeros(len(leaders), dtype=np.int64)])
        np.add.at(self.counts, state, 1)
        return state


class NoveltyReward:
    """Per-namespace stores of distinct state embeddings with visit counts, the state of the novelty reward. Pure
    numpy; the caller embeds states and turns the counts into rewards."""

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

    def visits(self, embs: np.ndarray, namespaces: Sequence[str] | None = None) -> np.ndarray:
        """Count a batch of visits. embs [N, d] (re-normalised here), namespaces N strings (default: one namespace)
        -> n [N] int64 ≥ 1: the visits before this call + the visits in this call of the state each visit is
        assigned to (the n of r_int = 1/n)."""
        x = np.asarray(embs, dtype=np.float32)
        if x.ndim != 2:
            raise ValueError(f"embeddings must be [N, d], got shape {x.shape}")
        n, d = x.shape
        names = [""] * n if namespaces is None else list(namespaces)
        if len(names) != n:
            raise ValueError(f"{len(names)} namespaces for {n} embeddings")
        if n == 0:
            return np.zeros((0,), dtype=np.int64)
        norms = np.linalg.norm(x, axis=1, keepdims=True)  # [N, 1]
        if not np.all(np.isfinite(x)) or np.any(norms == 0):
            raise ValueError("embeddings must be finite and non-zero")
        x = x / norms  # [N, d]
        visits = np.empty(n, dtype=np.int64)  # [N]
        for name in dict.fromkeys(names):
            rows = np.array([i for i, ns in enumerate(names) if ns == name])
            store = self._stores.setdefault(name, _Store(np.zeros((0, d), np.float32), np.zeros(0, np.int64)))
            if store.embs.shape[1] != d:
                raise ValueError(f"embedding dim {d} does not match the store's {store.embs.shape[1]}")
            state = store.count_batch(x[rows], self.threshold)  # [K]
            visits[rows] = store.counts[state]
        return visits

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
