"""``empo2 compare``: algorithms × seeds as ordinary run folders, a summary that agrees with them, skip and resume.

The end-to-end test runs real ``empo2 train`` subprocesses on the WebShop fixture catalog (no JVM, the cheapest real
environment) with the tiny random model of tests/conftest.py.
"""

from __future__ import annotations

import json
import re
import statistics
from pathlib import Path

import pytest

from empo2.cli import main
from empo2.config import Config
from empo2.experiments.compare import aggregate, parse_seeds, summary_markdown

TINY = ["env.max_steps=2", "env.eval_variations=1", "algo.num_generations=2", "train.iterations=2",
        "train.eval_every=1", "policy.few_shot=0", "policy.max_completion_length=6", "policy.history_window=1",
        "policy.reflection_max_tokens=8", "train.progress=false", "train.tensorboard=false",
        "train.sample_trajectories=0"]
ALGOS = ("grpo", "empo2")


def _compare(out: Path, model: str, *extra: str) -> int:
    return main(["compare", "--config", "configs/webshop_cpu.yaml", "--algos", ",".join(ALGOS), "--seeds", "2",
                 "--out", str(out), f"policy.model={model}", *TINY, *extra])


def _final_md_all_row(run: Path) -> tuple[str, str]:
    """(score, success) as ``eval/final.md`` prints them in its ``**all**`` row."""
    row = next(line for line in (run / "eval" / "final.md").read_text().splitlines() if "**all**" in line)
    score, success = re.findall(r"\*\*([0-9.\-]+)\*\*", row)
    return score, success


def _metrics(run: Path) -> list[dict]:
    return [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]


@pytest.mark.slow
def test_compare_summary_skip_and_resume(tmp_path, tiny_model, capfd, monkeypatch):
    # one torch thread per training subprocess: on a shared 2-core machine idle OpenMP threads spin and cost 2-3×
    monkeypatch.setenv("OMP_NUM_THREADS", "1")
    out = tmp_path / "cmp"
    assert _compare(out, tiny_model) == 0
    names = [f"{a}-seed{s}" for a in ALGOS for s in (0, 1)]
    assert sorted(p.name for p in (out / "runs").iterdir()) == sorted(names)
    assert (out / "curves.png").stat().st_size > 0
    summary = json.loads((out / "summary.json").read_text())
    md = (out / "summary.md").read_text()
    said = []  # each run's last console line: its final eval against its start eval
    for r in summary["runs"]:
        run = out / "runs" / r["name"]
        final = json.loads((run / "eval" / "final.json").read_text())["summary"]
        assert r["final"] == final
        score, success = _final_md_all_row(run)
        assert f"| {r['name']} | {r['algo']} | {r['seed']} | {score} | {success} |" in md
        rows = _metrics(run)
        assert [x["iteration"] for x in rows] == [0, 1]
        steps = [x["train"]["env_steps"] for x in rows]
        assert [x["env_steps"] for x in rows] == [steps[0], steps[0] + steps[1]] and r["env_steps"] == sum(steps)
        start = json.loads((run / "eval" / "start.json").read_text())["summary"]  # eval_at_start was on
        # the curve: untrained policy at 0 steps, the iteration-0 eval, then the final eval at the run's total
        assert [p[0] for p in r["curve"]] == [0, rows[0]["env_steps"], rows[1]["env_steps"]]
        assert [p[1] for p in r["curve"]] == [start["score_mean"], rows[0]["eval"]["score_mean"],
                                              final["score_mean"]]
        said.append(f"score {final['score_mean']:.1f} ({final['score_mean'] - start['score_mean']:+.1f} over the "
                    f"start eval's {start['score_mean']:.1f})")
    for algo in ALGOS:
        finals = [r["final"]["score_mean"] for r in summary["runs"] if r["algo"] == algo]
        assert summary["algorithms"][algo]["score_mean"] == pytest.approx(statistics.fmean(finals), abs=1e-12)
    printed = capfd.readouterr().out
    assert all(line in printed for line in said), (said, printed[-2000:])
    assert printed.count("env=webshop-fixture tasks=webshop model=") == 4  # each run's banner names its data

    # cut one run short (its last checkpoint and final eval gone), keep the others: the same command again
    cut = out / "runs" / "empo2-seed1"
    for p in sorted((cut / "checkpoints" / "iter_000001").rglob("*"), reverse=True):
        p.unlink() if p.is_file() else p.rmdir()
    (cut / "checkpoints" / "iter_000001").rmdir()
    (cut / "eval" / "final.json").unlink()
    before = {n: (out / "runs" / n / "metrics.jsonl").read_bytes() for n in names if n != cut.name}
    assert _compare(out, tiny_model) == 0
    text = capfd.readouterr().out
    assert text.count("finished already, skipped") == 3 and "empo2-seed1: resuming" in text
    assert {n: (out / "runs" / n / "metrics.jsonl").read_bytes() for n in before} == before  # no new iterations
    assert [x["iteration"] for x in _metrics(cut)] == [0, 1]  # iteration 1 redone once, nothing repeated
    assert (cut / "eval" / "final.json").is_file() and (cut / "checkpoints" / "iter_000001").is_dir()
    resumed = next(r for r in json.loads((out / "summary.json").read_text())["runs"] if r["name"] == cut.name)
    assert f"| {cut.name} | empo2 | 1 | {'{:.1f}'.format(resumed['final']['score_mean'])} |" in \
        (out / "summary.md").read_text()


