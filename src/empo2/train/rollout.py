"""Multi-turn batched rollouts: many episodes step together, one batched generation per step.

A trajectory is plain data (:class:`Episode` of :class:`Step`) that the update, the metrics and the sample writer read.
"""

from __future__ import annotations

import time
from contextlib import contextmanager
from dataclasses import dataclass, field
from typing import Any, Callable

import numpy as np

from empo2.agent.prompts import PromptParts, hints_text, parse_action, render_prompt_ids
from empo2.agent.reflection import memory_entry, parse_tip, reflection_messages
from empo2.envs.pool import WorkerError
from empo2.policy.backend import RolloutBackend
from empo2.policy.generate import Generation, generate_batch
from empo2.policy.prefix import DEFAULT_OPTIONS, ComputeOptions, HeadMemo
from empo2.policy.seeded import row_seed

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
    """The observation the action answered (:func:`state_text`): the retrieval query and a tip's key."""
    state_observation: str = ""
    """The observation the action answered, verbatim: GiGPO's anchor-state key (``state_text`` is folded and cut)."""
    state_embedding: np.ndarray | None = None
    """Embedding of ``state_text`` where one was computed (memory rollouts embed every state to retrieve)."""
    tip_ids: list[int] = field(default_factory=list)
    tips: list[str] = field(default_factory=list)
    intrinsic: float = 0.0
    accepted: bool = True
    """Whether the environment accepted the action (after correction)."""


@dataclass
class Episode:
    task: str
    variation: int
    group: int
    mode: str
    member: int = 0
    """Index of this rollout within its group: (group, member) orders a batch's episodes across ranks."""
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

    def intrinsic_return(self, aggregation: str = "mean") -> float:
        """The episode's novelty reward: mean over its steps (a long episode is not paid for its length) or sum."""
        values = [s.intrinsic for s in self.steps]
        if not values:
            return 0.0
        return float(np.mean(values) if aggregation == "mean" else np.sum(values))

    @property
    def accepted_rate(self) -> float:
        """Fraction of this episode's actions the environment accepted."""
        return float(np.mean([s.accepted for s in self.steps])) if self.steps else 1.0

    def summary(self) -> dict[str, Any]:
        return {"task": self.task, "variation": self.variation, "mode": self.mode, "score": self.score,
                "success": self.success, "steps": len(self.steps), "failed": self.failed}


def namespace_of(task: str, variation: int, scheme: str) -> str:
    return f"{task}#{variation}" if scheme == "task_variation" else task


def state_text(observation: str) -> str:
    """The key of a state for retrieval, tips and novelty: the observation alone. Memory and novelty are already
    namespaced by task, and a key that also held the task description made every state of a task look alike
    (cosine 0.94–0.99), so retrieval fell back to ranking ties."""
    return " ".join(observation.split())[:1000]


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
    """Environment steps taken so far (all episodes); tips record it as their creation/use time. Checkpointed."""
    sampling_seed: int | None = None
    """When set, each rollout samples from its own stream seeded by (this, group, member, turn)."""
    backend: RolloutBackend | None = None
    """A rollout backend (e.g. vLLM), called with the protocol's keywords; ``None`` = generate with ``model`` (HF)."""
    memory_sync: Any = None
    """Data-parallel hook ``(uses, adds, step) -> (uses, adds, step)``: every rank's memory operations in global
    order (see :mod:`empo2.train.distributed`); ``None`` = apply this process's operations directly."""
    demonstrations: dict = field(default_factory=dict)
    """(task, variation, shots) → demonstration text, fetched once for all workers (a ScienceWorld worker plays the
    gold trajectories to write one: ~1.6 s each on this CPU, and the G rollouts of a group ask for the same one)."""
    compute: ComputeOptions = DEFAULT_OPTIONS
    """How ``model`` generates: prefix sharing, head reuse, compute dtype (``empo2.policy.prefix.compute_options``)."""
    heads: HeadMemo = field(default_factory=HeadMemo)
    """The prompt heads the last generation call of the rollout in progress computed, for its next call."""


ActionSource = Callable[[RolloutContext, list[int], list[Episode], list[list[int]]], list[Generation]]
"""``(ctx, worker index per active row, episode per active row, prompt ids per row) -> one Generation per row``."""


