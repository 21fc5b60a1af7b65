"""The paper's comparison tables from run folders (``empo2 report``).

Inputs, any mix: a run folder (``config.yaml`` + ``eval/final.json``), a compare folder (its record ``scores.jsonl.gz``
and any run folders in ``runs/`` it does not hold; seeds of one method are averaged and their number n is shown), an
adaptation folder (``adapt.json``
from ``empo2 adapt``), or a folder holding adaptation folders. Outputs ``report.md``, ``report.json`` and one PNG of
bars per table:

- ScienceWorld: tasks × methods (mean score), with an average row (the paper's Table 1 layout);
- WebShop: score and success per method (Table 2), one table per environment label, so the bundled fixture
  (``webshop-fixture``) is never shown as WebShop;
- OOD: topic pairs × methods, the best trial's score, its gain over trial 0 and the later-trials gain (which picks
  no trial), each with a 95% CI over task variations and its n (Table 3; :mod:`empo2.experiments.ood_stats`). A
  gain over a trial 0 ≤ 0 is shown in points, never as a percentage. A cell with a no-memory control of the same
  weights and seed (``adapt --baseline none``) is also compared with it, variation by variation.

Under each run table, the methods over seeds (:mod:`empo2.experiments.stats`): mean final score and success with
95% t intervals, final − start, and the paired difference of every two methods (seeds paired by ``train.seed``)
with its 95% CI, paired t-test p and one sentence on whether it is distinguishable from zero at this n. A run's score
there is the mean of the episodes its ``eval/final.json`` (or its record) stores.

A method is the run's ``algo.name``, plus ``+<estimator>`` when ``algo.advantage`` is not that algorithm's own, or the
ablation arm it ran (``algo.arm``, :mod:`empo2.experiments.arm_runs`).
"""

from __future__ import annotations

import json
from collections import defaultdict
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import numpy as np
import yaml

from empo2.algo.registry import ALGORITHMS
from empo2.config import ConfigError, flat_settings
from empo2.config.sections import AlgoConfig
from empo2.experiments import arm_runs, ood_stats, records, stats


def method_label(cfg) -> str:
    """``empo2``, ``grpo``, ``gigpo``, ``empo2+gigpo`` … from a Config (or its ``algo`` mapping); GiGPO with
    ``algo.gigpo.normalization=mean_std_norm`` gets ``-std`` (``gigpo-std``, ``empo2+gigpo-std``), ProxMO with a part
    switched off ``-no-psc`` / ``-no-psa`` (``proxmo``, ``empo2+proxmo``, ``proxmo-no-psa``); an algorithm whose
    method has no novelty bonus, run with one, gets ``+novelty`` (``gigpo+novelty``); a run of an ablation arm is
    labelled by its ``algo.arm`` (``empo2-no-offpolicy`` …)."""
    settings = flat_settings({"algo": cfg.get("algo", {})} if isinstance(cfg, dict) else cfg.to_dict())
    algo = {key.removeprefix("algo."): value for key, value in settings.items() if key.startswith("algo.")}
    if algo.get("arm"):
        return algo["arm"]
    label = _estimator_label(algo)
    spec = ALGORITHMS.get(algo.get("name", "empo2"))
    defaults = {k: getattr(AlgoConfig, k) for k in ("intrinsic_weight", "intrinsic_schedule", "intrinsic_weight_start",
                                                    "intrinsic_weight_end")}
    bonus = arm_runs.novelty_on(SimpleNamespace(**{**defaults, **algo}))
    return f"{label}{arm_runs.NOVELTY_SUFFIX}" if bonus and spec is not None and not spec.novelty else label


def _estimator_label(algo: dict[str, Any]) -> str:
    name, advantage = algo.get("name", "empo2"), algo.get("advantage", "grpo")
    spec = ALGORITHMS.get(name)
    fixed = spec is not None and spec.advantage is not None  # e.g. gigpo: its own estimator, whatever the config says
    label = name if fixed or advantage == "grpo" else f"{name}+{advantage}"
    estimator = spec.advantage if fixed else advantage
    std = algo.get("gigpo.normalization") == "mean_std_norm"
    if estimator == "proxmo":  # a part switched off outside compare's arms is said in the label
        label += "".join(f"-no-{part}" for part in ("psc", "psa") if not algo.get(f"proxmo.{part}", True))
    return f"{label}-std" if estimator == "gigpo" and std else label


