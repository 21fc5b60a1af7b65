"""``empo2 compare``: several algorithms × seeds on one config with the same budget, then one summary.

Every run is an ordinary run folder ``OUT/runs/<algo>-seed<k>/`` made by ``empo2 train`` (same code path, with
``algo.name``, ``train.seed`` and ``train.eval_at_start=true`` added to the overrides; ``--algos empo2+gigpo`` also
sets ``algo.advantage=gigpo``, and a ``-std`` suffix (``gigpo-std``, ``empo2+gigpo-std``) picks GiGPO's
``algo.gigpo_normalization=mean_std_norm`` where the plain name runs ``mean_norm``). Runs go one after another,
each in its own ``empo2 train`` subprocess: a crash in one run cannot take the others down, and the model, the
environment workers (ScienceWorld JVMs) and the CUDA context are freed when the run ends instead of piling up in one
long-lived process. Re-running the same command skips finished runs and resumes unfinished ones (``--resume``).

All algorithms share ``iterations × tasks_per_batch × num_generations`` training episodes, so the budget is equal
by episodes; the environment steps those episodes took (``env_steps`` in ``metrics.jsonl``) are reported too.
Outputs: ``summary.md``, ``summary.json`` and ``curves.png`` (eval score vs environment steps).
"""

from __future__ import annotations

import json
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable

import numpy as np

from empo2.config import Config, ConfigError
from empo2.signals import set_phase
from empo2.train import checkpoint as ckpt
from empo2.train.metrics import read_metrics

SET_BY_COMPARE = ("algo.name", "algo.gigpo_normalization", "train.seed", "train.output_dir", "train.eval_at_start")
STD_SUFFIX = "-std"
"""``--algos gigpo-std``: GiGPO divided by the group std (``mean_std_norm``); report's ``method_label`` writes it so."""
COSMETIC = ("train.output_dir", "train.progress")  # may differ between invocations without changing a run


@dataclass
class RunPlan:
    """One (algorithm, seed) run of a comparison."""

    algo: str
    seed: int
    folder: Path
    cfg: Config

    @property
    def name(self) -> str:
        return f"{self.algo}-seed{self.seed}"


def run_compare(config: str, algos_text: str, seeds_text: str, out: Path, overrides: list[str],
                check: Callable[[Config], None] | None = None) -> int:
    """The ``empo2 compare`` command: validate every run, run/resume/skip them, summarise. 0 = all finished."""
    from empo2.envs.factory import env_label

    algos, seeds = parse_algos(algos_text), parse_seeds(seeds_text)
    plans = plan_runs(config, algos, seeds, out, overrides, check)
    say(f"empo2 compare: {', '.join(algos)} × seeds {seeds} = {len(plans)} runs → {out}")
    failed = run_all(plans, config, overrides)
    meta = {"config": config, "overrides": overrides, "algos": algos, "seeds": seeds,
            "label": env_label(plans[0].cfg.env)}
    write_summary(plans, out, meta, algos)
    say((out / "summary.md").read_text())
    say(f"comparison folder: {out}  (summary.md, summary.json, curves.png, runs/)")
    if failed:
        say(f"{len(failed)} run(s) did not finish: {', '.join(failed)}; re-run the same command to resume them")
        return 1
    return 0


def say(text: str) -> None:
    """One progress line, flushed before a child run writes to the same terminal."""
    print(text, flush=True)


# ---------------------------------------------------------------------------------------------------- planning
def parse_algos(text: str) -> list[str]:
    """``grpo,empo2`` → ``["grpo", "empo2"]``; names are checked later by the config's own validation."""
    algos = [a.replace(" ", "") for a in text.split(",") if a.strip()]
    if not algos:
        raise ConfigError("--algos needs at least one algorithm name, e.g. --algos grpo,empo2")
    if len(set(algos)) != len(algos):
        raise ConfigError(f"--algos names an algorithm twice: {text}")
    return algos


def parse_seeds(text: str) -> list[int]:
    """``3`` → seeds 0, 1, 2; ``1,4,7`` → exactly those seeds."""
    parts = [p.strip() for p in str(text).split(",") if p.strip()]
    try:
        values = [int(p) for p in parts]
    except ValueError:
        raise ConfigError(f"--seeds must be a count (3) or a comma-separated list of seeds (1,4,7), got {text!r}") \
            from None
    if not values:
        raise ConfigError("--seeds is empty")
    if "," not in str(text):
        if values[0] < 1:
            raise ConfigError(f"--seeds count must be >= 1, got {values[0]}")
        return list(range(values[0]))
    if min(values) < 0 or len(set(values)) != len(values):
        raise ConfigError(f"--seeds list must hold distinct non-negative integers, got {text!r}")
    return values


