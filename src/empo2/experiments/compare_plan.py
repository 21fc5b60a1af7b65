"""The runs of one ``empo2 compare``: the arms and seeds its command line names, and each (arm, seed) run's config,
built and checked before anything runs (:mod:`empo2.experiments.compare` runs them and writes the summary).

An arm is an algorithm (``grpo``), an algorithm with another advantage estimator (``empo2+gigpo``), GiGPO's ``-std``
variant, an algorithm with the config's novelty bonus (``+novelty``) or an ablation arm of
:mod:`empo2.experiments.arm_runs`; :func:`check_estimator_used` refuses a name that would run something other than
what it says. A run folder or a record made under other settings is refused here too (:func:`plan_runs`), so a
comparison never resumes or counts a run that is not its own.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from empo2.config import Config, ConfigError, flat_settings
from empo2.experiments import records
from empo2.experiments.arm_runs import (
    ARMS,
    NOVELTY_SUFFIX,
    STD_SUFFIX,
    arm_overrides,
    novelty_on,
    split_arm,
    wants_novelty,
)
from empo2.policy.precision import settle_autocast
from empo2.rundir import warm_start

SET_BY_COMPARE = ("algo.name", "algo.arm", "algo.gigpo.normalization", "algo.proxmo.psc", "algo.proxmo.psa",
                  "train.seed", "train.output_dir", "train.eval_at_start")
"""``--algos gigpo-std``: GiGPO divided by the group std (``mean_std_norm``); report's ``method_label`` writes it so."""
COSMETIC = ("train.output_dir", "train.progress")  # may differ between invocations without changing a run
"""Besides these, the ``sft`` section (how the warm start was made; its checksum is ``policy.warm_start_sha256``)."""


@dataclass
class RunPlan:
    """One (algorithm, seed) run of a comparison."""

    algo: str
    seed: int
    folder: Path
    cfg: Config
    command: dict[str, Any]
    """The comparison's ``--config`` file and overrides, as its record states them."""
    recorded: dict[str, Any] | None = None
    """This run's record in ``scores.jsonl.gz`` (:mod:`empo2.experiments.records`), when it is there."""

    @property
    def name(self) -> str:
        return f"{self.algo}-seed{self.seed}"

    @property
    def record_path(self) -> Path:
        return self.folder.parent.parent / records.RECORD_FILE


def parse_algos(text: str) -> list[str]:
    """``grpo,empo2`` → ``["grpo", "empo2"]``. Every name is an ablation arm or an algorithm (its estimator is checked
    later by the config's own validation)."""
    from empo2.algo.registry import ALGORITHMS

    algos = [a.replace(" ", "") for a in text.split(",") if a.strip()]
    if not algos:
        raise ConfigError("--algos needs at least one algorithm name, e.g. --algos grpo,empo2")
    if len(set(algos)) != len(algos):
        raise ConfigError(f"--algos names an algorithm twice: {text}")
    for algo in algos:
        if algo not in ARMS and split_arm(algo)[0] not in ALGORITHMS:
            raise ConfigError(f"--algos: unknown arm {algo!r}; valid: an algorithm (algo.name: "
                              f"{', '.join(sorted(ALGORITHMS))}, also NAME+ESTIMATOR, GiGPO's -std and "
                              f"{NOVELTY_SUFFIX}) or an ablation ({', '.join(ARMS)})")
    return algos


SEEDS_HELP = "seeds as a list and/or ranges: 3 (seed 3), 1,4,7, 0-4 (seeds 0 to 4), 0-2,9"


def parse_seeds(text: str) -> list[int]:
    """``--seeds``: always seed values, never a count. ``3`` → [3]; ``1,4,7`` → [1, 4, 7]; ``0-4`` → [0, 1, 2, 3,
    4]; items may be mixed (``0-2,9``). Seeds are non-negative and distinct."""
    seeds: list[int] = []
    for item in (p.strip() for p in str(text).split(",")):
        first, dash, last = item.partition("-")
        if not (first.isdigit() and (not dash or last.isdigit())):
            raise ConfigError(f"--seeds: {item!r} is not a seed or a range A-B ({SEEDS_HELP}), got {text!r}")
        lo, hi = int(first), int(last) if dash else int(first)
        if hi < lo:
            raise ConfigError(f"--seeds: range {item!r} runs backwards; write {hi}-{lo}")
        seeds += range(lo, hi + 1)
    if len(set(seeds)) != len(seeds):
        raise ConfigError(f"--seeds names a seed twice: {text!r}")
    return seeds