def collect(paths: list[str | Path], partial: bool = False) -> dict[str, list]:
    """Read every input into ``{"runs": [...], "adapt": [...], "unfinished": [...]}``; a folder that is none of the
    kinds is an error, and so is a run without its final eval unless ``partial``, which lists it in ``unfinished``."""
    found: dict[str, list] = {"runs": [], "adapt": [], "unfinished": []}
    for p in map(Path, paths):
        if not p.is_dir():
            raise ConfigError(f"no such folder: {p}")
        recorded = records.read(p / records.RECORD_FILE, missing_ok=True)  # a run folder holds none
        runs = [p] if (p / "config.yaml").is_file() else sorted(q for q in (p / "runs").glob("*") if q.is_dir()
                                                                    and q.name not in recorded)
        adapts = [p] if (p / "adapt.json").is_file() else sorted(q.parent for q in p.glob("*/adapt.json"))
        if not runs and not adapts and not recorded:
            raise ConfigError(f"{p} is not a run folder (config.yaml), a compare folder ({records.RECORD_FILE} or "
                              "runs/) or an adaptation folder (adapt.json)")
        try:
            found["runs"] += [_read_record(p, r) for r in recorded.values()]
            for r in runs:
                if partial and not (r / "eval" / "final.json").is_file():
                    found["unfinished"].append(_read_unfinished(r))
                elif (r / "config.yaml").is_file():
                    found["runs"].append(_read_run(r))
            found["adapt"] += [_read_adapt(a) for a in adapts]
        except (ValueError, yaml.YAMLError, KeyError, TypeError, AttributeError) as exc:  # JSON errors are ValueErrors
            raise ConfigError(f"{p}: unreadable run or adaptation file ({type(exc).__name__}: {exc})") from None
    return found


def _read_run(run: Path) -> dict[str, Any]:
    final = run / "eval" / "final.json"
    if not final.is_file():
        raise ConfigError(f"{run} has no eval/final.json (the run has not finished; --partial reports the finished "
                          "runs and names the others)")
    cfg = yaml.safe_load((run / "config.yaml").read_text()) or {}
    start = run / "eval" / "start.json"
    return _run_row(str(run), cfg, json.loads(final.read_text()),
                    json.loads(start.read_text()) if start.is_file() else None)


def _read_record(folder: Path, record: dict[str, Any]) -> dict[str, Any]:
    """A run recorded in a compare folder's ``scores.jsonl.gz``."""
    final = records.eval_result(record, "final")
    if final is None:
        raise ConfigError(f"{folder / records.RECORD_FILE}: run {record['name']} has no final eval")
    return _run_row(f"{folder / records.RECORD_FILE}:{record['name']}", record["config"], final,
                    records.eval_result(record, "start"))


def _run_row(path: str, cfg: dict[str, Any], final: dict[str, Any], start: dict[str, Any] | None) -> dict[str, Any]:
    return {"path": path, "method": method_label(cfg), "env": cfg.get("env", {}).get("name", "scienceworld"),
            "label": _run_label(path, cfg, final), "seed": int(cfg.get("train", {}).get("seed", 0)),
            "summary": final["summary"], "per_task": final.get("per_task", {}),
            "score": stats.run_score(final, f"{path} final eval"), "success": stats.run_success(final),
            "start": stats.run_score(start, f"{path} start eval") if start is not None else None}


def _read_unfinished(run: Path) -> dict[str, Any]:
    """A run left out by ``--partial``: its folder, and the method and table it will join once it has finished (none
    known for a run stopped before it saved its config)."""
    if not (run / "config.yaml").is_file():
        return {"path": str(run), "method": None, "label": None}
    cfg = yaml.safe_load((run / "config.yaml").read_text()) or {}
    return {"path": str(run), "method": method_label(cfg), "label": _run_label(run, cfg, {})}


def _run_label(run: Path | str, cfg: dict[str, Any], result: dict[str, Any]) -> str:
    """The label the run's eval recorded; for a result without one, its environment's own rule applied to the saved
    config (WebShop without its data is ``webshop-fixture``), so a fixture run is never shown as WebShop."""
    if result.get("label"):
        return result["label"]
    from empo2.config import Config
    from empo2.envs.factory import env_label

    try:
        return env_label(Config.from_dict({"env": cfg.get("env") or {}}, record=True).env)
    except ConfigError as exc:
        raise ConfigError(f"{run}: eval/final.json records no label and config.yaml's env gives none ({exc})") from None


