"""``empo2.experiments.stats`` against float64 references computed here: the textbook t interval of a mean and paired
t with closed-form t distributions (``tdist``) for p-values and intervals, an enumeration of sign flips for the exact
Wilcoxon test, and a seeded simulation for the power."""

from __future__ import annotations

import itertools
import math
import statistics

import numpy as np
import pytest

from empo2.experiments import stats
from helpers import tdist


def _paired_reference(a: list[float], b: list[float]) -> tuple[float, float, float, list[float]]:
    """(mean, t, two-sided p, 95% CI) of b − a, by hand."""
    d = [y - x for x, y in zip(a, b)]
    n, mean, sd = len(d), statistics.fmean(d), statistics.stdev(d)
    se = sd / math.sqrt(n)
    t = mean / se
    p = 2 * (1 - tdist.cdf(abs(t), n - 1))
    half = tdist.quantile_975(n - 1) * se
    return mean, t, p, [mean - half, mean + half]


def test_mean_ci_is_the_t_interval():
    scores = [-11.2, 3.5, 27.0, -4.25, 8.0, 0.5]
    got = stats.mean_ci(scores)
    assert got["n"] == 6 and got["mean"] == pytest.approx(statistics.fmean(scores), abs=1e-12)
    assert got["ci"] == pytest.approx(tdist.mean_interval(scores), abs=1e-9)
    three = [-40.0, -12.0, -29.0]  # 3 seeds: t(0.975, 2) ≈ 4.30, far wider than the seeds' range
    assert stats.mean_ci(three)["ci"] == pytest.approx(tdist.mean_interval(three), abs=1e-9)
    assert stats.mean_ci(three)["ci"][0] < -40.0 and stats.mean_ci(three)["ci"][1] > -12.0
    assert stats.mean_ci([4.0, 4.0, 4.0])["ci"] == [4.0, 4.0]


def test_rate_ci_is_clipped_to_its_range():
    rates = [0.0, 0.0, 0.125]
    raw = tdist.mean_interval(rates)
    assert raw[0] < 0.0  # the unclipped interval leaves [0, 1]
    assert stats.mean_ci(rates, bounds=(0.0, 1.0))["ci"] == pytest.approx([0.0, raw[1]], abs=1e-9)


def test_ci_undefined_below_two_seeds_is_said():
    got = stats.mean_ci([12.5])
    assert got["ci"] is None and "n=1" in got["note"] and got["mean"] == 12.5
    two = stats.mean_ci([12.5, -3.0])  # t(0.975, 1) ≈ 12.7: honest, and very wide
    assert two["ci"] == pytest.approx(tdist.mean_interval([12.5, -3.0]), abs=1e-8)


def test_paired_difference_whose_ci_includes_zero():
    """Three seeds whose differences are +27.0, 0.0, +20.8: t ≈ 1.95 on 2 df, p ≈ 0.19, the CI spans zero."""
    grpo, empo2 = [-40.0, -12.0, -29.0], [-13.0, -12.0, -8.2]
    mean, t, p, ci = _paired_reference(grpo, empo2)
    got = stats.paired(grpo, empo2)
    assert got["diff_mean"] == pytest.approx(mean, abs=1e-12) and got["t"] == pytest.approx(t, abs=1e-12)
    assert got["p"] == pytest.approx(p, abs=1e-10) and got["ci"] == pytest.approx(ci, abs=1e-8)
    assert round(t, 2) == 1.95 and 0.18 < p < 0.20 and ci[0] < 0 < ci[1]
    assert got["df"] == 2 and got["wilcoxon_p"] is None  # 3 seeds: no Wilcoxon line
    sentence = stats.verdict("empo2 − grpo", got)
    assert "not distinguishable from zero at this n" in sentence and "n = 3 seeds" in sentence
    need = stats.seeds_needed(got["diff_mean"], got["diff_sd"])
    assert need is not None and need > 3 and f"about {need} seeds" in sentence


def test_paired_difference_distinguishable_at_five_seeds():
    a, b = [1.0, 2.0, 0.5, 3.0, 1.5], [4.0, 4.5, 3.0, 7.5, 3.0]
    _, _, p, ci = _paired_reference(a, b)
    got = stats.paired(a, b)
    assert got["p"] == pytest.approx(p, abs=1e-10) and got["ci"] == pytest.approx(ci, abs=1e-8)
    assert p < 0.05 and ci[0] > 0
    assert stats.verdict("b − a", got).endswith("distinguishable from zero at this n.")