def plan_runs(config: str, algos: list[str], seeds: list[int], out: Path, overrides: list[str],
              check: Callable[[Config], None] | None = None) -> list[RunPlan]:
    """Build and validate every run's config before anything is written (a bad name fails here, exit 2)."""
    if Path(out).exists() and not Path(out).is_dir():
        raise ConfigError(f"--out {out} is a file, not a folder")
    for item in overrides:
        key = item.split("=", 1)[0].strip()
        full = Config().current_keys(key) if "=" in item else ()
        if set(full) & set(SET_BY_COMPARE):
            raise ConfigError(f"{key} is set by compare (--algos, e.g. gigpo-std; --seeds, --out; eval_at_start "
                              "is always on), not by an override")
        fixed_by = [a for a in algos if a in ARMS and set(full) & {f"algo.{k}" for k in ARMS[a].fixed()}]
        if fixed_by:  # the arm's own value would win silently over the one asked for
            raise ConfigError(f"{key} is fixed by the ablation arm {fixed_by[0]} ({ARMS[fixed_by[0]].what}); "
                              "drop the override or that arm")
    plans, recorded = [], records.read(Path(out) / records.RECORD_FILE, missing_ok=True)  # made by this command
    command = {"config": config, "overrides": list(overrides)}
    for seed in seeds:  # seed-major: an interrupted comparison has every algorithm on its first seeds
        for algo in algos:
            folder = Path(out) / "runs" / f"{algo}-seed{seed}"
            cfg = Config.load(config, [*overrides, *run_overrides(algo, seed, folder)])
            settle_autocast(cfg.policy)  # as the run will record it, so a finished run's saved config matches
            warm_start.settle(cfg.policy)  # likewise the warm start's checksum
            check_estimator_used(algo, cfg)
            if check is not None:
                check(cfg)
            plan = RunPlan(algo, seed, folder, cfg, command, recorded.get(f"{algo}-seed{seed}"))
            _check_same_settings(plan)
            plans.append(plan)
    return plans


def run_overrides(algo: str, seed: int, folder: Path) -> list[str]:
    """What compare adds to the overrides of one run: its arm's settings, its seed, its folder and the start eval."""
    return [*arm_overrides(algo), f"train.seed={seed}", f"train.output_dir={folder}", "train.eval_at_start=true"]


def check_estimator_used(algo: str, cfg: Config) -> None:
    """``gigpo+grpo``, ``grpo-std`` or a ``+novelty`` arm without a bonus would be labelled one thing and run
    another: refuse them."""
    from empo2.algo.registry import ALGORITHMS

    if algo in ARMS:
        return
    name, estimator, std = split_arm(algo)
    if wants_novelty(algo) and ALGORITHMS[name].novelty:
        raise ConfigError(f"--algos {algo}: {name} runs its novelty bonus as part of its method; drop "
                          f"'{NOVELTY_SUFFIX}'")
    if wants_novelty(algo) and not novelty_on(cfg.algo):
        raise ConfigError(f"--algos {algo}: '{NOVELTY_SUFFIX}' keeps the config's novelty bonus, but it has none "
                          "(algo.intrinsic_weight=0); set algo.intrinsic_weight > 0 or drop the arm")
    used = ALGORITHMS[name].estimator(cfg.algo)
    if estimator and used != estimator:
        raise ConfigError(f"--algos {algo}: algorithm {name!r} always uses the {used!r} advantage; "
                          f"drop '+{estimator}'")
    if std and used != "gigpo":
        raise ConfigError(f"--algos {algo}: '{STD_SUFFIX}' selects GiGPO's mean_std_norm, but {name!r} uses the "
                          f"{used!r} advantage (write e.g. gigpo-std or {name}+gigpo-std)")


def _check_same_settings(plan: RunPlan) -> None:
    """A run folder started with other settings is never resumed under a comparison it does not belong to, nor is
    a run recorded with other settings counted as this comparison's."""
    saved = plan.folder / "config.yaml"
    if saved.is_file():
        old, where = Config.load(saved), f"{plan.folder} was started"
    elif plan.recorded is not None:
        old = Config.from_dict(plan.recorded["config"], record=True)
        where = f"{plan.name} was recorded in {plan.record_path}"
    else:
        return
    flat, new = flat_settings(old.to_dict()), flat_settings(plan.cfg.to_dict())
    diff = [k for k in sorted(new) if k not in COSMETIC and not k.startswith("sft.") and flat.get(k) != new[k]]
    if diff:
        shown = ", ".join(f"{k}: {flat.get(k)!r} → {new[k]!r}" for k in diff[:3])
        remedy = "that run folder" if saved.is_file() else f"its lines from {records.RECORD_FILE}"
        raise ConfigError(f"{where} with other settings ({shown}); use another --out or delete {remedy}")
