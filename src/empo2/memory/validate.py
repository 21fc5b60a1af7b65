"""Input checks of the tip memory: tip text (what may be stored), embedding arrays, and the errors they raise."""

from __future__ import annotations

import json
import re
import zlib
from collections.abc import Iterable
from typing import Any

import numpy as np

from empo2.errors import UserError

from .entry import MAX_ACTION_CHARS, split_entry

REJECTION_REASONS = ("empty", "too_long", "invalid_unicode", "non_printable", "repetitive", "copy_of_context",
                     "duplicate")


class MemoryStoreError(UserError, RuntimeError):
    """The memory file cannot be used (corrupt, foreign, newer schema) or an argument is malformed."""


class DimensionMismatchError(MemoryStoreError, ValueError):
    """An embedding's dimension differs from the memory's."""


def json_line(obj: Any) -> str:
    """One JSON line, non-ASCII kept but U+2028/U+2029 escaped (``str.splitlines`` and JS split on them)."""
    return json.dumps(obj, ensure_ascii=False).replace("\u2028", "\\u2028").replace("\u2029", "\\u2029")


_WORD = re.compile(r"\S+")
_NORM = re.compile(r"[^\w]+")


def _normalise(text: str) -> str:
    """Lower-case, punctuation and runs of whitespace folded to one space (for copy detection)."""
    return _NORM.sub(" ", text.lower()).strip()


def _trigrams(words: list[str]) -> set[tuple[str, ...]]:
    return {tuple(words[i:i + 3]) for i in range(len(words) - 2)}


def check_tip_text(text: str, max_words: int = 100, context_texts: Iterable[str] = ()) -> str | None:
    """Why ``text`` must not be stored (a reason from :data:`REJECTION_REASONS`), or ``None`` if it may.

    The duplicate check needs embeddings and lives in :meth:`TipMemory.add`. A released-format entry
    (:mod:`empo2.memory.entry`) is checked on its tip: the action and score appended to it come from the environment,
    so they neither count against the length bound nor dilute the copy check.
    """
    text, action, _ = split_entry(text.strip())
    if action is not None and len(action) > MAX_ACTION_CHARS:
        return "too_long"
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
    return _copy_of_context(_normalise(text), context_texts)


MAX_NAMESPACE_BYTES = 1024
MAX_KEY_TEXT_BYTES = 16384
"""Bounds of a stored row's namespace and state key (a run writes keys of at most 1,000 characters)."""
NOT_TEXT = b"\0"
"""What the bounded SQL read gives for a text column that holds a blob, number or NULL instead of text."""


def max_entry_bytes(max_words: int) -> int:
    """The most UTF-8 bytes a tip that passes :func:`check_tip_text` can take (released-format suffix included)."""
    return 4 * (12 * max_words + MAX_ACTION_CHARS + 120)


def check_stored_tip(columns: tuple[bytes | None, bytes | None, bytes | None], max_words: int = 100) -> str | None:
    """Why a row read from a memory file must not be used, or ``None``: its (namespace, tip, key) must each be
    well-formed UTF-8 text within its bound, and the tip must pass :func:`check_tip_text`. A column is ``b"\\0"``
    when it was not text and ``None`` when it was longer than its bound: the SQL read leaves such values unread
    (:func:`empo2.memory.schema.read_embeddings`), so a 10 MB tip never reaches Python."""
    if any(raw == NOT_TEXT for raw in columns):
        return "invalid_unicode"
    if any(raw is None for raw in columns):
        return "too_long"
    try:
        namespace, text, _ = (raw.decode("utf-8") for raw in columns)
    except UnicodeDecodeError:
        return "invalid_unicode"
    return "empty" if not namespace else check_tip_text(text, max_words)


def _copy_of_context(norm: str, context_texts: Iterable[str]) -> str | None:
    """``copy_of_context`` when the normalised tip is a substring of, or shares most trigrams with, a context."""
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


def as_matrix(x: Any, dim: int, what: str) -> np.ndarray:
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


def check_settings(eviction: str | None, policies: tuple[str, ...], capacity: int | None, synchronous: str) -> None:
    """Raise :class:`MemoryStoreError` for an unknown eviction policy, a capacity < 1 or a bad ``synchronous``."""
    if eviction is not None and eviction not in policies:
        raise MemoryStoreError(f"eviction must be one of {', '.join(policies)}, got {eviction!r}")
    if capacity is not None and capacity < 1:
        raise MemoryStoreError(f"capacity must be >= 1, got {capacity}")
    if synchronous.upper() not in ("OFF", "NORMAL", "FULL", "EXTRA"):
        raise MemoryStoreError(f"synchronous must be OFF|NORMAL|FULL|EXTRA, got {synchronous!r}")
