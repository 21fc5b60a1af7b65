"""Bounds of every numeric config field, the values of every enumerated one, the size of every string, and the
machine's cap on environment workers.

Checked at load (:meth:`empo2.config.Config.validate`), so a nonsense value (``env.max_steps=-1``,
``algo.num_generations=100000``, a 10 MB path) exits with one line before anything starts. The bounds are wide:
they reject what cannot be a run, not what is unusual. The worker cap depends on the machine and is checked only by
commands that start workers here (``train``, ``compare``): a config written for a cluster still loads on a laptop.
"""

from __future__ import annotations

import functools
import math
import os
import types
import typing
from dataclasses import fields
from typing import Any, Literal


class ConfigError(ValueError):
    """A user error in a config file or override; the CLI prints it and exits with code 2 (re-exported by
    :mod:`empo2.config`, where callers import it from)."""


MAX_TEXT = 4096
"""Characters of one string field or list item (Linux paths are at most 4096 bytes)."""
MAX_ITEMS = 1000
"""Items of one list or mapping field (task lists, LoRA target modules, per-task step caps)."""
MAX_CONFIG_BYTES = 1 << 20
"""Size of a config file: a run's config is a few KB; a bigger file is not a config."""
WORKERS_PER_CORE = 8
"""Environment workers per CPU core by default: a worker mostly waits for the policy, so several share a core."""
WORKER_MEMORY = 512 << 20
"""Available memory reserved per environment worker by default (a ScienceWorld JVM holds about this much)."""

_BIG = 10 ** 9
_SEED = 2 ** 32 - 1  # numpy's seeds are 32-bit

INT_BOUNDS: dict[str, tuple[int, int]] = {
    "env.train_variations": (1, 1_000_000), "env.eval_variations": (1, 1_000_000), "env.max_steps": (1, 100_000),
    "env.webshop_num_products": (1, _BIG), "env.seed": (0, _SEED), "env.max_workers": (1, 1_000_000),
    "policy.lora_r": (1, 65_536), "policy.lora_alpha": (1, 1_000_000), "policy.top_k": (0, 10_000_000),
    "policy.max_completion_length": (1, 1_000_000), "policy.max_prompt_length": (1, 10_000_000),
    "policy.reflection_max_tokens": (1, 1_000_000), "policy.history_window": (0, 100_000),
    "policy.few_shot": (0, 1000),
    "memory.top_k_tips": (0, 100_000), "memory.capacity": (1, _BIG), "memory.max_tip_words": (1, 1_000_000),
    "algo.num_generations": (1, 4096), "algo.dr_grpo_length": (0, 1_000_000), "algo.intrinsic_schedule_iterations": (0, _BIG),
    "algo.proxmo_max_features": (0, _BIG), "algo.elpo_b_max": (1, 4096),
    "train.iterations": (0, _BIG), "train.tasks_per_batch": (1, 1_000_000), "train.num_iterations": (1, 10_000),
    "train.mini_batch_size": (0, _BIG), "train.micro_batch_tokens": (1, _BIG),
    "train.logprob_chunk_tokens": (1, _BIG), "train.eval_every": (0, _BIG),
    "train.eval_episodes_per_task": (1, 1_000_000), "train.save_every": (1, _BIG),
    "train.keep_checkpoints": (1, 100_000), "train.seed": (0, _SEED), "train.zero_adv_warn_iters": (1, _BIG),
    "train.sample_trajectories": (0, 1_000_000), "train.max_consecutive_env_failures": (1, _BIG),
}
"""Inclusive [low, high] of every integer field; a field missing here is a programming error (a test checks)."""

FLOAT_BOUNDS: dict[str, tuple[float, float]] = {
    "policy.lora_dropout": (0.0, 0.0), "policy.temperature": (0.0, 100.0), "policy.eval_temperature": (0.0, 100.0),
    "policy.reflection_temperature": (0.0, 100.0),
    "memory.similarity_threshold": (-1.0, 1.0), "memory.dedup_threshold": (-1.0, 2.0),
    "memory.rerank_score_weight": (0.0, 1e6), "memory.rerank_utility_weight": (0.0, 1e6),
    "algo.step_advantage_weight": (0.0, 1e6), "algo.adv_eps": (1e-12, 1.0), "algo.epsilon_high": (0.0, 100.0),
    "algo.dual_clip": (0.0, 1e6), "algo.beta": (0.0, 1e6), "algo.intrinsic_weight": (0.0, 1e6), "algo.tis_cap": (0.0, 1e6),
    "algo.intrinsic_weight_start": (0.0, 1e6), "algo.intrinsic_weight_end": (0.0, 1e6),
    "algo.novelty_threshold": (-1.0, 1.0), "algo.luffy_gamma": (1e-6, 1.0),
    "algo.proxmo_alpha": (0.0, 100.0), "algo.proxmo_range": (0.0, 0.99), "algo.proxmo_tau": (1e-6, 1e6),
    "algo.elpo_lambda": (0.0, 1.0), "algo.elpo_eps_elc": (0.0, 1.0),
    "algo.elpo_x_min": (1.0, 4096.0), "algo.elpo_x_max": (1.0, 4096.0), "algo.elpo_beta": (0.0, 1e6),
    "train.learning_rate": (1e-12, 10.0), "train.weight_decay": (0.0, 100.0), "train.max_grad_norm": (1e-12, 1e9),
}
"""Inclusive bounds of the float fields that :meth:`Config.validate` does not bound itself."""


def shown(value: Any, limit: int = 60) -> str:
    """``repr(value)`` cut to ``limit`` characters, so an error about a huge value stays one short line."""
    text = repr(value)
    return text if len(text) <= limit else f"{text[:limit]}… ({len(text)} characters)"


