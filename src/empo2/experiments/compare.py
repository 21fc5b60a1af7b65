"""``empo2 compare``: several algorithms × seeds on one config with the same budget, then one summary.

Every run is an ordinary run folder ``OUT/runs/<algo>-seed<k>/`` made by ``empo2 train`` (same code path, with
``algo.name``, ``train.seed`` and ``train.eval_at_start=true`` added to the overrides; ``--algos empo2+gigpo`` also
sets ``algo.advantage=gigpo``, and a ``-std`` suffix (``gigpo-std``, ``empo2+gigpo-std``) picks GiGPO's
``algo.gigpo.normalization=mean_std_norm`` where the plain name runs ``mean_norm``; ``proxmo`` and ``empo2+proxmo``
run both of ProxMO's parts (``algo.proxmo.psc`` and ``algo.proxmo.psa`` set true); an algorithm without a novelty
bonus of its own (all but EMPO²'s) runs with ``algo.intrinsic_weight=0`` unless its name ends in ``+novelty``
(``gigpo+novelty``: the config's bonus), so arms differ in their method only; an ablation arm of
:mod:`empo2.experiments.arm_runs` (``empo2-no-offpolicy`` …) sets its algorithm, its settings and ``algo.arm``, the label
``report`` shows). ``--seeds`` names seed values:
``3``, ``1,4,7``, ``0-4``. Runs go one after another (``--jobs N``: N at once, see :func:`run_all`), each in its own
``empo2 train`` subprocess and session: a crash in one run cannot take the others down, and the model, the
environment workers (ScienceWorld JVMs) and the CUDA context are freed when the run ends instead of piling up in one
long-lived process. Re-running the same command skips finished runs and resumes unfinished ones (``--resume``);
a command with other arms or seeds into the same ``--out`` adds its runs to the earlier ones in the summary
(:func:`earlier_runs`). Each finished run is recorded in ``OUT/scores.jsonl.gz`` (:mod:`empo2.experiments.records`);
a run recorded there with the same settings is finished, with or without its folder, so a comparison continues on
another machine from that file alone.

The untrained model's start eval is played once per seed: the first arm of a seed runs it, and a later arm with the
same model, seed and eval settings (:func:`start_eval_key`) gets a copy in its folder instead (``reused_from`` in
its ``eval/start.json``). Every run evaluates the same task variations: the first ``env.eval_variations`` of
``env.eval_split`` per task, as the environment lists them.

All algorithms share ``iterations × tasks_per_batch × num_generations`` training episodes, so the budget is equal
by episodes; the environment steps those episodes took (``env_steps`` in ``metrics.jsonl``) are reported too.
Outputs (:mod:`empo2.experiments.compare_summary`, from ``scores.jsonl.gz``): ``summary.md``, ``summary.json`` (CIs over
seeds, paired differences, and what each arm trains on: its reward, advantage and loss settings and where they differ
from its method's official runs, :func:`empo2.algo.arms.arm_settings`, also printed at the start) and ``curves.png``
(eval score vs environment steps, 95% CI band).
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

from empo2.config import Config, ConfigError, flat_settings
from empo2.experiments import records
from empo2.experiments.arm_runs import arm_settings, settings_line
from empo2.experiments.compare_plan import COSMETIC, RunPlan, parse_algos, parse_seeds, plan_runs, run_overrides
from empo2.rundir import checkpoint as ckpt
from empo2.signals import set_phase


def run_compare(config: str, algos_text: str, seeds_text: str, out: Path, overrides: list[str],
                check: Callable[[Config], None] | None = None, jobs: int = 1,
                reach: Callable[[Config], None] | None = None) -> int:
    """The ``empo2 compare`` command: validate every run, run/resume/skip them, summarise. 0 = all finished.
    ``reach(cfg)`` checks, once, that the evaluation variations can be won within the step cap (every arm shares the
    env section; :func:`empo2.envs.gold.check_reachable`)."""
    from empo2.envs.factory import env_label

    if jobs < 1:
        raise ConfigError(f"--jobs must be 1 or more (runs at once), got {jobs}")
    algos, seeds = parse_algos(algos_text), parse_seeds(seeds_text)
    plans = plan_runs(config, algos, seeds, out, overrides, check)
    if reach is not None:
        reach(plans[0].cfg)
    at_once = f", {jobs} at a time" if jobs > 1 else ""
    say(f"empo2 compare: {', '.join(algos)} × seeds {seeds} = {len(plans)} runs{at_once} → {out}")
    say("What each arm trains on (also in summary.md and summary.json):")
    for algo in algos:
        first = next(p for p in plans if p.algo == algo)
        say(f"  {settings_line(algo, arm_settings(first.cfg.algo))}")
    earlier = earlier_runs(config, out, overrides, plans, check)
    failed = run_all(plans, config, overrides, jobs, out / "logs", earlier)
    every = list(dict.fromkeys([*algos, *(p.algo for p in earlier)]))
    meta = {"config": config, "overrides": overrides, "algos": every,
            "seeds": sorted({*seeds, *(p.seed for p in earlier)}), "label": env_label(plans[0].cfg.env)}
    write_summary(plans + earlier, out, meta, every)
    say((out / "summary.md").read_text())
    say(f"comparison folder: {out}  (summary.md, summary.json, curves.png, {records.RECORD_FILE}, runs/)")
    if failed:
        say(f"{len(failed)} run(s) did not finish: {', '.join(failed)}; re-run the same command to resume them")
        return 1
    return 0


def say(text: str) -> None:
    """One progress line, flushed before a child run writes to the same terminal."""
    print(text, flush=True)


def run_status(plan: RunPlan) -> str:
    """``finished`` (recorded in ``scores.jsonl.gz``, or a final eval written after the last checkpoint), ``resume``
    or ``fresh``."""
    if plan.recorded is not None:
        return "finished"
    if not (plan.folder / "config.yaml").is_file():
        return "fresh"
    last = ckpt.latest_checkpoint(plan.folder)
    if (plan.folder / "eval" / "final.json").is_file() and last is not None \
            and int(last.name[len(ckpt.PREFIX):]) == plan.cfg.train.iterations - 1:
        return "finished"
    return "resume"


def start_eval_key(cfg: Config) -> dict[str, Any]:
    """The settings a start eval depends on: all but the algorithm's (it plays the untrained model before any update),
    except the group size, which sets how many episodes are played in one batch."""
    return {k: v for k, v in flat_settings(cfg.to_dict()).items()
            if k not in COSMETIC and (not k.startswith("algo.") or k == "algo.num_generations")}


def share_start_eval(plan: RunPlan, plans: list[RunPlan], status: str) -> str | None:
    """Before a run's start eval: when another run of this comparison already evaluated the same untrained model
    under the same settings and seed, put that run's ``eval/start.json`` (marked ``reused_from``) and ``start.md``
    into this run's folder, so the trainer skips its own start eval. A fresh run's folder is first emptied of an
    earlier attempt's run files; a resumed run gets the copy only if it stopped before its start eval was written
    and before any checkpoint. Returns the donor's name, or ``None``: the run evaluates itself."""
    from empo2.rundir.runlock import (
        LOCK_NAME,
        RunLock,
        clear_run_folder,
        empty_layout_folders,
        is_run_file,
        mark_run_folder,
        run_folder_owns,
    )

    if status == "resume" and ((plan.folder / "eval" / "start.json").is_file()
                               or ckpt.latest_checkpoint(plan.folder) is not None):
        return None
    if status == "fresh" and plan.folder.is_dir():
        names = [p.name for p in plan.folder.iterdir()]
        unknown = set(names) - {LOCK_NAME} - empty_layout_folders(plan.folder, names)
        if any(not is_run_file(n) for n in names) or (run_folder_owns(plan.folder) is None and unknown):
            return None  # someone else's files, or files not known to be empo2's: train's own check refuses them
        with RunLock(plan.folder):
            clear_run_folder(plan.folder)
    donor = _start_eval_donor(plan, plans)
    if donor is None:
        return None
    start, src = donor
    with RunLock(plan.folder):
        mark_run_folder(plan.folder)  # the start eval is empo2's: the run's own start keeps it
        (plan.folder / "eval").mkdir(exist_ok=True)
        (plan.folder / "eval" / "start.json").write_text(json.dumps(start, indent=2))
        if (src / "start.md").is_file():
            (plan.folder / "eval" / "start.md").write_bytes((src / "start.md").read_bytes())
    return start["reused_from"]