def test_user_errors_write_nothing(tmp_path, capsys):
    out = tmp_path / "cmp"
    base = ["compare", "--config", "configs/webshop_cpu.yaml", "--out", str(out)]
    cases = [(["--algos", "grpo,ppo"], "algo.name"), (["--seeds", "0"], "--seeds"), (["--seeds", "x"], "--seeds"),
             (["--seeds", "1,1"], "--seeds"), (["--algos", ","], "--algos"), (["algo.name=grpo"], "set by compare"),
             (["seed=3"], "ambiguous"), (["train.seed=3"], "set by compare"), (["policy.model=nope"], "unknown model"),
             (["train.iterations=-1"], "train.iterations"), (["--algos", "gigpo+grpo"], "always uses"),
             (["--algos", "empo2+nope"], "algo.advantage")]
    for extra, message in cases:
        assert main(base + extra) == 2, extra
        err = capsys.readouterr().err.strip()
        assert message in err and len(err.splitlines()) == 1, (extra, err)
    assert main(["compare", "--config", "configs/nope.yaml", "--out", str(out)]) == 2
    assert not out.exists()


def test_run_folder_with_other_settings_is_refused(tmp_path, capsys):
    out = tmp_path / "cmp"
    run = out / "runs" / "grpo-seed0"
    run.mkdir(parents=True)
    Config.load("configs/webshop_cpu.yaml", ["algo.name=grpo", "train.seed=0", "train.iterations=9"]).save(
        run / "config.yaml")
    assert main(["compare", "--config", "configs/webshop_cpu.yaml", "--algos", "grpo", "--seeds", "1",
                 "--out", str(out)]) == 2
    assert "train.iterations: 9 → 4" in capsys.readouterr().err
    assert sorted(p.name for p in run.iterdir()) == ["config.yaml"]


def test_algorithm_with_another_estimator_is_its_own_run(tmp_path):
    """``empo2+gigpo``: EMPO² with GiGPO's advantage, in its own folder, labelled so by the report."""
    from empo2.experiments.compare import plan_runs
    from empo2.experiments.report import method_label

    plans = plan_runs("configs/webshop_cpu.yaml", ["empo2", "empo2+gigpo", "gigpo"], [1], tmp_path, [])
    assert [p.folder.name for p in plans] == ["empo2-seed1", "empo2+gigpo-seed1", "gigpo-seed1"]
    assert [(p.cfg.algo.name, p.cfg.algo.advantage) for p in plans] == [
        ("empo2", "grpo"), ("empo2", "gigpo"), ("gigpo", "grpo")]
    assert [method_label(p.cfg) for p in plans] == ["empo2", "empo2+gigpo", "gigpo"]
    assert not tmp_path.joinpath("runs").exists()