def _read_adapt(folder: Path) -> dict[str, Any]:
    data = json.loads((folder / "adapt.json").read_text())
    ood_stats.per_variation(data)  # read now, so that a damaged trial fails here, naming its folder
    return {"path": str(folder), "method": data.get("method", "?"), "label": data.get("label", "?"),
            "pair": data.get("pair") or data.get("preset") or ", ".join(data.get("tasks", [])),
            "best": data["best"], "scores": data["scores"], "trial0": data.get("trial0", data["scores"][0]),
            "trials": data.get("trials", []), "seed": data.get("seed"), "weights": data.get("weights_sha256"),
            "baseline": data.get("baseline", "reflexion" if data.get("method") == "reflexion" else "memory")}


def _mean(values: list[float]) -> float | None:
    values = [v for v in values if v is not None]
    return float(np.mean(values)) if values else None


def tables(found: dict[str, list[dict[str, Any]]]) -> dict[str, Any]:
    """The numbers of every table (seeds averaged), keyed by table name (``scienceworld``, ``webshop-fixture`` …)."""
    out: dict[str, Any] = {}
    by_label: dict[str, dict[str, list]] = defaultdict(lambda: defaultdict(list))
    for r in found["runs"]:
        by_label[r["label"]][r["method"]].append(r)
    for label, methods in sorted(by_label.items()):
        over_seeds = _over_seeds(methods)
        if label == "scienceworld":
            tasks = sorted({t for runs in methods.values() for r in runs for t in r["per_task"]})
            out[label] = {"kind": "scienceworld", "tasks": tasks, "methods": {}}
            for m, runs in sorted(methods.items()):
                per_task = {t: _mean([r["per_task"].get(t, {}).get("score_mean") for r in runs]) for t in tasks}
                out[label]["methods"][m] = {"n": len(runs), "per_task": per_task,
                                            "average": _mean(list(per_task.values()))}  # over tasks, as the paper
        else:
            out[label] = {"kind": "webshop", "methods": {
                m: {"n": len(runs), "score": _mean([r["summary"]["score_mean"] for r in runs]),
                    "success": _mean([r["summary"]["success_rate"] * 100 for r in runs])}
                for m, runs in sorted(methods.items())}}
        out[label]["stats"] = over_seeds
        left_out = [{"path": u["path"], "method": u["method"]} for u in found["unfinished"] if u["label"] == label]
        if left_out:
            out[label]["unfinished"] = left_out
    if found["adapt"]:
        cells: dict[str, dict[str, list]] = defaultdict(lambda: defaultdict(list))
        for a in found["adapt"]:
            cells[a["pair"]][f"{a['method']} ({a['label']})"].append(a)
        for pair, row in cells.items():
            for m, adapts in row.items():
                _refuse_repeated_adapt(pair, m, adapts)
        methods = sorted({m for row in cells.values() for m in row})
        out["ood"] = {"kind": "ood", "methods": methods, "method_text": ood_stats.METHOD_TEXT, "pairs": {
            pair: {m: ood_stats.ood_cell(row[m]) for m in row} for pair, row in sorted(cells.items())},
            "versus_control": _versus_control(found["adapt"])}
    return out


def _versus_control(adapts: list[dict[str, Any]]) -> dict[str, dict[str, Any]]:
    """Every memory cell against the no-memory control (``--baseline none``) of the same pair, weights and seed:
    ``{pair: {"<method> − <control>": versus}}`` (:func:`ood_stats.versus_control`)."""
    controls = {(a["pair"], a["weights"], a["seed"]): a for a in adapts
                if a["baseline"] == "none" and a["seed"] is not None}
    matched: dict[str, dict[str, list]] = defaultdict(lambda: defaultdict(list))
    for a in adapts:
        control = controls.get((a["pair"], a["weights"], a["seed"]))
        if control is not None and a["baseline"] != "none":
            matched[a["pair"]][f"{a['method']} − {control['method']}"].append((a, control))
    return {pair: {m: ood_stats.versus_control(v) for m, v in sorted(row.items())}
            for pair, row in sorted(matched.items())}


