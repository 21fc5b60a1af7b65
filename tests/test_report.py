"""``empo2 report``'s guards and its OOD table: no percentage gain over a trial 0 ≤ 0 (points instead), WebShop-fixture
runs labelled ``webshop-fixture`` in every table, and the best-trial score and the gain over trial 0 each with a 95%
CI over task variations (against numpy resampling in float64 here), "n/a" with a note for adaptation folders that
store no per-variation scores, and the later-trials gain (mean of trials 1…K−1 − trial 0), which picks no trial,
against the same reference.

The adaptation folders are written by adapt's own writer (``adaptation_report`` + ``write_adaptation``) from
synthetic trials, and the run folders are synthetic (config.yaml + eval/final.json as train writes them): playing 10
trials of real episodes would take minutes and decide nothing here. ``test_adapt_trials_store_one_episode_per_
variation`` plays real WebShop-fixture episodes with the tiny model to show that adapt stores what the table reads.
"""

from __future__ import annotations

import argparse
import json
import re
import statistics
from pathlib import Path
from typing import Any

import numpy as np
import pytest

from empo2.cli import main
from empo2.config import Config
from empo2.experiments import adapt, stats
from helpers import tdist

PERCENT = re.compile(r"[+-]\d+(\.\d+)?%")  # a signed percentage gain (not the "95%" of a CI)
UNITS = [("t1", 0), ("t1", 1), ("t1", 2), ("t2", 0), ("t2", 1), ("t2", 2)]


def _trial(k: int, scores: list[float], with_episodes: bool = True) -> dict:
    episodes = [{"task": t, "variation": v, "mode": "on_tips", "score": s, "success": s >= 100, "steps": 3,
                 "failed": False} for (t, v), s in zip(UNITS, scores)]
    trial = {"trial": k, "episodes": len(scores), "score_mean": statistics.fmean(scores), "success_rate": 0.0,
             "per_task": {}, "memory_size": k}
    return {**trial, "per_episode": episodes} if with_episodes else trial


def _adapt_folder(root: Path, name: str, per_trial: list[list[float]], with_episodes: bool = True,
                  pair: str = "biology1→biology2", label: str = "scienceworld", method: str = "base model + tips",
                  **seeded: Any) -> Path:
    trials = [_trial(k, s, with_episodes) for k, s in enumerate(per_trial)]
    report = adapt.adaptation_report(trials, tasks=["t1", "t2"], preset=None, pair=pair, method=method, label=label,
                                     **seeded)
    adapt.write_adaptation(root / name, report)
    return root / name


# trial means: −50 → −20 → 0 (start < 0), 20 → 30 → 25 (start > 0), 0 → 10 (start 0)
NEGATIVE = [[-100.0, -100.0, -100.0, 0.0, 0.0, 0.0], [-100.0, -20.0, 0.0, 0.0, 0.0, 0.0],
            [0.0, 0.0, 0.0, 0.0, 0.0, 0.0]]
POSITIVE = [[10.0, 20.0, 30.0, 20.0, 20.0, 20.0], [30.0, 30.0, 30.0, 20.0, 40.0, 30.0],
            [25.0, 25.0, 25.0, 25.0, 25.0, 25.0]]
ZERO = [[0.0] * 6, [0.0, 0.0, 0.0, 20.0, 20.0, 20.0]]


def _ood(tmp_path: Path, *folders: Path) -> tuple[dict, str]:
    assert main(["report", *map(str, folders), "--out", str(tmp_path / "report")]) == 0
    tables = json.loads((tmp_path / "report" / "report.json").read_text())
    return tables["ood"], (tmp_path / "report" / "report.md").read_text()