def model_actions(temperature: float, greedy: bool = False) -> ActionSource:
    """The policy as the action source: one batched generation for all active rows."""

    def act(ctx: RolloutContext, active: list[int], episodes: list[Episode], prompts: list[list[int]]) -> list[Generation]:
        pcfg = ctx.policy_cfg
        return _generate(ctx, prompts, pcfg.max_completion_length, temperature=temperature, top_p=pcfg.top_p,
                         top_k=pcfg.top_k, greedy=greedy, row_seeds=_row_seeds(ctx, episodes))

    return act


def run_episodes(
    ctx: RolloutContext,
    specs: list[tuple[str, int, int, str]],
    temperature: float,
    greedy: bool = False,
    reflect: bool | None = None,
    progress=None,
    actions: ActionSource | None = None,
    on_step: Callable[[Episode], None] | None = None,
    write_memory: bool = True,
) -> tuple[list[Episode], dict[str, float]]:
    """Play ``specs`` = [(task, variation, group, mode)] to the end in parallel; pool size must be ≥ len(specs).

    Each step: retrieve tips (memory modes) → render prompts → generate (or ask ``actions``) → step the environments.
    At the end each episode reflects into memory when ``reflect`` (default: memory mode, or
    ``memory.reflect_in_on_mode``), unless ``write_memory`` is false (the caller reflects later, see
    :mod:`empo2.train.overlap`). ``on_step(episode)`` is called after each step (``empo2 play`` prints with it).
    Returns the episodes and timing/token stats.
    """
    actions = actions or model_actions(temperature, greedy)
    stats = {"gen_time": 0.0, "env_time": 0.0, "memory_time": 0.0, "gen_tokens": 0, "prompt_tokens": 0,
             "long_prompts": 0}
    members: dict[int, int] = {}
    episodes = []
    for t, v, g, m in specs:
        members[g] = members.get(g, -1) + 1
        episodes.append(Episode(task=t, variation=v, group=g, mode=m, member=members[g]))
    with _timed(stats, "env_time"):
        parts = _reset(ctx, episodes)
    with ctx.heads.reuse(ctx.compute):  # weights are fixed during a rollout: last step's prompt heads stay valid
        _play(ctx, episodes, parts, actions, stats, progress, on_step)
    if ctx.memory is not None and write_memory:
        with _timed(stats, "memory_time"):
            _reflect_and_update(ctx, episodes, reflect)
    return episodes, stats


def _play(ctx: RolloutContext, episodes: list[Episode], parts: dict[int, PromptParts], actions: ActionSource,
          stats: dict[str, float], progress, on_step) -> None:
    """Step every unfinished episode until all are done."""
    while active := [i for i, ep in enumerate(episodes) if not ep.done]:
        with _timed(stats, "memory_time"):
            keys, tips, embs = _retrieve(ctx, episodes, parts, active)
        prompts, train_prompts = _render(ctx, episodes, parts, active, tips, stats)
        with _timed(stats, "gen_time"):
            gens = actions(ctx, active, [episodes[i] for i in active], prompts)
        stats["gen_tokens"] += sum(len(g.ids) for g in gens)
        stats["prompt_tokens"] += sum(len(p) for p in prompts)
        with _timed(stats, "env_time"):
            _step(ctx, episodes, parts, active, gens, prompts, train_prompts, keys, tips, embs)
        for i in active:
            if on_step is not None:
                on_step(episodes[i])
        if progress is not None:
            progress(sum(ep.done for ep in episodes), len(episodes))


@contextmanager
def _timed(stats: dict[str, float], key: str):
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
    keys = [state_text(parts[i].observation) for i in active]
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
        p = parts[i]
        p.tips = tuple(t.text for t in tips[r])
        ids = render_prompt_ids(ctx.tokenizer, p, pcfg.history_window, pcfg.max_prompt_length)
        stats["long_prompts"] += len(ids) > pcfg.max_prompt_length
        prompts.append(ids)
        if episodes[i].mode == "off_tips" and p.tips:
            ids = render_prompt_ids(ctx.tokenizer, p.without_tips(), pcfg.history_window, pcfg.max_prompt_length)
        train_prompts.append(ids)
    return prompts, train_prompts


