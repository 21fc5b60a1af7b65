"""Evaluation on held-out variations: without memory by default (the trained policy alone), temperature 0.4.

Writes ``eval/<tag>.json`` and ``eval/<tag>.md`` (a per-task table).
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import numpy as np

from empo2.train.distributed import gather_episodes
from empo2.train.rollout import Episode, RolloutContext, run_episodes


def evaluate(
    ctx: RolloutContext,
    tasks: list[str],
    split: str,
    variations_per_task: int,
    episodes_per_task: int | None,
    temperature: float,
    batch_size: int,
    with_memory: bool = False,
    reflect: bool = False,
    dist=None,
) -> dict[str, Any]:
    """Play the first ``variations_per_task`` variations of ``split`` for every task, ``batch_size`` at a time.

    With a data-parallel ``dist`` (:class:`empo2.train.distributed.Dist`) each rank plays its share of every chunk
    of ``batch_size × ranks`` episodes and the result covers all of them.
    """
    episodes = play_split(ctx, tasks, split, variations_per_task, episodes_per_task, temperature, batch_size,
                          with_memory, reflect, dist)
    return summarise(episodes, tasks, split, temperature, with_memory)


def play_split(ctx: RolloutContext, tasks: list[str], split: str, variations_per_task: int,
               episodes_per_task: int | None, temperature: float, batch_size: int, with_memory: bool = False,
               reflect: bool = False, dist=None) -> list[Episode]:
    """The episodes of :func:`evaluate` (one per task variation, in task order)."""
    specs = []
    for task in tasks:
        variations = list(ctx.pool.call(0, "variations", task, split, retries=1))[:variations_per_task]
        if episodes_per_task is not None:
            variations = variations[:episodes_per_task]
        specs += [(task, v, len(specs) + k, "on_tips" if with_memory else "on") for k, v in enumerate(variations)]
    ranks = dist.world_size if dist is not None else 1
    episodes = []
    for start in range(0, len(specs), batch_size * ranks):  # every rank runs as many batches (memory sync)
        chunk = specs[start:start + batch_size * ranks]
        eps, _ = run_episodes(ctx, dist.shard(chunk) if ranks > 1 else chunk, temperature=temperature,
                              reflect=reflect)
        episodes += eps
    if ranks > 1:
        episodes = gather_episodes(dist, episodes)
    return episodes


def summarise(episodes: list[Episode], tasks: list[str], split: str, temperature: float,
              with_memory: bool) -> dict[str, Any]:
    """Per-task and overall mean score / success rate of played episodes (the result :func:`evaluate` returns)."""
    per_task = {}
    for task in tasks:
        mine = [ep for ep in episodes if ep.task == task]
        if mine:
            per_task[task] = {"episodes": len(mine), "score_mean": float(np.mean([e.score for e in mine])),
                              "success_rate": float(np.mean([e.success for e in mine])),
                              "steps_mean": float(np.mean([len(e.steps) for e in mine])),
                              "accepted_rate": _accepted(mine)}
    scores = [ep.score for ep in episodes]
    return {
        "split": split, "with_memory": with_memory, "temperature": temperature,
        "summary": {"episodes": len(episodes), "score_mean": float(np.mean(scores)) if scores else 0.0,
                    "success_rate": float(np.mean([e.success for e in episodes])) if episodes else 0.0,
                    "failed_episodes": sum(e.failed for e in episodes), "accepted_rate": _accepted(episodes)},
        "per_task": per_task,
        "episodes": [ep.summary() for ep in episodes],
    }


def _accepted(episodes) -> float:
    """Fraction of the episodes' actions that the environment accepted."""
    flags = [s.accepted for e in episodes for s in e.steps]
    return float(np.mean(flags)) if flags else 1.0


def markdown_table(result: dict[str, Any], label: str) -> str:
    mem = "with memory" if result["with_memory"] else "no memory"
    lines = [f"### {label} — {result['split']} split, {mem}, temperature {result['temperature']}", "",
             "| task | episodes | mean score | success rate | mean steps | actions accepted |",
             "|---|---:|---:|---:|---:|---:|"]
    for task, row in result["per_task"].items():
        lines.append(f"| {task} | {row['episodes']} | {row['score_mean']:.1f} | {row['success_rate']:.2f} | "
                     f"{row['steps_mean']:.1f} | {row['accepted_rate']:.0%} |")
    s = result["summary"]
    lines.append(f"| **all** | {s['episodes']} | **{s['score_mean']:.1f}** | **{s['success_rate']:.2f}** | | "
                 f"{s['accepted_rate']:.0%} |")
    return "\n".join(lines) + "\n"


def write_eval_tables(result: dict[str, Any], folder: Path, tag: str, label: str) -> tuple[Path, Path]:
    folder = Path(folder)
    folder.mkdir(parents=True, exist_ok=True)
    js, md = folder / f"{tag}.json", folder / f"{tag}.md"
    js.write_text(json.dumps({"label": label, **result}, indent=2))
    md.write_text(markdown_table(result, label))
    return js, md