def test_no_percentage_gain_over_a_start_at_or_below_zero(tmp_path):
    folders = [_adapt_folder(tmp_path, "neg", NEGATIVE, method="reflexion"),
               _adapt_folder(tmp_path, "pos", POSITIVE, pair="biology2→electricity"),
               _adapt_folder(tmp_path, "zero", ZERO, pair="electricity→chemistry")]
    ood, md = _ood(tmp_path, *folders)
    rows = {line.split(" | ")[0].lstrip("| "): line for line in md.splitlines() if "→" in line}
    assert "| -50.0 | 0.0 |" in rows["biology1→biology2"] and "| +50.0 pts |" in rows["biology1→biology2"]
    assert "| 20.0 | 30.0 |" in rows["biology2→electricity"] and "| +50% |" in rows["biology2→electricity"]
    assert "| 0.0 | 10.0 |" in rows["electricity→chemistry"] and "| +10.0 pts |" in rows["electricity→chemistry"]
    assert "+100%" not in md and not PERCENT.search(rows["biology1→biology2"] + rows["electricity→chemistry"])
    cells = {p: next(iter(row.values())) for p, row in ood["pairs"].items()}
    assert cells["biology1→biology2"]["gain_pct"] is None and cells["electricity→chemistry"]["gain_pct"] is None
    assert cells["biology2→electricity"]["gain_pct"] == pytest.approx(50.0, abs=1e-12)
    # adapt's own table and adapt.json say the same
    neg = json.loads((folders[0] / "adapt.json").read_text())
    assert neg["gain_pct"] is None and neg["gain"] == pytest.approx(50.0, abs=1e-12)
    neg_md = (folders[0] / "adapt.md").read_text()
    assert "gain +50.0 pts" in neg_md and not PERCENT.search(neg_md)
    assert "gain +50%" in (folders[1] / "adapt.md").read_text()


def test_ood_best_trial_and_gain_with_cis_over_variations(tmp_path, capsys):
    ood, md = _ood(tmp_path, _adapt_folder(tmp_path, "pos", POSITIVE))
    cell = ood["pairs"]["biology1→biology2"]["base model + tips (scienceworld)"]
    best, start = POSITIVE[1], POSITIVE[0]  # trial 1 has the best mean
    assert cell["n_variations"] == 6 and cell["n"] == 1
    assert cell["best"] == pytest.approx(statistics.fmean(best), abs=1e-12)
    assert cell["trial0"] == pytest.approx(statistics.fmean(start), abs=1e-12)
    assert cell["best_ci"] == pytest.approx(tdist.mean_interval(best), abs=1e-9)
    gains = [b - s for b, s in zip(best, start)]
    assert cell["gain_ci"] == pytest.approx(tdist.mean_interval(gains), abs=1e-9)
    assert cell["gain_ci"][0] < cell["gain"] < cell["gain_ci"][1]
    # the later-trials gain picks no trial: per variation, the mean of trials 1 and 2 minus trial 0
    later = (np.asarray(POSITIVE[1:], dtype=np.float64).mean(0) - np.asarray(start, dtype=np.float64)).tolist()
    assert cell["later_gain"] == pytest.approx(float(np.mean(later)), abs=1e-12) and cell["later_gain"] < cell["gain"]
    assert cell["later_gain_ci"] == pytest.approx(tdist.mean_interval(later), abs=1e-9)
    row = next(line for line in md.splitlines() if line.startswith("| biology1→biology2 |"))
    assert (f"| 1 | 6 | 20.0 | 30.0 | {stats.fmt_ci(cell['best_ci'])} | +50% | {stats.fmt_ci(cell['gain_ci'])} | "
            f"{cell['later_gain']:+.1f} pts | {stats.fmt_ci(cell['later_gain_ci'])} |") in row
    assert "95% CIs over task variations" in md
    # two adaptations of one cell pool their variations
    ood, _ = _ood(tmp_path, _adapt_folder(tmp_path / "two", "a", POSITIVE), _adapt_folder(tmp_path / "two", "b",
                                                                                          NEGATIVE))
    cell = ood["pairs"]["biology1→biology2"]["base model + tips (scienceworld)"]
    assert cell["n"] == 2 and cell["n_variations"] == 12
    assert cell["best_ci"] == pytest.approx(tdist.mean_interval(POSITIVE[1] + NEGATIVE[2]), abs=1e-9)
    # a seeded adaptation rerun with the same weights and seed played the same episodes: it is refused, not pooled
    same = {"weights_sha256": "ab" * 32, "seed": 0}
    rerun = [_adapt_folder(tmp_path / "rerun", name, POSITIVE, **same) for name in ("a", "b")]
    assert main(["report", *map(str, rerun), "--out", str(tmp_path / "rerun-report")]) == 2
    assert "--seed 0, so they played the same episodes" in capsys.readouterr().err
    other_seed = _adapt_folder(tmp_path / "rerun", "c", POSITIVE, **{**same, "seed": 1})
    ood, _ = _ood(tmp_path / "seeds", rerun[0], other_seed)
    assert ood["pairs"]["biology1→biology2"]["base model + tips (scienceworld)"]["n"] == 2
    # one trial has no later trials
    ood, md = _ood(tmp_path / "one", _adapt_folder(tmp_path / "one", "a", POSITIVE[:1]))
    cell = ood["pairs"]["biology1→biology2"]["base model + tips (scienceworld)"]
    assert cell["later_gain"] is None and cell["later_gain_ci"] is None and "| n/a | n/a |" in md


