"""Evaluation on held-out variations: without memory by default (the trained policy alone), temperature 0.4.

Writes ``eval/<tag>.json`` and ``eval/<tag>.md`` (a per-task table).
"""

from __future__ import annotations

import json
import os
from collections.abc import Callable
from dataclasses import dataclass
from functools import partial
from pathlib import Path
from typing import Any

import numpy as np

from empo2.episodes.episode import Episode
from empo2.episodes.reflection import reflect as reflect_into_memory
from empo2.episodes.rollout import RolloutContext, run_episodes
from empo2.parallel.distributed import Dist, gather_episodes
from empo2.policy.sampling import Sampling


@dataclass(frozen=True)
class EvalPlan:
    """Which episodes an evaluation plays, and how."""

    split: str
    variations_per_task: int
    """The first this many variations of ``split`` for every task."""
    episodes_per_task: int | None
    """A further cap per task (``None``: every one of those variations)."""
    temperature: float
    batch_size: int
    """Episodes played at once (per rank)."""
    with_memory: bool = False
    """Play ``on_tips`` (retrieve from memory) instead of ``on``."""

    @classmethod
    def from_config(cls, cfg, batch_size: int, with_memory: bool = False) -> EvalPlan:
        """The evaluation a training run does (``env.eval_split``, ``env.eval_variations``,
        ``train.eval_episodes_per_task``, ``policy.eval_temperature``)."""
        return cls(cfg.env.eval_split, cfg.env.eval_variations, cfg.train.eval_episodes_per_task,
                   cfg.policy.eval_temperature, batch_size, with_memory)


def evaluate(ctx: RolloutContext, tasks: list[str], plan: EvalPlan, dist: Dist | None = None,
             progress: Callable[[int, int], None] | None = None, seed: int | None = None) -> dict[str, Any]:
    """Play ``plan`` for every task, ``plan.batch_size`` at a time, and summarise the scores.

    A measurement: with ``plan.with_memory`` the memory is read, never written (no use counts, utilities or tips
    from held-out episodes), so evaluating a run leaves its memory as the run left it.

    With a data-parallel ``dist`` each rank plays its share of every chunk of ``batch_size × ranks`` episodes and the
    result covers all of them. ``progress(done, total)`` hears of finished episodes; ``seed`` (where set) gives each
    row its own sampling stream.
    """
    return summarise(play_split(ctx, tasks, plan, dist=dist, progress=progress, update_memory=False, seed=seed),
                     tasks, plan)


def play_split(ctx: RolloutContext, tasks: list[str], plan: EvalPlan, reflect: bool = False,
               dist: Dist | None = None, progress: Callable[[int, int], None] | None = None,
               update_memory: bool = True, seed: int | None = None) -> list[Episode]:
    """The episodes of :func:`evaluate` (one per task variation, in task order). Where ``ctx`` has a memory and
    ``update_memory`` is on, each chunk's tip uses are recorded and, with ``reflect``, every episode writes a tip;
    off, the memory is read only, and the caller updates it."""
    specs = []
    for task in tasks:
        variations = list(ctx.pool.call(0, "variations", task, plan.split, retries=1))[:plan.variations_per_task]
        if plan.episodes_per_task is not None:
            variations = variations[:plan.episodes_per_task]
        specs += [(task, v, len(specs) + k, "on_tips" if plan.with_memory else "on") for k, v in enumerate(variations)]
    ranks = dist.world_size if dist is not None else 1
    sampling = Sampling.rollout(ctx.policy_cfg, temperature=plan.temperature)
    episodes = []
    step = plan.batch_size * ranks
    for start in range(0, len(specs), step):  # every rank runs as many batches (memory sync)
        chunk = specs[start:start + step]
        overall = None if progress is None else partial(_overall_progress, progress, start, ranks, len(specs))
        eps, stats = run_episodes(ctx, dist.shard(chunk) if ranks > 1 else chunk, sampling, progress=overall, seed=seed)
        ctx.step_counter += stats["step_waves"]  # the memory clock that dates this chunk's tip uses and tips
        if ctx.memory is not None and update_memory:
            eps = reflect_into_memory(ctx, eps, eps if reflect else [], seed)
        episodes += eps
    if ranks > 1:
        episodes = gather_episodes(dist, episodes)
    return episodes


