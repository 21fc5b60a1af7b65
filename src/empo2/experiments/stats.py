"""Statistics over seeds for ``empo2 compare`` and ``empo2 report``: confidence intervals, paired differences, power.

The unit is the seed: a run's score is the mean of its stored eval episodes' scores (``eval/final.json``'s
``episodes``), so anyone can redo these numbers from the run folders. Methods, written into every summary:

- an arm's mean over seeds: its 95% Student t interval, mean ± t(0.975, n − 1) · SD / √n, from
  :data:`MIN_CI` seeds on. At the 3 to 5 seeds a comparison can afford, a percentile bootstrap's interval is about the
  range of the seeds and covers the true mean far less often than 95%; the t interval is exact for normal scores and
  widens as it should when n is small. A success rate's interval is clipped to [0, 1].
- between two arms, or a run's final against its start eval: the mean of the per-seed differences (seeds paired),
  its 95% t interval and the two-sided paired t-test (``scipy.stats.ttest_rel``) on the same differences, so the
  interval excludes zero exactly when p < 0.05. A Wilcoxon signed-rank test (``scipy.stats.wilcoxon``, exact) is a
  second line from :data:`MIN_WILCOXON` seeds on: below that its smallest possible two-sided p is above 0.05.
- many arms: every two arms are compared (28 pairs for 8 arms), and about one pair in twenty falls below 0.05 by
  chance alone. Each table's p-values also get Holm's step-down adjustment over the pairs it tests (``p_holm``); a
  verdict says when a difference holds alone but not after it.
- the seeds needed: the power of a two-sided paired t-test at α = 0.05 from the noncentral t distribution
  (``scipy.stats.nct``), taking the observed mean and SD of the differences as the truth; the least n with 80% power.
"""

from __future__ import annotations

import math
from typing import Any

import numpy as np
from scipy import stats as sps

LEVEL = 0.95
ALPHA = 1 - LEVEL
MIN_CI = 2
MIN_WILCOXON = 6
POWER = 0.8
MAX_SEEDS = 10_000  # beyond this the effect is, for any practical comparison, not there

METHOD_TEXT = ("95% CIs over seeds: an arm's mean by the Student t interval (needs ≥ 2 seeds; a success rate's "
               "clipped to [0, 1]); a paired difference by the t interval of the per-seed differences, p from the "
               f"two-sided paired t-test (scipy.stats.ttest_rel), and Holm-adjusted over the table's pairs; "
               f"Wilcoxon signed-rank p from {MIN_WILCOXON} seeds on. "
               "A run's score is the mean of its stored eval episodes.")


def episode_scores(result: dict[str, Any], source: str = "eval result") -> list[float]:
    """The per-episode scores an ``eval/<tag>.json`` stores; a file without them cannot give these statistics."""
    episodes = result.get("episodes")
    if not episodes:
        from empo2.config import ConfigError

        raise ConfigError(f"{source} stores no per-episode scores ('episodes'); evaluate the run again")
    return [float(e["score"]) for e in episodes]


def run_score(result: dict[str, Any], source: str = "eval result") -> float:
    """A run's score: the mean of its stored episode scores (float64)."""
    return float(np.mean(np.asarray(episode_scores(result, source), dtype=np.float64)))


def run_success(result: dict[str, Any]) -> float:
    return float(np.mean([bool(e["success"]) for e in result["episodes"]], dtype=np.float64))


def wilson(successes: int, n: int, level: float = LEVEL) -> list[float] | None:
    """The Wilson score interval of a success rate of ``successes`` in ``n`` episodes (``scipy.stats.binomtest``):
    unlike the normal interval it stays inside [0, 1] and is not empty at 0 or n successes."""
    if n <= 0:
        return None
    ci = sps.binomtest(int(successes), int(n)).proportion_ci(confidence_level=level, method="wilson")
    return [float(ci.low), float(ci.high)]


def mean_ci(values, unit: str = "seeds", bounds: tuple[float, float] | None = None) -> dict[str, Any]:
    """Mean over seeds (or another ``unit``) with its 95% Student t interval, clipped to ``bounds`` (a rate's [0, 1]);
    ``ci`` is ``None`` (and ``note`` says why) below :data:`MIN_CI` values."""
    x = np.asarray(values, dtype=np.float64)
    out: dict[str, Any] = {"n": int(x.size), "mean": float(x.mean()) if x.size else None, "ci": None, "note": ""}
    if x.size < MIN_CI:
        out["note"] = f"CI undefined at n={x.size} (needs ≥ {MIN_CI} {unit})"
        return out
    half = sps.t.ppf(1 - ALPHA / 2, x.size - 1) * x.std(ddof=1) / math.sqrt(x.size)
    lo, hi = out["mean"] - half, out["mean"] + half
    if bounds is not None:
        lo, hi = max(lo, bounds[0]), min(hi, bounds[1])
    out["ci"] = [float(lo), float(hi)]
    return out


