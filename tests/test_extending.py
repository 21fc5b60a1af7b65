"""Extending empo2 from outside ``src/``: a toy environment and a toy algorithm registered in this file train one
iteration through the real CLI (real pool worker processes, the tiny random model, a real run folder), and the toy
method's own setting (``algo.toy.pg_scale``) reaches its loss through the ``algo`` section without an edit of the config
or the update. The toy method brings its own options, rollout driver, row field and metrics, named in its one registration line,
as ELPO does in ``empo2.algo.elpo``; the toy environment brings its own options the same way (``env.doors.patience``),
as WebShop does in ``empo2.envs.webshop.env``.

The environment is a two-door room: the door that hides the prize depends on the variation's parity. It is small on
purpose; what is tested is that registration alone is enough (no edit of the package)."""

from __future__ import annotations

import json
import math
from dataclasses import dataclass
from typing import ClassVar

import pytest
from safetensors.torch import load_file

from empo2.algo.losses import POLICY_LOSSES, register_policy_loss
from empo2.algo.registry import ALGORITHMS, AlgorithmSpec, register_algorithm
from empo2.bounds import bounded
from empo2.cli import main
from empo2.config import Config, ConfigError
from empo2.envs import EnvSpec, StepResult, register_env
from empo2.envs.factory import make_env_kwargs
from empo2.envs.specs import ENVIRONMENTS
from empo2.episodes.rollout import run_episodes


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


@dataclass(frozen=True)
class ToyOptions:
    """The toy method's own settings, ``algo.toy.*``: registered with its algorithm, held by every ``algo`` section
    made after that (a new method's knob is one more documented field here)."""

    key: ClassVar[str] = "toy"

    pg_scale: float = bounded(1.0, 0, 1e6)
    """Factor on the toy loss."""


@dataclass(frozen=True)
class DoorOptions:
    """The toy environment's own settings, ``env.doors.*``: registered with its spec, held by every ``env`` section
    made after that."""

    key: ClassVar[str] = "doors"

    patience: int = bounded(3, 1, 100)
    """Steps an episode lasts when ``env.max_steps`` is unset."""


SEEN = {"driven": [], "first_step": []}
"""What the toy's rollout driver played and what its loss received, for the tests to read."""


def plain_policy_gradient(logp_new, logp_old, advantages, response_mask, algo, *, first_step=None, **_):
    """REINFORCE with a token mean, times the toy's own knob: −s·Σ A·log π / Σ mask (no ratio, no clip), s =
    ``algo.toy.pg_scale``. ``first_step`` [B]: the toy's own row field."""
    mask = response_mask.float()  # [B, T]
    scale = algo.toy.pg_scale
    loss = -scale * (advantages[:, None] * logp_new * mask).sum() / mask.sum().clamp(min=1)
    if first_step is not None:
        SEEN["first_step"].append(first_step.tolist())
    return loss, {"skipped": 0.0, "pg_loss": float(loss)}


def toy_rollout(ctx, specs, sampling, cfg, progress, seed=None):
    """The toy's rollout driver: the shared episodes, with the groups it played noted (a driver may play any way)."""
    episodes, stats = run_episodes(ctx, specs, sampling, progress=progress, seed=seed)
    SEEN["driven"].append(sorted({ep.group for ep in episodes}))
    return episodes, stats


def toy_row_extras(episode):
    """The toy's row field: whether the row is its episode's first step."""
    return {"first_step": [t == 0 for t in range(len(episode.steps))]}


def toy_metrics(batch):
    """The toy's part of the iteration record: the number of episodes the whole batch played."""
    return {"toy": {"episodes": len(batch.episodes)}}


