"""What a rollout needs from its collaborators, as structural types: any object with these methods will do (the
real ones are :class:`~empo2.envs.pool.EnvPool`, :class:`~empo2.memory.embedder.Embedder`,
:class:`~empo2.memory.store.TipMemory` and a Hugging Face tokenizer; tests pass their own)."""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any, Protocol

import numpy as np


class Tokenizer(Protocol):
    """A Hugging Face tokenizer with a chat template."""

    def apply_chat_template(self, messages: list[dict[str, str]], **kwargs: Any) -> Any: ...

    def decode(self, ids: Sequence[int], **kwargs: Any) -> str: ...


class EnvWorkers(Protocol):
    """A pool of environment workers, one episode per worker index (:class:`~empo2.envs.pool_base.WorkerPool`)."""

    def reset(self, assignments: list[tuple[int, str, int]]) -> dict[int, Any]:
        """``(worker, task, variation)`` → per worker ``(observation, info)`` or a failure."""

    def restore(self, assignments: list[tuple[int, str, int, list[list[str]]]]) -> dict[int, Any]:
        """``(worker, task, variation, step_commands)`` → per worker ``(observation, info)`` after replaying the
        prefix, or a failure."""

    def step(self, actions: dict[int, str]) -> dict[int, Any]:
        """One action per worker → per worker a ``StepResult`` (observation, reward, done, info)."""

    def call(self, i: int, method: str, *args: Any, retries: int = 0) -> Any:
        """Call ``method`` of worker ``i``'s environment; ``retries`` more tries on a fresh worker after a crash."""


class Embedder(Protocol):
    """A sentence embedder: texts → unit-norm float32 rows ``[N, dim]``."""

    dim: int

    def encode(self, texts: list[str]) -> np.ndarray: ...


class TipStore(Protocol):
    """The tip memory the rollout retrieves from and the reflection writes to."""

    def retrieve(self, namespaces: Sequence[str], query_embeddings: Any, k: int = 10, threshold: float = 0.5,
                 **kwargs: Any) -> list[list[Any]]: ...

    def record_use(self, tip_ids: Sequence[int], step: int) -> None: ...

    def update_utility(self, tip_ids: Sequence[int], episode_return: float) -> None: ...

    def add(self, namespace: str, tip_text: str, key_embedding: Any, **kwargs: Any) -> Any: ...


MemorySync = Callable[[list, list, int], tuple[list, list, int]]
"""Data-parallel hook ``(uses, adds, step) -> (uses, adds, step)``: every rank's memory operations in global order
(:func:`empo2.parallel.distributed.memory_sync`)."""