def test_ood_cell_against_its_no_memory_control(tmp_path):
    """A memory cell and a ``--baseline none`` cell of the same weights and seed share trial 0; report compares their
    later trials variation by variation (float64 reference here), leaves a cell of another seed unmatched, and says
    when the two trial 0s disagree."""
    control_trials = [POSITIVE[0], [10.0, 20.0, 30.0, 20.0, 20.0, 20.0], [20.0, 30.0, 20.0, 10.0, 20.0, 20.0]]
    seeded = {"weights_sha256": "cd" * 32, "seed": 0}
    cell = _adapt_folder(tmp_path, "tips", POSITIVE, baseline="memory", **seeded)
    control = _adapt_folder(tmp_path, "none", control_trials, method="base model, no memory", baseline="none",
                            **seeded)
    unmatched = _adapt_folder(tmp_path, "reflexion", NEGATIVE, method="reflexion", baseline="reflexion",
                              **{**seeded, "seed": 1})
    ood, md = _ood(tmp_path, cell, control, unmatched)
    versus = ood["versus_control"]["biology1→biology2"]
    assert list(versus) == ["base model + tips − base model, no memory"]
    v = versus["base model + tips − base model, no memory"]
    diffs = (np.asarray(POSITIVE[1:], dtype=np.float64).mean(0)
             - np.asarray(control_trials[1:], dtype=np.float64).mean(0)).tolist()
    assert v["n_variations"] == 6 and v["trial0_differs"] == 0
    assert v["diff"] == pytest.approx(float(np.mean(diffs)), abs=1e-12)
    assert v["ci"] == pytest.approx(tdist.mean_interval(diffs), abs=1e-9)
    assert (f"| biology1→biology2 | base model + tips − base model, no memory | 6 | {v['diff']:+.1f} pts | "
            f"{stats.fmt_ci(v['ci'])} |") in md
    assert "trial 0 differs" not in md
    # a control whose trial 0 is not the cell's did not play the same start
    moved = _adapt_folder(tmp_path / "moved", "none", [[0.0] * 6, *control_trials[1:]],
                          method="base model, no memory", baseline="none", **seeded)
    ood, md = _ood(tmp_path / "moved", cell, moved)
    assert ood["versus_control"]["biology1→biology2"]["base model + tips − base model, no memory"][
        "trial0_differs"] == 6
    assert "trial 0 differs in 6 variations" in md


def test_adaptation_folder_without_per_variation_scores_prints_na(tmp_path):
    old = _adapt_folder(tmp_path, "old", POSITIVE, with_episodes=False)
    ood, md = _ood(tmp_path, old)
    cell = ood["pairs"]["biology1→biology2"]["base model + tips (scienceworld)"]
    assert cell["best_ci"] is None and cell["gain_ci"] is None and cell["n_variations"] is None
    assert "| 1 | n/a | 20.0 | 30.0 | n/a | +50% | n/a |" in md
    assert "adapt.json stores no per-variation scores" in md
    # an adapt.json whose stored gain_pct is a percentage of |trial 0| (−50 → 0 stored as +100): report recomputes it
    stored = tmp_path / "stored" / "adapt.json"
    stored.parent.mkdir()
    stored.write_text(json.dumps({"method": "reflexion", "label": "scienceworld", "pair": "biology1→biology2",
                                  "scores": [-50.0, 0.0], "best": 0.0, "trial0": -50.0, "gain": 50.0,
                                  "gain_pct": 100.0, "trials": [_trial(k, s, False) for k, s in enumerate(NEGATIVE[::2])]}))
    _, md = _ood(tmp_path / "again", stored.parent)
    assert "| -50.0 | 0.0 | n/a | +50.0 pts | n/a |" in md and "+100%" not in md


def _webshop_run(root: Path, name: str, seed: int, label: str | None) -> Path:
    run = root / name
    (run / "eval").mkdir(parents=True)
    Config.load("configs/webshop_cpu.yaml", ["algo.name=grpo", f"train.seed={seed}"]).save(run / "config.yaml")
    episodes = [{"task": "webshop", "variation": k, "score": 10.0 * (k + seed), "success": False} for k in range(2)]
    result = {"summary": {"score_mean": statistics.fmean(e["score"] for e in episodes), "success_rate": 0.0},
              "per_task": {}, "episodes": episodes}
    (run / "eval" / "final.json").write_text(json.dumps({**result, **({"label": label} if label else {})}))
    return run


