"""Run configuration: one dataclass per concern, loaded from YAML with ``key=value`` overrides.

Names follow TRL where TRL has the knob (``num_generations``, ``beta``, ``epsilon``, ``epsilon_high``,
``temperature``, ``max_completion_length``, ``learning_rate``, ``gradient_accumulation_steps``); EMPO²'s own
knobs keep the paper's names (``delta``, ``p_memory``, ``p_off_policy``, ``top_k_tips``).

A YAML file has one mapping per section::

    env: {name: scienceworld, tasks: [find-animal]}
    algo: {name: empo2, beta: 0.0}

Overrides on the command line are ``section.key=value`` or, when the key is unique across sections, ``key=value``.
Values are parsed as YAML scalars/lists (``tasks=[find-animal,use-thermometer]``).
"""

from __future__ import annotations

import dataclasses
import os
from dataclasses import dataclass, field, fields
from pathlib import Path
from typing import Any

import yaml


class ConfigError(ValueError):
    """A user error in a config file or override; the CLI prints it and exits with code 2."""


@dataclass
class EnvConfig:
    """Which environment, which tasks, and how episodes are run."""

    name: str = "scienceworld"
    """Environment: ``scienceworld`` or ``webshop``."""
    tasks: list[str] = field(default_factory=lambda: ["find-animal"])
    """Task names or task-set names (``panel18``, ``biology1`` …) for ScienceWorld; ignored by WebShop."""
    train_variations: int = 5
    """Train on the first N train-split variations of each task (released code: 5)."""
    eval_split: str = "dev"
    """Split used for held-out evaluation: ``dev`` or ``test``."""
    eval_variations: int = 20
    """Evaluate on the first N variations of ``eval_split`` per task (released code: 20 test variations)."""
    simplification: str = "easy"
    """ScienceWorld simplification string (``easy`` = the released setup)."""
    max_steps: int | None = None
    """Episode step cap; ``None`` = per-task default (30; chemistry-mix 60; measure-melting-point-known-substance 120)."""
    step_caps: dict[str, int] | None = None
    """ScienceWorld per-task step caps, e.g. ``{chemistry-mix: 90}``; they win over ``max_steps`` for their tasks."""
    action_correction: bool = True
    """Map free-form model output to the closest valid action (raw and corrected strings are both kept)."""
    webshop_data: str | None = None
    """Directory with the official WebShop small set; ``None`` = ``$EMPO2_WEBSHOP_DATA`` or the bundled fixture."""
    webshop_goal_split: str = "train"
    """WebShop goal split for training: ``train``, ``eval`` or ``test``."""
    webshop_human_goals: bool = False
    """WebShop goals from the human instructions (``items_human_ins.json``; the WebShop/GiGPO evaluation setup)
    instead of the synthetic ones (one per instructed product × option combination)."""
    webshop_num_products: int | None = None
    """Use only the first N catalog products (``None`` = all)."""
    seed: int = 0
    """Seed for environment-side randomness (WebShop prices/goals)."""


@dataclass
class PolicyConfig:
    """The language model, how it generates, and how it is adapted."""

    model: str = "smollm2-135m"
    """Model: ``smollm2-135m`` (offline bundled default), a Hugging Face hub id, or a local path."""
    dtype: str = "auto"
    """``auto`` (float32 on CPU, bfloat16 on GPU), ``float32``, ``bfloat16`` or ``float16``."""
    device: str = "auto"
    """``auto``, ``cpu``, ``cuda`` or ``cuda:N``."""
    lora: bool = True
    """Train a LoRA adapter (CPU default); ``False`` = full fine-tuning."""
    lora_r: int = 16
    lora_alpha: int = 32
    lora_dropout: float = 0.0
    lora_target_modules: list[str] = field(
        default_factory=lambda: ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]
    )
    temperature: float = 1.0
    """Sampling temperature for training rollouts (released code: 1.0)."""
    eval_temperature: float = 0.4
    """Sampling temperature for evaluation (released code: 0.4)."""
    top_p: float = 1.0
    max_completion_length: int = 24
    """Max new tokens per action."""
    max_prompt_length: int = 1536
    """Prompts longer than this drop their oldest history steps."""
    reflection_max_tokens: int = 64
    """Max new tokens for an end-of-episode tip."""
    history_window: int = 4
    """How many recent (action, observation) steps the prompt shows."""
    few_shot: int = 1
    """Number of gold demonstrations (from other variations) in the prompt."""


