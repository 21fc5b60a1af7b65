"""Multi-turn batched rollouts: many episodes step together, one batched generation per step.

A trajectory is plain data (:class:`Episode` of :class:`Step`) that the update, the metrics and the sample writer read.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from empo2.agent.prompts import PromptParts, parse_action, render_prompt_ids
from empo2.agent.reflection import parse_tip, reflection_messages
from empo2.policy.generate import generate_batch

MEMORY_MODES = ("on_tips", "off_tips")


@dataclass
class Step:
    prompt_ids: list[int]
    """The prompt the action was sampled with (with tips in memory modes)."""
    train_prompt_ids: list[int]
    """The prompt the update trains on: tip-free for ``off_tips``, else the same as ``prompt_ids``."""
    response_ids: list[int]
    logp_old: list[float]
    """Behaviour log-probs of ``response_ids`` under ``prompt_ids``."""
    raw_action: str
    action: str
    observation: str
    reward: float
    state_text: str
    """Task + the observation the action answered: the retrieval query and the key of tips about this state."""
    state_embedding: np.ndarray | None = None
    """Embedding of ``state_text`` where one was computed (memory rollouts embed every state to retrieve)."""
    tip_ids: list[int] = field(default_factory=list)
    tips: list[str] = field(default_factory=list)
    intrinsic: float = 0.0


@dataclass
class Episode:
    task: str
    variation: int
    group: int
    mode: str
    task_description: str = ""
    steps: list[Step] = field(default_factory=list)
    score: float = 0.0
    success: bool = False
    done: bool = False
    failed: bool = False
    error: str = ""
    tip_written: str | None = None
    tip_rejected: str | None = None

    @property
    def extrinsic_return(self) -> float:
        return float(sum(s.reward for s in self.steps))

    @property
    def intrinsic_return(self) -> float:
        return float(sum(s.intrinsic for s in self.steps))

    def summary(self) -> dict[str, Any]:
        return {"task": self.task, "variation": self.variation, "mode": self.mode, "score": self.score,
                "success": self.success, "steps": len(self.steps), "failed": self.failed}


def namespace_of(task: str, variation: int, scheme: str) -> str:
    return f"{task}#{variation}" if scheme == "task_variation" else task


def state_text(task_description: str, observation: str) -> str:
    """The retrieval/novelty key of a state: task + current observation (never a fixed instruction prefix)."""
    return f"{task_description.strip()}\n{observation.strip()}"[:1000]


def _hints(info: dict[str, Any]) -> str:
    parts = []
    if info.get("focus_targets"):
        parts.append("Objects you may focus on: " + ", ".join(info["focus_targets"]))
    if info.get("inventory"):
        parts.append(str(info["inventory"]).strip()[:200])
    return "\n".join(parts)


@dataclass
class RolloutContext:
    """What a rollout needs; built once by the trainer."""

    model: Any
    tokenizer: Any
    pool: Any
    embedder: Any
    memory: Any | None
    env_name: str
    policy_cfg: Any
    memory_cfg: Any
    step_counter: int = 0


def run_episodes(
    ctx: RolloutContext,
    specs: list[tuple[str, int, int, str]],
    temperature: float,
    greedy: bool = False,
    reflect: bool | None = None,
    progress=None,
) -> tuple[list[Episode], dict[str, float]]:
    """Play ``specs`` = [(task, variation, group, mode)] to the end in parallel; pool size must be ≥ len(specs).

    In memory modes each step retrieves tips for the current state. At the end each episode reflects into memory when
    ``reflect`` (default: memory mode, or ``memory.reflect_in_on_mode``). Returns episodes and timing/token stats.
    """
    pcfg, mcfg = ctx.policy_cfg, ctx.memory_cfg
    stats = {"gen_time": 0.0, "env_time": 0.0, "memory_time": 0.0, "gen_tokens": 0, "prompt_tokens": 0,
             "long_prompts": 0}
    episodes = [Episode(task=t, variation=v, group=g, mode=m) for t, v, g, m in specs]
    parts: dict[int, PromptParts] = {}
    t0 = time.perf_counter()
    resets = ctx.pool.reset([(i, ep.task, ep.variation) for i, ep in enumerate(episodes)])
    for i, ep in enumerate(episodes):
        res = resets[i]
        if not isinstance(res, tuple):
            ep.failed, ep.done, ep.error = True, True, str(getattr(res, "error", res))
            continue
        obs, info = res
        ep.task_description = info.get("task_description") or ctx.pool.call(i, "task_description")
        demo = ctx.pool.call(i, "demonstration", ep.task, ep.variation, pcfg.few_shot) if pcfg.few_shot > 0 else ""
        parts[i] = PromptParts(env=ctx.env_name, task=ep.task_description, observation=obs, initial_observation=obs,
                               demonstration=demo,
                               hints=_hints(info))
    stats["env_time"] += time.perf_counter() - t0

    while True:
        active = [i for i, ep in enumerate(episodes) if not ep.done]
        if not active:
            break
        t0 = time.perf_counter()
        keys = [state_text(episodes[i].task_description, parts[i].observation) for i in active]
        tips_by_row: list[list[Any]] = [[] for _ in active]
        embs_by_row: list[np.ndarray | None] = [None] * len(active)
        mem_rows = [r for r, i in enumerate(active) if episodes[i].mode in MEMORY_MODES]
        if ctx.memory is not None and mem_rows and mcfg.top_k_tips > 0:
            query_embs = ctx.embedder.encode([keys[r] for r in mem_rows])  # only memory rollouts need the embedding
            for r, emb in zip(mem_rows, query_embs):
                embs_by_row[r] = emb
            found = ctx.memory.retrieve(
                [namespace_of(episodes[active[r]].task, episodes[active[r]].variation, mcfg.namespace) for r in mem_rows],
                query_embs, k=mcfg.top_k_tips, threshold=mcfg.similarity_threshold,
                score_weight=mcfg.rerank_score_weight, utility_weight=mcfg.rerank_utility_weight,
            )
            for r, tips in zip(mem_rows, found):
                tips_by_row[r] = tips
        stats["memory_time"] += time.perf_counter() - t0

        prompts, train_prompts = [], []
        for r, i in enumerate(active):
            p = parts[i]
            p.tips = tuple(t.text for t in tips_by_row[r])
            ids = render_prompt_ids(ctx.tokenizer, p, pcfg.history_window, pcfg.max_prompt_length)
            stats["long_prompts"] += len(ids) > pcfg.max_prompt_length
            prompts.append(ids)
            if episodes[i].mode == "off_tips" and p.tips:
                train_prompts.append(render_prompt_ids(ctx.tokenizer, p.without_tips(), pcfg.history_window,
                                                       pcfg.max_prompt_length))
            else:
                train_prompts.append(ids)
        t0 = time.perf_counter()
        gens = generate_batch(ctx.model, ctx.tokenizer, prompts, pcfg.max_completion_length,
                              temperature=temperature, top_p=pcfg.top_p, greedy=greedy)
        stats["gen_time"] += time.perf_counter() - t0
        stats["gen_tokens"] += sum(len(g.ids) for g in gens)
        stats["prompt_tokens"] += sum(len(p) for p in prompts)

        t0 = time.perf_counter()
        raw_actions = {i: parse_action(g.text) for i, g in zip(active, gens)}
        results = ctx.pool.step(raw_actions)
        stats["env_time"] += time.perf_counter() - t0
        ctx.step_counter += 1
        for r, (i, gen) in enumerate(zip(active, gens)):
            ep, res = episodes[i], results[i]
            info = res.info
            tips = tips_by_row[r]
            ep.steps.append(Step(
                prompt_ids=prompts[r], train_prompt_ids=train_prompts[r], response_ids=gen.ids,
                logp_old=gen.logprobs, raw_action=raw_actions[i], action=info.get("action", raw_actions[i]),
                observation=res.observation, reward=float(res.reward), state_text=keys[r],
                state_embedding=embs_by_row[r],
                tip_ids=[t.id for t in tips], tips=[t.text for t in tips],
            ))
            if info.get("failed"):
                ep.failed, ep.error = True, str(info.get("error", "environment failure"))
            ep.score = float(info.get("score", ep.score))
            ep.success = bool(info.get("success", False))
            parts[i].history.append((ep.steps[-1].action, res.observation))
            parts[i].observation = res.observation
            if info.get("inventory") or info.get("focus_targets"):
                parts[i].hints = _hints(info)
            if res.done:
                ep.done = True
        if progress is not None:
            progress(sum(ep.done for ep in episodes), len(episodes))

    if ctx.memory is not None:
        t0 = time.perf_counter()
        _reflect_and_update(ctx, episodes, reflect)
        stats["memory_time"] += time.perf_counter() - t0
    return episodes, stats


def _reflect_and_update(ctx: RolloutContext, episodes: list[Episode], reflect: bool | None) -> None:
    """Each finished episode writes one tip (batched generation) and updates the utility of the tips it used."""
    mcfg, pcfg = ctx.memory_cfg, ctx.policy_cfg
    for ep in episodes:
        used = sorted({tid for s in ep.steps for tid in s.tip_ids})
        if used:
            ctx.memory.record_use(used, ctx.step_counter)
            ctx.memory.update_utility(used, ep.score)
    writers = [ep for ep in episodes if not ep.failed and ep.steps and (
        reflect if reflect is not None else (ep.mode in MEMORY_MODES or mcfg.reflect_in_on_mode))]
    if not writers:
        return
    prompts = []
    for ep in writers:
        messages = reflection_messages(ep.task_description, [(s.action, s.observation) for s in ep.steps], ep.score,
                                       max_words=mcfg.max_tip_words)
        ids = ctx.tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=True, return_dict=False)
        prompts.append(list(ids["input_ids"] if hasattr(ids, "keys") else ids))
    gens = generate_batch(ctx.model, ctx.tokenizer, prompts, pcfg.reflection_max_tokens, temperature=0.7,
                          top_p=pcfg.top_p)
    tips = [parse_tip(g.text) for g in gens]
    # The key of a tip is the state it is about: the episode's first state (task + initial observation), which is
    # what later episodes of the same task see when they start and retrieve.
    first = [ep.steps[0] for ep in writers]
    missing = [s for s in first if s.state_embedding is None]
    for s, emb in zip(missing, ctx.embedder.encode([s.state_text for s in missing])):
        s.state_embedding = emb
    key_embs = [s.state_embedding for s in first]
    tip_embs = ctx.embedder.encode([t or " " for t in tips])
    for ep, tip, key, temb in zip(writers, tips, key_embs, tip_embs):
        result = ctx.memory.add(
            namespace_of(ep.task, ep.variation, mcfg.namespace), tip, key, key_text=ep.steps[0].state_text,
            score=ep.score, step=ctx.step_counter,
            context_texts=[ep.task_description] + [s.observation for s in ep.steps[-3:]], tip_embedding=temb,
        )
        if result.id is not None:
            ep.tip_written = tip
        else:
            ep.tip_rejected = result.reason


def episode_record(ep: Episode, tokenizer, max_steps: int = 50) -> dict[str, Any]:
    """A JSON-able sample of an episode for ``trajectories.jsonl``: prompts as text, actions, rewards, tips."""
    return {
        **ep.summary(), "task_description": ep.task_description, "tip_written": ep.tip_written,
        "tip_rejected": ep.tip_rejected, "error": ep.error,
        "steps": [{
            "prompt": tokenizer.decode(s.prompt_ids), "raw_action": s.raw_action, "action": s.action,
            "observation": s.observation, "reward": s.reward, "intrinsic": s.intrinsic, "tips": s.tips,
        } for s in ep.steps[:max_steps]],
    }


def novelty_rewards(novelty, embedder, episodes: list[Episode]) -> None:
    """Fill ``Step.intrinsic`` with the novelty reward of the state each step reached (1/n for the n-th visit)."""
    steps = [s for ep in episodes for s in ep.steps]
    if not steps:
        return
    texts = [state_text(ep.task_description, s.observation) for ep in episodes for s in ep.steps]
    rewards = novelty.reward(embedder.encode(texts))
    for s, r in zip(steps, np.asarray(rewards, dtype=np.float64)):
        s.intrinsic = float(r)
