"""The tip memory: validated, de-duplicated tips keyed by the state they are about (SPEC §5).

One SQLite file per run (WAL journal) is the source of truth; every write is its own transaction, so a killed process
loses at most the write that was in flight. Search runs on an in-RAM float32 matrix per namespace (exact cosine top-k;
one matrix product serves every query of a namespace in a batch).

Schema (``PRAGMA user_version`` = :data:`SCHEMA_VERSION`, ``PRAGMA application_id`` = :data:`APPLICATION_ID`)::

    meta(key, value)            schema_version, dim, embedder, created_at
    tips(id, namespace, text, key_text, key_emb, tip_emb, score, step, created_at,
         use_count, last_use_step, touched, utility, utility_n)
    counters(name, value)       rejected:<reason>, evicted

Embeddings are little-endian float32 blobs of ``dim`` values, L2-normalised on the way in.
``utility`` is NULL until an episode that used the tip reports its return.
"""

from __future__ import annotations

import contextlib
import json
import re
import sqlite3
import struct
import threading
import time
import zlib
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any, Iterable, Sequence

import numpy as np

SCHEMA_VERSION = 1
APPLICATION_ID = 0x454D5032  # "EMP2"
SQLITE_MAGIC = b"SQLite format 3\x00"
EVICTION_POLICIES = ("utility", "lru", "fifo")
REJECTION_REASONS = ("empty", "too_long", "invalid_unicode", "non_printable", "repetitive", "copy_of_context",
                     "duplicate")

_SCHEMA = """
CREATE TABLE meta (key TEXT PRIMARY KEY, value TEXT NOT NULL);
CREATE TABLE tips (
    id INTEGER PRIMARY KEY AUTOINCREMENT,
    namespace TEXT NOT NULL,
    text TEXT NOT NULL,
    key_text TEXT NOT NULL DEFAULT '',
    key_emb BLOB NOT NULL,
    tip_emb BLOB NOT NULL,
    score REAL NOT NULL,
    step INTEGER NOT NULL,
    created_at REAL NOT NULL,
    use_count INTEGER NOT NULL DEFAULT 0,
    last_use_step INTEGER,
    touched INTEGER NOT NULL,
    utility REAL,
    utility_n INTEGER NOT NULL DEFAULT 0
);
CREATE INDEX tips_namespace ON tips(namespace);
CREATE TABLE counters (name TEXT PRIMARY KEY, value INTEGER NOT NULL);
"""
_TIP_COLUMNS = "id, namespace, text, key_text, score, step, created_at, use_count, last_use_step, utility, utility_n"


class MemoryStoreError(RuntimeError):
    """The memory file cannot be used (corrupt, foreign, newer schema) or an argument is malformed."""


class DimensionMismatchError(MemoryStoreError, ValueError):
    """An embedding's dimension differs from the memory's."""


@dataclass
class Tip:
    """One stored tip. ``similarity`` and ``rank_score`` are set by :meth:`TipMemory.retrieve` (else 0)."""

    id: int
    namespace: str
    text: str
    key_text: str
    score: float
    step: int
    created_at: float
    use_count: int
    last_use_step: int | None
    utility: float | None
    utility_n: int
    similarity: float = 0.0
    rank_score: float = 0.0

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)


@dataclass(frozen=True)
class AddResult:
    """Outcome of :meth:`TipMemory.add`: ``id`` when stored, else ``reason`` (one of :data:`REJECTION_REASONS`)."""

    id: int | None
    reason: str | None = None
    evicted: tuple[int, ...] = ()

    @property
    def ok(self) -> bool:
        return self.id is not None


def json_line(obj: Any) -> str:
    """One JSON line, non-ASCII kept but U+2028/U+2029 escaped (``str.splitlines`` and JS split on them)."""
    return json.dumps(obj, ensure_ascii=False).replace("\u2028", "\\u2028").replace("\u2029", "\\u2029")


# ---------------------------------------------------------------------------------------------------------- validation
_WORD = re.compile(r"\S+")
_NORM = re.compile(r"[^\w]+")


def _normalise(text: str) -> str:
    """Lower-case, punctuation and runs of whitespace folded to one space (for copy detection)."""
    return _NORM.sub(" ", text.lower()).strip()


