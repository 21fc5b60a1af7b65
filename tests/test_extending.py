"""Extending empo2 from outside ``src/``: a toy environment and a toy algorithm registered in this file train one
iteration through the real CLI (real pool worker processes, the tiny random model, a real run folder).

The environment is a two-door room: the door that hides the prize depends on the variation's parity. It is small on
purpose; what is tested is that registration alone is enough (no edit of the package)."""

from __future__ import annotations

import json
import math

import pytest
from safetensors.torch import load_file

from empo2.algo.losses import POLICY_LOSSES, register_policy_loss
from empo2.algo.registry import ALGORITHMS, AlgorithmSpec, register_algorithm
from empo2.cli import main
from empo2.envs import EnvSpec, StepResult, register_env
from empo2.envs.registry import ENVIRONMENTS


class TwoDoors:
    """A text environment on the TextEnv protocol (module level, so pool workers can unpickle its class)."""

    name = "two-doors"
    ACTIONS = ["open left door", "open right door", "look around"]

    def __init__(self, max_steps: int = 3):
        self.max_steps, self.variation, self.steps = max_steps, 0, 0

    def task_names(self):
        return ["doors"]

    def variations(self, task, split):
        return {"train": [0, 1, 2, 3], "dev": [4, 5], "test": [6, 7]}[split]

    def reset(self, task, variation):
        self.variation, self.steps = variation, 0
        return "You are in a room with a left door and a right door.", {"task_description": self.task_description()}

    def step(self, raw):
        self.steps += 1
        # A crude corrector: any text that is not an action opens a door chosen by its characters.
        action = raw.strip() if raw.strip() in self.ACTIONS else self.ACTIONS[sum(map(ord, raw)) % 2]
        prize = "open left door" if self.variation % 2 == 0 else "open right door"
        won = action == prize
        done = action.startswith("open") or self.steps >= self.max_steps
        info = {"score": 100.0 if won else 0.0, "success": won, "accepted": True, "action": action,
                "raw_action": raw}
        return StepResult("You found the prize!" if won else "Nothing here.", 100.0 if won else 0.0, done, info)

    def valid_actions(self):
        return list(self.ACTIONS)

    def task_description(self):
        return "Find the prize behind one of the doors."

    def demonstration(self, task, variation, n=1):
        return ""

    def gold_actions(self):
        return ["open left door" if self.variation % 2 == 0 else "open right door"]

    def close(self):
        pass


def plain_policy_gradient(logp_new, logp_old, advantages, response_mask, **_):
    """REINFORCE with a token mean: −Σ A·log π / Σ mask (no ratio, no clip)."""
    mask = response_mask.float()  # [B, T]
    loss = -(advantages[:, None] * logp_new * mask).sum() / mask.sum().clamp(min=1)
    return loss, {"skipped": 0.0}


@pytest.fixture
def registered():
    register_env(EnvSpec("two-doors", factory=TwoDoors, kwargs=lambda cfg: {"max_steps": cfg.max_steps or 3},
                         guide="Open the door that hides the prize. Answer with one action.",
                         tasks=lambda cfg: ["doors"]))
    register_policy_loss("toy_pg")(plain_policy_gradient)
    register_algorithm(AlgorithmSpec("toy_reinforce", uses_memory=False, loss="toy_pg", advantage="grpo"))
    yield
    ENVIRONMENTS.pop("two-doors"), POLICY_LOSSES.pop("toy_pg"), ALGORITHMS.pop("toy_reinforce")


@pytest.mark.slow
def test_toy_algorithm_and_environment_train_without_editing_src(tmp_path, tiny_model, registered):
    run = tmp_path / "toy"
    rc = main(["train", f"train.output_dir={run}", "env.name=two-doors", "algo.name=toy_reinforce",
               f"policy.model={tiny_model}", "algo.num_generations=4", "train.tasks_per_batch=2",
               "train.iterations=1", "env.eval_variations=2", "policy.few_shot=0", "policy.max_completion_length=6",
               "train.progress=false", "train.tensorboard=false", "train.learning_rate=0.01",
               "train.mini_batch_size=3"])
    assert rc == 0
    record = json.loads((run / "metrics.jsonl").read_text().splitlines()[0])
    assert record["modes"] == ["on", "on"] and record["memory"]["size"] == 0
    assert record["advantage"]["groups"] == 2
    final = json.loads((run / "eval" / "final.json").read_text())
    assert final["label"] == "two-doors" and final["summary"]["episodes"] == 2
    assert not (run / "memory.sqlite").exists()  # the toy algorithm keeps no memory
    # some group had a winner and a loser, so the toy loss took steps (one per mini-batch of 3 rows) and the
    # adapter moved
    assert record["advantage"]["zero_adv_groups"] < 2 and record["loss"]["rows"] >= 2
    assert record["loss"]["optimizer_steps"] == math.ceil(record["loss"]["rows"] / 3)
    adapter = load_file(str(sorted((run / "checkpoints").glob("iter_*"))[-1] / "model" / "adapter_model.safetensors"))
    assert any(t.abs().max() > 0 for name, t in adapter.items() if "lora_B" in name)


def test_unknown_names_list_the_registered_ones(tmp_path, capsys, registered):
    assert main(["train", f"train.output_dir={tmp_path / 'x'}", "algo.name=toy_reinforc"]) == 2
    err = capsys.readouterr().err
    assert "toy_reinforce" in err and err.count("\n") == 1
    assert main(["train", f"train.output_dir={tmp_path / 'x'}", "env.name=two-door"]) == 2
    assert "two-doors" in capsys.readouterr().err
    assert not (tmp_path / "x").exists()