@dataclass
class MemoryConfig:
    """The tip memory (non-parametric half of EMPO²)."""

    top_k_tips: int = 10
    """Tips retrieved per state (paper: 10)."""
    similarity_threshold: float = 0.5
    """Minimum cosine similarity of a retrieved tip's key to the current state (released code: 0.5)."""
    capacity: int = 1000
    """Tips kept per namespace."""
    eviction: str = "utility"
    """``utility`` (lowest first), ``lru`` or ``fifo``."""
    namespace: str = "task"
    """``task`` or ``task_variation``."""
    dedup_threshold: float = 0.95
    """A new tip this similar to an existing one in its namespace is rejected as a duplicate."""
    max_tip_words: int = 100
    rerank_score_weight: float = 0.0
    """Weight of the (normalised) episode score in retrieval ranking; 0 = pure similarity."""
    rerank_utility_weight: float = 0.0
    """Weight of the (normalised) utility in retrieval ranking; 0 = pure similarity."""
    reflect_in_on_mode: bool = True
    """Also write a tip after ``on`` (memory-free) episodes, as the released code does."""
    embedder: str = "all-minilm-l6-v2"
    """Sentence embedder: the bundled offline MiniLM, or a sentence-transformers id/path."""
    seed_from: str | None = None
    """Copy this memory database into the run at start (e.g. a previous run's ``memory.sqlite``)."""


@dataclass
class AlgoConfig:
    """The RL objective: advantages, the clipped loss, modes, and the intrinsic reward."""

    name: str = "empo2"
    """``empo2`` (three modes + memory) or ``grpo`` (on-policy only, no memory)."""
    num_generations: int = 8
    """Rollouts per task (the GRPO group G)."""
    advantage: str = "grpo"
    """Advantage estimator from the registry."""
    scale_rewards: bool = True
    """Divide group-centred returns by the group std (ddof=0) + ``adv_eps``."""
    adv_eps: float = 1e-6
    epsilon: float = 0.2
    """Lower clip range ε_low."""
    epsilon_high: float = 0.3
    """Upper clip range ε_high."""
    dual_clip: float = 10.0
    """Dual-clip constant c for negative advantages (0 disables)."""
    delta: float = 0.01
    """Low-probability mask: drop tokens with π_θ(a|tip-free prompt) < δ (0 disables)."""
    mask_granularity: str = "token"
    """``token`` (paper) or ``sequence`` (released code: drop a response if any old log-prob < log δ)."""
    beta: float = 0.0
    """KL-to-reference coefficient (k3 estimator)."""
    loss_aggregation: str = "token_mean"
    """``token_mean`` or ``sequence_mean``."""
    off_policy_ratio: str = "paper"
    """``paper``: π_θ(a|s)/π_old(a|s,tips); ``tip_free``: tip-free prompt in both (pre-release variant)."""
    p_memory: float = 0.25
    """Probability of a memory rollout (``on_tips`` + ``off_tips``); released: 0.25."""
    p_off_policy: float = 0.17
    """Probability of an ``off_tips`` rollout (part of ``p_memory``); ``on_tips`` gets ``p_memory - p_off_policy``.
    Released defaults: on / on_tips / off_tips = 0.75 / 0.08 / 0.17."""
    mode_granularity: str = "batch"
    """Sample the mode once per ``batch`` or per ``group``."""
    intrinsic_weight: float = 0.0
    """Weight w of the summed novelty reward in the return (0 = off)."""
    intrinsic_schedule: str = "constant"
    """``constant`` (w) or ``linear`` (from ``intrinsic_weight_start`` to ``intrinsic_weight_end``)."""
    intrinsic_weight_start: float = 0.8
    intrinsic_weight_end: float = 0.2
    novelty_threshold: float = 0.9
    """Cosine above which two states count as the same for the novelty reward."""