def paired(a, b) -> dict[str, Any]:
    """``b − a`` per seed (the lists are in the same seed order): mean, SD, 95% t CI, paired t-test, Wilcoxon."""
    a, b = np.asarray(a, dtype=np.float64), np.asarray(b, dtype=np.float64)
    d = b - a
    n = int(d.size)
    out: dict[str, Any] = {"n": n, "diff_mean": float(d.mean()) if n else None, "diff_sd": None, "ci": None,
                           "t": None, "df": n - 1, "p": None, "wilcoxon_p": None, "test": "paired t-test", "note": ""}
    if n < 2:
        out["note"] = f"no test at n={n} (a paired t-test needs ≥ 2 seeds)"
        return out
    out["diff_sd"] = float(d.std(ddof=1))
    if out["diff_sd"] == 0.0:  # t is 0/0 or ±inf: no p-value can be given
        out["ci"] = [out["diff_mean"], out["diff_mean"]]
        out["note"] = f"every seed's difference is {out['diff_mean']:+.1f}: no spread, no p-value"
        return out
    res = sps.ttest_rel(b, a)
    ci = res.confidence_interval(LEVEL)
    out.update(t=float(res.statistic), p=float(res.pvalue), ci=[float(ci.low), float(ci.high)])
    if n >= MIN_WILCOXON:
        out["wilcoxon_p"] = float(sps.wilcoxon(b, a).pvalue)
    return out


def holm(ps: list[float | None]) -> list[float | None]:
    """Holm's step-down adjustment of a family of p-values: the i-th smallest of the m tested becomes
    max over j ≤ i of min(1, (m − j + 1) · p_(j)). ``None`` (no test) stays ``None`` and is not counted in m."""
    tested = sorted((p, i) for i, p in enumerate(ps) if p is not None)
    adjusted: list[float | None] = [None] * len(ps)
    running = 0.0
    for rank, (p, i) in enumerate(tested):
        running = max(running, min(1.0, (len(tested) - rank) * p))
        adjusted[i] = running
    return adjusted


def power(effect: float, n: int) -> float:
    """Power of a two-sided paired t-test at α = 0.05 for a standardised effect (mean / SD of differences), n seeds."""
    df = n - 1
    crit = sps.t.ppf(1 - ALPHA / 2, df)
    nc = effect * math.sqrt(n)
    return float(sps.nct.sf(crit, df, nc) + sps.nct.cdf(-crit, df, nc))


def seeds_needed(diff_mean: float, diff_sd: float) -> int | None:
    """The least n with :data:`POWER` power if the observed mean and SD were true; ``None`` when no n up to
    :data:`MAX_SEEDS` gets there (no difference observed)."""
    if diff_sd is None or diff_mean is None or diff_sd == 0 or diff_mean == 0:
        return None
    effect = abs(diff_mean) / diff_sd
    lo, hi = 2, MAX_SEEDS
    if power(effect, hi) < POWER:
        return None
    while lo < hi:  # power grows with n: bisect for the first n that reaches it
        mid = (lo + hi) // 2
        lo, hi = (mid + 1, hi) if power(effect, mid) < POWER else (lo, mid)
    return lo


def verdict(what: str, pair: dict[str, Any], digits: int = 1, family: int = 1) -> str:
    """One sentence: is ``what`` (e.g. ``empo2 − grpo``) distinguishable from zero at this n, alone and among the
    ``family`` pairs tested with it (``pair["p_holm"]``), and what n would settle it (``digits``: decimals of the
    difference, 2 for a success rate)."""
    n, m, f = pair["n"], pair["diff_mean"], f"+.{digits}f"
    if n < 2:
        return f"{what}: not testable with {n} paired seed(s); run at least 3 seeds per arm."
    if pair["p"] is None:
        return f"{what}: {pair['note']} over {n} seeds; run more seeds to test it."
    lo, hi = pair["ci"]
    head = f"{what} = {m:{f}} (95% CI {lo:{f}} to {hi:{f}}, paired t-test p = {pair['p']:.3g}, n = {n} seeds)"
    if pair["p"] < ALPHA:
        if family < 2 or pair.get("p_holm") is None:
            return f"{head}: distinguishable from zero at this n."
        among = f"the {family} pairs tested (Holm-adjusted p = {pair['p_holm']:.3g})"
        if pair["p_holm"] < ALPHA:
            return f"{head}: distinguishable from zero at this n, also among {among}."
        return f"{head}: distinguishable from zero alone, not among {among}; more seeds would tell."
    need = seeds_needed(m, pair["diff_sd"])
    more = (f"about {need} seeds would detect a difference this size with {POWER:.0%} power, if its SD "
            f"({pair['diff_sd']:.{digits}f}) holds" if need else "no practical number of seeds would detect a difference "
            "this size")
    return f"{head}: not distinguishable from zero at this n; {more}."


# ---------------------------------------------------------------------------------------------------- rendering
def fmt_ci(ci: list[float] | None, digits: int = 1) -> str:
    return "n/a" if ci is None else f"[{ci[0]:.{digits}f}, {ci[1]:.{digits}f}]"


def fmt_p(p: float | None) -> str:
    return "n/a" if p is None else f"{p:.3g}"