def _overall_progress(progress, before: int, ranks: int, total: int, done: int, _chunk: int) -> None:
    """A chunk's finished episodes (this rank's share of it) as a count over the whole split."""
    progress(min(before + done * ranks, total), total)


def summarise(episodes: list[Episode], tasks: list[str], plan: EvalPlan) -> dict[str, Any]:
    """Per-task and overall mean score / success rate of played episodes (the result :func:`evaluate` returns)."""
    per_task = {}
    for task in tasks:
        mine = [ep for ep in episodes if ep.task == task]
        if mine:
            per_task[task] = {"episodes": len(mine), "score_mean": float(np.mean([e.score for e in mine])),
                              "success_rate": float(np.mean([e.success for e in mine])),
                              "steps_mean": float(np.mean([len(e.steps) for e in mine])),
                              "accepted_rate": _accepted(mine), "raw_valid_rate": _raw_valid(mine)}
    scores = [ep.score for ep in episodes]
    return {
        "split": plan.split, "with_memory": plan.with_memory, "temperature": plan.temperature,
        "summary": {"episodes": len(episodes), "score_mean": float(np.mean(scores)) if scores else 0.0,
                    "success_rate": float(np.mean([e.success for e in episodes])) if episodes else 0.0,
                    "failed_episodes": sum(e.failed for e in episodes), "accepted_rate": _accepted(episodes),
                    "raw_valid_rate": _raw_valid(episodes)},
        "per_task": per_task,
        # the actions taken, so that a score (a collapse to one wrong action, say) can be explained from the file
        "episodes": [{**ep.summary(), "actions": [s.action for s in ep.steps]} for ep in episodes],
    }


def _accepted(episodes) -> float:
    """Fraction of the episodes' actions that the environment accepted."""
    flags = [s.accepted for e in episodes for s in e.steps]
    return float(np.mean(flags)) if flags else 1.0


def _raw_valid(episodes) -> float:
    """Fraction of the episodes' actions the environment ran as the model wrote them (before any correction)."""
    flags = [s.raw_valid for e in episodes for s in e.steps]
    return float(np.mean(flags)) if flags else 0.0


def markdown_table(result: dict[str, Any], label: str) -> str:
    mem = "with memory" if result["with_memory"] else "no memory"
    lines = [f"### {label} — {result['split']} split, {mem}, temperature {result['temperature']}", "",
             "| task | episodes | mean score | success rate | mean steps | actions accepted | raw outputs valid |",
             "|---|---:|---:|---:|---:|---:|---:|"]
    for task, row in result["per_task"].items():
        lines.append(f"| {task} | {row['episodes']} | {row['score_mean']:.1f} | {row['success_rate']:.2f} | "
                     f"{row['steps_mean']:.1f} | {row['accepted_rate']:.0%} | {row.get('raw_valid_rate', 0):.0%} |")
    s = result["summary"]
    lines.append(f"| **all** | {s['episodes']} | **{s['score_mean']:.1f}** | **{s['success_rate']:.2f}** | | "
                 f"{s['accepted_rate']:.0%} | {s.get('raw_valid_rate', 0):.0%} |")
    return "\n".join(lines) + "\n"


def write_eval_tables(result: dict[str, Any], folder: Path, tag: str, label: str) -> tuple[Path, Path]:
    folder = Path(folder)
    folder.mkdir(parents=True, exist_ok=True)
    js, md = folder / f"{tag}.json", folder / f"{tag}.md"
    md.write_text(markdown_table(result, label))
    # the JSON last and whole: a compare run that reuses this start eval waits for it and reads it at once
    tmp = folder / f".{tag}.json.tmp"
    tmp.write_text(json.dumps({"label": label, **result}, indent=2))
    os.replace(tmp, js)
    return js, md