@dataclass
class TrainConfig:
    """The outer loop: iterations, optimisation, evaluation, checkpoints."""

    iterations: int = 4
    tasks_per_batch: int = 1
    """Tasks per iteration (each rolled out ``num_generations`` times)."""
    learning_rate: float = 1e-4
    """AdamW learning rate (released full fine-tuning: 1e-6; LoRA wants more)."""
    weight_decay: float = 0.0
    max_grad_norm: float = 1.0
    ppo_epochs: int = 1
    micro_batch_tokens: int = 4096
    """Token budget of one forward/backward micro-batch."""
    gradient_accumulation_steps: int = 0
    """Micro-batches accumulated per optimizer step; 0 = the whole iteration's data makes one optimizer step."""
    eval_every: int = 0
    """Evaluate every N iterations (0 = only at the end)."""
    eval_episodes_per_task: int | None = None
    """Cap on eval episodes per task (``None`` = ``env.eval_variations``)."""
    save_every: int = 1
    keep_checkpoints: int = 2
    output_dir: str = "runs/empo2"
    seed: int = 0
    zero_adv_warn_iters: int = 5
    """Warn when this many consecutive iterations had zero advantage in every group."""
    sample_trajectories: int = 4
    """Episodes written to ``trajectories.jsonl`` per iteration."""
    tensorboard: bool = True
    progress: bool = True