def test_gigpo_variants_are_labelled_by_their_normalisation(tmp_path, capsys):
    """``gigpo`` runs the reference's mean-only normalisation, ``gigpo-std`` the std one; compare's folders, the
    configs the runs get and report's labels agree, also when the config file asks for the other variant."""
    from empo2.experiments.compare import plan_runs
    from empo2.experiments.report import method_label

    algos = ["gigpo", "gigpo-std", "empo2+gigpo", "empo2+gigpo-std", "grpo"]
    config = tmp_path / "std.yaml"  # a config file that asks for the std variant
    Config.load("configs/webshop_cpu.yaml", ["algo.gigpo_normalization=mean_std_norm"]).save(config)
    for cfg_path in ("configs/webshop_cpu.yaml", config):
        plans = plan_runs(str(cfg_path), algos, [0], tmp_path / "out", [])
        assert [p.folder.name for p in plans] == [f"{a}-seed0" for a in algos]
        assert [p.cfg.algo.gigpo_normalization for p in plans] == [
            "mean_norm", "mean_std_norm", "mean_norm", "mean_std_norm", "mean_norm"]
        assert [method_label(p.cfg) for p in plans] == algos
        assert [method_label(p.cfg.to_dict()) for p in plans] == algos  # as report reads a run's config.yaml
    assert method_label({"algo": {"name": "gigpo"}}) == "gigpo"  # the default is mean-only
    base = ["compare", "--config", "configs/webshop_cpu.yaml", "--out", str(tmp_path / "cmp")]
    for extra, message in [(["--algos", "grpo-std"], "'grpo' uses the 'grpo' advantage"),
                           (["--algos", "empo2-std"], "empo2+gigpo-std"),
                           (["--algos", "gigpo", "algo.gigpo_normalization=mean_std_norm"], "set by compare")]:
        assert main(base + extra) == 2, extra
        err = capsys.readouterr().err.strip()
        assert message in err and len(err.splitlines()) == 1, (extra, err)
    assert not (tmp_path / "cmp").exists()


def test_parse_seeds():
    assert parse_seeds("3") == [0, 1, 2] and parse_seeds("4,1,7") == [4, 1, 7] and parse_seeds("5,") == [5]


def test_aggregate_and_markdown_against_float64_reference():
    results = []
    for algo, seed, score, success, steps in [("grpo", 0, 12.25, 0.5, 40), ("grpo", 1, -3.0, 0.0, 44),
                                              ("empo2", 0, 71.0, 1.0, 38), ("empo2", 1, 40.5, 0.25, 50)]:
        curve = [[0, 1.0 + seed, 0.0], [steps // 2, score / 2, 0.0], [steps, score, success]]
        results.append({"name": f"{algo}-seed{seed}", "algo": algo, "seed": seed, "env_steps": steps,
                        "train_episodes": 8, "curve": curve,
                        "final": {"score_mean": score, "success_rate": success, "episodes": 4}})
    per = aggregate(results, ["grpo", "empo2"])
    assert per["grpo"]["score_mean"] == statistics.fmean([12.25, -3.0])
    assert per["empo2"]["success_mean"] == statistics.fmean([1.0, 0.25])
    assert (per["empo2"]["score_min"], per["empo2"]["score_max"]) == (40.5, 71.0)
    assert per["grpo"]["curve"]["env_steps"] == [0.0, 21.0, 42.0]
    assert per["grpo"]["curve"]["score_mean"] == [1.5, statistics.fmean([6.125, -1.5]), 4.625]
    assert per["grpo"]["curve"]["score_min"] == [1.0, -1.5, -3.0]
    meta = {"label": "webshop-fixture", "config": "c.yaml", "overrides": [], "eval_split": "test",
            "eval_episodes": 4, "budget_text": "2 × 1 × 4 = 8"}
    md = summary_markdown(meta, per, results, missing=["empo2-seed2"])
    assert "| grpo | 2 | **4.6** | -3.0–12.2 | 0.25 | 42 | 0: 12.2 · 1: -3.0 | 0: 0.50 · 1: 0.00 |" in md
    assert "| empo2-seed1 | empo2 | 1 | 40.5 | 0.25 | 4 | 8 | 50 |" in md
    assert "Not finished (left out above): empo2-seed2" in md