@pytest.fixture
def registered():
    register_env(EnvSpec("two-doors", factory=TwoDoors,
                         kwargs=lambda cfg: {"max_steps": cfg.max_steps or cfg.doors.patience},
                         guide="Open the door that hides the prize. Answer with one action.",
                         tasks=lambda cfg: ["doors"], options=DoorOptions))
    register_policy_loss("toy_pg")(plain_policy_gradient)
    register_algorithm(AlgorithmSpec("toy_reinforce", uses_memory=False, loss="toy_pg", advantage="grpo",
                                     rollout=toy_rollout, row_extras=toy_row_extras, metrics=toy_metrics,
                                     options=ToyOptions))
    SEEN["driven"].clear(), SEEN["first_step"].clear()
    yield
    ENVIRONMENTS.pop("two-doors"), POLICY_LOSSES.pop("toy_pg"), ALGORITHMS.pop("toy_reinforce")


@pytest.mark.slow
def test_toy_algorithm_and_environment_train_without_editing_src(tmp_path, tiny_model, registered):
    run = tmp_path / "toy"
    rc = main(["train", f"train.output_dir={run}", "env.name=two-doors", "algo.name=toy_reinforce",
               f"policy.model={tiny_model}", "algo.num_generations=4", "train.tasks_per_batch=2",
               "train.iterations=1", "env.eval_variations=2", "policy.few_shot=0", "policy.max_completion_length=6",
               "train.progress=false", "train.report_to=none", "train.learning_rate=0.01",
               "train.mini_batch_size=3"])
    assert rc == 0
    record = json.loads((run / "metrics.jsonl").read_text().splitlines()[0])
    assert record["modes"] == ["on", "on"] and record["memory"]["size"] == 0
    assert record["advantage"]["groups"] == 2 and record["toy"] == {"episodes": 8}  # the toy's own metrics
    final = json.loads((run / "eval" / "final.json").read_text())
    assert final["label"] == "two-doors" and final["summary"]["episodes"] == 2
    assert not (run / "memory.sqlite").exists()  # the toy algorithm keeps no memory
    # some group had a winner and a loser, so the toy loss took steps (one per mini-batch of 3 rows) and the
    # adapter moved
    assert record["advantage"]["zero_adv_groups"] < 2 and record["loss"]["rows"] >= 2
    assert record["loss"]["optimizer_steps"] == math.ceil(record["loss"]["rows"] / 3)
    # the toy's own rollout played the iteration's two groups, and its loss got its own row field (every episode's
    # first step is a row, so some micro-batch holds one)
    assert SEEN["driven"] == [[0, 1]]
    assert any(any(flags) for flags in SEEN["first_step"])
    adapter = load_file(str(sorted((run / "checkpoints").glob("iter_*"))[-1] / "model" / "adapter_model.safetensors"))
    assert any(t.abs().max() > 0 for name, t in adapter.items() if "lora_B" in name)


def test_unknown_names_list_the_registered_ones(tmp_path, capsys, registered):
    assert main(["train", f"train.output_dir={tmp_path / 'x'}", "algo.name=toy_reinforc"]) == 2
    err = capsys.readouterr().err
    assert "toy_reinforce" in err and err.count("\n") == 1
    assert main(["train", f"train.output_dir={tmp_path / 'x'}", "env.name=two-door"]) == 2
    assert "two-doors" in capsys.readouterr().err
    assert not (tmp_path / "x").exists()


