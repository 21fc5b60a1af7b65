"""Run configuration: one dataclass per concern, loaded from YAML with ``key=value`` overrides.

Names follow TRL where TRL has the knob (``num_generations``, ``beta``, ``epsilon``, ``epsilon_high``,
``temperature``, ``top_p``, ``top_k``, ``max_completion_length``, ``learning_rate``, ``num_iterations``,
``loss_type``); EMPO²'s own
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
    """Environment registry name: ``scienceworld`` or ``webshop`` (or one registered with ``register_env``)."""
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
    """Map free-form model output to a valid action (raw and corrected strings are both kept)."""
    action_cutoff: float = 0.0
    """Similarity (0–100) a rejected output needs to its closest valid action to be replaced by it; below it the
    output is sent as is (and rejected). 0 = always map to the closest valid action, as the released code does: a
    small model that is not corrected this way almost never acts."""
    webshop_data: str | None = None
    """Directory with the official WebShop small set; ``None`` = ``$EMPO2_WEBSHOP_DATA`` or the bundled fixture."""
    webshop_human_goals: bool = False
    """WebShop goals from the human instructions (``items_human_ins.json``; the WebShop/GiGPO evaluation setup)
    instead of the synthetic ones (one per instructed product × option combination)."""
    webshop_num_products: int | None = None
    """Use only the first N catalog products (``None`` = all)."""
    seed: int = 0
    """Seed for environment-side randomness (WebShop prices/goals)."""
    pool: str = "process"
    """Where environment workers run: ``process`` (local subprocesses) or ``ray`` (Ray actors, on any node of the
    cluster in ``$RAY_ADDRESS``, else a local Ray; ``pip install 'empo2[ray]'``)."""


@dataclass
class PolicyConfig:
    """The language model, how it generates, and how it is adapted."""

    model: str = "smollm2-135m"
    """Model: ``smollm2-135m`` (offline bundled default), a Hugging Face hub id, or a local path."""
    dtype: str = "auto"
    """``auto`` (float32 on CPU, bfloat16 on GPU), ``float32``, ``bfloat16`` or ``float16``."""
    device: str = "auto"
    """``auto``, ``cpu``, ``cuda`` or ``cuda:N``."""
    autocast: str = "none"
    """Compute dtype for forward passes (``torch.autocast``): ``none``, ``bfloat16`` or ``float16``. Weights and
    optimizer state stay in ``dtype``: ``dtype=float32`` + ``autocast=bfloat16`` is fp32 master weights with bf16
    compute. Full fine-tuning refuses non-float32 ``dtype`` (small updates would round to zero). On CPUs without
    native bfloat16 (no AVX512-BF16/AMX) bfloat16 is slower; see benchmarks/results/iteration.json."""
    backend: str = "hf"
    """Rollout generation: ``hf`` (the training model's ``generate``) or ``vllm`` (a colocated vLLM engine with
    prefix caching, weights synced after every update; ``pip install 'empo2[vllm]'``, CUDA only)."""
    vllm_memory: float = 0.4
    """Fraction of the GPU's memory the vLLM engine may take (weights + KV cache); the trainer uses the rest."""
    seeded_sampling: bool = False
    """Seed each rollout's sampling by (``train.seed``, iteration, group, member, turn) instead of one shared stream,
    so its tokens do not depend on the other rollouts in its batch: a run on N data-parallel ranks then samples what
    the one-rank run samples. Costs one vocabulary-sized noise draw per rollout and token."""
    lora: bool = True
    """Train a LoRA adapter (CPU default); ``False`` = full fine-tuning."""
    lora_r: int = 16
    """LoRA rank."""
    lora_alpha: int = 32
    """LoRA scaling numerator (the update is scaled by ``lora_alpha / lora_r``)."""
    lora_dropout: float = 0.0
    """Dropout on the LoRA branch (0 keeps behaviour and training log-probs identical)."""
    lora_target_modules: list[str] = field(
        default_factory=lambda: ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]
    )
    """Module names that get a LoRA adapter."""
    temperature: float = 1.0
    """Sampling temperature for training rollouts (released code: 1.0)."""
    eval_temperature: float = 0.4
    """Sampling temperature for evaluation (released code: 0.4)."""
    top_p: float = 1.0
    """Nucleus-sampling mass (1.0 = off). Generation never applies the model's own generation defaults (repetition
    penalty, top-k): only what is configured here."""
    top_k: int = 0
    """Top-k sampling (0 = off)."""
    max_completion_length: int = 24
    """Max new tokens per action."""
    max_prompt_length: int = 1536
    """Prompts longer than this drop their oldest history steps."""
    reflection_max_tokens: int = 64
    """Max new tokens for an end-of-episode tip."""
    reflection_temperature: float = 1.0
    """Sampling temperature of the end-of-episode reflection (released code: 1.0)."""
    history_window: int = 4
    """How many recent (action, observation) steps the prompt shows."""
    few_shot: int = 1
    """Number of gold demonstrations (from other variations) in the prompt."""
    prefix_sharing: bool = True
    """Compute the token head that several prompts share (system prompt, task, demonstration) once, in generation
    and in the update; ``False`` = every row runs its whole prompt (the older, slower path; same results)."""


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
    """Tips longer than this many words are rejected (the reflection prompt asks for fewer)."""
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
    """Algorithm registry name (``empo2.algo.registry``): ``empo2`` (three modes + memory), ``grpo`` (on-policy
    only, no memory) or ``gigpo`` (GRPO's loop with the ``gigpo`` estimator). The algorithm decides memory use, mode
    probabilities, loss and (by default) estimator."""
    num_generations: int = 8
    """Rollouts per task (the GRPO group G)."""
    advantage: str = "grpo"
    """Advantage-estimator registry name, for algorithms that do not fix their own: ``grpo`` or ``gigpo``."""
    gamma: float = 0.95
    """GiGPO: discount of the step return R_t = Σ_{k≥t} γ^{k−t} r_k (paper: 0.95)."""
    step_advantage_weight: float = 1.0
    """GiGPO: ω in A = A_episode + ω·A_step (paper: 1.0)."""
    step_similarity: float | None = None
    """GiGPO: ``None`` = anchor states grouped by exact match; a ratio in (0, 1] also groups states whose texts are
    at least this similar (difflib ratio)."""
    scale_rewards: bool = True
    """Divide group-centred returns by the group std (ddof=0) + ``adv_eps``."""
    adv_eps: float = 1e-6
    """Added to the group std before dividing."""
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
    loss_type: str = "token_mean"
    """Loss aggregation: ``token_mean`` (sum over tokens / tokens of the mini-batch; TRL's ``dapo``/``bnpo``) or
    ``sequence_mean`` (per-response mean, then mean over responses; TRL's ``grpo``)."""
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
    """Weight w of the episode's novelty reward in the return (0 = off)."""
    intrinsic_aggregation: str = "mean"
    """How an episode's per-step novelty rewards become its intrinsic return: ``mean`` (default: a longer episode
    is not paid for its length) or ``sum``."""
    intrinsic_schedule: str = "constant"
    """``constant`` (w) or ``linear`` (from ``intrinsic_weight_start`` to ``intrinsic_weight_end``)."""
    intrinsic_weight_start: float = 0.8
    """Weight at the first iteration under the ``linear`` schedule."""
    intrinsic_weight_end: float = 0.2
    """Weight at the last iteration under the ``linear`` schedule."""
    novelty_threshold: float = 0.9
    """Cosine above which two observations (of one task) count as the same state for the novelty reward."""


