"""The sections of the two stages a run can go through: ``train`` (RL: iterations, optimisation, evaluation,
checkpoints) and ``sft`` (the warm start from gold demonstrations, before RL). Declared like the other sections
(:mod:`empo2.config.sections`)."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Literal

from empo2.bounds import ANY_COUNT, SEED_MAX, bounded


@dataclass
class TrainConfig:
    """The outer loop: iterations, optimisation, evaluation, checkpoints."""

    iterations: int = bounded(4, 0, ANY_COUNT)
    """Training iterations (each: sample tasks, roll out groups, update)."""
    tasks_per_batch: int = bounded(1, 1, 1_000_000)
    """Tasks per iteration (each rolled out ``num_generations`` times)."""
    learning_rate: float = bounded(1e-4, 1e-12, 10)
    """AdamW learning rate (released full fine-tuning: 1e-6; LoRA wants more)."""
    weight_decay: float = bounded(0.0, 0, 100)
    """AdamW weight decay."""
    max_grad_norm: float = bounded(1.0, 1e-12, 1e9)
    """Gradient-norm clip before each optimizer step."""
    ppo_epochs: int = bounded(1, 1, 10_000)
    """Passes (PPO epochs) over an iteration's rollouts (TRL's ``num_iterations``; released code: 1)."""
    mini_batch_size: int = bounded(0, 0, ANY_COUNT)
    """Action steps (rows) per optimizer step, each mini-batch normalised by its own tokens; 0 = one optimizer step
    over the whole iteration. verl takes one step per ``ppo_mini_batch_size``, ~20–30 per iteration."""
    pack_episodes: bool = False
    """Keep rows that chain (each step's prompt + response starts the next step's prompt: ``policy.prompt_layout:
    append``) in one mini-batch, shuffling the chains whole, so each chain runs as one forward of its last row
    (:mod:`empo2.policy.packing`). Rows that share a micro-batch are packed either way (exactly: same log-probs and
    gradients); this changes which rows share an optimizer step when ``mini_batch_size`` cuts the rows."""
    micro_batch_tokens: int = bounded(1024, 1, ANY_COUNT)
    """Token budget of one forward/backward micro-batch (memory, not maths: micro-batches of a mini-batch add up).
    Peak memory grows with it; speed depends on how many rows share a prompt head in a micro-batch
    (``benchmarks/iteration.py``; records/benchmarks.md)."""
    logprob_chunk_tokens: int = bounded(1024, 1, ANY_COUNT)
    """Response tokens whose full-vocabulary logits exist at once when computing log-probs (bounds update memory)."""
    gradient_checkpointing: bool = False
    """Recompute each decoder layer in backward instead of storing its activations (large models on GPUs: less
    memory, about one more forward of compute). The update then runs without prefix sharing: transformers drops the
    KV cache inside a checkpointed layer, so rows would lose their shared head (and a kept cache would be appended to
    twice when the layer is replayed)."""
    sharding: Literal["none", "fsdp"] = "none"
    """``none``: every rank holds the whole model (data parallel). ``fsdp``: FSDP2 shards the weights, gradients and
    AdamW moments over the ranks per decoder layer (float32 masters; bfloat16 compute with ``policy.autocast:
    bfloat16``), for models whose full replica does not fit one GPU. Launched as ever (``torchrun``); one process
    runs the same sharded code on a group of one. With ``policy.backend: vllm`` each rank's engine takes the weights
    gathered one decoder layer at a time; the update runs without prefix sharing; checkpoints are sharded (``empo2
    export RUN OUT`` writes Hugging Face weights). ``empo2.parallel.sharding``."""
    memory_check: bool = True
    """Before the first rollout on a GPU, estimate one rank's peak memory (weights, gradients, AdamW state,
    activations, the vLLM engine's share) and stop with one line, and a setting that fits, when it exceeds the
    device's free memory (:mod:`empo2.train.preflight`); false skips the check."""
    eval_every: int = bounded(0, 0, ANY_COUNT)
    """Evaluate every N iterations (0 = only at the end)."""
    eval_at_start: bool = False
    """Also evaluate the untrained policy before iteration 0 (``eval/start.json``), so a learning curve starts at
    zero environment steps; ``empo2 compare`` turns it on."""
    eval_episodes_per_task: int | None = bounded(None, 1, 1_000_000)
    """Cap on eval episodes per task (``None`` = ``env.eval_variations``)."""
    save_every: int = bounded(1, 1, ANY_COUNT)
    """Write a checkpoint every N iterations (and after the last)."""
    keep_checkpoints: int = bounded(2, 1, 100_000)
    """Checkpoints kept on disk (older ones are deleted)."""
    output_dir: str = "runs/empo2"
    """The run folder."""
    seed: int = bounded(0, 0, SEED_MAX)
    """Seed of task, mode and sampling randomness (Python, numpy, torch)."""
    zero_adv_warn_iters: int = bounded(5, 1, ANY_COUNT)
    """Warn when this many consecutive iterations had zero advantage in every group."""
    sample_trajectories: int = bounded(4, 0, 1_000_000)
    """Episodes written to ``trajectories.jsonl`` per iteration."""
    progress: bool = True
    """Show progress: a bar on a terminal; where output goes to a file, a plain line as each stage (rollouts, update,
    an eval) starts and ends, and at most once a minute between."""
    max_consecutive_env_failures: int = bounded(8, 1, ANY_COUNT)
    """Stop the run (exit 2) after this many training episodes in a row were lost to a crashed environment worker
    (a dead JVM is restarted and its episode dropped from the update; a steady stream of crashes is not a run)."""
    preempt_save: bool = False
    """On SIGTERM/SIGINT, finish the current iteration and write its checkpoint before exiting (a second signal stops
    at once). Off: stop at once and resume from the last checkpoint, losing the unfinished iteration (with
    ``save_every: 1``, at most one). Turn it on only when the scheduler's grace period (SLURM ``KillWait``, 30 s by
    default; Kubernetes ``terminationGracePeriodSeconds``) is longer than an iteration, or SIGKILL comes mid-save."""
    report_to: list[str] = field(default_factory=lambda: ["tensorboard"])
    """Experiment trackers that receive every iteration's scalars (TRL's ``report_to``): ``tensorboard`` (events in
    ``RUN/tb``), ``wandb`` (Weights & Biases; files in ``RUN/wandb``, ``WANDB_MODE=offline`` keeps them local),
    ``mlflow`` (where ``MLFLOW_TRACKING_URI`` points), one name or a list, or ``none``.
    ``metrics.jsonl`` is always written. Each package is imported only when named; a missing one stops the run
    before it writes anything (``pip install wandb`` / ``mlflow``)."""


