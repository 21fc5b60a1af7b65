"""Out-of-distribution adaptation (paper: OOD tests): trials on unseen tasks that change memory only, never the weights.

Two ways to remember between trials, and a control that remembers nothing:

- ``memory`` (EMPO²): every episode writes a tip into the tip memory; each step retrieves the tips whose key is most
  similar to the current state.
- ``reflexion`` (Shinn et al., 2023, the paper's baseline): after a FAILED trial the agent writes a verbal reflection
  (the same reflection prompt); the last :data:`REFLEXION_BUFFER` reflections of a (task, variation) are shown in
  every step of that variation's next trial, whatever the state.
- ``none`` (the control): no memory at all. Its trials differ only by their sampling seeds, so the change of its
  later trials over trial 0 is what sampling alone moves, and a memory cell of the same weights and seed, which plays
  the same trial 0, is compared with it variation by variation.

The weights are hashed before and after; a difference is an error (:class:`WeightsChanged`).
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np
import torch

from empo2.config import ConfigError
from empo2.envs.factory import env_label
from empo2.episodes.episode import Episode
from empo2.episodes.evaluate import EvalPlan, play_split, summarise
from empo2.episodes.reflection import reflect, write_tips
from empo2.episodes.rollout import RolloutContext
from empo2.experiments import ood_stats
from empo2.experiments.report import method_label
from empo2.memory.reflexion import REFLEXION_BUFFER, ReflexionBuffer
from empo2.policy.seeded import row_seed

PRESETS: dict[str, tuple[str, str]] = {
    "bio1-to-bio2": ("biology1", "biology2"),
    "bio2-to-elec": ("biology2", "electricity"),
    "elec-to-chem": ("electricity", "chemistry"),
}
"""The paper's OOD pairs: preset -> (topic the run was trained on, topic adapted to); topics are ScienceWorld
``TASK_SETS``."""
PRESET_TRIALS = 10
BASELINES = ("memory", "reflexion", "none")


def resolve_tasks(preset: str | None, tasks: str | None, max_tasks: int | None, env: str | None
                  ) -> tuple[str | None, str | None]:
    """(env, comma-separated tasks) for ``empo2 adapt``: a preset fixes ScienceWorld and its adapt topic's tasks;
    ``max_tasks`` keeps the first N (quick checks)."""
    from empo2.envs.scienceworld.tasks import expand_tasks

    if preset is None:
        if max_tasks and tasks:
            tasks = ",".join(expand_tasks(tasks.split(","))[:max_tasks])
        return env, tasks
    if tasks:
        raise ConfigError("--preset fixes the tasks; leave out --tasks (use --max-tasks to cut them)")
    if env not in (None, "scienceworld"):
        raise ConfigError("the adaptation presets are ScienceWorld topic pairs; leave out --env")
    return "scienceworld", ",".join(expand_tasks(PRESETS[preset][1])[: max_tasks or None])


class WeightsChanged(RuntimeError):
    """The model's parameters differ after adaptation (adaptation must update memory only)."""


def parameter_checksum(model) -> str:
    """SHA-256 over every parameter's name, shape, dtype and bytes, in name order."""
    digest = hashlib.sha256()
    for name, p in sorted(model.named_parameters(), key=lambda kv: kv[0]):
        t = p.detach().cpu().contiguous()
        digest.update(f"{name}|{tuple(t.shape)}|{t.dtype}".encode())
        digest.update(t.reshape(-1).view(torch.uint8).numpy().tobytes())
    return digest.hexdigest()


def use_reflexion(ctx: RolloutContext) -> ReflexionBuffer:
    """Switch ``ctx`` to Reflexion: a buffer per task variation instead of the tip memory. The context gets memory
    settings of its own; the config section it was built from is left as it was."""
    ctx.memory_cfg = dataclasses.replace(ctx.memory_cfg, namespace="task_variation", top_k_tips=REFLEXION_BUFFER)
    ctx.memory = ReflexionBuffer()
    return ctx.memory


def run_trials(ctx: RolloutContext, tasks: list[str], trials: int, split: str, variations: int, temperature: float,
               batch: int, baseline: str = "memory", say: Callable[[str], None] = print, seed: int = 0
               ) -> tuple[list[dict[str, Any]], str]:
    """Play every task variation ``trials`` times, remembering between trials.

    A trial plays with the memory it started with and updates it when it ends (its tips, and the counts and utility of
    the tips it used), so trial 0 has none and retrieval cannot change within a trial. Its sampling is
    seeded by (``seed``, trial, episode, turn): where two cells' prompts agree they draw the same tokens, so the
    cells of one model start from the same trial 0, and a rerun repeats a cell.

    Returns one summary per trial, with its episodes (one per task variation: the unit of the report's CIs), and
    the weights' checksum (equal before and after, else :class:`WeightsChanged`).
    """
    before = parameter_checksum(ctx.model)
    out = []
    plan = EvalPlan(split, variations, None, temperature, batch, with_memory=baseline != "none")
    for trial in range(trials):
        trial_seed = row_seed(seed, trial)
        episodes = play_split(ctx, tasks, plan, update_memory=False, seed=trial_seed)
        if baseline == "reflexion":
            _remember_failures(ctx, episodes)
        elif baseline == "memory":
            episodes = reflect(ctx, episodes, episodes, trial_seed)  # a tip per episode; the uses of those it retrieved
        result = summarise(episodes, tasks, plan)
        remembered = ctx.memory.stats()["tips"] if ctx.memory is not None else 0
        out.append({"trial": trial, **result["summary"], "per_task": result["per_task"],
                    "memory_size": remembered, "per_episode": result["episodes"]})
        say(f"trial {trial}: mean score {out[-1]['score_mean']:.1f}, success {out[-1]['success_rate']:.2f} "
            f"({baseline}: {out[-1]['memory_size']} entries)")
    if parameter_checksum(ctx.model) != before:
        raise WeightsChanged("the model's parameters changed during adaptation (it must update memory only)")
    return out, before