def check_size(key: str, value: Any) -> None:
    """Refuse a string longer than :data:`MAX_TEXT` or a list/mapping of more than :data:`MAX_ITEMS` items."""
    if isinstance(value, str) and len(value) > MAX_TEXT:
        raise _error(f"{key} is {len(value):,} characters long; at most {MAX_TEXT} are accepted")
    if isinstance(value, (list, dict)):
        if len(value) > MAX_ITEMS:
            raise _error(f"{key} has {len(value):,} items; at most {MAX_ITEMS} are accepted")
        for item in (list(value) + list(value.values())) if isinstance(value, dict) else value:
            check_size(key, item)


@functools.cache
def choices(section_type: type) -> dict[str, tuple[Any, ...]]:
    """``{field: allowed values}`` of a config section's ``Literal[...]`` fields (``None`` too for an optional one):
    the annotation is the one list of what a field may hold."""
    hints = typing.get_type_hints(section_type)
    out = {}
    for f in fields(section_type):
        hint = hints[f.name]
        parts = typing.get_args(hint) if typing.get_origin(hint) in (typing.Union, types.UnionType) else (hint,)
        allowed = [v for part in parts if typing.get_origin(part) is Literal for v in typing.get_args(part)]
        if allowed:
            out[f.name] = tuple(allowed) + ((None,) if type(None) in parts else ())
    return out


def check_choices(cfg) -> None:
    """Every ``Literal[...]`` field holds one of its values."""
    for section in cfg.SECTIONS:
        obj = getattr(cfg, section)
        for name, allowed in choices(type(obj)).items():
            value = getattr(obj, name)
            if not any(value == v and type(value) is type(v) for v in allowed):
                raise _error(f"{section}.{name} must be one of {', '.join(map(str, allowed))}, got {shown(value)}")


def check_bounds(cfg) -> None:
    """Every int and float field within its bounds (``None`` passes where the field allows it)."""
    for section in cfg.SECTIONS:
        obj = getattr(cfg, section)
        for f in fields(obj):
            key, value = f"{section}.{f.name}", getattr(obj, f.name)
            if isinstance(value, bool) or value is None:
                continue
            if isinstance(value, float) and not math.isfinite(value):
                raise _error(f"{key} must be a finite number, got {value}")
            bounds = INT_BOUNDS.get(key) if isinstance(value, int) else FLOAT_BOUNDS.get(key)
            if bounds is not None and not bounds[0] <= value <= bounds[1]:
                raise _error(f"{key} must be in [{bounds[0]}, {bounds[1]}], got {shown(value)}")
    for task, cap in (cfg.env.step_caps or {}).items():
        low, high = INT_BOUNDS["env.max_steps"]
        if not low <= cap <= high:
            raise _error(f"env.step_caps: {shown(task)} must be in [{low}, {high}], got {cap}")


def worker_cap() -> tuple[int, str]:
    """The default cap on environment workers here, and how it was derived (for the error message)."""
    import psutil

    cores = os.cpu_count() or 1
    available = psutil.virtual_memory().available
    cap = max(1, min(WORKERS_PER_CORE * cores, available // WORKER_MEMORY))
    return cap, (f"{WORKERS_PER_CORE} per core × {cores} cores, one per {WORKER_MEMORY >> 20} MiB of the "
                 f"{available / 2 ** 30:.1f} GiB available")


def check_machine_limits(cfg) -> None:
    """The environment pool (``train.tasks_per_batch × algo.num_generations`` local workers) fits this machine."""
    check_worker_count(cfg.train.tasks_per_batch * cfg.algo.num_generations, cfg.env,
                       "train.tasks_per_batch × algo.num_generations")


def check_worker_count(workers: int, env, what: str) -> None:
    """``workers`` local environment workers fit this machine; ``env.max_workers`` overrides the derived cap. Ray
    workers run anywhere on a cluster and are not capped here."""
    if env.pool != "process":
        return
    cap, why = (env.max_workers, "env.max_workers") if env.max_workers is not None else worker_cap()
    if not 1 <= workers <= cap:
        raise _error(f"{what} = {workers} environment workers; this machine's cap is {cap} ({why}): lower it, or "
                     f"set env.max_workers={workers} if the machine can take it")
    check_process_limit(workers, what)


def worker_tasks() -> int:
    """Processes and threads one environment worker holds: its Python process (4 threads) and a ScienceWorld JVM
    (about 13 threads plus garbage-collector threads that grow with the cores), with room to spare."""
    return 24 + (os.cpu_count() or 1)


def check_process_limit(workers: int, what: str) -> None:
    """``workers`` environment workers fit under the process limit (``ulimit -u``, which counts every thread of the
    user): refused before any is forked, since a fork past it fails half-way with ``BlockingIOError``."""
    import resource

    import psutil

    limit = resource.getrlimit(resource.RLIMIT_NPROC)[0]
    if limit == resource.RLIM_INFINITY:
        return
    uid = os.getuid()
    used = 0
    for proc in psutil.process_iter(["uids", "num_threads"]):
        if proc.info["uids"] is not None and proc.info["uids"].real == uid:
            used += proc.info["num_threads"] or 0
    needed = workers * worker_tasks()
    if used + needed > limit:
        raise _error(f"{what} = {workers} environment workers need about {needed} processes and threads, but the "
                     f"process limit (ulimit -u) is {limit} with {used} in use: lower it, or raise the limit")


def _error(message: str) -> ConfigError:
    return ConfigError(message)
