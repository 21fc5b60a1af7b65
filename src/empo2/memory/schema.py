"""The tip memory's SQLite schema: tables, transactions, rows and embedding blobs (the file's checks before SQLite
opens it: :mod:`empo2.memory.sqlite_file`).

Schema (``PRAGMA user_version`` = :data:`SCHEMA_VERSION`, ``PRAGMA application_id`` = :data:`APPLICATION_ID`)::

    meta(key, value)            schema_version, dim, embedder, created_at, capacity, eviction
    tips(id, namespace, text, key_text, key_emb, tip_emb, score, step, created_at,
         use_count, last_use_step, touched, utility, utility_n)
    counters(name, value)       rejected:<reason>, evicted

Embeddings are little-endian float32 blobs of ``dim`` values, L2-normalised on the way in.
``utility`` is NULL until an episode that used the tip reports its return.
"""

from __future__ import annotations

import contextlib
import sqlite3
import time
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

import numpy as np

from .validate import MAX_KEY_TEXT_BYTES, MAX_NAMESPACE_BYTES, MemoryStoreError, check_stored_tip, max_entry_bytes

SCHEMA_VERSION = 1
APPLICATION_ID = 0x454D5032  # "EMP2"

_SCHEMA = """
CREATE TABLE IF NOT EXISTS meta (key TEXT PRIMARY KEY, value TEXT NOT NULL);
CREATE TABLE IF NOT EXISTS tips (
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
CREATE INDEX IF NOT EXISTS tips_namespace ON tips(namespace);
CREATE TABLE IF NOT EXISTS counters (name TEXT PRIMARY KEY, value INTEGER NOT NULL);
"""
_OBJECTS = {("table", "meta"), ("table", "tips"), ("table", "counters"), ("table", "sqlite_sequence"),
            ("index", "tips_namespace"), ("index", "sqlite_autoindex_meta_1"), ("index", "sqlite_autoindex_counters_1")}
"""Everything :data:`_SCHEMA` makes. A trigger or view would run SQL of the file's author on every write or read
(e.g. rewriting each new tip that retrieval then puts into prompts), so a file with anything else is refused."""


@contextlib.contextmanager
def transaction(conn: sqlite3.Connection):
    """One write transaction: committed as a whole, or rolled back (and the error re-raised)."""
    conn.execute("BEGIN IMMEDIATE")
    try:
        yield conn
    except BaseException:
        conn.execute("ROLLBACK")
        raise
    conn.execute("COMMIT")


def blob(vec: np.ndarray) -> bytes:
    return np.asarray(vec, dtype="<f4").tobytes()


def unblob(data: bytes, dim: int, tid: int) -> np.ndarray:
    if len(data) != 4 * dim:
        raise MemoryStoreError(f"tip {tid}: stored embedding has {len(data) // 4} values, expected {dim}")
    return np.frombuffer(data, dtype="<f4")


def check_objects(conn: sqlite3.Connection, path: Path) -> None:
    """Refuse a memory holding SQL objects the schema does not make (triggers, views, other tables or indexes)."""
    try:
        found = set(conn.execute("SELECT type, name FROM sqlite_master"))
    except sqlite3.DatabaseError as exc:
        raise MemoryStoreError(f"{path} is corrupt: {exc}") from None
    extra = sorted(found - _OBJECTS)
    if extra:
        named = ", ".join(f"{kind} {name[:40]!r}" for kind, name in extra[:3]) + (" …" if len(extra) > 3 else "")
        raise MemoryStoreError(f"{path} holds SQL objects a tip memory does not have ({named}); refused and left "
                               "unchanged: a trigger or view there would run its author's SQL on this run's tips")


