"""Seeded choice of the tasks an iteration trains on."""

from __future__ import annotations

from typing import Any

import numpy as np


class TaskSampler:
    """Seeded choice of (task, train variation) pairs; its RNG state goes into checkpoints."""

    def __init__(self, tasks: dict[str, list[int]], seed: int):
        self.tasks = tasks
        self.rng = np.random.default_rng(seed)

    def sample(self, n: int) -> list[tuple[str, int]]:
        names = sorted(self.tasks)
        picks = self.rng.choice(len(names), size=n, replace=n > len(names))
        return [(names[i], int(self.rng.choice(self.tasks[names[i]]))) for i in picks]

    def state_dict(self) -> dict[str, Any]:
        return {"bit_generator": self.rng.bit_generator.state}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.rng.bit_generator.state = state["bit_generator"]