def test_two_seeds_have_a_t_test():
    a, b = [10.0, 20.0], [14.0, 30.0]
    _, _, p, ci = _paired_reference(a, b)
    got = stats.paired(a, b)
    assert got["df"] == 1 and got["p"] == pytest.approx(p, abs=1e-10) and got["ci"] == pytest.approx(ci, abs=1e-7)


def test_one_seed_and_no_spread_are_said_not_crashed():
    one = stats.paired([3.0], [5.0])
    assert one["p"] is None and one["ci"] is None and one["diff_mean"] == 2.0
    assert "not testable with 1 paired seed" in stats.verdict("x − y", one)
    flat = stats.paired([0.0, 0.0, 0.0], [0.0, 0.0, 0.0])  # e.g. every run scores 0
    assert flat["p"] is None and flat["ci"] == [0.0, 0.0] and "no spread" in stats.verdict("x − y", flat)


def test_wilcoxon_matches_sign_flip_enumeration():
    a = [0.0, 1.0, 2.0, 3.0, 4.0, 5.0, 6.0]
    b = [2.5, 0.0, 6.0, 4.5, 9.0, 10.5, 6.75]
    d = [y - x for x, y in zip(a, b)]  # distinct |d|, no zeros: the exact null is the 2^n sign flips
    ranks = {v: k + 1 for k, v in enumerate(sorted(abs(x) for x in d))}
    w_plus = sum(ranks[abs(x)] for x in d if x > 0)
    total = sum(ranks.values())
    stat = min(w_plus, total - w_plus)
    sums = [sum(r for r, s in zip(ranks.values(), signs) if s) for signs in itertools.product((0, 1), repeat=len(d))]
    p = 2 * sum(1 for s in sums if s <= stat) / len(sums)
    assert stats.paired(a, b)["wilcoxon_p"] == pytest.approx(min(p, 1.0), abs=1e-12)


def test_power_and_seeds_needed_against_simulation():
    # the textbook case: effect 0.5, two-sided α = 0.05 → 34 pairs for 80% power
    assert stats.seeds_needed(0.5, 1.0) == 34 and stats.seeds_needed(-2.0, 4.0) == 34
    assert stats.seeds_needed(0.0, 3.0) is None and stats.seeds_needed(1.0, 0.0) is None
    rng = np.random.default_rng(1)
    n, effect = 8, 0.9
    d = rng.normal(effect, 1.0, (200_000, n))
    t = d.mean(1) / (d.std(1, ddof=1) / math.sqrt(n))
    simulated = float(np.mean(np.abs(t) > tdist.quantile_975(n - 1)))
    assert stats.power(effect, n) == pytest.approx(simulated, abs=0.005)


def test_summarise_arms_pairs_seeds_and_gains():
    runs = [{"arm": arm, "seed": seed, "score": score, "success": success, "start": start}
            for arm, seed, score, success, start in [
                ("grpo", 0, -40.0, 0.0, -30.0), ("grpo", 1, -12.0, 0.0, -20.0), ("grpo", 2, -29.0, 0.5, -25.0),
                ("empo2", 2, -8.2, 0.5, -25.0), ("empo2", 0, -13.0, 0.0, -30.0), ("empo2", 1, -12.0, 0.0, -20.0)]]
    got = stats.summarise_arms(runs, ["grpo", "empo2"])
    assert list(got["arms"]) == ["grpo", "empo2"] and got["arms"]["empo2"]["seeds"] == [0, 1, 2]
    assert got["arms"]["grpo"]["score"]["ci"] == pytest.approx(tdist.mean_interval([-40.0, -12.0, -29.0]), abs=1e-9)
    _, _, p_gain, _ = _paired_reference([-30.0, -20.0, -25.0], [-13.0, -12.0, -8.2])
    assert got["arms"]["empo2"]["gain"]["p"] == pytest.approx(p_gain, abs=1e-10)
    (pair,) = got["pairs"]
    assert pair["what"] == "empo2 − grpo" and pair["seeds"] == [0, 1, 2]
    assert pair["p"] == pytest.approx(_paired_reference([-40.0, -12.0, -29.0], [-13.0, -12.0, -8.2])[2], abs=1e-10)
    md = "\n".join(stats.stats_markdown(got))
    assert "| empo2 − grpo | 3 | +15.9 |" in md and "paired t-test" in md and pair["verdict"] in md