def _remember_failures(ctx: RolloutContext, episodes: list[Episode]) -> None:
    failed = [ep for ep in episodes if not ep.success and not ep.failed and ep.steps]
    if failed:
        for ep, text in zip(failed, write_tips(ctx, failed)):
            ctx.memory.push(f"{ep.task}#{ep.variation}", text)


def adaptation_report(trials: list[dict[str, Any]], **meta: Any) -> dict[str, Any]:
    """Best score and the gain over trial 0 (in points, and in % of trial 0 only when trial 0 scored > 0), and the
    later-trials gain, with their CIs over task variations (:func:`ood_stats.ood_cell`)."""
    scores = [t["score_mean"] for t in trials]
    base, best = scores[0], max(scores)
    report = {**meta, "scores": scores, "best": best, "trial0": base, "gain": best - base,
              "gain_pct": ood_stats.gain_pct(base, best), "trials": trials}
    cell = ood_stats.ood_cell([report])
    return {**report, **{k: cell[k] for k in ("n_variations", "best_ci", "gain_ci", "later_gain", "later_gain_ci")}}


def finish(out: Path, tasks: list[str], trials: list[dict[str, Any]], checksum: str, cfg, *, preset: str | None,
           baseline: str, run: str | None, split: str, seed: int = 0) -> dict[str, Any]:
    """Label the method, build the report, write it (:func:`write_adaptation`) and print its table."""
    model = method_label(cfg) if run else "base model"
    method = {"reflexion": "reflexion", "memory": f"{model} + tips", "none": f"{model}, no memory"}[baseline]
    report = adaptation_report(trials, tasks=tasks, preset=preset, baseline=baseline,
                               pair="→".join(PRESETS[preset]) if preset else None, method=method,
                               label=env_label(cfg.env), run=run, model=cfg.policy.model, split=split,
                               weights_sha256=checksum, weights_unchanged=True, seed=seed)
    for path in write_adaptation(out, report):
        print(f"wrote {path}")
    print(adaptation_markdown(report))
    return report


def write_adaptation(out: Path, report: dict[str, Any]) -> list[Path]:
    """``adapt.json``, ``adapt.md`` (per-trial table, per task) and ``adapt.png`` (score vs trial)."""
    out = Path(out)
    out.mkdir(parents=True, exist_ok=True)
    paths = [out / "adapt.json", out / "adapt.md", out / "adapt.png"]
    paths[0].write_text(json.dumps(report, indent=2))
    paths[1].write_text(adaptation_markdown(report))
    _plot(report, paths[2])
    return paths


def adaptation_markdown(report: dict[str, Any]) -> str:
    tasks = report["tasks"]
    lines = [f"### adaptation — {report.get('label', '')} · {report.get('method', '')} · "
             f"{report.get('preset') or ', '.join(tasks)}", "",
             "| trial | " + " | ".join(f"{t} score / success" for t in tasks) + " | mean score | success |",
             "|---:|" + "---:|" * (len(tasks) + 2)]
    for t in report["trials"]:
        cells = [f"{t['per_task'][k]['score_mean']:.1f} / {t['per_task'][k]['success_rate']:.2f}"
                 if k in t["per_task"] else "–" for k in tasks]
        lines.append(f"| {t['trial']} | " + " | ".join(cells) + f" | {t['score_mean']:.1f} | {t['success_rate']:.2f} |")
    lines += ["", ood_stats.cell_text(ood_stats.ood_cell([report])) + ".", "", ood_stats.METHOD_TEXT]
    return "\n".join(lines) + "\n"


def _plot(report: dict[str, Any], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(6, 3.5))
    x = [t["trial"] for t in report["trials"]]
    for task in report["tasks"]:
        ys = [t["per_task"].get(task, {}).get("score_mean", np.nan) for t in report["trials"]]
        ax.plot(x, ys, marker=".", alpha=0.6, label=task)
    ax.plot(x, report["scores"], marker="o", color="black", linewidth=2, label="mean")
    ax.set_xlabel("trial")
    ax.set_ylabel("score")
    ax.grid(alpha=0.3)
    ax.legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
