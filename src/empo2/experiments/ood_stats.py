"""The numbers of an OOD adaptation (``empo2 adapt``): the gain over trial 0 and 95% CIs over task variations.

- The gain over trial 0 is ``best − trial 0``. Over a positive start it is shown as a percentage of the start, over
  a start ≤ 0 in points: a percentage of a negative or zero score says nothing (−50 → 0 would read +100%). Its CI is
  always in points.
- The CIs' unit is a (task, variation) pair, which adapt plays once per trial (``trials[k]["per_episode"]`` in
  ``adapt.json``). The best-trial score's CI is the Student t interval (:func:`stats.mean_ci`) of that trial's
  per-variation scores; the gain's is that of the per-variation differences best trial − trial 0. The best trial is
  picked on these same episodes, so its score leans optimistic, and the CIs do not include that choice: the best of
  10 noisy trials beats trial 0 with no adaptation at all. The later-trials gain involves no pick: per variation,
  the mean of trials 1…K−1 minus trial 0, with the same t interval. Several adaptations of one cell (e.g. one per
  trained seed) pool their pairs.
- Against its control: a cell of the same weights and ``--seed`` played with ``--baseline none`` starts from the same
  trial 0 and differs afterwards only by memory. Per variation, the mean of trials 1…K−1 of the cell minus that of
  the control, with the same t interval, is the gain memory adds over what sampling alone moves.
"""

from __future__ import annotations

from typing import Any

import numpy as np

from empo2.experiments import stats

UNIT = "task variations"
METHOD_TEXT = (f"95% CIs over {UNIT}: Student t interval (needs ≥ {stats.MIN_CI}) of the best trial's per-variation scores and "
               "of the per-variation gains best trial − trial 0; the best trial is chosen on the same episodes, so that "
               "gain leans optimistic. The later-trials gain (mean of trials 1…K−1 − trial 0 per variation, same "
               "CI) picks nothing. A gain over a trial 0 ≤ 0 is given in points, never as a percentage. Against a "
               "no-memory control, the per-variation difference of the later-trial means, same CI.")


def gain_pct(trial0: float, best: float) -> float | None:
    """``(best − trial0) / trial0`` in percent, or ``None`` when trial 0 scored ≤ 0."""
    return (best - trial0) / trial0 * 100 if trial0 > 0 else None


def gain_text(trial0: float | None, gain: float | None) -> str:
    """``+50%`` over a positive trial 0, ``+50.0 pts`` over one ≤ 0."""
    if trial0 is None or gain is None:
        return "n/a"
    return f"{gain / trial0 * 100:+.0f}%" if trial0 > 0 else f"{gain:+.1f} pts"


def later_text(cell: dict[str, Any]) -> str:
    """The later-trials gain in points, ``n/a`` when the trials store no episodes or there is one trial."""
    return "n/a" if cell["later_gain"] is None else f"{cell['later_gain']:+.1f} pts"


def _per_trial(report: dict[str, Any]) -> list[dict[tuple[str, int], float]] | None:
    """Each trial's score per (task, variation), or ``None`` when the trials store no episodes."""
    trials = report.get("trials") or []
    if not trials or any("per_episode" not in t for t in trials):
        return None
    return [{(e["task"], int(e["variation"])): float(e["score"]) for e in t["per_episode"]} for t in trials]


def per_variation(report: dict[str, Any]) -> tuple[list[float], list[float], list[float]] | None:
    """(best-trial scores, gains over trial 0, later-trials gains) per (task, variation), or ``None`` when the
    trials store no episodes. A later-trials gain is the mean of trials 1…K−1 minus trial 0 (none with one trial)."""
    per = _per_trial(report)
    if per is None:
        return None
    trials = report["trials"]
    best = int(np.argmax([t["score_mean"] for t in trials]))  # the first of equal trials, as max() picks
    keys = sorted(set.intersection(*map(set, per)))
    later = [float(np.mean([p[k] for p in per[1:]], dtype=np.float64)) - per[0][k] for k in keys] if per[1:] else []
    return [per[best][k] for k in keys], [per[best][k] - per[0][k] for k in keys], later


def ood_cell(reports: list[dict[str, Any]]) -> dict[str, Any]:
    """One table cell from the ``adapt.json`` of each adaptation of one (topic pair, method): the means over them of
    trial 0, best trial and gain, and the CIs over their pooled task variations (``None`` with a ``note`` when an
    adaptation stores no per-variation scores)."""
    trial0 = float(np.mean([r.get("trial0", r["scores"][0]) for r in reports], dtype=np.float64))
    best = float(np.mean([r["best"] for r in reports], dtype=np.float64))
    cell: dict[str, Any] = {"n": len(reports), "trial0": trial0, "best": best, "gain": best - trial0,
                            "gain_pct": gain_pct(trial0, best), "n_variations": None, "best_ci": None,
                            "gain_ci": None, "later_gain": None, "later_gain_ci": None, "note": ""}
    parts = [per_variation(r) for r in reports]
    if any(p is None for p in parts):
        cell["note"] = "adapt.json stores no per-variation scores (trials[k].per_episode): no CI; rerun adapt for one"
        return cell
    best_units = [s for p in parts for s in p[0]]
    gain_units = [g for p in parts for g in p[1]]
    later_units = [g for p in parts for g in p[2]]
    best_ci, gain_ci = stats.mean_ci(best_units, UNIT), stats.mean_ci(gain_units, UNIT)
    cell.update(n_variations=len(best_units), best_ci=best_ci["ci"], gain_ci=gain_ci["ci"], note=best_ci["note"])
    if later_units:
        cell.update(later_gain=float(np.mean(later_units, dtype=np.float64)),
                    later_gain_ci=stats.mean_ci(later_units, UNIT)["ci"])
    return cell


def cell_text(cell: dict[str, Any]) -> str:
    """One sentence: best trial, trial 0 and gain, each with its CI and n."""
    n = "n/a" if cell["n_variations"] is None else cell["n_variations"]
    return (f"best trial {cell['best']:.1f} (95% CI {stats.fmt_ci(cell['best_ci'])}); trial 0 {cell['trial0']:.1f}; "
            f"gain {gain_text(cell['trial0'], cell['gain'])} (95% CI in points {stats.fmt_ci(cell['gain_ci'])}); "
            f"later-trials gain {later_text(cell)} (95% CI {stats.fmt_ci(cell['later_gain_ci'])}); "
            f"n = {n} {UNIT}" + (f" ({cell['note']})" if cell["note"] else ""))


def versus_control(matched: list[tuple[dict[str, Any], dict[str, Any]]]) -> dict[str, Any]:
    """A cell against its no-memory control, from (cell ``adapt.json``, control ``adapt.json``) pairs of the same
    weights and seed: the per-variation difference of their later-trial means, pooled over the pairs, with its CI;
    ``trial0_differs`` counts the variations whose trial 0 scores disagree (they should not: same prompts, same
    seeds)."""
    diffs, differs = [], 0
    for cell, control in matched:
        a, b = _per_trial(cell), _per_trial(control)
        if a is None or b is None or len(a) < 2 or len(b) < 2:
            continue
        for key in sorted(set.intersection(*map(set, a), *map(set, b))):
            diffs.append(float(np.mean([p[key] for p in a[1:]], dtype=np.float64)
                               - np.mean([p[key] for p in b[1:]], dtype=np.float64)))
            differs += a[0][key] != b[0][key]
    ci = stats.mean_ci(diffs, UNIT)
    return {"n": len(matched), "n_variations": len(diffs), "diff": ci["mean"], "ci": ci["ci"], "note": ci["note"],
            "trial0_differs": differs}