def _start_eval_donor(plan: RunPlan, plans: list[RunPlan]) -> tuple[dict[str, Any], Path] | None:
    """The first other run with a complete start eval under this run's :func:`start_eval_key`: (its result marked
    ``reused_from`` with the run that played it, its eval folder). A run known only by its record (its folder left
    on another machine) gives the start eval its record holds."""
    key = start_eval_key(plan.cfg)
    for other in plans:
        src = other.folder / "eval"
        if other is not plan and other.recorded is not None and not (src / "start.json").is_file():
            start = records.eval_result(other.recorded, "start")
            if start and start.get("episodes") and start_eval_key(other.cfg) == key:
                return {**start, "reused_from": start.get("reused_from") or other.name}, src
            continue
        if other is plan or not (src / "start.json").is_file() or not (other.folder / "config.yaml").is_file():
            continue
        try:
            start = json.loads((src / "start.json").read_text())
            same = start_eval_key(Config.load(other.folder / "config.yaml")) == key
        except (OSError, ValueError, ConfigError):  # a half-written donor is no donor
            continue
        if same and start.get("episodes"):
            return {**start, "reused_from": start.get("reused_from") or other.name}, src
    return None


def train_command(plan: RunPlan, config: str, overrides: list[str], status: str) -> list[str]:
    """The ``empo2 train`` command line of one run (a fresh start or ``--resume``)."""
    cmd = [sys.executable, "-m", "empo2.cli", "train"]
    if status == "resume":
        return cmd + ["--resume", str(plan.folder)]
    cmd += ["--config", config, "--output-dir", str(plan.folder)]
    if plan.folder.exists() and not (plan.folder / "eval" / "start.json").is_file():
        cmd.append("--overwrite")  # a folder left without config.yaml holds nothing worth keeping
    return cmd + [*overrides, *run_overrides(plan.algo, plan.seed, plan.folder)]