@dataclass
class TrainConfig:
    """The outer loop: iterations, optimisation, evaluation, checkpoints."""

    iterations: int = 4
    """Training iterations (each: sample tasks, roll out groups, update)."""
    tasks_per_batch: int = 1
    """Tasks per iteration (each rolled out ``num_generations`` times)."""
    learning_rate: float = 1e-4
    """AdamW learning rate (released full fine-tuning: 1e-6; LoRA wants more)."""
    weight_decay: float = 0.0
    """AdamW weight decay."""
    max_grad_norm: float = 1.0
    """Gradient-norm clip before each optimizer step."""
    num_iterations: int = 1
    """Passes (PPO epochs) over an iteration's rollouts (TRL's name; released code: 1)."""
    mini_batch_size: int = 0
    """Action steps (rows) per optimizer step, each mini-batch normalised by its own tokens; 0 = one optimizer step
    over the whole iteration. verl takes one step per ``ppo_mini_batch_size``, ~20–30 per iteration."""
    micro_batch_tokens: int = 4096
    """Token budget of one forward/backward micro-batch (memory, not maths: micro-batches of a mini-batch add up)."""
    logprob_chunk_tokens: int = 1024
    """Response tokens whose full-vocabulary logits exist at once when computing log-probs (bounds update memory)."""
    eval_every: int = 0
    """Evaluate every N iterations (0 = only at the end)."""
    eval_at_start: bool = False
    """Also evaluate the untrained policy before iteration 0 (``eval/start.json``), so a learning curve starts at
    zero environment steps; ``empo2 compare`` turns it on."""
    eval_episodes_per_task: int | None = None
    """Cap on eval episodes per task (``None`` = ``env.eval_variations``)."""
    save_every: int = 1
    """Write a checkpoint every N iterations (and after the last)."""
    keep_checkpoints: int = 2
    """Checkpoints kept on disk (older ones are deleted)."""
    output_dir: str = "runs/empo2"
    """The run folder."""
    seed: int = 0
    """Seed of task, mode and sampling randomness (Python, numpy, torch)."""
    zero_adv_warn_iters: int = 5
    """Warn when this many consecutive iterations had zero advantage in every group."""
    sample_trajectories: int = 4
    """Episodes written to ``trajectories.jsonl`` per iteration."""
    tensorboard: bool = True
    """Write TensorBoard events to ``RUN/tb``."""
    progress: bool = True
    """Show a progress bar (only on a terminal)."""
    max_consecutive_env_failures: int = 8
    """Stop the run (exit 2) after this many training episodes in a row were lost to a crashed environment worker
    (a dead JVM is restarted and its episode dropped from the update; a steady stream of crashes is not a run)."""


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
                raise ConfigError(f"malformed YAML in {p}: {_yaml_problem(exc)}") from None
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
        setattr(obj, name, _coerce(f"{section}.{name}", value, obj, name))

    def to_dict(self) -> dict[str, Any]:
        return {s: dataclasses.asdict(getattr(self, s)) for s in self.SECTIONS}

    def save(self, path: str | os.PathLike) -> None:
        Path(path).write_text(yaml.safe_dump(self.to_dict(), sort_keys=False))

    # ------------------------------------------------------------------ checks
    def validate(self) -> None:
        a, e, m, p, t = self.algo, self.env, self.memory, self.policy, self.train
        checks = [
            (e.eval_split in ("dev", "test", "train", "eval"), "env.eval_split must be dev|test (webshop: eval|test)"),
            (0 <= e.action_cutoff <= 100, "env.action_cutoff must be in [0, 100]"),
            (p.autocast in ("none", "bfloat16", "float16"), "policy.autocast must be none|bfloat16|float16"),
            (p.backend in ("hf", "vllm"), "policy.backend must be hf|vllm"),
            (e.pool in ("process", "ray"), "env.pool must be process|ray"),
            (0 < p.vllm_memory < 1, "policy.vllm_memory must be in (0, 1)"),
            (a.num_generations >= 1, "algo.num_generations must be >= 1"),
            (0 <= a.epsilon < 1 and a.epsilon_high >= 0, "algo.epsilon must be in [0,1) and epsilon_high >= 0"),
            (0 <= a.delta < 1, "algo.delta must be in [0, 1)"),
            (a.beta >= 0, "algo.beta must be >= 0"),
            (a.mask_granularity in ("token", "sequence"), "algo.mask_granularity must be token|sequence"),
            (a.loss_type in ("token_mean", "sequence_mean"), "algo.loss_type must be token_mean|sequence_mean"),
            (a.off_policy_ratio in ("paper", "tip_free"), "algo.off_policy_ratio must be paper|tip_free"),
            (0 <= a.p_off_policy <= a.p_memory <= 1, "algo.p_off_policy <= algo.p_memory, both in [0, 1]"),
            (a.mode_granularity in ("batch", "group"), "algo.mode_granularity must be batch|group"),
            (a.intrinsic_schedule in ("constant", "linear"), "algo.intrinsic_schedule must be constant|linear"),
            (a.intrinsic_aggregation in ("mean", "sum"), "algo.intrinsic_aggregation must be mean|sum"),
            (0 <= a.gamma <= 1, "algo.gamma must be in [0, 1]"),
            (a.step_similarity is None or 0 < a.step_similarity <= 1, "algo.step_similarity must be in (0, 1] or null"),
            (m.namespace in ("task", "task_variation"), "memory.namespace must be task|task_variation"),
            (m.top_k_tips >= 0 and m.capacity >= 1, "memory.top_k_tips >= 0 and memory.capacity >= 1"),
            (p.temperature >= 0 and p.reflection_temperature >= 0 and p.top_k >= 0 and 0 < p.top_p <= 1,
             "policy temperatures >= 0, policy.top_k >= 0 and policy.top_p in (0, 1]"),
            (t.iterations >= 0 and t.tasks_per_batch >= 1, "train.iterations >= 0 and train.tasks_per_batch >= 1"),
            (t.learning_rate > 0, "train.learning_rate must be > 0"),
            (t.max_consecutive_env_failures >= 1, "train.max_consecutive_env_failures must be >= 1"),
            (t.num_iterations >= 1, "train.num_iterations must be >= 1"),
            (t.micro_batch_tokens >= 1 and t.mini_batch_size >= 0, "train.micro_batch_tokens >= 1 and "
             "train.mini_batch_size >= 0"),
            (t.logprob_chunk_tokens >= 1, "train.logprob_chunk_tokens must be >= 1"),
        ]
        for ok, message in checks:
            if not ok:
                raise ConfigError(message)
        self._check_registry_names()

    def _check_registry_names(self) -> None:
        """Every registry-backed name (algorithm, estimator, loss, environment, tasks, eviction policy) is checked
        here, at load, so a typo exits before any run folder exists. The registries live in higher layers and are
        imported only now, when they are needed."""
        from empo2.algo.advantages import ADVANTAGE_ESTIMATORS
        from empo2.algo.losses import POLICY_LOSSES
        from empo2.algo.registry import ALGORITHMS
        from empo2.envs.base import EnvError
        from empo2.envs.registry import get_env_spec
        from empo2.memory.store import EVICTION_POLICIES

        def known(kind: str, key: str, name: str, registry) -> None:
            if name not in registry:
                raise ConfigError(f"{key}: unknown {kind} {name!r}; valid: {', '.join(sorted(registry))}")

        known("algorithm", "algo.name", self.algo.name, ALGORITHMS)
        spec = ALGORITHMS[self.algo.name]
        known("advantage estimator", "algo.advantage", spec.estimator(self.algo), ADVANTAGE_ESTIMATORS)
        known("policy loss", f"algorithm {spec.name!r} loss", spec.loss, POLICY_LOSSES)
        known("eviction policy", "memory.eviction", self.memory.eviction, EVICTION_POLICIES)
        try:
            get_env_spec(self.env.name).tasks(self.env)
        except EnvError as exc:
            raise ConfigError(f"env: {exc}") from None

    @property
    def algorithm(self):
        """The :class:`~empo2.algo.registry.AlgorithmSpec` named by ``algo.name``."""
        from empo2.algo.registry import get_algorithm

        return get_algorithm(self.algo.name)


def _yaml_problem(exc: Exception) -> str:
    """A YAML parser error as one line: what went wrong, and where (the parser's own text spans several lines)."""
    mark = getattr(exc, "problem_mark", None)
    where = f" (line {mark.line + 1}, column {mark.column + 1})" if mark is not None else ""
    return " ".join(str(getattr(exc, "problem", None) or exc).split()) + where


def _coerce(key: str, value: Any, obj: Any, name: str) -> Any:
    """Check a value against the field's declared type annotation."""
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