def plan_runs(config: str, algos: list[str], seeds: list[int], out: Path, overrides: list[str],
              check: Callable[[Config], None] | None = None) -> list[RunPlan]:
    """Build and validate every run's config before anything is written (a bad name fails here, exit 2)."""
    if Path(out).exists() and not Path(out).is_dir():
        raise ConfigError(f"--out {out} is a file, not a folder")
    for item in overrides:
        key = item.split("=", 1)[0].strip()
        if "=" in item and ".".join(Config().resolve_key(key)) in SET_BY_COMPARE:
            raise ConfigError(f"{key} is set by compare (--algos, e.g. gigpo-std; --seeds, --out; eval_at_start "
                              "is always on), not by an override")
    plans = []
    for seed in seeds:  # seed-major: an interrupted comparison has every algorithm on its first seeds
        for algo in algos:
            folder = Path(out) / "runs" / f"{algo}-seed{seed}"
            cfg = Config.load(config, [*overrides, *_own_overrides(algo, seed, folder)])
            _check_estimator_used(algo, cfg)
            if check is not None:
                check(cfg)
            plan = RunPlan(algo, seed, folder, cfg)
            _check_same_settings(plan)
            plans.append(plan)
    return plans


def _split(algo: str) -> tuple[str, str, bool]:
    """``"empo2+gigpo"`` → ``("empo2", "gigpo", False)`` (EMPO² with GiGPO's advantage estimator);
    ``"gigpo-std"`` → ``("gigpo", "", True)`` (GiGPO's ``mean_std_norm``); ``"grpo"`` → ``("grpo", "", False)``."""
    std = algo.endswith(STD_SUFFIX)
    name, _, estimator = algo.removesuffix(STD_SUFFIX).partition("+")
    return name, estimator, std


def _own_overrides(algo: str, seed: int, folder: Path) -> list[str]:
    name, estimator, std = _split(algo)
    chosen = [f"algo.name={name}"] + ([f"algo.advantage={estimator}"] if estimator else [])
    # always set, so that a config file's choice cannot run under a label that says the other one
    chosen.append(f"algo.gigpo_normalization={'mean_std_norm' if std else 'mean_norm'}")
    return [*chosen, f"train.seed={seed}", f"train.output_dir={folder}", "train.eval_at_start=true"]


def _check_estimator_used(algo: str, cfg: Config) -> None:
    """``gigpo+grpo`` or ``grpo-std`` would be labelled one thing and run another: refuse them."""
    from empo2.algo.registry import ALGORITHMS

    name, estimator, std = _split(algo)
    used = ALGORITHMS[name].estimator(cfg.algo)
    if estimator and used != estimator:
        raise ConfigError(f"--algos {algo}: algorithm {name!r} always uses the {used!r} advantage; "
                          f"drop '+{estimator}'")
    if std and used != "gigpo":
        raise ConfigError(f"--algos {algo}: '{STD_SUFFIX}' selects GiGPO's mean_std_norm, but {name!r} uses the "
                          f"{used!r} advantage (write e.g. gigpo-std or {name}+gigpo-std)")


def _check_same_settings(plan: RunPlan) -> None:
    """A run folder started with other settings is never resumed under a comparison it does not belong to."""
    saved = plan.folder / "config.yaml"
    if not saved.is_file():
        return
    old, new = _flat(Config.load(saved).to_dict()), _flat(plan.cfg.to_dict())
    diff = [k for k in sorted(new) if k not in COSMETIC and old.get(k) != new[k]]
    if diff:
        shown = ", ".join(f"{k}: {old.get(k)!r} → {new[k]!r}" for k in diff[:3])
        raise ConfigError(f"{plan.folder} was started with other settings ({shown}); use another --out or "
                          "delete that run folder")


def _flat(d: dict[str, dict[str, Any]]) -> dict[str, Any]:
    return {f"{s}.{k}": v for s, values in d.items() for k, v in values.items()}


# ---------------------------------------------------------------------------------------------------- running
def run_status(plan: RunPlan) -> str:
    """``finished`` (final eval written after the last iteration's checkpoint), ``resume`` or ``fresh``."""
    if not (plan.folder / "config.yaml").is_file():
        return "fresh"
    last = ckpt.latest_checkpoint(plan.folder)
    last_it = int(last.name[len(ckpt.PREFIX):]) if last is not None else -1
    if (plan.folder / "eval" / "final.json").is_file() and last_it == plan.cfg.train.iterations - 1:
        return "finished"
    return "resume"


