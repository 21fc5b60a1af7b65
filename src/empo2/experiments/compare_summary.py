"""``empo2 compare``'s outputs from its compact record: ``summary.md``, ``summary.json`` and ``curves.png``.

Every number is read back from the runs' records (:mod:`empo2.experiments.records`, the lines of ``scores.jsonl.gz``): a
run's score and success are the means of its final eval's episodes, its start score those of its start eval; the
statistics over seeds are :mod:`empo2.experiments.stats`'. :func:`rebuild` makes the summary from ``scores.jsonl.gz``
alone.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import numpy as np

from empo2 import machine
from empo2.experiments import arm_runs, records, stats

PROTOCOL_EPISODES = 40
"""Held-out eval episodes per run below which the summary says the evaluation is too small to rank methods."""


def run_result(record: dict[str, Any]) -> dict[str, Any]:
    """A finished run's final eval (from its stored episodes), start eval, budget and learning curve
    [(env steps, eval score, success rate)]."""
    rows, name = record["metrics"], record["name"]
    env_steps = records.env_steps(record)
    final, start = records.eval_result(record, "final"), records.eval_result(record, "start")
    score, success = stats.run_score(final, f"{name}'s final eval"), stats.run_success(final)
    curve = []
    if start is not None:
        curve.append([0, stats.run_score(start, f"{name}'s start eval"), stats.run_success(start)])
    curve += [[int(r["env_steps"]), r["eval"]["score_mean"], r["eval"]["success_rate"]] for r in rows
              if r.get("eval") and "env_steps" in r]
    curve.append([env_steps, score, success])
    train, algo = record["config"].get("train", {}), record["config"].get("algo", {})
    return {"name": name, "algo": record["algo"], "seed": record["seed"], "folder": record["folder"],
            "final": final["summary"], "score": score, "success": success,
            "start": curve[0][1] if start is not None else None,
            "start_from": start.get("reused_from") if start is not None else None,
            "episodes": [[e["task"], e["variation"]] for e in final["episodes"]],
            "env_steps": env_steps, "expert_env_steps": int(rows[-1].get("expert_env_steps", 0)) if rows else 0,
            "iterations": train.get("iterations"),
            "train_episodes": train.get("iterations", 0) * train.get("tasks_per_batch", 0) * algo.get(
                "num_generations", 0), "curve": curve, "machines": record["machines"]}


def aggregate(results: list[dict[str, Any]], algos: list[str]) -> dict[str, dict[str, Any]]:
    """Per algorithm: mean / min / max over seeds of the final score, success and env steps, and the mean curve with
    its 95% t-interval band over seeds (``None`` below :data:`stats.MIN_CI` seeds).

    Runs of one algorithm evaluate at the same iterations, so curves are aligned by evaluation index; the x of a
    point is the seeds' mean env steps there.
    """
    out = {}
    for algo in algos:
        mine = [r for r in results if r["algo"] == algo]
        if not mine:
            continue
        score = np.array([r["score"] for r in mine], dtype=np.float64)
        success = np.array([r["success"] for r in mine], dtype=np.float64)
        steps = np.array([r["env_steps"] for r in mine], dtype=np.float64)
        n = min(len(r["curve"]) for r in mine)
        pts = np.array([r["curve"][:n] for r in mine], dtype=np.float64)  # (seeds, points, 3)
        cis = [stats.mean_ci(pts[:, k, 1])["ci"] for k in range(n)]
        success_cis = [stats.mean_ci(pts[:, k, 2], bounds=(0.0, 1.0))["ci"] for k in range(n)]
        out[algo] = {"runs": len(mine), "seeds": [r["seed"] for r in mine],
                     "score_mean": float(score.mean()), "score_min": float(score.min()),
                     "score_max": float(score.max()), "success_mean": float(success.mean()),
                     "env_steps_mean": float(steps.mean()),
                     "curve": {"env_steps": pts[:, :, 0].mean(0).tolist(),
                               "score_mean": pts[:, :, 1].mean(0).tolist(),
                               "score_ci_low": [c[0] if c else None for c in cis],
                               "score_ci_high": [c[1] if c else None for c in cis],
                               "success_mean": pts[:, :, 2].mean(0).tolist(),
                               "success_ci_low": [c[0] if c else None for c in success_cis],
                               "success_ci_high": [c[1] if c else None for c in success_cis]}}
    return out


def protocol(config: dict[str, Any], results: list[dict[str, Any]]) -> dict[str, Any]:
    """The evaluation protocol the summary states (``config``: a run's config as a mapping), with what the runs
    show: the episodes per task and whether every run played the same task variations."""
    per_task: dict[str, int] = {}
    for task, _ in (results[0]["episodes"] if results else []):
        per_task[task] = per_task.get(task, 0) + 1
    same = all(r["episodes"] == results[0]["episodes"] for r in results)
    env, train, policy = (config.get(k, {}) for k in ("env", "train", "policy"))
    return {"eval_split": env.get("eval_split"), "eval_variations": env.get("eval_variations"),
            "eval_episodes_per_task": train.get("eval_episodes_per_task"), "episodes_per_task": per_task,
            "eval_episodes": len(results[0]["episodes"]) if results else 0, "same_episodes": same,
            "eval_temperature": policy.get("eval_temperature")}


def _protocol_text(p: dict[str, Any], results: list[dict[str, Any]]) -> list[str]:
    cap = p["eval_episodes_per_task"]
    counts = sorted(set(p["episodes_per_task"].values()))
    lines = [f"Evaluation: `env.eval_split={p['eval_split']}`, `env.eval_variations={p['eval_variations']}`"
             + (f", `train.eval_episodes_per_task={cap}`" if cap is not None else "")
             + f" → {'/'.join(map(str, counts)) or 0} episodes per task × {len(p['episodes_per_task'])} task(s) = "
             f"{p['eval_episodes']} episodes per run, no memory, temperature {p['eval_temperature']}; "
             + ("every arm and seed played the same task variations." if p["same_episodes"] else
                "**the runs did not all play the same task variations** (see each run's eval/final.json).")]
    if p["eval_split"] != "test" or p["eval_episodes"] < PROTOCOL_EPISODES:
        lines.append(f"Note: the evidence protocol is ≥ {PROTOCOL_EPISODES} held-out episodes per run "
                     f"(`env.eval_split=test`); these runs used {p['eval_episodes']} on the `{p['eval_split']}` split.")
    lines += machine_warnings(results)
    reused = sorted({(r["seed"], r["start_from"]) for r in results if r["start_from"]})
    if reused:
        lines.append("Start eval (untrained model): run once per seed and reused by that seed's other arms ("
                     + ", ".join(f"seed {s}: {src}" for s, src in reused) + ").")
    return lines


def arms_trained_on(found: list[dict[str, Any]], algos: list[str]) -> dict[str, dict[str, Any]]:
    """Per arm, what its runs train on (:func:`empo2.algo.arms.arm_settings` of its first recorded run's config):
    reward, advantage, loss settings and where they differ from its method's official runs."""
    from empo2.config import Config, ConfigError

    out = {}
    for algo in algos:
        record = next((r for r in found if r["algo"] == algo), None)
        if record is None:
            continue
        try:
            out[algo] = arm_runs.arm_settings(Config.from_dict(record["config"], record=True).algo)
        except (ConfigError, ValueError):  # a record of a config this version cannot read
            continue
    return out


def settings_text(settings: dict[str, dict[str, Any]]) -> list[str]:
    """The arms' settings as a markdown table."""
    if not settings:
        return []
    lines = ["## What each arm trains on", "",
             "Loss settings that differ from a method's official runs are deliberate: the arms share the config's "
             "loss unless their method fixes it (LUFFY's, ELPO's), so that they differ in their method only.", "",
             "| arm | reward | advantage | loss | differs from its official runs |", "|---|---|---|---|---|"]
    for algo, s in settings.items():
        loss = s["loss"]
        parts = ", ".join(f"{k.replace('_', ' ')} {v}" for k, v in loss.items() if k != "loss")
        differs = "; ".join(s["differs_from_official"]) or "—"
        source = f" ({s['official']})" if s["differs_from_official"] else ""
        lines.append(f"| {algo} | {s['reward']} | {s['advantage']} | {loss['loss']}: {parts} | {differs}{source} |")
    return [*lines, ""]


def machine_warnings(results: list[dict[str, Any]]) -> list[str]:
    """A warning per seed whose runs (paired by that seed across arms) computed under different thread counts, CPU
    kernel paths or library versions (:data:`empo2.machine.FIXES`): their differences then hold the machines'."""
    seeds = sorted({r["seed"] for r in results})
    found = [(seed, machine.differences({r["name"]: r.get("machines", []) for r in results if r["seed"] == seed}))
             for seed in seeds]
    return [f"**Warning: seed {seed}'s runs did not compute alike** ({'; '.join(diff)}): with one seed, runs "
            "sample the same only under the same threads, kernels and versions, so the paired differences of this "
            "seed also hold the machines' difference." for seed, diff in found if diff]


def summary_markdown(meta: dict[str, Any], per_algo: dict[str, dict], results: list[dict], missing: list[str],
                     summary_stats: dict[str, Any] | None = None) -> str:
    """The comparison as markdown; per-run numbers use ``eval/final.md``'s formats (score .1f, success .2f)."""
    lines = [f"# empo2 compare — {meta['label']}", "",
             f"Config `{meta['config']}`" + (f" with `{' '.join(meta['overrides'])}`" if meta["overrides"] else "")
             + ".", *(_protocol_text(meta["protocol"], results) if "protocol" in meta else []),
             *arm_runs.describe(meta.get("algos", [])),
             f"Budget: every run trains {meta['budget_text']} episodes; the environment steps they took are below.",
             *expert_steps_text(results),
             ("Learning curves: `curves.png` (eval success rate and eval score vs environment steps; line = mean over "
              f"seeds, band = 95% t interval over seeds, drawn from {stats.MIN_CI} seeds on)."), "",
             *settings_text(meta.get("arm_settings", {}))]
    if summary_stats is not None:
        lines += ["## Final eval per arm (95% CIs over seeds)", "", *stats.arm_table(summary_stats["arms"]), ""]
        if summary_stats.get("success_pairs"):
            lines += ["## Paired differences between arms (final success rate)", "",
                      *stats.pair_table(summary_stats["success_pairs"], 2), ""]
        if summary_stats["pairs"]:
            lines += ["## Paired differences between arms (final score)", "", *stats.pair_table(summary_stats["pairs"]),
                      ""]
        lines += [f"Method: {summary_stats['method']}", ""]
    lines += ["## Runs", "", ("| run | algorithm | seed | start score | final score | success | eval episodes | "
                              "train episodes | env steps | machine (CPU, widest vector flag, torch threads, GPU) |"),
              "|---|---|---:|---:|---:|---:|---:|---:|---:|---|"]
    for r in results:
        start = "n/a" if r.get("start") is None else f"{r['start']:.1f}"
        where = ", ".join(dict.fromkeys(machine.short(m) for m in r.get("machines", []))) or "not recorded"
        lines.append(f"| {r['name']} | {r['algo']} | {r['seed']} | {start} | {r['score']:.1f} | {r['success']:.2f} "
                     f"| {len(r['episodes'])} | {r['train_episodes']} | {r['env_steps']} | {where} |")
    if missing:
        lines += ["", f"Not finished (left out above): {', '.join(missing)}. Re-run the same command to resume them."]
    return "\n".join(lines) + "\n"


def expert_steps_text(results: list[dict]) -> list[str]:
    """Where runs had expert members (LUFFY): their environment steps, which the env steps column leaves out."""
    expert = [r for r in results if r.get("expert_env_steps")]
    if not expert:
        return []
    return [f"Expert steps: the gold-path members of {', '.join(dict.fromkeys(r['algo'] for r in expert))} took "
            "environment steps of their own, counted apart from the policy's (not in the env steps column nor in "
            "the curves' x): " + ", ".join(f"{r['name']} {r['expert_env_steps']}" for r in expert) + "."]


def plot_curves(per_algo: dict[str, dict], path: Path) -> Path:
    """``curves.png``: eval success rate and eval score vs environment steps, one mean line and 95% CI band per
    algorithm in each panel."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, 2, figsize=(11, 3.8))
    for ax, key, label in ((axes[0], "success", "eval success rate"), (axes[1], "score", "eval score")):
        for algo, a in per_algo.items():
            c = a["curve"]
            if f"{key}_mean" not in c:  # a summary written before success curves were kept
                continue
            line, = ax.plot(c["env_steps"], c[f"{key}_mean"], marker="o", label=f"{algo} (n={a['runs']})")
            low = [np.nan if v is None else v for v in c[f"{key}_ci_low"]]
            high = [np.nan if v is None else v for v in c[f"{key}_ci_high"]]
            ax.fill_between(c["env_steps"], low, high, color=line.get_color(), alpha=0.2)
        ax.set_xlabel("environment steps (training episodes)")
        ax.set_ylabel(f"{label}, no memory")
        ax.grid(alpha=0.3)
    axes[0].set_ylim(-0.01, max(axes[0].get_ylim()[1], 0.1))  # a rate: from 0, and 0 stays at the bottom
    axes[0].set_title("success (band: 95% CI over seeds)", fontsize=9)
    axes[1].set_title("score (band: 95% CI over seeds)", fontsize=9)
    axes[1].legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path


def record_of(plan) -> dict[str, Any]:
    """A finished run's record: from its run folder when it has one, else the one ``scores.jsonl.gz`` holds."""
    if getattr(plan, "recorded", None) is not None and not (plan.folder / "config.yaml").is_file():
        return plan.recorded
    return records.from_folder(plan.folder, plan.algo, plan.seed, getattr(plan, "command", None) or {})


def write_summary(plans: list, done: list, out: Path, meta: dict[str, Any], algos: list[str]) -> dict[str, Any]:
    """Record the finished runs (``done``) of ``plans`` in ``scores.jsonl.gz``, then write the summary from them."""
    found = [record_of(p) for p in done]
    Path(out).mkdir(parents=True, exist_ok=True)
    records.merge(Path(out) / records.RECORD_FILE, found)
    return summarise(found, out, meta, algos, [p.name for p in plans if p not in done])


def summarise(found: list[dict[str, Any]], out: Path, meta: dict[str, Any], algos: list[str],
              missing: list[str] = ()) -> dict[str, Any]:
    """Write ``summary.json``, ``summary.md`` and ``curves.png`` from run records; returns the summary."""
    results = [run_result(r) for r in found]
    per_algo = aggregate(results, algos)
    first = found[0]["config"] if found else {}
    train, algo = first.get("train", {}), first.get("algo", {})
    summary_stats = stats.summarise_arms([{**r, "arm": r["algo"]} for r in results], algos)
    meta = {**meta, "protocol": protocol(first, results), "arm_settings": arms_trained_on(found, algos),
            "budget_text": f"{train.get('iterations')} iterations × {train.get('tasks_per_batch')} tasks × "
                           f"G={algo.get('num_generations')} = {results[0]['train_episodes'] if results else '?'}"}
    summary = {**meta, "algorithms": per_algo, "stats": summary_stats, "runs": results, "missing": list(missing)}
    out = Path(out)
    out.mkdir(parents=True, exist_ok=True)
    (out / "summary.json").write_text(json.dumps(summary, indent=2))
    (out / "summary.md").write_text(summary_markdown(meta, per_algo, results, list(missing), summary_stats))
    if per_algo:
        plot_curves(per_algo, out / "curves.png")
    return summary


def rebuild(folder: Path, out: Path | None = None, algos: list[str] | None = None,
            seeds: list[int] | None = None) -> dict[str, Any]:
    """The summary of the comparison ``folder/scores.jsonl.gz`` records, from that file alone, written into ``out``
    (default ``folder``): its runs of ``algos`` (default: every arm, in the order first recorded) and ``seeds``
    (default: all). The command shown is the first run's."""
    found = list(records.read(Path(folder) / records.RECORD_FILE, missing_ok=True).values())
    if not found:
        from empo2.config import ConfigError

        raise ConfigError(f"{folder} has no {records.RECORD_FILE} (a comparison's record)")
    algos = algos or list(dict.fromkeys(r["algo"] for r in found))
    found = [r for r in found if r["algo"] in algos and (seeds is None or r["seed"] in seeds)]
    command = found[0]["command"] if found else {}
    final = records.eval_result(found[0], "final") if found else None
    meta = {"config": command.get("config"), "overrides": command.get("overrides", []), "algos": algos,
            "seeds": sorted({r["seed"] for r in found}), "label": (final or {}).get("label", "?")}
    return summarise(found, Path(out or folder), meta, algos)