def create_schema(conn: sqlite3.Connection, meta: dict[str, str]) -> dict[str, str]:
    """Write header pragmas, tables and ``meta`` in one rollback-journal transaction, then switch to WAL.

    The main file is complete (and recognisable by :func:`check_header`) before the WAL exists; a crash here leaves
    no half-made memory. Returns the file's meta. Another process that made the schema first (both saw an empty
    file) is no error: the write lock orders the two, and the second keeps the first one's tables and meta.
    """
    conn.execute("BEGIN IMMEDIATE")
    conn.execute(f"PRAGMA application_id = {APPLICATION_ID}")
    conn.execute(f"PRAGMA user_version = {SCHEMA_VERSION}")
    for stmt in filter(None, (s.strip() for s in _SCHEMA.split(";"))):
        conn.execute(stmt)
    conn.executemany("INSERT OR IGNORE INTO meta(key, value) VALUES (?, ?)", meta.items())
    stored = dict(conn.execute("SELECT key, value FROM meta").fetchall())
    conn.execute("COMMIT")
    conn.execute("PRAGMA journal_mode = WAL")
    return stored


def insert_tip(conn: sqlite3.Connection, row: tuple) -> int:
    """Insert (namespace, text, key_text, key_emb, tip_emb, score, step, created_at, touched); the new id."""
    return int(conn.execute("INSERT INTO tips(namespace, text, key_text, key_emb, tip_emb, score, step, created_at, "
                            "touched) VALUES (?, ?, ?, ?, ?, ?, ?, ?, ?)", row).lastrowid)


def delete_tips(conn: sqlite3.Connection, ids: list[int]) -> None:
    """Delete evicted tips and count them."""
    if ids:
        conn.executemany("DELETE FROM tips WHERE id = ?", [(t,) for t in ids])
        bump(conn, "evicted", len(ids))


def bump(conn: sqlite3.Connection, name: str, by: int = 1) -> None:
    conn.execute("INSERT INTO counters(name, value) VALUES (?, ?) "
                 "ON CONFLICT(name) DO UPDATE SET value = value + excluded.value", (name, by))


def new_meta(dim: int, embedder_name: str, capacity: int, eviction: str) -> dict[str, str]:
    return {"schema_version": str(SCHEMA_VERSION), "dim": str(dim), "created_at": str(time.time()),
            "embedder": embedder_name, "capacity": str(capacity), "eviction": eviction}


def read_schema(conn: sqlite3.Connection, path: Path) -> tuple[int, dict[str, str]]:
    """(schema version, meta table) of an open memory; raises :class:`MemoryStoreError` for foreign/damaged files."""
    try:
        version = conn.execute("PRAGMA user_version").fetchone()[0]
        tables = {r[0] for r in conn.execute("SELECT name FROM sqlite_master WHERE type = 'table'")}
        if not {"meta", "tips", "counters"} <= tables:
            raise MemoryStoreError(f"{path} lacks the tip-memory tables (foreign or damaged file)")
        check_objects(conn, path)
        meta = dict(conn.execute("SELECT key, value FROM meta").fetchall())
    except sqlite3.DatabaseError as exc:
        raise MemoryStoreError(f"{path} is corrupt: {exc}") from None
    if version > SCHEMA_VERSION:
        raise MemoryStoreError(f"{path} has memory schema {version}; this empo2 reads up to {SCHEMA_VERSION} "
                               "(upgrade empo2)")
    return version, meta


# ------------------------------------------------------------------------------------------------------- rows
_TIP_COLUMNS = "id, namespace, text, key_text, score, step, created_at, use_count, last_use_step, utility, utility_n"


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


def fetch_tips(conn: sqlite3.Connection, ids: list[int]) -> dict[int, Tip]:
    """The tips with these ids (unknown ids are absent), 500 ids per query."""
    out: dict[int, Tip] = {}
    for i in range(0, len(ids), 500):
        chunk = ids[i:i + 500]
        for r in conn.execute(f"SELECT {_TIP_COLUMNS} FROM tips WHERE id IN ({','.join('?' * len(chunk))})", chunk):
            out[r[0]] = Tip(*r)
    return out


def select_tips(conn: sqlite3.Connection, namespace: str | None) -> list[Tip]:
    """Every tip (optionally of one namespace), oldest first."""
    sql = f"SELECT {_TIP_COLUMNS} FROM tips" + (" WHERE namespace = ?" if namespace is not None else "")
    return [Tip(*r) for r in conn.execute(sql + " ORDER BY id", (namespace,) if namespace is not None else ())]