def _step(ctx, episodes, parts, active, gens, prompts, train_prompts, keys, tips, embs) -> None:
    """Send every active row's action to its worker at once; record the steps and advance the prompt parts."""
    raw_actions = {i: parse_action(g.text) for i, g in zip(active, gens)}
    results = ctx.pool.step(raw_actions)
    ctx.step_counter += 1
    for r, (i, gen) in enumerate(zip(active, gens)):
        ep, res = episodes[i], results[i]
        info = res.info
        ep.steps.append(Step(
            prompt_ids=prompts[r], train_prompt_ids=train_prompts[r], response_ids=gen.ids,
            logp_old=gen.logprobs, raw_action=raw_actions[i], action=info.get("action", raw_actions[i]),
            observation=res.observation, reward=float(res.reward), state_text=keys[r], state_embedding=embs[r],
            state_observation=parts[i].observation,  # still the observation before this action
            tip_ids=[t.id for t in tips[r]], tips=[t.text for t in tips[r]], accepted=bool(info.get("accepted", True)),
        ))
        if info.get("failed"):
            ep.failed, ep.error = True, str(info.get("error", "environment failure"))
        ep.score = float(info.get("score", ep.score))
        ep.success = bool(info.get("success", False))
        parts[i].history.append((ep.steps[-1].action, res.observation))
        parts[i].observation = res.observation
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


def _generate(ctx: RolloutContext, prompts: list[list[int]], max_new_tokens: int, **kwargs) -> list[Generation]:
    if ctx.backend is not None:
        return ctx.backend.generate(prompts, max_new_tokens, **kwargs)
    return generate_batch(ctx.model, ctx.tokenizer, prompts, max_new_tokens, options=ctx.compute, heads=ctx.heads,
                          **kwargs)


def _row_seeds(ctx: RolloutContext, episodes: list[Episode], turn: int | None = None) -> list[int] | None:
    return None if ctx.sampling_seed is None else [
        row_seed(ctx.sampling_seed, ep.group, ep.member, len(ep.steps) if turn is None else turn) for ep in episodes]


def _reflect_and_update(ctx: RolloutContext, episodes: list[Episode], reflect: bool | None) -> None:
    """Each finished episode writes one tip (batched generation) and updates the utility of the tips it used."""
    uses, writers = memory_plan(ctx, episodes, reflect)
    write_memory_ops(ctx, episodes, memory_ops(ctx, uses, writers, write_tips(ctx, writers)))


def memory_plan(ctx: RolloutContext, episodes: list[Episode], reflect: bool | None) -> tuple[list, list[Episode]]:
    """What the finished ``episodes`` will do to memory: ``uses``, as ``((group, member), (tip ids, score))`` pairs
    in episode order, and the episodes that write a tip (``reflect``; default: memory modes, or
    ``memory.reflect_in_on_mode``)."""
    uses = [((ep.group, ep.member), (used, ep.score)) for ep in episodes
            if not ep.failed and (used := sorted({tid for s in ep.steps for tid in s.tip_ids}))]
    writers = [ep for ep in episodes if not ep.failed and ep.steps and (
        reflect if reflect is not None else (ep.mode in MEMORY_MODES or ctx.memory_cfg.reflect_in_on_mode))]
    return uses, writers


def memory_ops(ctx: RolloutContext, uses: list, writers: list[Episode], tips: list[str]) -> tuple[list, list]:
    """``uses`` and one add operation per writer (its tip, key and embeddings), as ``((group, member), op)`` pairs."""
    if not writers:
        return uses, []
    # A tip's key is the state it is about (its last action's: where it ended or went wrong), so a task's keys differ.
    last = [ep.steps[-1] for ep in writers]
    missing = [s for s in last if s.state_embedding is None]
    for s, emb in zip(missing, ctx.embedder.encode([s.state_text for s in missing])):
        s.state_embedding = emb
    tip_embs = ctx.embedder.encode([t or " " for t in tips])  # of the tip alone: what de-duplication compares
    return uses, [((ep.group, ep.member), {
        "namespace": namespace_of(ep.task, ep.variation, ctx.memory_cfg.namespace), "score": ep.score,
        "tip_text": memory_entry(tip, key.action, ep.score, ctx.memory_cfg.entry_format),
        "key_embedding": key.state_embedding, "key_text": key.state_text,
        "context_texts": [ep.task_description] + [s.observation for s in ep.steps[-3:]], "tip_embedding": temb,
    }) for ep, tip, key, temb in zip(writers, tips, last, tip_embs)]