def test_webshop_fixture_runs_are_labelled_so_in_every_table(tmp_path, monkeypatch):
    """A fixture run whose final.json records no label (an eval written without one) is still ``webshop-fixture``:
    the label comes from its config's environment, whose data is the bundled fixture."""
    monkeypatch.delenv("EMPO2_WEBSHOP_DATA", raising=False)
    runs = [_webshop_run(tmp_path / "cmp" / "runs", "grpo-seed0", 0, "webshop-fixture"),
            _webshop_run(tmp_path / "cmp" / "runs", "grpo-seed1", 1, None)]
    adapted = _adapt_folder(tmp_path, "adapt", POSITIVE, pair="webshop", label="webshop-fixture")
    assert main(["report", str(tmp_path / "cmp"), str(adapted), "--out", str(tmp_path / "report")]) == 0
    tables = json.loads((tmp_path / "report" / "report.json").read_text())
    assert sorted(tables) == ["ood", "webshop-fixture"]
    assert tables["webshop-fixture"]["methods"]["grpo"]["n"] == len(runs)
    assert list(tables["ood"]["pairs"]["webshop"]) == ["base model + tips (webshop-fixture)"]
    md = (tmp_path / "report" / "report.md").read_text()
    assert "### WebShop — env `webshop-fixture`" in md and "Over seeds, env `webshop-fixture`" in md
    assert "| webshop | base model + tips (webshop-fixture) |" in md
    assert "env `webshop`" not in md and "(webshop)" not in md
    assert (tmp_path / "report" / "webshop-fixture.png").is_file()



def test_unfinished_run_is_refused_unless_partial_which_names_it(tmp_path, capsys):
    """A compare still under way: by default one line and nothing written; with ``--partial`` the finished runs make
    the tables (n counts them only) and report.md names the run left out, above the tables."""
    root = tmp_path / "cmp" / "runs"
    finished = [_webshop_run(root, f"grpo-seed{s}", s, "webshop-fixture") for s in (0, 1)]
    stopped = _webshop_run(root, "grpo-seed2", 2, "webshop-fixture")
    (stopped / "eval" / "final.json").unlink()  # stopped after its checkpoints, before its final eval
    bare = root / "grpo-seed3"
    bare.mkdir()  # stopped before it saved its config: named, in no table
    out = tmp_path / "report"
    assert main(["report", str(tmp_path / "cmp"), "--out", str(out)]) == 2
    err = capsys.readouterr().err
    assert f"{stopped} has no eval/final.json (the run has not finished; --partial" in err and not out.exists()
    assert main(["report", str(tmp_path / "cmp"), "--out", str(out), "--partial"]) == 0
    table = json.loads((out / "report.json").read_text())["webshop-fixture"]
    assert table["methods"]["grpo"]["n"] == len(finished) == 2
    assert table["methods"]["grpo"]["score"] == pytest.approx(statistics.fmean([5.0, 15.0]), abs=1e-12)
    assert table["unfinished"] == [{"path": str(stopped), "method": "grpo"}]  # the JSON names it too, in its table
    md = (out / "report.md").read_text()
    assert md.startswith("**Partial report.** Left out, not finished (each n counts finished runs only): "
                         f"`{stopped}`, `{bare}`.")
    assert "| grpo | 2 |" in md and md.count("grpo-seed2") == 1
    (stopped / "eval" / "final.json").write_text((finished[0] / "eval" / "final.json").read_text())
    bare.rmdir()
    assert main(["report", str(tmp_path / "cmp"), "--out", str(tmp_path / "whole"), "--partial"]) == 0
    assert "Partial report" not in (tmp_path / "whole" / "report.md").read_text()  # nothing left out: a full report
    assert "unfinished" not in json.loads((tmp_path / "whole" / "report.json").read_text())["webshop-fixture"]


