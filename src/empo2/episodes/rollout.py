"""The play loop: many episodes step together, one batched generation per step (the paper's rollouts, with
tips retrieved in the memory modes). The episodes are plain data (:mod:`empo2.episodes.episode`); what an episode writes
to memory when it ends is :mod:`empo2.episodes.reflection`.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from contextlib import contextmanager
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import torch

from empo2.agent.prompts import PromptParts, append_prompt_ids, hints_text, parse_action, render_prompt_ids
from empo2.algo.modes import MEMORY_MODES, training_prompt_has_tips
from empo2.config.sections import MemoryConfig, PolicyConfig
from empo2.envs.base import state_of
from empo2.envs.pool import WorkerError
from empo2.episodes.episode import Episode, Step, namespace_of
from empo2.episodes.protocols import Embedder, EnvWorkers, MemorySync, TipStore, Tokenizer
from empo2.policy.backend import RolloutBackend
from empo2.policy.generate import Generation, generate_batch
from empo2.policy.prefix import DEFAULT_OPTIONS, ComputeOptions, HeadMemo
from empo2.policy.sampling import Sampling
from empo2.policy.seeded import row_seed


@dataclass
class RolloutContext:
    """What a rollout needs; built once by the trainer."""

    model: torch.nn.Module | None
    """The policy (``None`` for a scripted action source)."""
    tokenizer: Tokenizer | None
    pool: EnvWorkers
    embedder: Embedder | None
    memory: TipStore | None
    env_name: str
    policy_cfg: PolicyConfig
    memory_cfg: MemoryConfig
    step_counter: int = 0
    """The memory clock: the waves of environment steps (one per batched step of a rollout's active rows) the run has
    taken; tips record it as their creation/use time. A rollout counts its waves (``step_waves`` in its stats) and
    leaves the clock alone: its caller advances it, and a reflection sets it to the step the memory operations were
    applied at. Checkpointed."""
    backend: RolloutBackend | None = None
    """A rollout backend (e.g. vLLM), called with the protocol's keywords; ``None`` = generate with ``model`` (HF)."""
    memory_sync: MemorySync | None = None
    """Data-parallel hook: every rank's memory operations in global order (see :mod:`empo2.parallel.distributed`);
    ``None`` = apply this process's operations directly."""
    demonstrations: dict = field(default_factory=dict)
    """(task, variation, shots) → demonstration text, fetched once for all workers (a ScienceWorld worker plays the
    gold trajectories to write one, and the G rollouts of a group ask for the same one)."""
    compute: ComputeOptions = DEFAULT_OPTIONS
    """How ``model`` generates: prefix sharing, head reuse, compute dtype (``empo2.policy.prefix.compute_options``)."""
    heads: HeadMemo = field(default_factory=HeadMemo)
    """The prompt heads the last generation call of the rollout in progress computed, for its next call."""


ActionSource = Callable[[RolloutContext, list[int], list[Episode], list[list[int]]], list[Generation]]
"""``(ctx, worker index per active row, episode per active row, prompt ids per row) -> one Generation per row``."""


def model_actions(sampling: Sampling, seed: int | None = None) -> ActionSource:
    """The policy as the action source: one batched generation for all active rows (each row from its own stream
    seeded by (``seed``, group, member, turn) where ``seed`` is set)."""

    def act(ctx: RolloutContext, active: list[int], episodes: list[Episode],
            prompts: list[list[int]]) -> list[Generation]:
        return generate(ctx, prompts, sampling, row_seeds(seed, episodes))

    return act


def run_episodes(
    ctx: RolloutContext,
    specs: list[tuple[str, int, int, str]],
    sampling: Sampling | None = None,
    progress=None,
    actions: ActionSource | None = None,
    on_step: Callable[[Episode], None] | None = None,
    seed: int | None = None,
) -> tuple[list[Episode], dict[str, float]]:
    """Play ``specs`` = [(task, variation, group, mode)] to the end in parallel; pool size must be ≥ len(specs).
    The policy acts with ``sampling`` (default: ``ctx.policy_cfg``'s rollout sampling), unless ``actions`` is given.

    Each step: retrieve tips (memory modes) → render prompts → generate (or ask ``actions``) → step the environments.
    ``on_step(episode)`` is called after each step (``empo2 play`` prints with it). The end-of-episode reflection is
    the caller's next step (:func:`empo2.episodes.reflection.reflect`). Returns the episodes and timing/token stats,
    with ``step_waves``, the steps by which the caller advances ``ctx.step_counter``.
    """
    actions = actions or model_actions(sampling or Sampling.rollout(ctx.policy_cfg), seed)
    stats = {"gen_time": 0.0, "env_time": 0.0, "memory_time": 0.0, "gen_tokens": 0, "prompt_tokens": 0,
             "long_prompts": 0, "step_waves": 0}
    members: dict[int, int] = {}
    episodes = []
    for t, v, g, m in specs:
        members[g] = members.get(g, -1) + 1
        episodes.append(Episode(task=t, variation=v, group=g, mode=m, member=members[g]))
    with timed(stats, "env_time"):
        parts = _reset(ctx, episodes)
    with ctx.heads.reuse(ctx.compute):  # weights are fixed during a rollout: last step's prompt heads stay valid
        _play(ctx, episodes, parts, actions, stats, progress, on_step)
    return episodes, stats


def _play(ctx: RolloutContext, episodes: list[Episode], parts: dict[int, PromptParts], actions: ActionSource,
          stats: dict[str, float], progress, on_step) -> None:
    """Step every unfinished episode until all are done."""
    while active := [i for i, ep in enumerate(episodes) if not ep.done]:
        with timed(stats, "memory_time"):
            keys, tips, embs = _retrieve(ctx, episodes, parts, active)
        prompts, train_prompts = _render(ctx, episodes, parts, active, tips, stats)
        with timed(stats, "gen_time"):
            gens = actions(ctx, active, [episodes[i] for i in active], prompts)
        stats["gen_tokens"] += sum(len(g.ids) for g in gens)
        stats["prompt_tokens"] += sum(len(p) for p in prompts)
        with timed(stats, "env_time"):
            _step(ctx, episodes, parts, active, gens, prompts, train_prompts, keys, tips, embs)
        stats["step_waves"] += 1
        for i in active:
            if on_step is not None:
                on_step(episodes[i])
        if progress is not None:
            progress(sum(ep.done for ep in episodes), len(episodes))


@contextmanager
def timed(stats: dict[str, float], key: str):
    """Add the seconds the block takes to ``stats[key]``."""
    t0 = time.perf_counter()
    try:
        yield
    finally:
        stats[key] += time.perf_counter() - t0


def _reset(ctx: RolloutContext, episodes: list[Episode]) -> dict[int, PromptParts]:
    """Reset every episode's worker; fetch its task description and demonstration. Failed resets end the episode."""
    parts: dict[int, PromptParts] = {}
    resets = ctx.pool.reset([(i, ep.task, ep.variation) for i, ep in enumerate(episodes)])
    for i, ep in enumerate(episodes):
        res = resets[i]
        if not isinstance(res, tuple):
            ep.failed, ep.done, ep.error = True, True, str(getattr(res, "error", res))
            continue
        obs, info = res
        ep.task_description = info.get("task_description") or call_worker(ctx.pool, ep, i, "task_description")
        demo = _demonstration(ctx, ep, i)
        if ep.failed:
            continue
        parts[i] = PromptParts(env=ctx.env_name, task=ep.task_description, observation=obs, initial_observation=obs,
                               demonstration=demo, hints=hints_text(info))
        ep.initial_observation, ep.final_state = obs, state_of(obs, info)  # the state the first action answers
    return parts


def _demonstration(ctx: RolloutContext, ep: Episode, i: int) -> str:
    """The group's demonstration: asked of worker ``i`` the first time only (see ``RolloutContext.demonstrations``)."""
    shots = ctx.policy_cfg.few_shot
    key = (ep.task, ep.variation, shots)
    if shots > 0 and key not in ctx.demonstrations:
        demo = call_worker(ctx.pool, ep, i, "demonstration", ep.task, ep.variation, shots)
        if ep.failed:
            return ""
        ctx.demonstrations[key] = demo
    return ctx.demonstrations.get(key, "")


def _retrieve(ctx: RolloutContext, episodes: list[Episode], parts: dict[int, PromptParts], active: list[int]):
    """State keys of the active rows; for memory-mode rows also their embeddings and the retrieved tips."""
    mcfg = ctx.memory_cfg
    keys = [episodes[i].final_state for i in active]  # the state each row's next action answers
    tips: list[list[Any]] = [[] for _ in active]
    embs: list[np.ndarray | None] = [None] * len(active)
    rows = [r for r, i in enumerate(active) if episodes[i].mode in MEMORY_MODES]
    if ctx.memory is None or not rows or mcfg.top_k_tips <= 0:
        return keys, tips, embs
    query = ctx.embedder.encode([keys[r] for r in rows])  # only memory rollouts need the embedding
    found = ctx.memory.retrieve(
        [namespace_of(episodes[active[r]].task, episodes[active[r]].variation, mcfg.namespace) for r in rows],
        query, k=mcfg.top_k_tips, threshold=mcfg.similarity_threshold,
        score_weight=mcfg.rerank_score_weight, utility_weight=mcfg.rerank_utility_weight,
    )
    for r, emb, row_tips in zip(rows, query, found):
        embs[r], tips[r] = emb, row_tips
    return keys, tips, embs


def _render(ctx, episodes, parts, active, tips, stats) -> tuple[list[list[int]], list[list[int]]]:
    """Rollout prompts (with tips in memory modes) and training prompts (tip-free for ``off_tips``), from parts."""
    pcfg = ctx.policy_cfg
    if ctx.tokenizer is None:  # a scripted action source (``empo2 play --policy gold``) needs no prompts
        return [[] for _ in active], [[] for _ in active]
    prompts, train_prompts = [], []
    for r, i in enumerate(active):
        p, last = parts[i], episodes[i].steps[-1] if episodes[i].steps else None
        p.tips = tuple(t.text for t in tips[r])
        ids = _prompt_ids(ctx, p, last and (last.prompt_ids, last.response_ids))
        stats["long_prompts"] += len(ids) > pcfg.max_prompt_length
        prompts.append(ids)
        if not training_prompt_has_tips(episodes[i].mode) and (p.tips or last and last.train_prompt_ids != last.prompt_ids):
            ids = _prompt_ids(ctx, p.without_tips(), last and (last.train_prompt_ids, last.response_ids))
        train_prompts.append(ids)
    return prompts, train_prompts


def _prompt_ids(ctx, parts: PromptParts, previous: tuple[list[int], list[int]] | None) -> list[int]:
    """One step's prompt in the run's ``policy.prompt_layout``; ``previous``: the last step's (prompt, response)."""
    pcfg = ctx.policy_cfg
    if pcfg.prompt_layout == "append":
        return append_prompt_ids(ctx.tokenizer, parts, pcfg.history_window, pcfg.max_prompt_length, previous)
    return render_prompt_ids(ctx.tokenizer, parts, pcfg.history_window, pcfg.max_prompt_length)


def _step(ctx, episodes, parts, active, gens, prompts, train_prompts, keys, tips, embs) -> None:
    """Send every active row's action to its worker at once; record the steps and advance the prompt parts."""
    raw_actions = {i: parse_action(g.text) for i, g in zip(active, gens)}
    results = ctx.pool.step(raw_actions)
    for r, (i, gen) in enumerate(zip(active, gens)):
        ep, res = episodes[i], results[i]
        info = res.info
        ep.steps.append(Step(
            prompt_ids=prompts[r], train_prompt_ids=train_prompts[r], response_ids=gen.ids,
            logp_old=gen.logprobs, raw_action=raw_actions[i], action=info.get("action", raw_actions[i]),
            observation=res.observation, reward=float(res.reward), state_text=keys[r], state_embedding=embs[r],
            tip_ids=[t.id for t in tips[r]], tips=[t.text for t in tips[r]], accepted=bool(info.get("accepted", True)),
            commands=list(info.get("commands", ())),
        ))
        if info.get("failed"):
            ep.failed, ep.error = True, str(info.get("error", "environment failure"))
        ep.score = float(info.get("score", ep.score))
        ep.success = bool(info.get("success", False))
        parts[i].history.append((ep.steps[-1].action, res.observation))
        parts[i].observation = res.observation
        ep.final_state = state_of(res.observation, info)
        if info.get("inventory") or info.get("focus_targets"):
            parts[i].hints = hints_text(info)
        ep.done = ep.done or res.done


def call_worker(pool, ep: Episode, i: int, method: str, *args: Any) -> Any:
    """``pool.call(i, method, *args)`` for episode ``ep``; a worker that crashed (the pool has restarted it) ends the
    episode as failed, like a crash during reset or step, and gives ``None``."""
    if ep.failed:
        return None
    try:
        return pool.call(i, method, *args)
    except WorkerError as exc:
        ep.failed, ep.done, ep.error = True, True, str(exc)
        return None


def generate(ctx: RolloutContext, prompts: list[list[int]], sampling: Sampling,
             row_seeds: list[int] | None = None) -> list[Generation]:
    """One batched generation with the rollout backend, or with the model itself (HF)."""
    if ctx.backend is not None:
        return ctx.backend.generate(prompts, sampling, row_seeds)
    return generate_batch(ctx.model, ctx.tokenizer, prompts, sampling, row_seeds, options=ctx.compute,
                          heads=ctx.heads)


def row_seeds(seed: int | None, episodes: list[Episode], turn: int | None = None) -> list[int] | None:
    """Each row's sampling seed from (``seed``, group, member, turn); ``None`` when unseeded (``seed`` ``None``)."""
    return None if seed is None else [
        row_seed(seed, ep.group, ep.member, len(ep.steps) if turn is None else turn) for ep in episodes]
