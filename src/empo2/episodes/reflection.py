"""Reflection: when an episode ends the policy writes one tip about it, and the memory records which tips the
episode used (the paper's non-parametric update of the memory buffer M). Memory operations are computed per rank and
applied in global order (:mod:`empo2.parallel.distributed`), so every rank's copy of the memory stays the same.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, replace

from empo2.agent.prompts import chat_prompt_ids
from empo2.agent.reflection_prompt import memory_entry, parse_tip, reflection_messages
from empo2.algo.modes import MEMORY_MODES
from empo2.config.sections import MemoryConfig
from empo2.episodes.episode import Episode, namespace_of
from empo2.episodes.rollout import RolloutContext, generate, row_seeds
from empo2.policy.sampling import Sampling


def tip_writers(episodes: list[Episode], memory_cfg: MemoryConfig) -> list[Episode]:
    """The training episodes that write a tip: the memory-mode rollouts, and the on-policy ones as well under
    ``memory.reflect_in_on_mode``."""
    return [ep for ep in episodes if ep.mode in MEMORY_MODES or memory_cfg.reflect_in_on_mode]


def reflect(ctx: RolloutContext, episodes: list[Episode], writers: list[Episode],
            seed: int | None = None) -> list[Episode]:
    """The memory step after ``episodes`` end: each of ``writers`` (a subset of ``episodes``; failed or empty ones
    are skipped) writes one tip (one batched generation; per-row streams from ``seed`` where set), and every episode
    updates the count, recency and utility of the tips it used.

    Returns ``episodes`` as new values that note the tip each wrote or had rejected (the given ones stay as they
    were), and moves ``ctx``'s memory clock to the step the operations were applied at."""
    uses, writers = memory_plan(episodes, writers)
    return land_memory_ops(ctx, episodes, memory_ops(ctx, uses, writers, write_tips(ctx, writers, seed)))


def land_memory_ops(ctx: RolloutContext, episodes: list[Episode], ops: tuple[list, list]) -> list[Episode]:
    """Apply ``ops`` (:func:`write_memory_ops`), move ``ctx``'s memory clock to the step they were applied at, and
    return ``episodes`` as new values noting their tips."""
    writes = write_memory_ops(ctx, episodes, ops)
    ctx.step_counter = writes.step
    return writes.noted_on(episodes)


def memory_plan(episodes: list[Episode], writers: list[Episode]) -> tuple[list, list[Episode]]:
    """What the finished ``episodes`` will do to memory: ``uses``, as ``((group, member), (tip ids, score))`` pairs
    in episode order, and the ``writers`` that can write a tip (those that ran and took a step). An expert member
    (LUFFY's gold path) credits no tip: its prompts show tips, but its actions are the gold path's, whatever they
    said."""
    uses = [((ep.group, ep.member), (used, ep.score)) for ep in episodes
            if not ep.failed and not ep.expert and (used := sorted({tid for s in ep.steps for tid in s.tip_ids}))]
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


@dataclass(frozen=True)
class MemoryWrites:
    """What one memory step did to this rank's episodes, by (group, member): the tip each wrote (its stored text)
    or the reason its tip was rejected; and ``step``, the memory clock the operations were applied at (data
    parallel: the largest of the ranks' clocks, the count a one-rank run would have)."""

    written: dict[tuple[int, int], str]
    rejected: dict[tuple[int, int], str]
    step: int

    def noted_on(self, episodes: list[Episode]) -> list[Episode]:
        """``episodes`` as new values with ``tip_written`` / ``tip_rejected`` set where this step names them."""
        def noted(ep: Episode) -> Episode:
            key = (ep.group, ep.member)
            if key in self.written:
                return replace(ep, tip_written=self.written[key])
            return replace(ep, tip_rejected=self.rejected[key]) if key in self.rejected else ep
        return [noted(ep) for ep in episodes]


def write_memory_ops(ctx: RolloutContext, episodes: list[Episode], ops: tuple[list, list]) -> MemoryWrites:
    """Apply the operations (``memory_ops``) to memory; returns what became of the tips of ``episodes`` (this
    rank's), and leaves the episodes and ``ctx`` as they were."""
    uses, adds = ops
    step = ctx.step_counter
    if ctx.memory_sync is not None:  # data parallel: every rank applies all ranks' operations, in global order
        uses, adds, step = ctx.memory_sync(uses, adds, step)
    mine = {(ep.group, ep.member) for ep in episodes}
    written, rejected = {}, {}
    for (key, op), result in zip(adds, apply_memory_ops(ctx.memory, uses, adds, step)):
        if key in mine and result.id is not None:
            written[key] = op["tip_text"]
        elif key in mine:
            rejected[key] = result.reason
    return MemoryWrites(written, rejected, step)


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
        prompts.append(chat_prompt_ids(ctx.tokenizer, messages))
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