def run_all(plans: list[RunPlan], config: str, overrides: list[str], jobs: int = 1,
            logs: Path | None = None, earlier: list[RunPlan] = ()) -> list[str]:
    """Run, resume or skip every plan in order, ``jobs`` at a time; returns the names of runs that failed.

    One run at a time writes to this terminal. With ``jobs`` > 1 each run writes to ``logs/<run>.log`` and gets
    :func:`~empo2.experiments.parallel.threads_per_job` torch threads, and a run waits while another run of its seed
    is still playing the start eval it can reuse; ``earlier`` (finished runs of this comparison that the command does
    not name, :func:`earlier_runs`) lend theirs too. Each run is its own process with its own seeds, so running several
    at once changes their wall time, not their results.
    """
    from empo2.experiments.parallel import run_at_most, spawn_run, threads_per_job

    failed, t_all, heads = [], time.perf_counter(), {}
    env = {**os.environ, "OMP_NUM_THREADS": threads_per_job(jobs)} if jobs > 1 else None

    def launch(i: int) -> subprocess.Popen | None:
        plan, heads[i] = plans[i], f"[{i + 1}/{len(plans)}] {plans[i].name}"
        status = run_status(plan)
        if status == "finished":
            where = "" if (plan.folder / "config.yaml").is_file() else f" (recorded in {plan.record_path})"
            say(f"{heads[i]}: finished already{where}, skipped")
            return None
        log = None if logs is None or jobs == 1 else logs / f"{plan.name}.log"
        say(f"{heads[i]}: {'resuming' if status == 'resume' else 'starting'} → {plan.folder}"
            + (f" (output: {log})" if log else ""))
        if donor := share_start_eval(plan, [*plans, *earlier], status):
            say(f"{heads[i]}: start eval (untrained model, seed {plan.seed}) reused from {donor}")
        set_phase(f"compare run {plan.name} (its own line above says where it stopped)" if log is None else
                  f"compare, {jobs} runs at once (each run's log in {logs} says where it stopped)")
        return spawn_run(train_command(plan, config, overrides, status), log, env)

    def ready(i: int, running: list[int]) -> bool:
        key = start_eval_key(plans[i].cfg)
        return not any(start_eval_key(plans[j].cfg) == key and not (plans[j].folder / "eval" / "start.json").is_file()
                       for j in running)

    def finish(i: int, rc: int, took: float) -> None:
        plan = plans[i]
        if rc != 0 or run_status(plan) != "finished":
            failed.append(plan.name)
            say(f"{heads[i]}: FAILED (exit {rc}) after {took:.0f}s; re-run the same command to resume it")
            return
        from empo2.experiments.compare_summary import record_of

        plan.recorded = record_of(plan)
        records.merge(plan.record_path, [plan.recorded])  # recorded as soon as it ends: a later crash keeps it
        final = plan.recorded["evals"]["final"]["summary"]
        say(f"{heads[i]}: done in {took:.0f}s (total {time.perf_counter() - t_all:.0f}s) · final score "
            f"{final['score_mean']:.1f} · success {final['success_rate']:.2f}")

    run_at_most(jobs, range(len(plans)), launch, ready, finish)
    return failed


# ---------------------------------------------------------------------------------------------------- summary
def earlier_runs(config: str, out: Path, overrides: list[str], plans: list[RunPlan],
                 check: Callable[[Config], None] | None = None) -> list[RunPlan]:
    """The finished runs in ``out/runs/`` or ``out/scores.jsonl.gz`` that this command did not name, when they ran under
    the same config and overrides: a comparison built up over several commands (other arms, more seeds) keeps all its
    runs in one summary, even one whose command stopped before writing it. A run with other settings is left out,
    with a line; its folder and record stay, so a later command with its settings finds it again."""
    named = {(p.algo, p.seed) for p in plans}
    found = {(r["algo"], r["seed"]) for r in records.read(Path(out) / records.RECORD_FILE, missing_ok=True).values()}
    for folder in sorted((Path(out) / "runs").glob("*-seed*")):
        algo, _, seed = folder.name.rpartition("-seed")
        if folder.is_dir() and seed.isdigit():
            found.add((algo, int(seed)))
    kept = []
    for algo, seed in sorted(found - named, key=lambda n: (n[1], n[0])):
        try:
            (plan,) = plan_runs(config, [algo], [seed], out, overrides, check)
        except (ConfigError, OSError) as exc:  # another arm's name, other settings, an unreadable config
            say(f"{algo}-seed{seed}: left out of the summary ({exc})")
            continue
        if run_status(plan) == "finished":
            kept.append(plan)
    return kept


def write_summary(plans: list[RunPlan], out: Path, meta: dict[str, Any], algos: list[str]) -> dict[str, Any]:
    """``scores.jsonl.gz``, then ``summary.md``, ``summary.json`` and ``curves.png`` from it, of the finished runs."""
    from empo2.experiments.compare_summary import write_summary as write

    return write(plans, [p for p in plans if run_status(p) == "finished"], out, meta, algos)
