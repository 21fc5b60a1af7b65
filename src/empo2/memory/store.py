"""The tip memory: validated, de-duplicated tips keyed by the state they are about (the paper's memory M). One SQLite
file per run (WAL journal; layout in :mod:`empo2.memory.schema`) is the source of truth; every write is its own
transaction, so a killed process loses at most the write in flight. Opening a file runs SQLite's ``quick_check``
first: a damaged file is refused and never written. Search runs on the in-RAM index (:mod:`empo2.memory.index`);
tip-text validation is in :mod:`empo2.memory.validate`."""

from __future__ import annotations

import sqlite3
import threading
import time
from collections.abc import Iterable, Sequence
from pathlib import Path
from typing import Any

import numpy as np

# isort: off
from .index import EVICTION_POLICIES, NamespaceIndex
from .schema import (APPLICATION_ID, SCHEMA_VERSION, AddResult, Tip, backup_to, blob, bump, create_schema, delete_tips,
                     fetch_tips, insert_tip, new_meta, read_embeddings, read_schema, read_stats, select_tips, transaction)
from .sqlite_file import (SQLITE_MAGIC, check_header, check_integrity, check_regular_file, existing_sidecars,
                          open_connection, remove_new_sidecars)
from .validate import (REJECTION_REASONS, DimensionMismatchError, MemoryStoreError, as_matrix, check_settings,
                       check_tip_text, json_line)
# isort: on

__all__ = ["TipMemory", "Tip", "AddResult", "MemoryStoreError", "DimensionMismatchError", "check_tip_text",
           "json_line", "EVICTION_POLICIES", "REJECTION_REASONS", "SCHEMA_VERSION", "APPLICATION_ID", "SQLITE_MAGIC"]