def _bounded_text(column: str) -> str:
    """SQL giving a text column's UTF-8 bytes when it is text within the bound bound to ``?``, ``X'00'``
    (:data:`~empo2.memory.validate.NOT_TEXT`) when it is not text, else NULL; the value itself is never fetched
    when too long."""
    return (f"CASE WHEN typeof({column}) <> 'text' THEN X'00' "
            f"WHEN length(CAST({column} AS BLOB)) <= ? THEN CAST({column} AS BLOB) END")


def read_embeddings(conn: sqlite3.Connection, dim: int,
                    max_tip_words: int = 100) -> tuple[dict[str, list[tuple]], dict[str, int]]:
    """Per namespace: (id, key [dim], tip embedding [dim], score, utility or NaN, touched) rows, by id, of the tips
    that pass :func:`~empo2.memory.validate.check_stored_tip`; and how many were skipped, by reason. The text
    columns are read bounded, so a file from elsewhere cannot put a huge or undecodable value into this process."""
    rows: dict[str, list] = {}
    skipped: dict[str, int] = {}
    size = 4 * dim
    sql = (f"SELECT id, {_bounded_text('namespace')}, {_bounded_text('text')}, {_bounded_text('key_text')}, "
           "length(key_emb), length(tip_emb), CASE WHEN length(key_emb) = ? AND length(tip_emb) = ? THEN key_emb END, "
           "CASE WHEN length(key_emb) = ? AND length(tip_emb) = ? THEN tip_emb END, score, utility, touched "
           "FROM tips ORDER BY id")
    bounds = (MAX_NAMESPACE_BYTES, max_entry_bytes(max_tip_words), MAX_KEY_TEXT_BYTES, *(size,) * 4)
    for tid, ns, text, key_text, key_len, temb_len, key, temb, score, util, touched in conn.execute(sql, bounds):
        if key is None or temb is None:
            wrong = key_len if key_len != size else temb_len
            raise MemoryStoreError(f"tip {tid}: stored embedding has {(wrong or 0) // 4} values, expected {dim}")
        reason = check_stored_tip((ns, text, key_text), max_tip_words)
        if reason is not None:
            skipped[reason] = skipped.get(reason, 0) + 1
            continue
        rows.setdefault(ns.decode("utf-8"), []).append((tid, unblob(key, dim, tid), unblob(temb, dim, tid), score,
                                                       np.nan if util is None else util, touched))
    return rows, skipped


def read_stats(conn: sqlite3.Connection) -> dict[str, Any]:
    """Counts per namespace, rejections by reason, utilities and usage (plain JSON types), from one snapshot: a
    trainer's write between two of the queries would otherwise give totals that do not add up."""
    in_transaction = conn.in_transaction
    if not in_transaction:
        conn.execute("BEGIN")
    try:
        return _read_stats(conn)
    finally:
        if not in_transaction:
            conn.execute("COMMIT")


def _read_stats(conn: sqlite3.Connection) -> dict[str, Any]:
    per_ns = {}
    for ns, n, rated, mean_u, uses, used in conn.execute(
            "SELECT namespace, COUNT(*), COUNT(utility), AVG(utility), SUM(use_count), "
            "SUM(use_count > 0) FROM tips GROUP BY namespace ORDER BY namespace"):
        per_ns[ns] = {"tips": n, "rated": rated, "mean_utility": mean_u, "uses": uses, "used_tips": used}
    total, rated, mean_u = conn.execute("SELECT COUNT(*), COUNT(utility), AVG(utility) FROM tips").fetchone()
    evicted = conn.execute("SELECT value FROM counters WHERE name = 'evicted'").fetchone()
    rej = {name.split(":", 1)[1]: int(v)
           for name, v in conn.execute("SELECT name, value FROM counters WHERE name LIKE 'rejected:%'")}
    return {"tips": total, "rated_tips": rated, "mean_utility": mean_u, "namespaces": per_ns, "rejections": rej,
            "rejected": sum(rej.values()), "evicted": int(evicted[0]) if evicted else 0}


def backup_to(conn: sqlite3.Connection, dest: Path) -> None:
    """A consistent copy of the open database at ``dest`` (SQLite online backup), in WAL mode."""
    target = sqlite3.connect(str(dest))
    try:
        conn.backup(target)
        target.execute("PRAGMA journal_mode = WAL")
    finally:
        target.close()