def train_command(plan: RunPlan, config: str, overrides: list[str], status: str) -> list[str]:
    """The ``empo2 train`` command line of one run (a fresh start or ``--resume``)."""
    cmd = [sys.executable, "-m", "empo2.cli", "train"]
    if status == "resume":
        return cmd + ["--resume", str(plan.folder)]
    cmd += ["--config", config, "--output-dir", str(plan.folder)]
    if plan.folder.exists():
        cmd.append("--overwrite")  # a folder left without config.yaml holds nothing worth keeping
    return cmd + [*overrides, *_own_overrides(plan.algo, plan.seed, plan.folder)]


def run_one(cmd: list[str]) -> int:
    """Run one training subprocess; its output goes straight to this terminal. SIGTERM or Ctrl-C is passed on to it
    (a scheduler signals this process only), and it gets time to close its environment workers and lock."""
    from empo2.signals import Stopped

    proc = subprocess.Popen(cmd)
    try:
        return proc.wait()
    except Stopped as stop:
        proc.send_signal(stop.signum)
        try:
            proc.wait(timeout=60)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()
        raise


def run_all(plans: list[RunPlan], config: str, overrides: list[str]) -> list[str]:
    """Run, resume or skip every plan in order; returns the names of runs that failed."""
    failed, t_all = [], time.perf_counter()
    for i, plan in enumerate(plans, 1):
        head = f"[{i}/{len(plans)}] {plan.name}"
        status = run_status(plan)
        if status == "finished":
            say(f"{head}: finished already, skipped")
            continue
        say(f"{head}: {'resuming' if status == 'resume' else 'starting'} → {plan.folder}")
        set_phase(f"compare run {plan.name} (its own line above says where it stopped)")
        t0 = time.perf_counter()
        rc = run_one(train_command(plan, config, overrides, status))
        took = time.perf_counter() - t0
        if rc != 0 or run_status(plan) != "finished":
            failed.append(plan.name)
            say(f"{head}: FAILED (exit {rc}) after {took:.0f}s; re-run the same command to resume it")
            continue
        final = _final(plan)["summary"]
        say(f"{head}: done in {took:.0f}s (total {time.perf_counter() - t_all:.0f}s) · final score "
            f"{final['score_mean']:.1f} · success {final['success_rate']:.2f}")
    return failed


# ---------------------------------------------------------------------------------------------------- summary
def _final(plan: RunPlan) -> dict[str, Any]:
    return json.loads((plan.folder / "eval" / "final.json").read_text())


def run_result(plan: RunPlan) -> dict[str, Any]:
    """A finished run's final eval, budget and learning curve [(env steps, eval score, success rate)]."""
    rows = read_metrics(plan.folder)
    env_steps = int(rows[-1].get("env_steps", 0)) if rows else 0
    curve = []
    start = plan.folder / "eval" / "start.json"
    if start.is_file():
        s = json.loads(start.read_text())["summary"]
        curve.append([0, s["score_mean"], s["success_rate"]])
    curve += [[int(r["env_steps"]), r["eval"]["score_mean"], r["eval"]["success_rate"]] for r in rows
              if r.get("eval") and "env_steps" in r]
    final = _final(plan)["summary"]
    curve.append([env_steps, final["score_mean"], final["success_rate"]])
    t = plan.cfg.train
    return {"name": plan.name, "algo": plan.algo, "seed": plan.seed, "folder": str(plan.folder),
            "final": final, "env_steps": env_steps, "iterations": t.iterations,
            "train_episodes": t.iterations * t.tasks_per_batch * plan.cfg.algo.num_generations, "curve": curve}


def aggregate(results: list[dict[str, Any]], algos: list[str]) -> dict[str, dict[str, Any]]:
    """Per algorithm: mean / min / max over seeds of the final score, success and env steps, and the mean curve.

    Runs of one algorithm evaluate at the same iterations, so curves are aligned by evaluation index; the x of a
    point is the seeds' mean env steps there.
    """
    out = {}
    for algo in algos:
        mine = [r for r in results if r["algo"] == algo]
        if not mine:
            continue
        score = np.array([r["final"]["score_mean"] for r in mine], dtype=np.float64)
        success = np.array([r["final"]["success_rate"] for r in mine], dtype=np.float64)
        steps = np.array([r["env_steps"] for r in mine], dtype=np.float64)
        n = min(len(r["curve"]) for r in mine)
        pts = np.array([r["curve"][:n] for r in mine], dtype=np.float64)  # (seeds, points, 3)
        out[algo] = {"runs": len(mine), "seeds": [r["seed"] for r in mine],
                     "score_mean": float(score.mean()), "score_min": float(score.min()),
                     "score_max": float(score.max()), "success_mean": float(success.mean()),
                     "env_steps_mean": float(steps.mean()),
                     "curve": {"env_steps": pts[:, :, 0].mean(0).tolist(),
                               "score_mean": pts[:, :, 1].mean(0).tolist(),
                               "score_min": pts[:, :, 1].min(0).tolist(),
                               "score_max": pts[:, :, 1].max(0).tolist()}}
    return out