def test_a_new_loss_reads_its_own_knob_through_the_algo_section(registered):
    """The toy method's ``algo.toy.pg_scale`` is set like any key (``algo.toy.pg_scale=0.5``, bounds checked) and
    the unchanged update hands the loss the section: half the knob, half the loss and (plain SGD) half the step, on a
    real tiny Llama."""
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    from empo2.parallel.distributed import Dist
    from empo2.train.rows import UpdateRow
    from empo2.train.update import PolicyUpdate

    class PadOnly:  # the update reads only the pad id of a tokenizer
        pad_token_id = 0

    rows = [UpdateRow([5, 6, 7, 8], [9, 10], [-3.0, -3.0], 1.0, "on"),
            UpdateRow([5, 6, 11], [12, 13, 14], [-3.0] * 3, -1.0, "on")]
    losses, steps = {}, {}
    for scale in ("1", "0.5"):
        cfg = Config()
        cfg.set("algo.name", "toy_reinforce")
        cfg.set("algo.toy.pg_scale", scale)
        cfg.set("train.max_grad_norm", "1e9")  # no clipping: the step is proportional to the gradient
        cfg.validate()
        torch.manual_seed(0)
        model = LlamaForCausalLM(LlamaConfig(vocab_size=32, hidden_size=16, intermediate_size=32, num_hidden_layers=1,
                                             num_attention_heads=2, num_key_value_heads=1))
        before = [p.detach().clone() for p in model.parameters()]
        update = PolicyUpdate(cfg, model, PadOnly(), torch.optim.SGD(model.parameters(), lr=0.1),
                              POLICY_LOSSES[cfg.algorithm.loss], Dist())
        metrics = update(rows)
        assert metrics["optimizer_steps"] == 1
        losses[scale] = metrics["pg_loss"]
        steps[scale] = torch.cat([(p.detach() - b).flatten() for p, b in zip(model.parameters(), before)])
    assert losses["1"] != 0 and losses["0.5"] == pytest.approx(losses["1"] / 2, rel=1e-6)
    torch.testing.assert_close(steps["0.5"], steps["1"] / 2)
    with pytest.raises(ConfigError, match=r"^algo.toy.pg_scale must be in \[0, 1000000\], got -1.0$"):
        Config.load(None, ["algo.name=toy_reinforce", "algo.toy.pg_scale=-1"])


def test_a_new_environment_brings_its_own_setting_in_its_registration(tmp_path, capsys, registered):
    """The toy environment's ``env.doors.patience``, declared by the options its one registration names, is set like
    any key (bounds checked, saved nested, kept through pickling) and reaches its constructor's arguments; a misspelt
    one exits 2 with one line naming what ``env.doors`` holds."""
    import pickle

    cfg = Config.load(None, ["env.name=two-doors", "env.doors.patience=5"])
    assert make_env_kwargs(cfg.env) == {"max_steps": 5}
    assert make_env_kwargs(Config.load(None, ["env.name=two-doors"]).env) == {"max_steps": 3}
    assert pickle.loads(pickle.dumps(cfg)).env.doors == DoorOptions(patience=5)
    cfg.save(tmp_path / "c.yaml")
    assert "doors:\n    patience: 5" in (tmp_path / "c.yaml").read_text()
    assert Config.load(tmp_path / "c.yaml").to_dict() == cfg.to_dict()
    with pytest.raises(ConfigError, match=r"^env.doors.patience must be in \[1, 100\], got 0$"):
        Config.load(None, ["env.name=two-doors", "env.doors.patience=0"])
    assert main(["train", f"train.output_dir={tmp_path / 'x'}", "env.name=two-doors", "env.doors.patiense=5"]) == 2
    err = capsys.readouterr().err.strip()
    assert err == "error: unknown config key 'env.doors.patiense'; env.doors holds: patience"
    assert not (tmp_path / "x").exists()


def test_an_environment_options_class_that_cannot_be_nested_is_refused_at_registration():
    @dataclass(frozen=True)
    class ShopOptions:
        key: ClassVar[str] = "webshop"

    class LooseOptions:  # not a dataclass
        key = "loose"

    def spec(name, options):
        return EnvSpec(name, factory=TwoDoors, kwargs=lambda cfg: {}, guide="", tasks=lambda cfg: ["doors"],
                       options=options)

    Config()  # the built-in environments are registered
    with pytest.raises(ValueError, match="^environment 'shop': env.webshop already holds the options WebShopOptions$"):
        register_env(spec("shop", ShopOptions))
    with pytest.raises(ValueError, match="must be a dataclass with a class attribute `key`"):
        register_env(spec("loose", LooseOptions))
    assert "shop" not in ENVIRONMENTS and "loose" not in ENVIRONMENTS