def _trigrams(words: list[str]) -> set[tuple[str, ...]]:
    return {tuple(words[i:i + 3]) for i in range(len(words) - 2)}


def check_tip_text(text: str, max_words: int = 100, context_texts: Iterable[str] = ()) -> str | None:
    """Why ``text`` must not be stored (a reason from :data:`REJECTION_REASONS`), or ``None`` if it may.

    The duplicate check needs embeddings and lives in :meth:`TipMemory.add`.
    """
    text = text.strip()
    if not text:
        return "empty"
    words = _WORD.findall(text)
    if len(words) > max_words or len(text) > 12 * max_words:
        return "too_long"
    try:
        text.encode("utf-8")
    except UnicodeEncodeError:  # lone surrogates cannot be stored as UTF-8 text
        return "invalid_unicode"
    bad = sum(1 for ch in text if (not ch.isprintable() and ch not in "\t\n") or ch == "\ufffd")
    if bad > 0.3 * len(text) or not any(ch.isalnum() for ch in text):
        return "non_printable"
    lowered = [w.lower() for w in words]
    if len(words) >= 8 and len(set(lowered)) < 0.35 * len(words):
        return "repetitive"
    raw = text.encode("utf-8")
    if len(raw) >= 64 and len(zlib.compress(raw, 9)) < 0.22 * len(raw):
        return "repetitive"
    norm = _normalise(text)
    norm_words = norm.split()
    grams = _trigrams(norm_words)
    for ctx in context_texts:
        ctx_norm = _normalise(ctx or "")
        if not ctx_norm:
            continue
        if len(norm_words) >= 3 and f" {norm} " in f" {ctx_norm} ":
            return "copy_of_context"
        if len(grams) >= 3 and len(grams & _trigrams(ctx_norm.split())) >= 0.8 * len(grams):
            return "copy_of_context"
    return None


# ------------------------------------------------------------------------------------------------------- in-RAM index
class _NamespaceIndex:
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


# ------------------------------------------------------------------------------------------------------------ helpers
def _as_matrix(x: Any, dim: int, what: str) -> np.ndarray:
    """Validate and L2-normalise embeddings → float32 ``[N, dim]`` (a single vector gives ``[1, dim]``)."""
    arr = np.asarray(x, dtype=np.float32)
    if arr.ndim == 1:
        arr = arr[None, :]
    if arr.ndim != 2:
        raise MemoryStoreError(f"{what} must be a vector or a [N, dim] matrix, got shape {arr.shape}")
    if arr.shape[1] != dim:
        raise DimensionMismatchError(f"{what} has dimension {arr.shape[1]} but this memory stores {dim}-d embeddings")
    if not np.isfinite(arr).all():
        raise MemoryStoreError(f"{what} contains NaN or infinite values")
    norms = np.linalg.norm(arr, axis=1, keepdims=True)
    return np.ascontiguousarray(arr / np.where(norms > 0, norms, 1.0), dtype=np.float32)


_BLAS = None


def _blas_limit(threads: int | None):
    """Context limiting BLAS threads for the search products (single-threaded sgemv is faster and far steadier on a
    busy machine; oversubscribed BLAS threads gave 100+ ms p99 spikes). A no-op without threadpoolctl."""
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


@contextlib.contextmanager
def _transaction(conn: sqlite3.Connection):
    """One write transaction: committed as a whole, or rolled back (and the error re-raised)."""
    conn.execute("BEGIN IMMEDIATE")
    try:
        yield conn
    except BaseException:
        conn.execute("ROLLBACK")
        raise
    conn.execute("COMMIT")


def _blob(vec: np.ndarray) -> bytes:
    return np.asarray(vec, dtype="<f4").tobytes()


def _unblob(data: bytes, dim: int, tid: int) -> np.ndarray:
    if len(data) != 4 * dim:
        raise MemoryStoreError(f"tip {tid}: stored embedding has {len(data) // 4} values, expected {dim}")
    return np.frombuffer(data, dtype="<f4")


def _minmax(values: np.ndarray) -> np.ndarray:
    """Scale to [0, 1] (NaN → 0; a constant column → 0)."""
    v = np.asarray(values, dtype=np.float64)
    finite = np.isfinite(v)
    if not finite.any():
        return np.zeros_like(v)
    lo, hi = v[finite].min(), v[finite].max()
    out = np.zeros_like(v) if hi <= lo else (v - lo) / (hi - lo)
    return np.where(finite, out, 0.0)


