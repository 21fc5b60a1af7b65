"""Reflexion's episodic memory (Shinn et al., 2023), the OOD baseline: the last reflections per task variation, shown
in the prompt where EMPO²'s retrieved tips would go."""
from __future__ import annotations

from collections import deque
from dataclasses import dataclass

REFLEXION_BUFFER = 3
"""Reflections kept per (task, variation) (Reflexion's episodic memory of the last attempts)."""


@dataclass
class Reflection:
    id: int
    text: str


class ReflexionBuffer:
    """Reflexion's episodic memory, shaped like the tip memory's retrieval side so the rollout can show it.

    ``retrieve`` ignores the state: a namespace (``task#variation``) gets its last reflections, oldest first.
    """

    def __init__(self, size: int = REFLEXION_BUFFER):
        self.size, self.next_id = size, 0
        self.by_namespace: dict[str, deque[Reflection]] = {}

    def push(self, namespace: str, text: str) -> bool:
        if not text.strip():
            return False
        self.by_namespace.setdefault(namespace, deque(maxlen=self.size)).append(Reflection(self.next_id, text))
        self.next_id += 1
        return True

    def retrieve(self, namespaces: list[str], query_embs, k: int, **_ignored) -> list[list[Reflection]]:
        return [list(self.by_namespace.get(ns, ()))[-k:] for ns in namespaces]

    def record_use(self, ids, step) -> None:  # the rollout reports use; nothing to keep
        pass

    def update_utility(self, ids, score) -> None:
        pass

    def stats(self) -> dict[str, int]:
        return {"tips": sum(len(d) for d in self.by_namespace.values())}

    def close(self) -> None:
        pass