class TipMemory:
    """A persistent tip memory (see the module docstring).

    Args:
        path: the SQLite file (created if missing or empty; an existing file must be an empo2 memory).
        dim: embedding dimension; ``None`` = take it from an existing file (384 for a new one).
        capacity: tips kept per namespace; adding to a full namespace evicts by ``eviction``. ``None`` = the value
            saved in the file (1000 for a new one); a given value is saved for later readers.
        eviction: ``utility`` (lowest utility first; a never-rated tip counts its episode score), ``lru``
            (least recently added or used) or ``fifo`` (oldest). ``None`` = saved value (``utility`` when new).
        dedup_threshold: a tip whose text embedding has cosine > this to one in its namespace is a duplicate.
        max_tip_words: longer tips are rejected.
        embedder: object with ``encode(list[str]) -> [N, dim]`` for tip-text embeddings; without it callers of
            :meth:`add` pass ``tip_embedding``.
        synchronous: SQLite ``synchronous`` level; ``NORMAL`` survives killed processes, ``FULL`` also power loss.
        blas_threads: BLAS threads for the search matrix products (``None`` = library default).
        integrity_check: on opening an existing file, ``quick`` (SQLite ``quick_check``), ``full``
            (``integrity_check``) or ``none``; a damaged file raises :class:`MemoryStoreError` and is left unchanged.
        read_only: never write the file (readers such as ``empo2 memory``); an empty file is refused, not created.
    """

    def __init__(self, path: str | Path, dim: int | None = 384, capacity: int | None = None,
                 eviction: str | None = None,
                 dedup_threshold: float = 0.95, max_tip_words: int = 100, embedder: Any = None,
                 synchronous: str = "NORMAL", blas_threads: int | None = 1,
                 integrity_check: str = "quick", read_only: bool = False):
        check_settings(eviction, EVICTION_POLICIES, capacity, synchronous)
        self.path = Path(path)
        self.capacity = 1000 if capacity is None else int(capacity)
        self.eviction = eviction or "utility"
        self.dedup_threshold = float(dedup_threshold)
        self.max_tip_words = int(max_tip_words)
        self.embedder = embedder
        self.blas_threads = blas_threads
        self._lock = threading.RLock()
        self._index: dict[str, NamespaceIndex] = {}
        self._conn: sqlite3.Connection | None = None
        self.skipped: dict[str, int] = {}  # stored tips that fail the tip checks, by reason (see _load)
        self.read_only = read_only
        if embedder is not None and dim is not None and getattr(embedder, "dim", dim) != dim:
            raise DimensionMismatchError(f"embedder gives {embedder.dim}-d vectors but dim={dim}")
        check_regular_file(self.path)
        fresh = not self.path.exists() or self.path.stat().st_size == 0
        if fresh and read_only:  # only the run that owns a memory creates its schema
            raise MemoryStoreError(f"{self.path} is empty: no tip memory has been written to it yet")
        if fresh:
            self.dim = int(dim if dim is not None else getattr(embedder, "dim", 384))
            self._create(synchronous)
        else:
            check_header(self.path)
            check_integrity(self.path, integrity_check)
            self._connect(synchronous)
            self.dim = self._check_schema(dim)
            if embedder is not None and getattr(embedder, "dim", self.dim) != self.dim:
                self.close()
                raise DimensionMismatchError(f"embedder gives {embedder.dim}-d vectors but {self.path} stores "
                                             f"{self.dim}-d embeddings")
            self.capacity = int(self.meta.get("capacity", 1000)) if capacity is None else int(capacity)
            self.eviction = eviction or self.meta.get("eviction", "utility")
            if self.eviction not in EVICTION_POLICIES:
                self.eviction = "utility"
            self._load()
            self._save_settings()
        self._clock = max((int(i.touched[: i.n].max()) for i in self._index.values() if i.n), default=0)

    # ------------------------------------------------------------------ file handling
    def _connect(self, synchronous: str) -> None:
        self._sidecars = existing_sidecars(self.path)  # a reader removes the ones it made when it closes
        self._conn = open_connection(self.path, synchronous, self.read_only)

    def _create(self, synchronous: str) -> None:
        self.path.parent.mkdir(parents=True, exist_ok=True)
        self._connect(synchronous)
        self.meta = create_schema(self._conn, new_meta(self.dim, str(getattr(self.embedder, "name", "") or ""),
                                                       self.capacity, self.eviction))

    def _check_schema(self, dim: int | None) -> int:
        try:
            _, meta = read_schema(self._conn, self.path)
        except MemoryStoreError:
            self.close()
            raise
        stored = int(meta.get("dim", "0"))
        if dim is not None and stored != dim:
            self.close()
            raise DimensionMismatchError(f"{self.path} stores {stored}-d embeddings but dim={dim} was requested "
                                         "(was it written with another embedder?)")
        self.meta = meta
        return stored

    def _load(self) -> None:
        """Load into the per-namespace matrices every tip that passes a new tip's checks; one that fails (too long,
        undecodable, …: a file from elsewhere) stays in the file, never retrieved, counted in :attr:`skipped`."""
        try:
            rows, self.skipped = read_embeddings(self._conn, self.dim, self.max_tip_words)
        except (sqlite3.DatabaseError, MemoryStoreError) as exc:
            self.close()
            raise MemoryStoreError(f"{self.path} is corrupt: {exc}") from None
        for ns, items in rows.items():
            idx = self._index[ns] = NamespaceIndex(self.dim)
            ids, keys, tembs, scores, utils, touched = zip(*items)
            idx.add(np.array(ids), np.stack(keys), np.stack(tembs), np.array(scores), np.array(utils),
                    np.array(touched))

    def _save_settings(self) -> None:
        """Record capacity and eviction policy in the file when they changed (readers such as the CLI use them)."""
        wanted = {"capacity": str(self.capacity), "eviction": self.eviction}
        if self.read_only or all(self.meta.get(k) == v for k, v in wanted.items()):
            return
        with transaction(self._conn) as conn:
            conn.executemany("INSERT OR REPLACE INTO meta(key, value) VALUES (?, ?)", wanted.items())
        self.meta.update(wanted)

    def _require_open(self) -> sqlite3.Connection:
        if self._conn is None:
            raise MemoryStoreError(f"memory {self.path} is closed")
        return self._conn
    def close(self) -> None:
        """Close the database (committed data is already on disk)."""
        with self._lock:
            if self._conn is not None:
                self._conn.close()
                self._conn = None
                if self.read_only:
                    remove_new_sidecars(self.path, self._sidecars)

    def __enter__(self) -> TipMemory:
        return self

    def __exit__(self, *exc: Any) -> None:
        self.close()

    def __len__(self) -> int:
        return sum(idx.n for idx in self._index.values())

    def namespaces(self) -> list[str]:
        return sorted(ns for ns, idx in self._index.items() if idx.n)

    # ------------------------------------------------------------------ writing
    def _reject(self, reason: str) -> AddResult:
        conn = self._require_open()
        with transaction(conn):
            bump(conn, f"rejected:{reason}")
        return AddResult(None, reason)

    def _victims(self, namespace: str, count: int) -> list[int]:
        idx = self._index.get(namespace)
        return idx.victims(self.eviction, count) if idx is not None else []

    def add(self, namespace: str, tip_text: str, key_embedding: Any, *, key_text: str = "", score: float = 0.0,
            step: int = 0, context_texts: Iterable[str] = (), tip_embedding: Any = None) -> AddResult:
        """Validate and store one tip in one transaction (evicting first when the namespace is full).

        ``key_embedding`` is the embedding of the state the tip is about (task + observation), the vector that
        retrieval queries are compared with. ``context_texts`` (prompt, observations) are what the tip must not copy.
        Rejections return ``AddResult(None, reason)`` and are counted in the database.
        """
        if not isinstance(namespace, str) or not namespace:
            raise MemoryStoreError("namespace must be a non-empty string")
        key = as_matrix(key_embedding, self.dim, "key_embedding")
        if key.shape[0] != 1:
            raise MemoryStoreError(f"key_embedding must be one vector, got {key.shape[0]}")
        with self._lock:
            conn = self._require_open()
            text = tip_text.strip() if isinstance(tip_text, str) else ""
            reason = check_tip_text(text, self.max_tip_words, context_texts)
            if reason is not None:
                return self._reject(reason)
            if tip_embedding is None:
                if self.embedder is None:
                    raise MemoryStoreError("add() needs tip_embedding when the memory has no embedder")
                tip_embedding = self.embedder.encode([text])
            temb = as_matrix(tip_embedding, self.dim, "tip_embedding")[0]
            idx = self._index.get(namespace)
            if idx is not None and idx.max_tip_similarity(temb, self.blas_threads) > self.dedup_threshold:
                return self._reject("duplicate")
            evicted: list[int] = []
            with transaction(conn):
                count = idx.n if idx is not None else 0
                if count >= self.capacity:
                    evicted = self._victims(namespace, count - self.capacity + 1)
                    delete_tips(conn, evicted)
                tick = self._clock + 1
                tid = insert_tip(conn, (namespace, text, str(key_text), blob(key[0]), blob(temb), float(score),
                                        int(step), time.time(), tick))
            self._clock = tick
            if idx is None:
                idx = self._index[namespace] = NamespaceIndex(self.dim)
            for t in evicted:
                idx.remove(t)
            idx.add(np.array([tid]), key, temb[None], np.array([float(score)]), np.array([np.nan]), np.array([tick]))
            return AddResult(tid, None, tuple(evicted))

    def bulk_insert(self, namespace: str, texts: Sequence[str], key_embeddings: Any, tip_embeddings: Any, *,
                    scores: Sequence[float] | None = None, step: int = 0) -> list[int]:
        """Insert many tips in one transaction WITHOUT validation or de-duplication (imports, benchmarks).

        Capacity still holds: if the namespace overflows, the policy's victims are evicted in the same transaction.
        """
        keys = as_matrix(key_embeddings, self.dim, "key_embeddings")
        tembs = as_matrix(tip_embeddings, self.dim, "tip_embeddings")
        if not len(texts) == len(keys) == len(tembs):
            raise MemoryStoreError("texts, key_embeddings and tip_embeddings must have the same length")
        scores = np.zeros(len(texts)) if scores is None else np.asarray(scores, dtype=np.float64)
        with self._lock:
            conn = self._require_open()
            now = time.time()
            first = self._clock + 1
            rows = [(namespace, str(t), "", blob(k), blob(e), float(s), int(step), now, first + i)
                    for i, (t, k, e, s) in enumerate(zip(texts, keys, tembs, scores))]
            idx = self._index.setdefault(namespace, NamespaceIndex(self.dim))
            added: list[int] = []
            try:
                with transaction(conn):
                    ids = [insert_tip(conn, row) for row in rows]
                    idx.add(np.array(ids, dtype=np.int64), keys, tembs, scores, np.full(len(ids), np.nan),
                            np.arange(first, first + len(ids)))
                    added = ids
                    evicted = self._victims(namespace, idx.n - self.capacity)
                    delete_tips(conn, evicted)
            except BaseException:
                for t in added:  # rolled back: the index drops them too
                    idx.remove(t)
                raise
            self._clock = first + len(rows) - 1
            for t in evicted:
                idx.remove(t)
            dead = set(evicted)
            return [t for t in ids if t not in dead]

    def _live(self, tip_ids: Iterable[int]) -> list[tuple[int, str]]:
        """(id, namespace) of the ids still stored (evicted ids are skipped silently)."""
        out = []
        for tid in dict.fromkeys(int(t) for t in tip_ids):
            for ns, idx in self._index.items():
                if tid in idx.row:
                    out.append((tid, ns))
                    break
        return out

    def record_use(self, tip_ids: Iterable[int], step: int) -> None:
        """Mark tips as shown in a prompt at ``step``: use count +1, last use, LRU recency (one transaction)."""
        with self._lock:
            conn = self._require_open()
            live = self._live(tip_ids)
            if not live:
                return
            with transaction(conn):
                tick = self._clock + 1
                conn.executemany("UPDATE tips SET use_count = use_count + 1, last_use_step = ?, touched = ? "
                                 "WHERE id = ?", [(int(step), tick, t) for t, _ in live])
            self._clock = tick
            for tid, ns in live:
                idx = self._index[ns]
                idx.touched[idx.row[tid]] = tick

    def update_utility(self, tip_ids: Iterable[int], episode_return: float) -> None:
        """Fold an episode's return into the running-mean utility of each tip its prompts contained."""
        r = float(episode_return)
        if not np.isfinite(r):
            raise MemoryStoreError(f"episode_return must be finite, got {episode_return!r}")
        with self._lock:
            conn = self._require_open()
            live = self._live(tip_ids)
            if not live:
                return
            with transaction(conn):
                conn.executemany("UPDATE tips SET utility = (COALESCE(utility, 0) * utility_n + ?) / (utility_n + 1), "
                                 "utility_n = utility_n + 1 WHERE id = ?", [(r, t) for t, _ in live])
                new = dict(conn.execute(f"SELECT id, utility FROM tips WHERE id IN ({','.join('?' * len(live))})",
                                        [t for t, _ in live]).fetchall())
            for tid, ns in live:
                idx = self._index[ns]
                idx.utils[idx.row[tid]] = new[tid]

    def record_episode(self, tip_ids: Iterable[int], episode_return: float, step: int) -> None:
        """:meth:`record_use` + :meth:`update_utility` for one finished episode."""
        ids = list(tip_ids)
        self.record_use(ids, step)
        self.update_utility(ids, episode_return)

    # ------------------------------------------------------------------ reading
    def retrieve(self, namespaces: Sequence[str] | str, query_embeddings: Any, k: int = 10, threshold: float = 0.5,
                 score_weight: float = 0.0, utility_weight: float = 0.0) -> list[list[Tip]]:
        """Top-``k`` tips per query whose key has cosine >= ``threshold`` to the query (the current state).

        ``namespaces[i]`` is the namespace of query ``i`` (a single string applies to all). Ranking is by
        ``similarity + score_weight * score' + utility_weight * utility'`` where ``'`` is min-max scaled over the
        namespace (an unrated utility counts 0); ties go to the newer tip. Queries are grouped by namespace and
        each group is one matrix product. Does not count as a use; call :meth:`record_use` for the tips you show.
        """
        q = as_matrix(query_embeddings, self.dim, "query_embeddings")
        if isinstance(namespaces, str):
            namespaces = [namespaces] * q.shape[0]
        if len(namespaces) != q.shape[0]:
            raise MemoryStoreError(f"{len(namespaces)} namespaces for {q.shape[0]} query embeddings")
        if k <= 0:
            return [[] for _ in range(q.shape[0])]
        results: dict[int, list[tuple[int, float, float]]] = {i: [] for i in range(q.shape[0])}
        with self._lock:
            groups: dict[str, list[int]] = {}
            for i, ns in enumerate(namespaces):
                groups.setdefault(ns, []).append(i)
            for ns, rows in groups.items():  # one matrix product per namespace
                if ns in self._index:
                    found = self._index[ns].top_k(q[rows], k, threshold, score_weight, utility_weight,
                                                  self.blas_threads)
                    results.update(zip(rows, found))
            tips = self._fetch({tid for res in results.values() for tid, _, _ in res})
        return [[Tip(**{**tips[tid].to_dict(), "similarity": sim, "rank_score": rank}) for tid, sim, rank in res]
                for res in results.values()]

    def _fetch(self, ids: Iterable[int]) -> dict[int, Tip]:
        return fetch_tips(self._require_open(), list(ids))

    def get(self, tip_id: int) -> Tip | None:
        """One tip by id, or ``None``."""
        with self._lock:
            return self._fetch([int(tip_id)]).get(int(tip_id))

    def all_tips(self, namespace: str | None = None) -> list[Tip]:
        """Every stored tip (optionally of one namespace), oldest first."""
        with self._lock:
            return select_tips(self._require_open(), namespace)

    def embeddings(self, tip_ids: Sequence[int]) -> tuple[np.ndarray, np.ndarray]:
        """(key embeddings, tip-text embeddings) of the given ids, each ``[N, dim]`` (unknown ids raise KeyError)."""
        keys, tembs = [], []
        with self._lock:
            for tid, ns in self._live(tip_ids):
                idx = self._index[ns]
                keys.append(idx.keys[idx.row[tid]].copy())
                tembs.append(idx.tip_embs[idx.row[tid]].copy())
        if len(keys) != len(set(tip_ids)):
            raise KeyError("some tip ids are not stored")
        return (np.stack(keys) if keys else np.zeros((0, self.dim), np.float32),
                np.stack(tembs) if tembs else np.zeros((0, self.dim), np.float32))

    def rejections(self) -> dict[str, int]:
        """Rejected adds by reason (persisted)."""
        with self._lock:
            return read_stats(self._require_open())["rejections"]

    def stats(self) -> dict[str, Any]:
        """Counts per namespace, rejections by reason, utilities and usage, in plain JSON types."""
        with self._lock:
            counts = read_stats(self._require_open())
        return {"path": str(self.path), "schema_version": SCHEMA_VERSION, "dim": self.dim, "capacity": self.capacity,
                "eviction": self.eviction, **counts}

    def export_jsonl(self, path: str | Path) -> int:
        """Write every tip as one JSON object per line (UTF-8, non-ASCII kept); returns the count."""
        tips = self.all_tips()
        with open(path, "w", encoding="utf-8") as f:
            for t in tips:
                d = t.to_dict()
                d.pop("similarity"), d.pop("rank_score")
                f.write(json_line(d) + "\n")
        return len(tips)

    def copy_to(self, path: str | Path) -> Path:
        """A consistent copy of the database (SQLite online backup) at ``path``; refuses an existing non-empty file."""
        dest = Path(path)
        if dest.exists() and dest.stat().st_size > 0:
            raise MemoryStoreError(f"{dest} already exists; not overwriting it")
        dest.parent.mkdir(parents=True, exist_ok=True)
        with self._lock:
            backup_to(self._require_open(), dest)
        return dest
