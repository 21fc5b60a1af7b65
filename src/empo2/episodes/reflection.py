"""Reflection: when an episode ends the policy writes one tip about it, and the memory records which tips the
episode used (the paper's non-parametric update of the memory buffer M). Memory operations are computed per rank and
applied in global order (:mod:`empo2.parallel.distributed`), so every rank's copy of the memory stays the same.
"""

from __future__ import annotations

from collections.abc import Callable

from empo2.agent.reflection import memory_entry, parse_tip, reflection_messages
from empo2.algo.empo2 import MEMORY_MODES
from empo2.config_sections import MemoryConfig
from empo2.episodes.episode import Episode, namespace_of
from empo2.episodes.rollout import RolloutContext, generate, row_seeds
from empo2.policy.sampling import Sampling


def tip_writers(episodes: list[Episode], memory_cfg: MemoryConfig) -> list[Episode]:
    """The training episodes that write a tip: the memory-mode rollouts, and the on-policy ones as well under
    ``memory.reflect_in_on_mode``."""
    return [ep for ep in episodes if ep.mode in MEMORY_MODES or memory_cfg.reflect_in_on_mode]


def reflect(ctx: RolloutContext, episodes: list[Episode], writers: list[Episode], seed: int | None = None) -> None:
    """The memory step after ``episodes`` end: each of ``writers`` (a subset of ``episodes``; failed or empty ones
    are skipped) writes one tip (one batched generation; per-row streams from ``seed`` where set), and every episode
    updates the count, recency and utility of the tips it used."""
    uses, writers = memory_plan(episodes, writers)
    write_memory_ops(ctx, episodes, memory_ops(ctx, uses, writers, write_tips(ctx, writers, seed)))


def memory_plan(episodes: list[Episode], writers: list[Episode]) -> tuple[list, list[Episode]]:
    """What the finished ``episodes`` will do to memory: ``uses``, as ``((group, member), (tip ids, score))`` pairs
    in episode order, and the ``writers`` that can write a tip (those that ran and took a step)."""
    uses = [((ep.group, ep.member), (used, ep.score)) for ep in episodes
            if not ep.failed and (used := sorted({tid for s in ep.steps for tid in s.tip_ids}))]
    return uses, [ep for ep in writers if not ep.failed and ep.steps]


def memory_ops(ctx: RolloutContext, uses: list, writers: list[Episode], tips: list[str]) -> tuple[list, list]:
    """``uses`` and one add operation per writer (its tip, key and embeddings), as ``((group, member), op)`` pairs."""
    if not writers:
        return uses, []
    # A tip's key is the state it is about (its last action's: where it ended or went wrong), so a task's keys differ.
    last = [ep.steps[-1] for ep in writers]
    missing = [k for k, s in enumerate(last) if s.state_embedding is None]  # an on-policy step retrieved nothing
    computed = dict(zip(missing, ctx.embedder.encode([last[k].state_text for k in missing]))) if missing else {}
    key_embs = [computed.get(k, s.state_embedding) for k, s in enumerate(last)]
    tip_embs = ctx.embedder.encode([t or " " for t in tips])  # of the tip alone: what de-duplication compares
    return uses, [((ep.group, ep.member), {
        "namespace": namespace_of(ep.task, ep.variation, ctx.memory_cfg.namespace), "score": ep.score,
        "tip_text": memory_entry(tip, key.action, ep.score, ctx.memory_cfg.entry_format),
        "key_embedding": kemb, "key_text": key.state_text,
        "context_texts": [ep.task_description] + [s.observation for s in ep.steps[-3:]], "tip_embedding": temb,
    }) for ep, tip, key, kemb, temb in zip(writers, tips, last, key_embs, tip_embs)]


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


def reflection_job(ctx: RolloutContext, episodes: list[Episode], seed: int | None = None) -> Callable[..., list[str]]:
    """Everything a reflection needs from ``ctx`` now (prompts, per-row seeds), as a call that generates the tips
    with the given ``generate`` (:func:`~empo2.episodes.rollout.generate`'s signature, minus ``ctx``)."""
    if not episodes:
        return lambda generate: []
    sampling, prompts = Sampling.reflection(ctx.policy_cfg), reflection_prompts(ctx, episodes)
    seeds = row_seeds(seed, episodes, turn=-1)

    def run(generate) -> list[str]:
        gens = generate(prompts, sampling, seeds)
        return [parse_tip(g.text, max_words=ctx.memory_cfg.max_tip_words) for g in gens]

    return run


def write_tips(ctx: RolloutContext, episodes: list[Episode], seed: int | None = None) -> list[str]:
    """One reflection per episode, in one batched generation (``policy.reflection_temperature``)."""
    return reflection_job(ctx, episodes, seed)(lambda *args: generate(ctx, *args))