@dataclass
class SftConfig:
    """The warm start (``empo2 sft``): behaviour cloning on the gold paths of training variations, before RL. Read by
    ``empo2 sft`` only (with the ``env`` and ``policy`` sections, which decide how prompts are rendered and which
    LoRA is trained); ``train`` starts from its result through ``policy.warm_start``."""

    tasks: list[str] = field(default_factory=list)
    """Tasks (or task sets) whose gold paths are the demonstrations; empty: ``env.tasks``. Neighbouring tasks
    (find-animal and find-plant for find-non-living-thing) make the RL stage a transfer."""
    demos: int = bounded(32, 1, ANY_COUNT)
    """Gold episodes to learn from: the first train-split variations of the tasks, taken in turn, whose gold path
    succeeds within the step cap (one that does not is skipped for the next)."""
    epochs: int = bounded(3, 1, 10_000)
    """Passes over the demonstrations."""
    learning_rate: float = bounded(2e-4, 1e-12, 10)
    """AdamW learning rate of the LoRA adapter (weight decay and gradient clip: ``train``'s)."""
    batch_rows: int = bounded(16, 1, ANY_COUNT)
    """Steps (a prompt and its gold action) per optimizer step. Episodes are shuffled whole, so most rows of a batch
    share their episode's prompt head, computed once."""
    validation_demos: int = bounded(8, 0, ANY_COUNT)
    """Gold episodes of the dev split of ``env.tasks`` whose loss is the validation loss (0: none)."""
    eval_variations: int = bounded(10, 0, ANY_COUNT)
    """After each epoch, play the first N dev variations of each of ``env.tasks`` as a training run evaluates (no
    memory, ``policy.eval_temperature``): held-out success and the share of raw outputs that are valid (0: none)."""
    select: Literal["success", "loss"] = "success"
    """The epoch that becomes the warm start: ``success``, the best held-out success (ties: lower validation loss);
    ``loss``, the lowest validation loss. Without the measure asked for, the other one; without either, the last."""
    output_dir: str = "runs/sft"
    """The warm start's run folder (``policy.warm_start`` names it)."""
    seed: int = bounded(0, 0, SEED_MAX)
    """Seed of the shuffling and the held-out evaluation's sampling."""
