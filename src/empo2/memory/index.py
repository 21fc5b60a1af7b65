"""The tip memory's in-RAM search index: one growable float32 matrix per namespace (exact cosine top-k).

The SQLite file (:mod:`empo2.memory.store`) is the source of truth; this index mirrors its embeddings, scores,
utilities and LRU clock so a search is one matrix product per namespace.
"""

from __future__ import annotations

import contextlib

import numpy as np

EVICTION_POLICIES = ("utility", "lru", "fifo")


class NamespaceIndex:
    """Growable float32 matrices of one namespace's key and tip embeddings, with per-row score and utility."""

    def __init__(self, dim: int):
        self.dim = dim
        self.n = 0
        self.ids = np.zeros(0, dtype=np.int64)
        self.keys = np.zeros((0, dim), dtype=np.float32)
        self.tip_embs = np.zeros((0, dim), dtype=np.float32)
        self.scores = np.zeros(0, dtype=np.float64)
        self.utils = np.zeros(0, dtype=np.float64)  # NaN = no utility yet
        self.touched = np.zeros(0, dtype=np.int64)  # logical clock of the last add or use (LRU)
        self.row: dict[int, int] = {}

    def _grow(self, need: int) -> None:
        cap = len(self.ids)
        if need <= cap:
            return
        new = max(need, 2 * cap, 64)
        for name in ("ids", "keys", "tip_embs", "scores", "utils", "touched"):
            old = getattr(self, name)
            arr = np.zeros((new,) + old.shape[1:], dtype=old.dtype)
            arr[: self.n] = old[: self.n]
            setattr(self, name, arr)

    def add(self, ids, keys, tip_embs, scores, utils, touched) -> None:
        """Append rows: ``keys``/``tip_embs`` are ``[m, dim]`` L2-normalised, the rest length ``m``."""
        m = len(ids)
        self._grow(self.n + m)
        sl = slice(self.n, self.n + m)
        self.ids[sl], self.keys[sl], self.tip_embs[sl] = ids, keys, tip_embs
        self.scores[sl], self.utils[sl], self.touched[sl] = scores, utils, touched
        for i, tid in enumerate(ids):
            self.row[int(tid)] = self.n + i
        self.n += m

    def remove(self, tid: int) -> None:
        r = self.row.pop(tid)
        last = self.n - 1
        if r != last:  # move the last row into the hole
            for arr in (self.ids, self.keys, self.tip_embs, self.scores, self.utils, self.touched):
                arr[r] = arr[last]
            self.row[int(self.ids[r])] = r
        self.n -= 1

    def victims(self, policy: str, count: int) -> list[int]:
        """The ``count`` ids to evict first under ``policy`` (ties: oldest first)."""
        n = self.n
        if count <= 0 or n == 0:
            return []
        ids = self.ids[:n]
        if policy == "utility":  # a tip nobody has rated yet is judged by its own episode's score
            order = np.lexsort((ids, np.where(np.isnan(self.utils[:n]), self.scores[:n], self.utils[:n])))
        elif policy == "lru":
            order = np.lexsort((ids, self.touched[:n]))
        else:
            order = np.argsort(ids, kind="stable")
        return [int(t) for t in ids[order[:count]]]

    def max_tip_similarity(self, temb: np.ndarray, blas_threads: int | None) -> float:
        """Highest cosine of the tip-text embedding ``temb`` [dim] to a stored tip's (-inf when empty)."""
        if self.n == 0:
            return float("-inf")
        with blas_limit(blas_threads):
            return float((self.tip_embs[: self.n] @ temb).max())

    def top_k(self, q: np.ndarray, k: int, threshold: float, score_weight: float, utility_weight: float,
              blas_threads: int | None) -> list[list[tuple[int, float, float]]]:
        """Per query row of ``q`` [m, dim]: up to ``k`` (id, similarity, rank score), best first, ties → newer."""
        if self.n == 0:
            return [[] for _ in range(len(q))]
        with blas_limit(blas_threads):
            sims = q @ self.keys[: self.n].T  # [m, n]: one row of similarities per query
        bonus = np.zeros(self.n)
        if score_weight:
            bonus = bonus + score_weight * minmax(self.scores[: self.n])
        if utility_weight:
            bonus = bonus + utility_weight * minmax(self.utils[: self.n])
        ids = self.ids[: self.n]
        out = []
        for sim in sims:
            cand = np.flatnonzero(sim >= threshold)
            rank = sim[cand] + bonus[cand]
            if len(cand) > k:  # keep everything tied with the k-th best, then sort exactly
                kth = np.partition(rank, len(cand) - k)[len(cand) - k]
                keep = rank >= kth
                cand, rank = cand[keep], rank[keep]
            order = np.lexsort((-ids[cand], -rank))[:k]
            out.append([(int(ids[cand[o]]), float(sim[cand[o]]), float(rank[o])) for o in order])
        return out


_BLAS = None


def blas_limit(threads: int | None):
    """Context limiting BLAS threads for the search products (single-threaded sgemv is faster and far steadier on a
    busy machine, where oversubscribed BLAS threads give latency spikes). A no-op without threadpoolctl."""
    global _BLAS
    if threads is None:
        return contextlib.nullcontext()
    if _BLAS is None:
        try:
            from threadpoolctl import ThreadpoolController

            _BLAS = ThreadpoolController().select(user_api="blas")
        except Exception:  # threadpoolctl missing or broken: leave BLAS alone
            _BLAS = False
    return _BLAS.limit(limits=threads) if _BLAS else contextlib.nullcontext()


def minmax(values: np.ndarray) -> np.ndarray:
    """Scale to [0, 1] (NaN → 0; a constant column → 0)."""
    v = np.asarray(values, dtype=np.float64)
    finite = np.isfinite(v)
    if not finite.any():
        return np.zeros_like(v)
    lo, hi = v[finite].min(), v[finite].max()
    out = np.zeros_like(v) if hi <= lo else (v - lo) / (hi - lo)
    return np.where(finite, out, 0.0)