def test_run_score_is_the_mean_of_stored_episodes():
    result = {"episodes": [{"score": 10.0, "success": False}, {"score": -3.5, "success": True},
                           {"score": 100.0, "success": True}]}
    assert stats.run_score(result) == statistics.fmean([10.0, -3.5, 100.0])
    assert stats.run_success(result) == 2 / 3
    from empo2.config import ConfigError

    with pytest.raises(ConfigError, match="no per-episode scores"):
        stats.run_score({"summary": {}}, "runs/x/eval/final.json")


def _holm_reference(ps: list[float | None]) -> list[float | None]:
    """Holm's adjusted p of each hypothesis as the least level at which the step-down procedure rejects it: at
    level α, reject the k-th smallest p (k = 1, 2, …) while p_(k) ≤ α / (m − k + 1), and stop at the first that
    is not."""
    tested = [p for p in ps if p is not None]
    m = len(tested)

    def rejected(alpha: float) -> set[float]:
        out = set()
        for k, p in enumerate(sorted(tested), start=1):
            if p > alpha / (m - k + 1):
                break
            out.add(p)
        return out

    levels = sorted({min(1.0, (m - k + 1) * p) for k, p in enumerate(sorted(tested), start=1)} | {1.0})
    return [None if p is None else next(a for a in levels if p in rejected(a * (1 + 1e-12))) for p in ps]


@pytest.mark.parametrize("ps", [[0.01, 0.04, 0.03, 0.005], [0.2, None, 0.001, 0.02, 0.5, 0.02], [0.9], [None],
                                [0.3, 0.01, 0.049, 0.7, 0.011, 0.04]])
def test_holm_is_the_step_down_procedure(ps):
    assert stats.holm(ps) == pytest.approx(_holm_reference(ps), abs=1e-15)
    assert stats.holm([0.01, 0.04, 0.03, 0.005]) == pytest.approx([0.03, 0.06, 0.06, 0.02], abs=1e-15)


def test_a_pair_below_005_alone_is_told_apart_from_one_that_survives_the_family():
    seeds = [0, 1, 2]
    base = [20.0, 35.0, 50.0]
    arms = {"a": base, "b": [x + d for x, d in zip(base, [10.0, 12.0, 17.0])],
            "c": [x + d for x, d in zip(base, [1.0, -2.0, 3.0])]}
    runs = [{"arm": arm, "seed": s, "score": v[s], "success": 0.0, "start": None}
            for arm, v in arms.items() for s in seeds]
    pairs = {q["what"]: q for q in stats.summarise_arms(runs, list(arms))["pairs"]}
    ps = [pairs[w]["p"] for w in ("b − a", "c − a", "c − b")]
    assert ps[0] == pytest.approx(_paired_reference(arms["a"], arms["b"])[2], abs=1e-10) and ps[0] < 0.05
    want = _holm_reference(ps)
    assert [pairs[w]["p_holm"] for w in ("b − a", "c − a", "c − b")] == pytest.approx(want, abs=1e-12)
    assert want[0] >= 0.05
    assert "distinguishable from zero alone, not among the 3 pairs tested" in pairs["b − a"]["verdict"]
    (one,) = stats.summarise_arms([r for r in runs if r["arm"] != "c"], ["a", "b"])["pairs"]
    assert one["p_holm"] == pytest.approx(one["p"]) and one["verdict"].endswith("distinguishable from zero at this n.")


@pytest.mark.parametrize("k, n", [(0, 40), (2, 40), (13, 40), (40, 40), (1, 7)])
def test_wilson_interval_is_the_score_interval(k, n):
    """The closed form (p̂ + z²/2n ± z·sqrt(p̂(1 − p̂)/n + z²/4n²)) / (1 + z²/n), written out in float64."""
    z = 1.959963984540054
    p = k / n
    centre, half = p + z * z / (2 * n), z * math.sqrt(p * (1 - p) / n + z * z / (4 * n * n))
    low, high = (centre - half) / (1 + z * z / n), (centre + half) / (1 + z * z / n)
    assert stats.wilson(k, n) == pytest.approx([low, high], abs=1e-12)
    assert stats.wilson(0, 0) is None
