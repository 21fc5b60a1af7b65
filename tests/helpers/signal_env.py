"""A toy environment with a learning signal in every group, for training tests that must see an update.

ChecksumRoom's one-step episodes score the action text by its character checksum (mod 97), so two different
actions almost surely score differently: a group of sampled actions from the tiny random model has a non-zero
advantage, where ScienceWorld's and the WebShop fixture's short episodes mostly all score 0. It lives at module
level so the pool's spawned workers can unpickle its class."""

from __future__ import annotations

from contextlib import contextmanager

from empo2.envs import EnvSpec, StepResult, register_env
from empo2.envs.specs import ENVIRONMENTS


class ChecksumRoom:
    """A text environment on the TextEnv protocol."""

    name = "checksum-room"

    def __init__(self, max_steps: int = 1):
        self.max_steps, self.variation, self.steps = max_steps, 0, 0

    def task_names(self):
        return ["say"]

    def variations(self, task, split):
        return {"train": [0, 1, 2, 3], "dev": [4, 5], "test": [6, 7]}[split]

    def reset(self, task, variation):
        self.variation, self.steps = variation, 0
        return "You are in an empty room. Say something.", {"task_description": self.task_description()}

    def step(self, raw):
        self.steps += 1
        score = float(sum(map(ord, raw)) % 97)
        info = {"score": score, "success": score >= 50, "accepted": True, "action": raw, "raw_action": raw}
        return StepResult(f"The room echoes: {raw}", score, self.steps >= self.max_steps, info)

    def valid_actions(self):
        return ["say hello"]

    def task_description(self):
        return "Say something the room likes."

    def demonstration(self, task, variation, n=1):
        return ""

    def gold_actions(self):
        return ["say hello"]

    def close(self):
        pass


@contextmanager
def checksum_room():
    """``env.name=checksum-room`` registered for the duration of the block."""
    register_env(EnvSpec("checksum-room", factory=ChecksumRoom, kwargs=lambda cfg: {"max_steps": cfg.max_steps or 1},
                         guide="Answer with one short sentence.", tasks=lambda cfg: ["say"]))
    try:
        yield
    finally:
        ENVIRONMENTS.pop("checksum-room")