# ----------------------------------------------------------------------------------------------------------- the store
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
    """

    def __init__(self, path: str | Path, dim: int | None = 384, capacity: int | None = None,
                 eviction: str | None = None,
                 dedup_threshold: float = 0.95, max_tip_words: int = 100, embedder: Any = None,
                 synchronous: str = "NORMAL", blas_threads: int | None = 1):
        if eviction is not None and eviction not in EVICTION_POLICIES:
            raise MemoryStoreError(f"eviction must be one of {', '.join(EVICTION_POLICIES)}, got {eviction!r}")
        if capacity is not None and capacity < 1:
            raise MemoryStoreError(f"capacity must be >= 1, got {capacity}")
        if synchronous.upper() not in ("OFF", "NORMAL", "FULL", "EXTRA"):
            raise MemoryStoreError(f"synchronous must be OFF|NORMAL|FULL|EXTRA, got {synchronous!r}")
        self.path = Path(path)
        self.capacity = 1000 if capacity is None else int(capacity)
        self.eviction = eviction or "utility"
        self.dedup_threshold = float(dedup_threshold)
        self.max_tip_words = int(max_tip_words)
        self.embedder = embedder
        self.blas_threads = blas_threads
        self._lock = threading.RLock()
        self._index: dict[str, _NamespaceIndex] = {}
        self._conn: sqlite3.Connection | None = None
        if embedder is not None and dim is not None and getattr(embedder, "dim", dim) != dim:
            raise DimensionMismatchError(f"embedder gives {embedder.dim}-d vectors but dim={dim}")
        fresh = not self.path.exists() or self.path.stat().st_size == 0
        if fresh:
            self.dim = int(dim if dim is not None else getattr(embedder, "dim", 384))
            self._create(synchronous)
        else:
            self._check_header()
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

    @classmethod
    def open(cls, path: str | Path, **kwargs: Any) -> "TipMemory":
        """Open (or create) a memory file; same arguments as the constructor."""
        return cls(path, **kwargs)

    # ------------------------------------------------------------------ file handling
    def _check_header(self) -> None:
        """Refuse a file that is not an empo2 memory before SQLite touches it (so it is never modified)."""
        try:
            with open(self.path, "rb") as f:
                head = f.read(100)
        except OSError as exc:
            raise MemoryStoreError(f"cannot read memory file {self.path}: {exc}") from None
        if len(head) < 100 or not head.startswith(SQLITE_MAGIC):
            raise MemoryStoreError(f"{self.path} is not a SQLite database (corrupt or foreign file); "
                                   "it was left unchanged")
        (app_id,) = struct.unpack(">I", head[68:72])
        if app_id != APPLICATION_ID:
            raise MemoryStoreError(f"{self.path} is a SQLite database but not an empo2 tip memory "
                                   f"(application_id {app_id:#x}); it was left unchanged")

    def _connect(self, synchronous: str) -> None:
        try:
            self._conn = sqlite3.connect(str(self.path), isolation_level=None, check_same_thread=False, timeout=30)
            self._conn.execute("PRAGMA busy_timeout = 30000")
            self._conn.execute(f"PRAGMA synchronous = {synchronous.upper()}")
        except sqlite3.Error as exc:
            raise MemoryStoreError(f"cannot open memory file {self.path}: {exc}") from None

    def _create(self, synchronous: str) -> None:
        self.path.parent.mkdir(parents=True, exist_ok=True)
        self._connect(synchronous)
        c = self._conn
        # Header pragmas, tables and meta in one rollback-journal transaction, so the main file is complete (and
        # recognisable by _check_header) before the WAL exists; a crash here leaves no half-made memory.
        c.execute("BEGIN IMMEDIATE")
        c.execute(f"PRAGMA application_id = {APPLICATION_ID}")
        c.execute(f"PRAGMA user_version = {SCHEMA_VERSION}")
        for stmt in filter(None, (s.strip() for s in _SCHEMA.split(";"))):
            c.execute(stmt)
        meta = {"schema_version": str(SCHEMA_VERSION), "dim": str(self.dim), "created_at": str(time.time()),
                "embedder": str(getattr(self.embedder, "name", "") or ""), "capacity": str(self.capacity),
                "eviction": self.eviction}
        c.executemany("INSERT INTO meta(key, value) VALUES (?, ?)", meta.items())
        c.execute("COMMIT")
        c.execute("PRAGMA journal_mode = WAL")
        self.meta = meta

    def _check_schema(self, dim: int | None) -> int:
        try:
            version = self._scalar("PRAGMA user_version")
            tables = {r[0] for r in self._conn.execute("SELECT name FROM sqlite_master WHERE type = 'table'")}
            if not {"meta", "tips", "counters"} <= tables:
                raise MemoryStoreError(f"{self.path} lacks the tip-memory tables (foreign or damaged file)")
            meta = dict(self._conn.execute("SELECT key, value FROM meta").fetchall())
        except sqlite3.DatabaseError as exc:
            self.close()
            raise MemoryStoreError(f"{self.path} is corrupt: {exc}") from None
        except MemoryStoreError:
            self.close()
            raise
        if version > SCHEMA_VERSION:
            self.close()
            raise MemoryStoreError(f"{self.path} has memory schema {version}; this empo2 reads up to "
                                   f"{SCHEMA_VERSION} (upgrade empo2)")
        stored = int(meta.get("dim", "0"))
        if dim is not None and stored != dim:
            self.close()
            raise DimensionMismatchError(f"{self.path} stores {stored}-d embeddings but dim={dim} was requested "
                                         "(was it written with another embedder?)")
        self.meta = meta
        return stored

    def _load(self) -> None:
        """Read every tip's embeddings into the per-namespace matrices."""
        rows: dict[str, list] = {}
        try:
            for tid, ns, key, temb, score, util, touched in self._conn.execute(
                    "SELECT id, namespace, key_emb, tip_emb, score, utility, touched FROM tips ORDER BY id"):
                rows.setdefault(ns, []).append((tid, _unblob(key, self.dim, tid), _unblob(temb, self.dim, tid),
                                                score, np.nan if util is None else util, touched))
        except sqlite3.DatabaseError as exc:
            self.close()
            raise MemoryStoreError(f"{self.path} is corrupt: {exc}") from None
        for ns, items in rows.items():
            idx = self._index[ns] = _NamespaceIndex(self.dim)
            ids, keys, tembs, scores, utils, touched = zip(*items)
            idx.add(np.array(ids), np.stack(keys), np.stack(tembs), np.array(scores), np.array(utils),
                    np.array(touched))

    def _save_settings(self) -> None:
        """Record capacity and eviction policy in the file when they changed (readers such as the CLI use them)."""
        wanted = {"capacity": str(self.capacity), "eviction": self.eviction}
        if all(self.meta.get(k) == v for k, v in wanted.items()):
            return
        conn = self._conn
        with _transaction(conn):
            conn.executemany("INSERT OR REPLACE INTO meta(key, value) VALUES (?, ?)", wanted.items())
        self.meta.update(wanted)

    def _scalar(self, sql: str, args: Sequence = ()) -> Any:
        return self._conn.execute(sql, args).fetchone()[0]

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

    def __enter__(self) -> "TipMemory":
        return self

    def __exit__(self, *exc: Any) -> None:
        self.close()

    def __len__(self) -> int:
        return sum(idx.n for idx in self._index.values())

    def namespaces(self) -> list[str]:
        return sorted(ns for ns, idx in self._index.items() if idx.n)

    # ------------------------------------------------------------------ writing
    def _bump(self, conn: sqlite3.Connection, name: str, by: int = 1) -> None:
        conn.execute("INSERT INTO counters(name, value) VALUES (?, ?) "
                     "ON CONFLICT(name) DO UPDATE SET value = value + excluded.value", (name, by))

    def _reject(self, reason: str) -> AddResult:
        conn = self._require_open()
        with _transaction(conn):
            self._bump(conn, f"rejected:{reason}")
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
        key = _as_matrix(key_embedding, self.dim, "key_embedding")
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
            temb = _as_matrix(tip_embedding, self.dim, "tip_embedding")[0]
            idx = self._index.get(namespace)
            if idx is not None and idx.n:
                with _blas_limit(self.blas_threads):
                    nearest = float((idx.tip_embs[: idx.n] @ temb).max())
                if nearest > self.dedup_threshold:
                    return self._reject("duplicate")
            evicted: list[int] = []
            with _transaction(conn):
                count = idx.n if idx is not None else 0
                if count >= self.capacity:
                    evicted = self._victims(namespace, count - self.capacity + 1)
                    conn.executemany("DELETE FROM tips WHERE id = ?", [(t,) for t in evicted])
                    self._bump(conn, "evicted", len(evicted))
                tick = self._clock + 1
                cur = conn.execute(
                    "INSERT INTO tips(namespace, text, key_text, key_emb, tip_emb, score, step, created_at, touched) "
                    "VALUES (?, ?, ?, ?, ?, ?, ?, ?, ?)",
                    (namespace, text, str(key_text), _blob(key[0]), _blob(temb), float(score), int(step), time.time(),
                     tick))
                tid = int(cur.lastrowid)
            self._clock = tick
            if idx is None:
                idx = self._index[namespace] = _NamespaceIndex(self.dim)
            for t in evicted:
                idx.remove(t)
            idx.add(np.array([tid]), key, temb[None], np.array([float(score)]), np.array([np.nan]), np.array([tick]))
            return AddResult(tid, None, tuple(evicted))

    def bulk_insert(self, namespace: str, texts: Sequence[str], key_embeddings: Any, tip_embeddings: Any, *,
                    scores: Sequence[float] | None = None, step: int = 0) -> list[int]:
        """Insert many tips in one transaction WITHOUT validation or de-duplication (imports, benchmarks).

        Capacity still holds: if the namespace overflows, the policy's victims are evicted in the same transaction.
        """
        keys = _as_matrix(key_embeddings, self.dim, "key_embeddings")
        tembs = _as_matrix(tip_embeddings, self.dim, "tip_embeddings")
        if not len(texts) == len(keys) == len(tembs):
            raise MemoryStoreError("texts, key_embeddings and tip_embeddings must have the same length")
        scores = np.zeros(len(texts)) if scores is None else np.asarray(scores, dtype=np.float64)
        with self._lock:
            conn = self._require_open()
            now = time.time()
            first = self._clock + 1
            rows = [(namespace, str(t), "", _blob(k), _blob(e), float(s), int(step), now, first + i)
                    for i, (t, k, e, s) in enumerate(zip(texts, keys, tembs, scores))]
            idx = self._index.setdefault(namespace, _NamespaceIndex(self.dim))
            conn.execute("BEGIN IMMEDIATE")
            added: list[int] = []
            try:
                ids = [conn.execute(
                    "INSERT INTO tips(namespace, text, key_text, key_emb, tip_emb, score, step, created_at, touched) "
                    "VALUES (?, ?, ?, ?, ?, ?, ?, ?, ?)", row).lastrowid for row in rows]
                idx.add(np.array(ids, dtype=np.int64), keys, tembs, scores, np.full(len(ids), np.nan),
                        np.arange(first, first + len(ids)))
                added = ids
                evicted = self._victims(namespace, idx.n - self.capacity)
                conn.executemany("DELETE FROM tips WHERE id = ?", [(t,) for t in evicted])
                if evicted:
                    self._bump(conn, "evicted", len(evicted))
                conn.execute("COMMIT")
            except BaseException:
                conn.execute("ROLLBACK")
                for t in added:
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
            with _transaction(conn):
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
            with _transaction(conn):
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
        q = _as_matrix(query_embeddings, self.dim, "query_embeddings")
        if isinstance(namespaces, str):
            namespaces = [namespaces] * q.shape[0]
        if len(namespaces) != q.shape[0]:
            raise MemoryStoreError(f"{len(namespaces)} namespaces for {q.shape[0]} query embeddings")
        results: list[list[tuple[int, float, float]]] = [[] for _ in range(q.shape[0])]
        if k <= 0:
            return [[] for _ in results]
        with self._lock:
            groups: dict[str, list[int]] = {}
            for i, ns in enumerate(namespaces):
                groups.setdefault(ns, []).append(i)
            for ns, rows in groups.items():
                idx = self._index.get(ns)
                if idx is None or idx.n == 0:
                    continue
                with _blas_limit(self.blas_threads):
                    sims = q[rows] @ idx.keys[: idx.n].T  # [m, n]: one row of similarities per query
                bonus = 0.0
                if score_weight:
                    bonus = bonus + score_weight * _minmax(idx.scores[: idx.n])
                if utility_weight:
                    bonus = bonus + utility_weight * _minmax(idx.utils[: idx.n])
                ids = idx.ids[: idx.n]
                for j, qi in enumerate(rows):
                    sim = sims[j]
                    cand = np.flatnonzero(sim >= threshold)
                    rank = sim[cand] + bonus[cand] if np.ndim(bonus) else sim[cand]
                    if len(cand) > k:  # keep everything tied with the k-th best, then sort exactly
                        kth = np.partition(rank, len(cand) - k)[len(cand) - k]
                        keep = rank >= kth
                        cand, rank = cand[keep], rank[keep]
                    order = np.lexsort((-ids[cand], -rank))[:k]
                    results[qi] = [(int(ids[cand[o]]), float(sim[cand[o]]), float(rank[o])) for o in order]
            wanted = {tid for res in results for tid, _, _ in res}
            tips = self._fetch(wanted)
        out = []
        for res in results:
            row = []
            for tid, sim, rank in res:
                t = Tip(**{**tips[tid].to_dict(), "similarity": sim, "rank_score": rank})
                row.append(t)
            out.append(row)
        return out

    def _fetch(self, ids: Iterable[int]) -> dict[int, Tip]:
        ids = list(ids)
        out: dict[int, Tip] = {}
        conn = self._require_open()
        for i in range(0, len(ids), 500):
            chunk = ids[i:i + 500]
            for r in conn.execute(f"SELECT {_TIP_COLUMNS} FROM tips WHERE id IN ({','.join('?' * len(chunk))})", chunk):
                out[r[0]] = Tip(*r)
        return out

    def get(self, tip_id: int) -> Tip | None:
        """One tip by id, or ``None``."""
        with self._lock:
            return self._fetch([int(tip_id)]).get(int(tip_id))

    def all_tips(self, namespace: str | None = None) -> list[Tip]:
        """Every stored tip (optionally of one namespace), oldest first."""
        with self._lock:
            conn = self._require_open()
            sql = f"SELECT {_TIP_COLUMNS} FROM tips" + (" WHERE namespace = ?" if namespace is not None else "")
            return [Tip(*r) for r in conn.execute(sql + " ORDER BY id", (namespace,) if namespace is not None else ())]

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
            rows = self._require_open().execute("SELECT name, value FROM counters WHERE name LIKE 'rejected:%'")
            return {name.split(":", 1)[1]: int(v) for name, v in rows}

    def stats(self) -> dict[str, Any]:
        """Counts per namespace, rejections by reason, utilities and usage, in plain JSON types."""
        with self._lock:
            conn = self._require_open()
            per_ns = {}
            for ns, n, rated, mean_u, uses, used in conn.execute(
                    "SELECT namespace, COUNT(*), COUNT(utility), AVG(utility), SUM(use_count), "
                    "SUM(use_count > 0) FROM tips GROUP BY namespace ORDER BY namespace"):
                per_ns[ns] = {"tips": n, "rated": rated, "mean_utility": mean_u, "uses": uses, "used_tips": used}
            total, rated, mean_u = conn.execute("SELECT COUNT(*), COUNT(utility), AVG(utility) FROM tips").fetchone()
            evicted = conn.execute("SELECT value FROM counters WHERE name = 'evicted'").fetchone()
            rej = self.rejections()
            return {"path": str(self.path), "schema_version": SCHEMA_VERSION, "dim": self.dim,
                    "capacity": self.capacity, "eviction": self.eviction, "tips": total, "rated_tips": rated,
                    "mean_utility": mean_u, "namespaces": per_ns, "rejections": rej,
                    "rejected": sum(rej.values()), "evicted": int(evicted[0]) if evicted else 0}

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
        """A consistent copy of the database (SQLite online backup) at ``path``, e.g. to seed another run.

        Refuses to overwrite an existing non-empty file.
        """
        dest = Path(path)
        if dest.exists() and dest.stat().st_size > 0:
            raise MemoryStoreError(f"{dest} already exists; not overwriting it")
        dest.parent.mkdir(parents=True, exist_ok=True)
        with self._lock:
            conn = self._require_open()
            target = sqlite3.connect(str(dest))
            try:
                conn.backup(target)
                target.execute("PRAGMA journal_mode = WAL")
            finally:
                target.close()
        return dest