def summary_markdown(meta: dict[str, Any], per_algo: dict[str, dict], results: list[dict], missing: list[str]) -> str:
    """The comparison as markdown; per-run numbers use ``eval/final.md``'s formats (score .1f, success .2f)."""
    lines = [f"# empo2 compare — {meta['label']}", "",
             f"Config `{meta['config']}`" + (f" with `{' '.join(meta['overrides'])}`" if meta["overrides"] else "")
             + f". Final evaluation: {meta['eval_split']} split, no memory, {meta['eval_episodes']} episodes per run.",
             f"Budget: every run trains {meta['budget_text']} episodes; the environment steps they took are below.",
             "Learning curve: `curves.png` (eval score vs environment steps; line = mean over seeds, band = min–max).",
             "", "| algorithm | runs | final score (mean) | min–max | success (mean) | env steps (mean) | "
             "score per seed | success per seed |", "|---|---:|---:|---:|---:|---:|---|---|"]
    for algo, a in per_algo.items():
        mine = [r for r in results if r["algo"] == algo]
        per_score = " · ".join(f"{r['seed']}: {r['final']['score_mean']:.1f}" for r in mine)
        per_success = " · ".join(f"{r['seed']}: {r['final']['success_rate']:.2f}" for r in mine)
        lines.append(f"| {algo} | {a['runs']} | **{a['score_mean']:.1f}** | "
                     f"{a['score_min']:.1f}–{a['score_max']:.1f} | {a['success_mean']:.2f} | "
                     f"{a['env_steps_mean']:.0f} | {per_score} | {per_success} |")
    lines += ["", "| run | algorithm | seed | final score | success | eval episodes | train episodes | env steps |",
              "|---|---|---:|---:|---:|---:|---:|---:|"]
    for r in results:
        f = r["final"]
        lines.append(f"| {r['name']} | {r['algo']} | {r['seed']} | {f['score_mean']:.1f} | {f['success_rate']:.2f} "
                     f"| {f['episodes']} | {r['train_episodes']} | {r['env_steps']} |")
    if missing:
        lines += ["", f"Not finished (left out above): {', '.join(missing)}. Re-run the same command to resume them."]
    return "\n".join(lines) + "\n"


def plot_curves(per_algo: dict[str, dict], path: Path) -> Path:
    """``curves.png``: eval score vs environment steps, one mean line and min–max band per algorithm."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(6, 3.8))
    for algo, a in per_algo.items():
        c = a["curve"]
        line, = ax.plot(c["env_steps"], c["score_mean"], marker="o", label=f"{algo} (n={a['runs']})")
        ax.fill_between(c["env_steps"], c["score_min"], c["score_max"], color=line.get_color(), alpha=0.2)
    ax.set_xlabel("environment steps (training episodes)")
    ax.set_ylabel("eval score, no memory")
    ax.grid(alpha=0.3)
    ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path


def write_summary(plans: list[RunPlan], out: Path, meta: dict[str, Any], algos: list[str]) -> dict[str, Any]:
    """Write ``summary.json``, ``summary.md`` and ``curves.png`` from the finished runs' folders."""
    done = [p for p in plans if run_status(p) == "finished"]
    missing = [p.name for p in plans if p not in done]
    results = [run_result(p) for p in done]
    per_algo = aggregate(results, algos)
    first = plans[0].cfg
    meta = {**meta, "eval_split": first.env.eval_split,
            "eval_episodes": results[0]["final"]["episodes"] if results else 0,
            "budget_text": f"{first.train.iterations} iterations × {first.train.tasks_per_batch} tasks × "
                           f"G={first.algo.num_generations} = {results[0]['train_episodes'] if results else '?'}"}
    summary = {**meta, "algorithms": per_algo, "runs": results, "missing": missing}
    out.mkdir(parents=True, exist_ok=True)
    (out / "summary.json").write_text(json.dumps(summary, indent=2))
    (out / "summary.md").write_text(summary_markdown(meta, per_algo, results, missing))
    if per_algo:
        plot_curves(per_algo, out / "curves.png")
    return summary