def arm_table(arms: dict[str, dict[str, Any]]) -> list[str]:
    """Markdown rows: per arm n, success mean [CI] (the headline), score mean [CI], and the gain of final over start
    when known."""
    lines = [("| arm | n seeds | success (mean) | 95% CI | final score (mean) | 95% CI | final − start | 95% CI "
              "| p (t-test) |"),
             "|---|---:|---:|---|---:|---|---:|---|---:|"]
    for arm, a in arms.items():
        s, ok, g = a["score"], a["success"], a.get("gain")
        gain = (f"{g['diff_mean']:+.1f} | {fmt_ci(g['ci'])} | {fmt_p(g['p'])}" if g and g["diff_mean"] is not None
                else "n/a | n/a | n/a")
        lines.append(f"| {arm} | {s['n']} | **{ok['mean']:.2f}** | {fmt_ci(ok['ci'], 2)} | {s['mean']:.1f} | "
                     f"{fmt_ci(s['ci'])} | {gain} |")
    return lines


def pair_table(pairs: list[dict[str, Any]], digits: int = 1) -> list[str]:
    """Markdown rows of the paired differences between arms, then one verdict sentence per pair (``digits``:
    decimals of the differences, 2 for success rates)."""
    if not pairs:
        return []
    lines = ["| difference (seeds paired) | n | mean | SD | 95% CI | paired t | p (t-test) | p (Holm) "
             "| p (Wilcoxon) |",
             "|---|---:|---:|---:|---|---:|---:|---:|---:|"]
    for q in pairs:
        sd = "n/a" if q["diff_sd"] is None else f"{q['diff_sd']:.{digits}f}"
        t = "n/a" if q["t"] is None else f"{q['t']:.2f} (df {q['df']})"
        mean = "n/a" if q["diff_mean"] is None else f"{q['diff_mean']:+.{digits}f}"
        lines.append(f"| {q['what']} | {q['n']} | {mean} | {sd} | {fmt_ci(q['ci'], digits)} | {t} | "
                     f"{fmt_p(q['p'])} | {fmt_p(q.get('p_holm'))} | {fmt_p(q['wilcoxon_p'])} |")
    return lines + [""] + [f"- {q['verdict']}" for q in pairs]


def compare_arms(per_seed: dict[str, dict[int, float]], digits: int = 1) -> list[dict[str, Any]]:
    """Paired differences ``later − earlier`` for every two arms (arms in the order given, the first the baseline),
    over the seeds both have; ``p_holm`` adjusts their p-values as one family."""
    arms, pairs = list(per_seed), []
    for i, base in enumerate(arms):
        for other in arms[i + 1:]:
            seeds = sorted(set(per_seed[base]) & set(per_seed[other]))
            q = paired([per_seed[base][s] for s in seeds], [per_seed[other][s] for s in seeds])
            pairs.append({"what": f"{other} − {base}", "a": base, "b": other, "seeds": seeds, **q})
    family = sum(q["p"] is not None for q in pairs)
    for q, p_holm in zip(pairs, holm([q["p"] for q in pairs])):
        q["p_holm"] = p_holm
        q["verdict"] = verdict(q["what"], q, digits, family)
    return pairs


def summarise_arms(runs: list[dict[str, Any]], arms: list[str]) -> dict[str, Any]:
    """The statistics of a comparison from per-run rows ``{"arm", "seed", "score", "success", "start"}`` (``start``:
    the run's start-eval score, or ``None``): per arm the CIs and final − start, then the paired differences of the
    final score (``pairs``) and of the final success rate (``success_pairs``)."""
    out: dict[str, Any] = {"method": METHOD_TEXT, "arms": {}, "pairs": [], "success_pairs": []}
    per_seed: dict[str, dict[int, float]] = {}
    per_seed_success: dict[str, dict[int, float]] = {}
    for arm in arms:
        mine = sorted((r for r in runs if r["arm"] == arm), key=lambda r: r["seed"])
        if not mine:
            continue
        per_seed[arm] = {r["seed"]: r["score"] for r in mine}
        per_seed_success[arm] = {r["seed"]: r["success"] for r in mine}
        started = [r for r in mine if r.get("start") is not None]
        gain = paired([r["start"] for r in started], [r["score"] for r in started]) if started else None
        out["arms"][arm] = {"seeds": [r["seed"] for r in mine], "score": mean_ci([r["score"] for r in mine]),
                            "success": mean_ci([r["success"] for r in mine], bounds=(0.0, 1.0)), "gain": gain}
    out["pairs"] = compare_arms(per_seed)
    out["success_pairs"] = compare_arms(per_seed_success, digits=2)
    return out


def stats_markdown(summary: dict[str, Any]) -> list[str]:
    """The arms' table, the paired differences of success and score with their verdicts, and the method line."""
    success = summary.get("success_pairs") or []
    return [*arm_table(summary["arms"]), "", *([*pair_table(success, 2), ""] if success else []),
            *pair_table(summary["pairs"]), "", f"Method: {summary['method']}"]
