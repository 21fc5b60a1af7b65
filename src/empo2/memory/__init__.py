"""Tip memory: validation, the in-RAM index, the SQLite store, the novelty counter and their reports."""

from __future__ import annotations


def open_tip_memory(path, dim: int | None, mc):
    """The :class:`~empo2.memory.store.TipMemory` at ``path`` with the settings of a ``memory`` config section ``mc``
    (the one place that maps config fields to store arguments)."""
    from empo2.memory.store import TipMemory

    return TipMemory(path, dim=dim, capacity=mc.capacity, eviction=mc.eviction, dedup_threshold=mc.dedup_threshold,
                     max_tip_words=mc.max_tip_words)