def _refuse_repeated_adapt(pair: str, method: str, adapts: list[dict[str, Any]]) -> None:
    """A seeded adaptation replays the same episodes when rerun with the same weights and seed; pooling the rerun
    would count its variations twice. Cells from before adapt recorded a seed sampled unseeded and are kept."""
    seen: dict[tuple, str] = {}
    for a in adapts:
        if a["seed"] is None:
            continue
        key = (a["weights"], a["seed"])
        if key in seen:
            raise ConfigError(f"OOD cell {pair} / {method}: {seen[key]} and {a['path']} adapted the same weights with "
                              f"--seed {a['seed']}, so they played the same episodes; give each seed once")
        seen[key] = a["path"]


def _over_seeds(methods: dict[str, list[dict[str, Any]]]) -> dict[str, Any]:
    """CIs over seeds and paired differences (seeds paired by ``train.seed``) of one table's methods."""
    rows = []
    for m, runs in sorted(methods.items()):
        seeds = [r["seed"] for r in runs]
        twice = sorted({s for s in seeds if seeds.count(s) > 1})
        if twice:
            raise ConfigError(f"method {m} has more than one run with train.seed {twice[0]} "
                              f"({', '.join(r['path'] for r in runs if r['seed'] == twice[0])}); give each seed once")
        rows += [{"arm": m, "seed": r["seed"], "score": r["score"], "success": r["success"], "start": r["start"]}
                 for r in runs]
    return stats.summarise_arms(rows, sorted(methods))


def _fmt(x: float | None, digits: int = 1) -> str:
    return "–" if x is None else f"{x:.{digits}f}"


def markdown(tabs: dict[str, Any]) -> str:
    """All tables as markdown, each headed by its environment label."""
    parts = []
    for label, t in tabs.items():
        heads = [f"{m} (n={v['n']})" for m, v in t["methods"].items()] if t["kind"] != "ood" else t["methods"]
        if t["kind"] == "scienceworld":
            lines = [f"### ScienceWorld — env `{label}`: mean score per task (eval without memory)", "",
                     "| task | " + " | ".join(heads) + " |", "|---|" + "---:|" * len(heads)]
            for task in t["tasks"]:
                lines.append(f"| {task} | " + " | ".join(_fmt(v["per_task"][task]) for v in t["methods"].values())
                             + " |")
            lines.append("| **average** | " + " | ".join(f"**{_fmt(v['average'])}**" for v in t["methods"].values())
                         + " |")
        elif t["kind"] == "webshop":
            title = "WebShop" if label.startswith("webshop") else "Score and success"
            lines = [f"### {title} — env `{label}`: score and success (eval without memory)", "",
                     "| method | n | score | success (%) |", "|---|---:|---:|---:|"]
            for m, v in t["methods"].items():
                lines.append(f"| {m} | {v['n']} | {_fmt(v['score'])} | {_fmt(v['success'])} |")
        else:
            lines = _ood_lines(t)
        if "stats" in t:  # the run tables: their methods over seeds
            for line in arm_runs.describe(t["methods"]):
                lines += ["", line]
            lines += ["", f"Over seeds, env `{label}` (a run's score: the mean of its eval episodes):", "",
                      *stats.stats_markdown(t["stats"])]
        parts.append("\n".join(lines))
    return "\n\n".join(parts) + "\n"