@dataclass
class Config:
    env: EnvConfig = field(default_factory=EnvConfig)
    policy: PolicyConfig = field(default_factory=PolicyConfig)
    memory: MemoryConfig = field(default_factory=MemoryConfig)
    algo: AlgoConfig = field(default_factory=AlgoConfig)
    train: TrainConfig = field(default_factory=TrainConfig)

    SECTIONS = ("env", "policy", "memory", "algo", "train")

    # ------------------------------------------------------------------ loading
    @classmethod
    def from_dict(cls, data: dict[str, Any] | None) -> "Config":
        cfg = cls()
        for section, values in (data or {}).items():
            if section not in cls.SECTIONS:
                raise ConfigError(f"unknown config section {section!r}; valid sections: {', '.join(cls.SECTIONS)}")
            if values is None:
                continue
            if not isinstance(values, dict):
                raise ConfigError(f"config section {section!r} must be a mapping, got {type(values).__name__}")
            for key, value in values.items():
                cfg.set(f"{section}.{key}", value)
        cfg.validate()
        return cfg

    @classmethod
    def load(cls, path: str | os.PathLike | None, overrides: list[str] | tuple[str, ...] = ()) -> "Config":
        data: dict[str, Any] = {}
        if path is not None:
            p = Path(path)
            if not p.is_file():
                raise ConfigError(f"config file not found: {p}")
            try:
                data = yaml.safe_load(p.read_text()) or {}
            except yaml.YAMLError as exc:
                raise ConfigError(f"malformed YAML in {p}: {exc}") from None
            if not isinstance(data, dict):
                raise ConfigError(f"{p} must hold a mapping of sections, got {type(data).__name__}")
        cfg = cls.from_dict(data)
        for item in overrides:
            if "=" not in item:
                raise ConfigError(f"override {item!r} is not key=value")
            key, raw = item.split("=", 1)
            try:
                value = yaml.safe_load(raw) if raw != "" else None
            except yaml.YAMLError:
                value = raw
            cfg.set(key.strip(), value)
        cfg.validate()
        return cfg

    # ------------------------------------------------------------------ access
    def valid_keys(self) -> list[str]:
        return [f"{s}.{f.name}" for s in self.SECTIONS for f in fields(getattr(self, s))]

    def resolve_key(self, key: str) -> tuple[str, str]:
        if "." in key:
            section, name = key.split(".", 1)
            if section in self.SECTIONS and name in {f.name for f in fields(getattr(self, section))}:
                return section, name
        else:
            owners = [s for s in self.SECTIONS if key in {f.name for f in fields(getattr(self, s))}]
            if len(owners) == 1:
                return owners[0], key
            if len(owners) > 1:
                raise ConfigError(f"key {key!r} is ambiguous; write one of: {', '.join(f'{o}.{key}' for o in owners)}")
        raise ConfigError(f"unknown config key {key!r}; valid keys: {', '.join(self.valid_keys())}")

    def set(self, key: str, value: Any) -> None:
        section, name = self.resolve_key(key)
        obj = getattr(self, section)
        current = getattr(obj, name)
        setattr(obj, name, _coerce(f"{section}.{name}", value, current, obj, name))

    def to_dict(self) -> dict[str, Any]:
        return {s: dataclasses.asdict(getattr(self, s)) for s in self.SECTIONS}

    def save(self, path: str | os.PathLike) -> None:
        Path(path).write_text(yaml.safe_dump(self.to_dict(), sort_keys=False))

    # ------------------------------------------------------------------ checks
    def validate(self) -> None:
        a, e, m, t = self.algo, self.env, self.memory, self.train
        checks = [
            (e.name in ("scienceworld", "webshop"), "env.name must be 'scienceworld' or 'webshop'"),
            (e.eval_split in ("dev", "test", "train", "eval"), "env.eval_split must be dev|test (webshop: eval|test)"),
            (a.name in ("empo2", "grpo"), "algo.name must be 'empo2' or 'grpo'"),
            (a.num_generations >= 1, "algo.num_generations must be >= 1"),
            (0 <= a.epsilon < 1 and a.epsilon_high >= 0, "algo.epsilon must be in [0,1) and epsilon_high >= 0"),
            (0 <= a.delta < 1, "algo.delta must be in [0, 1)"),
            (a.beta >= 0, "algo.beta must be >= 0"),
            (a.mask_granularity in ("token", "sequence"), "algo.mask_granularity must be token|sequence"),
            (a.loss_aggregation in ("token_mean", "sequence_mean"), "algo.loss_aggregation must be token_mean|sequence_mean"),
            (a.off_policy_ratio in ("paper", "tip_free"), "algo.off_policy_ratio must be paper|tip_free"),
            (0 <= a.p_off_policy <= a.p_memory <= 1, "algo.p_off_policy <= algo.p_memory, both in [0, 1]"),
            (a.mode_granularity in ("batch", "group"), "algo.mode_granularity must be batch|group"),
            (a.intrinsic_schedule in ("constant", "linear"), "algo.intrinsic_schedule must be constant|linear"),
            (m.eviction in ("utility", "lru", "fifo"), "memory.eviction must be utility|lru|fifo"),
            (m.namespace in ("task", "task_variation"), "memory.namespace must be task|task_variation"),
            (m.top_k_tips >= 0 and m.capacity >= 1, "memory.top_k_tips >= 0 and memory.capacity >= 1"),
            (t.iterations >= 0 and t.tasks_per_batch >= 1, "train.iterations >= 0 and train.tasks_per_batch >= 1"),
            (t.learning_rate > 0, "train.learning_rate must be > 0"),
            (t.micro_batch_tokens >= 1 and t.gradient_accumulation_steps >= 0, "train.micro_batch_tokens >= 1 and "
             "train.gradient_accumulation_steps >= 0"),
        ]
        for ok, message in checks:
            if not ok:
                raise ConfigError(message)

    @property
    def mode_probs(self) -> dict[str, float]:
        """Probabilities of the three rollout modes (``grpo`` = always ``on``)."""
        if self.algo.name == "grpo":
            return {"on": 1.0, "on_tips": 0.0, "off_tips": 0.0}
        pm, po = self.algo.p_memory, self.algo.p_off_policy
        return {"on": 1 - pm, "on_tips": pm - po, "off_tips": po}


def _coerce(key: str, value: Any, current: Any, obj: Any, name: str) -> Any:
    """Check a value against the field's declared type (from its current value / annotation)."""
    hint = str({f.name: f.type for f in fields(obj)}[name])
    if value is None:
        if "None" in hint:
            return None
        raise ConfigError(f"{key} may not be empty")
    if hint.startswith("list"):
        if isinstance(value, str):
            value = [v.strip() for v in value.split(",") if v.strip()]
        if not isinstance(value, list):
            raise ConfigError(f"{key} must be a list, got {value!r}")
        return [str(v) for v in value]
    if hint.startswith("bool"):
        if isinstance(value, bool):
            return value
        raise ConfigError(f"{key} must be true or false, got {value!r}")
    if hint.startswith("int"):
        if isinstance(value, bool) or not isinstance(value, int):
            raise ConfigError(f"{key} must be an integer, got {value!r}")
        return value
    if hint.startswith("float"):
        if isinstance(value, bool) or not isinstance(value, (int, float)):
            raise ConfigError(f"{key} must be a number, got {value!r}")
        return float(value)
    if hint.startswith("str"):
        if isinstance(value, (dict, list)):
            raise ConfigError(f"{key} must be a string, got {value!r}")
        return str(value)
    return value