def write_memory_ops(ctx: RolloutContext, episodes: list[Episode], ops: tuple[list, list]) -> None:
    """Apply the operations (``memory_ops``) to memory and note on each episode the tip it wrote or had rejected."""
    uses, adds = ops
    step = ctx.step_counter
    if ctx.memory_sync is not None:  # data parallel: every rank applies all ranks' operations, in global order
        uses, adds, step = ctx.memory_sync(uses, adds, step)
        ctx.step_counter = step
    mine = {(ep.group, ep.member): ep for ep in episodes}
    for (key, op), result in zip(adds, apply_memory_ops(ctx.memory, uses, adds, step)):
        if key in mine and result.id is not None:
            mine[key].tip_written = op["tip_text"]
        elif key in mine:
            mine[key].tip_rejected = result.reason


def apply_memory_ops(memory, uses: list, adds: list, step: int) -> list:
    """Apply operations in order: every use (count, recency, utility) first, then every reflection.

    Returns the :class:`AddResult` of each reflection.
    """
    for _, (used, score) in uses:
        memory.record_use(used, step)
        memory.update_utility(used, score)
    return [memory.add(op["namespace"], op["tip_text"], op["key_embedding"], key_text=op["key_text"],
                       score=op["score"], step=step, context_texts=op["context_texts"],
                       tip_embedding=op["tip_embedding"]) for _, op in adds]


def reflection_prompts(ctx: RolloutContext, episodes: list[Episode]) -> list[list[int]]:
    """The token ids of each episode's reflection prompt."""
    prompts = []
    for ep in episodes:
        messages = reflection_messages(ep.task_description, [(s.action, s.observation) for s in ep.steps], ep.score,
                                       max_words=ctx.memory_cfg.max_tip_words)
        ids = ctx.tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=True, return_dict=False)
        prompts.append(list(ids["input_ids"] if hasattr(ids, "keys") else ids))
    return prompts


def reflection_job(ctx: RolloutContext, episodes: list[Episode]) -> Callable[..., list[str]]:
    """Everything a reflection needs from ``ctx`` now (prompts, per-row seeds), as a call that generates the tips
    with the given ``generate`` (``_generate``'s signature, minus ``ctx``)."""
    if not episodes:
        return lambda generate: []
    pcfg, prompts, seeds = ctx.policy_cfg, reflection_prompts(ctx, episodes), _row_seeds(ctx, episodes, turn=-1)

    def run(generate) -> list[str]:
        gens = generate(prompts, pcfg.reflection_max_tokens, temperature=pcfg.reflection_temperature,
                        top_p=pcfg.top_p, top_k=pcfg.top_k, row_seeds=seeds)
        return [parse_tip(g.text) for g in gens]

    return run


def write_tips(ctx: RolloutContext, episodes: list[Episode]) -> list[str]:
    """One reflection per episode, in one batched generation (``policy.reflection_temperature``)."""
    return reflection_job(ctx, episodes)(lambda *args, **kwargs: _generate(ctx, *args, **kwargs))


def episode_record(ep: Episode, tokenizer, max_steps: int = 50) -> dict[str, Any]:
    """A JSON-able sample of an episode for ``trajectories.jsonl``: prompts as text, actions, rewards, tips."""
    return {
        **ep.summary(), "task_description": ep.task_description, "tip_written": ep.tip_written,
        "tip_rejected": ep.tip_rejected, "error": ep.error,
        "steps": [{
            "prompt": tokenizer.decode(s.prompt_ids), "raw_action": s.raw_action, "action": s.action,
            "accepted": s.accepted, "observation": s.observation, "reward": s.reward, "intrinsic": s.intrinsic,
            "tips": s.tips,
        } for s in ep.steps[:max_steps]],
    }