def _ood_lines(t: dict[str, Any]) -> list[str]:
    """The OOD table: one row per (topic pair, method), best trial, its gain over trial 0 and the later-trials gain,
    with CIs over variations."""
    lines = ["### OOD adaptation (memory only, weights unchanged): best trial and gain over trial 0", "",
             ("| pair | method | runs | n variations | trial 0 | best trial | 95% CI | gain over trial 0 | "
              "95% CI (points) | later trials − trial 0 | 95% CI (points) |"),
             "|---|---|---:|---:|---:|---:|---|---:|---|---:|---|"]
    notes = []
    for pair, row in t["pairs"].items():
        for m in t["methods"]:
            if m not in row:
                continue
            c = row[m]
            n = "n/a" if c["n_variations"] is None else str(c["n_variations"])
            lines.append(f"| {pair} | {m} | {c['n']} | {n} | {_fmt(c['trial0'])} | {_fmt(c['best'])} | "
                         f"{stats.fmt_ci(c['best_ci'])} | {ood_stats.gain_text(c['trial0'], c['gain'])} | "
                         f"{stats.fmt_ci(c['gain_ci'])} | {ood_stats.later_text(c)} | "
                         f"{stats.fmt_ci(c['later_gain_ci'])} |")
            if c["note"]:
                notes.append(f"- {pair}, {m}: {c['note']}.")
    versus = [(pair, m, v) for pair, row in t.get("versus_control", {}).items() for m, v in row.items()]
    if versus:
        lines += ["", "Against the no-memory control of the same weights and seed (same trial 0; per variation, the "
                  "mean of trials 1…K−1 of the cell minus the control's):", "",
                  "| pair | cell − control | n variations | later trials, difference | 95% CI (points) |",
                  "|---|---|---:|---:|---|"]
        for pair, m, v in versus:
            diff = "n/a" if v["diff"] is None else f"{v['diff']:+.1f} pts"
            lines.append(f"| {pair} | {m} | {v['n_variations']} | {diff} | {stats.fmt_ci(v['ci'])} |")
            if v["trial0_differs"]:
                notes.append(f"- {pair}, {m}: trial 0 differs in {v['trial0_differs']} variations (played by "
                             "different code or settings?), so the control does not share its start.")
            if v["note"]:
                notes.append(f"- {pair}, {m}: {v['note']}.")
    return [*lines, "", *notes, *([""] if notes else []), f"Method: {t['method_text']}"]


def plot(tabs: dict[str, Any], out: Path) -> list[Path]:
    """One grouped bar chart per table: ``<table>.png``."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    paths = []
    for label, t in tabs.items():
        if t["kind"] == "scienceworld":
            groups, series = t["tasks"] + ["average"], {m: [*v["per_task"].values(), v["average"]]
                                                        for m, v in t["methods"].items()}
        elif t["kind"] == "webshop":
            groups, series = ["score", "success (%)"], {m: [v["score"], v["success"]] for m, v in t["methods"].items()}
        else:
            groups = list(t["pairs"])
            series = {m: [t["pairs"][p].get(m, {}).get("best") for p in groups] for m in t["methods"]}
        fig, ax = plt.subplots(figsize=(max(5.0, 1.1 * len(groups) * max(1, len(series)) ** 0.5), 3.8))
        width = 0.8 / max(len(series), 1)
        for k, (m, ys) in enumerate(series.items()):
            x = np.arange(len(groups)) + (k - (len(series) - 1) / 2) * width
            ax.bar(x, [np.nan if y is None else y for y in ys], width, label=m)
        ax.set_xticks(np.arange(len(groups)), groups, rotation=30 if len(groups) > 3 else 0, ha="right", fontsize=7)
        ax.set_title(f"{t['kind']} — env {label}" if t["kind"] != "ood" else "OOD adaptation: best mean score")
        ax.axhline(0, color="grey", linewidth=0.5)
        ax.grid(alpha=0.3, axis="y")
        ax.legend(fontsize=7)
        fig.tight_layout()
        paths.append(Path(out) / f"{label}.png")
        fig.savefig(paths[-1], dpi=110)
        plt.close(fig)
    return paths


def write_report(paths: list[str | Path], out: Path, partial: bool = False) -> dict[str, Any]:
    """Read ``paths``, then write ``report.md``, ``report.json`` and the PNGs into ``out``; returns the tables. With
    ``partial``, runs that have not finished are left out: report.md names them above the tables, and report.json
    lists them as ``unfinished`` in the table they will join (a table none of whose runs has finished is not made)."""
    if Path(out).exists() and not Path(out).is_dir():
        raise ConfigError(f"--out {out} is a file; give a folder for report.md, report.json and the PNGs")
    found = collect(paths, partial)  # every input is read (and may fail) before anything is written
    tabs = tables(found)
    out = Path(out)
    out.mkdir(parents=True, exist_ok=True)
    head = ""
    if found["unfinished"]:
        head = ("**Partial report.** Left out, not finished (each n counts finished runs only): "
                + ", ".join(f"`{u['path']}`" for u in found["unfinished"]) + ".\n\n")
    (out / "report.md").write_text(head + markdown(tabs))
    (out / "report.json").write_text(json.dumps(tabs, indent=2))
    plot(tabs, out)
    return tabs