def test_adapt_cells_of_one_model_share_trial_0_and_a_rerun_repeats_a_cell(tmp_path, tiny_model, monkeypatch):
    """Real WebShop-fixture episodes with the tiny model, 3 variations in chunks of 2: a trial plays with the memory
    it started with (none in trial 0, even for the second chunk), and its sampling is seeded, so the tips, the
    Reflexion and the no-memory control cell play the same trial 0 and a second tips cell repeats the first."""
    from empo2.cli.policy import policy_context

    sizes, retrieved, play = [], [], adapt.play_split

    def memory_state(memory) -> tuple:
        """Tips, rated tips and use counts: what a trial's play must leave as it found it."""
        if memory is None:
            return None
        stats = memory.stats()
        return stats["tips"], stats.get("rated_tips"), {ns: v["uses"] for ns, v in stats.get("namespaces", {}).items()}

    def play_and_count(ctx, *args, **kwargs):
        before = memory_state(ctx.memory)
        episodes = play(ctx, *args, **kwargs)
        sizes.append((before, memory_state(ctx.memory)))
        retrieved.append(sum(len({tid for step in ep.steps for tid in step.tip_ids}) for ep in episodes))
        return episodes

    monkeypatch.setattr(adapt, "play_split", play_and_count)

    def cell(name: str, baseline: str) -> list[dict]:
        args = argparse.Namespace(run=None, model=tiny_model, env="webshop", tasks=None, max_steps=2, batch=2)
        cfg, ctx = policy_context(args, tmp_path / name / "memory.sqlite" if baseline == "memory" else None)
        for key, value in (("max_completion_length", 6), ("reflection_max_tokens", 8), ("few_shot", 0)):
            setattr(ctx.policy_cfg, key, value)
        if baseline == "reflexion":
            adapt.use_reflexion(ctx)
        try:
            trials, _ = adapt.run_trials(ctx, ["webshop"], 2, "test", 3, 1.0, 2, baseline, say=lambda _: None, seed=3)
            if baseline == "memory":  # each episode's retrieved tips count one use each, recorded as its trial ended
                assert sum(memory_state(ctx.memory)[2].values()) == sum(retrieved[-2:]) > 0
        finally:
            ctx.pool.close()
            if ctx.memory is not None:
                ctx.memory.close()
        return trials

    tips, again, reflexion = cell("tips", "memory"), cell("again", "memory"), cell("reflexion", "reflexion")
    control = cell("none", "none")
    assert tips[0]["memory_size"] >= 1  # trial 0 wrote tips, read from trial 1 on
    assert all(before == after for before, after in sizes) and sizes[1][0][0] >= 1  # none while a trial plays
    assert tips[0]["per_episode"] == reflexion[0]["per_episode"]
    assert all(e["actions"] for e in tips[0]["per_episode"])
    assert [t["per_episode"] for t in tips] == [t["per_episode"] for t in again]
    played = [({k: v for k, v in e.items() if k != "mode"}) for e in tips[0]["per_episode"]]
    assert [{k: v for k, v in e.items() if k != "mode"} for e in control[0]["per_episode"]] == played
    assert {e["mode"] for t in control for e in t["per_episode"]} == {"on"}  # no tips retrieved, ever
    assert [t["memory_size"] for t in control] == [0, 0] and not (tmp_path / "none").exists()

def test_adapt_trials_store_one_episode_per_variation(tmp_path, tiny_model):
    """Real WebShop-fixture episodes with the tiny model: each trial stores its episodes, one per task variation, whose
    mean is the trial's score, and the report's CI counts them."""
    from empo2.cli.policy import policy_context

    args = argparse.Namespace(run=None, model=tiny_model, env="webshop", tasks=None, max_steps=2, batch=2)
    cfg, ctx = policy_context(args, tmp_path / "memory.sqlite")
    for key, value in (("max_completion_length", 6), ("reflection_max_tokens", 8), ("few_shot", 0),
                       ("history_window", 1)):
        setattr(ctx.policy_cfg, key, value)  # short generations: the test is about what is stored, not the play
    try:
        trials, _ = adapt.run_trials(ctx, ["webshop"], 2, "test", 3, 0.4, 2, say=lambda _: None)
    finally:
        ctx.pool.close()
        ctx.memory.close()
    for t in trials:
        played = t["per_episode"]
        assert len(played) == t["episodes"] == 3 and len({e["variation"] for e in played}) == 3
        assert all(e["task"] == "webshop" for e in played)
        assert statistics.fmean(e["score"] for e in played) == pytest.approx(t["score_mean"], abs=1e-12)
    report = adapt.adaptation_report(trials, tasks=["webshop"], pair="webshop", method="base model + tips",
                                     label="webshop-fixture")
    assert report["n_variations"] == 3 and report["best_ci"] is not None
    json.dumps(report)  # adapt.json can hold it
