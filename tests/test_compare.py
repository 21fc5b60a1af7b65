"""``empo2 compare``: algorithms × seeds as ordinary run folders, a summary that agrees with them, skip and resume.

The end-to-end test runs real ``empo2 train`` subprocesses on the WebShop fixture catalog (no JVM, the cheapest real
environment) with the tiny random model of tests/conftest.py.
"""

from __future__ import annotations

import gzip
import json
import math
import re
import shutil
import statistics
from pathlib import Path

import pytest

from empo2 import machine
from empo2.cli import main
from empo2.config import Config, ConfigError
from empo2.experiments import records, stats
from empo2.experiments.compare import run_status, share_start_eval, start_eval_key
from empo2.experiments.compare_plan import parse_seeds, plan_runs
from empo2.experiments.compare_summary import aggregate, summary_markdown
from empo2.rundir import checkpoint as ckpt
from helpers import tdist

WEBSHOP = ["--allow-unreachable", "--config", "configs/webshop_cpu.yaml"]  # 2-step caps: plumbing, not a measurement
TINY = ["env.max_steps=2", "env.eval_variations=1", "algo.num_generations=2", "train.iterations=2",
        "train.eval_every=1", "policy.few_shot=0", "policy.max_completion_length=6", "policy.history_window=1",
        "policy.reflection_max_tokens=8", "train.progress=false", "train.report_to=none",
        "train.sample_trajectories=0"]
ALGOS = ("grpo", "empo2")


def _compare(out: Path, model: str, *extra: str) -> int:
    return main(["compare", *WEBSHOP, "--algos", ",".join(ALGOS), "--seeds", "0-1",
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
        start_eval = json.loads((run / "eval" / "start.json").read_text())
        assert f"| {r['name']} | {r['algo']} | {r['seed']} | {start_eval['summary']['score_mean']:.1f} | {score} | " \
               f"{success} |" in md
        if r["algo"] == "empo2":  # the seed's start eval was played once, by grpo, and copied here
            donor = json.loads((out / "runs" / f"grpo-seed{r['seed']}" / "eval" / "start.json").read_text())
            assert start_eval == {**donor, "reused_from": f"grpo-seed{r['seed']}"}
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
    # the statistics, from the episode scores the run folders store
    finals = {(r["algo"], r["seed"]): statistics.fmean(e["score"] for e in json.loads(
        (out / "runs" / r["name"] / "eval" / "final.json").read_text())["episodes"]) for r in summary["runs"]}
    d = [finals["empo2", s] - finals["grpo", s] for s in (0, 1)]
    (pair,) = summary["stats"]["pairs"]
    assert pair["what"] == "empo2 − grpo" and pair["diff_mean"] == pytest.approx(statistics.fmean(d), abs=1e-12)
    if d[0] != d[1]:  # two seeds: Student t with 1 df, p = 1 − 2·atan(|t|)/π
        t = statistics.fmean(d) / (statistics.stdev(d) / math.sqrt(2))
        assert pair["p"] == pytest.approx(1 - 2 * math.atan(abs(t)) / math.pi, abs=1e-10)
    assert pair["verdict"] in md
    grpo = [finals["grpo", s] for s in (0, 1)]  # two seeds: a t interval with 1 df (wide, and honest)
    assert summary["stats"]["arms"]["grpo"]["score"]["ci"] == pytest.approx(tdist.mean_interval(grpo), abs=1e-8)
    assert "`env.eval_split=test`, `env.eval_variations=1`" in md and summary["protocol"]["same_episodes"]
    printed = capfd.readouterr().out
    assert all(line in printed for line in said), (said, printed[-2000:])
    assert printed.count("start eval (no memory") == 2  # played by the grpo runs only
    assert "empo2-seed1: start eval (untrained model, seed 1) reused from grpo-seed1" in printed
    assert printed.count("env=webshop-fixture tasks=webshop model=") == 4  # each run's banner names its data
    for r in summary["runs"]:  # where each run computed: one start line, shown in the runs table
        (where,) = machine.read(out / "runs" / r["name"])
        assert where["event"] == "start" and r["machines"] == [where] and where["torch_threads"] == 1
        assert md.count(f"| {r['env_steps']} | {machine.short(where)} |") >= 1

    # cut one run short (its last checkpoint and final eval gone), keep the others: the same command again
    cut = out / "runs" / "empo2-seed1"
    for p in sorted((cut / "checkpoints" / "iter_000001").rglob("*"), reverse=True):
        p.unlink() if p.is_file() else p.rmdir()
    (cut / "checkpoints" / "iter_000001").rmdir()
    (cut / "eval" / "final.json").unlink()
    kept = [x for x in gzip.decompress((out / "scores.jsonl.gz").read_bytes()).decode().splitlines()
            if json.loads(x)["run"] != cut.name]
    (out / "scores.jsonl.gz").write_bytes(gzip.compress("".join(x + "\n" for x in kept).encode()))
    before = {n: (out / "runs" / n / "metrics.jsonl").read_bytes() for n in names if n != cut.name}
    assert _compare(out, tiny_model) == 0
    text = capfd.readouterr().out
    assert text.count("finished already, skipped") == 3 and "empo2-seed1: resuming" in text
    assert {n: (out / "runs" / n / "metrics.jsonl").read_bytes() for n in before} == before  # no new iterations
    assert [x["iteration"] for x in _metrics(cut)] == [0, 1]  # iteration 1 redone once, nothing repeated
    assert (cut / "eval" / "final.json").is_file() and (cut / "checkpoints" / "iter_000001").is_dir()
    assert [m["event"] for m in machine.read(cut)] == ["start", "resume"]
    resumed = next(r for r in json.loads((out / "summary.json").read_text())["runs"] if r["name"] == cut.name)
    assert f"| {cut.name} | empo2 | 1 | {resumed['start']:.1f} | {resumed['score']:.1f} |" in \
        (out / "summary.md").read_text()

    # a later command that names one arm and seed keeps the earlier runs of the same settings in the summary
    whole = json.loads((out / "summary.json").read_text())
    assert main(["compare", *WEBSHOP, "--algos", "grpo", "--seeds", "1", "--out",
                 str(out), f"policy.model={tiny_model}", *TINY]) == 0
    again = json.loads((out / "summary.json").read_text())
    assert sorted(r["name"] for r in again["runs"]) == sorted(names) and again["algos"] == ["grpo", "empo2"]
    assert again["seeds"] == [0, 1] and again["stats"] == whole["stats"]
    # an earlier run whose settings differ from this command's is not one of its runs: left out, with a line
    saved = out / "runs" / "empo2-seed0" / "config.yaml"
    original = saved.read_text()
    saved.write_text(re.sub(r"learning_rate: .*", "learning_rate: 0.5", original))
    capfd.readouterr()
    assert main(["compare", *WEBSHOP, "--algos", "grpo", "--seeds", "1", "--out",
                 str(out), f"policy.model={tiny_model}", *TINY]) == 0
    assert "empo2-seed0: left out of the summary (" in capfd.readouterr().out
    assert sorted(r["name"] for r in json.loads((out / "summary.json").read_text())["runs"]) == \
        sorted(n for n in names if n != "empo2-seed0")
    # earlier runs are found in runs/, not through the summary: with the settings back and no summary left (a
    # command stopped before writing it), the left-out run comes back
    saved.write_text(original)
    (out / "summary.json").unlink()
    assert main(["compare", *WEBSHOP, "--algos", "grpo", "--seeds", "1", "--out",
                 str(out), f"policy.model={tiny_model}", *TINY]) == 0
    assert sorted(r["name"] for r in json.loads((out / "summary.json").read_text())["runs"]) == sorted(names)


def _finished_folder(plan, scores: list[float]) -> None:
    """A synthetic finished run folder: its config, both evals with per-episode scores, metrics and a last
    checkpoint (train.iterations=2)."""
    (plan.folder / "eval").mkdir(parents=True)
    plan.cfg.save(plan.folder / "config.yaml")
    for tag, eps in (("start", [-10.0] * len(scores)), ("final", scores)):
        episodes = [{"task": "webshop", "variation": k, "score": s, "success": s >= 100} for k, s in enumerate(eps)]
        (plan.folder / "eval" / f"{tag}.json").write_text(json.dumps({
            "label": "webshop-fixture", "summary": {"score_mean": statistics.fmean(eps), "success_rate": 0.0},
            "per_task": {}, "episodes": episodes}))
    rows = [{"iteration": 0, "env_steps": 5, "eval": {"score_mean": 1.0, "success_rate": 0.0}},
            {"iteration": 1, "env_steps": 11}]
    (plan.folder / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    (plan.folder / "checkpoints" / "iter_000001").mkdir(parents=True)
    (plan.folder / "checkpoints" / "iter_000001" / ckpt.STATE).write_bytes(b"")


def test_a_comparison_continues_from_its_record_alone(tmp_path, capsys):
    """``scores.jsonl.gz`` is the comparison: with every run folder deleted, its runs are finished, their settings are
    checked against the record, a later command keeps them, and the summary rebuilt from it alone is the same."""
    from empo2.experiments import compare, records
    from empo2.experiments.compare_summary import rebuild

    out = tmp_path / "cmp"
    plans = plan_runs("configs/webshop_cpu.yaml", ["grpo", "empo2"], [0, 1], out, TINY)
    assert [run_status(p) for p in plans] == ["fresh"] * 4
    for k, plan in enumerate(plans):
        _finished_folder(plan, [10.0 * k, 5.0 - k * k, 3.0])
    assert [run_status(p) for p in plans] == ["finished"] * 4
    meta = {"config": "configs/webshop_cpu.yaml", "overrides": TINY, "algos": list(ALGOS), "seeds": [0, 1],
            "label": "webshop-fixture"}
    first = compare.write_summary(plans, out, meta, list(ALGOS))
    lines = [json.loads(x) for x in gzip.decompress((out / "scores.jsonl.gz").read_bytes()).decode().splitlines()]
    assert sum(x["kind"] == "episode" and x["phase"] == "final" for x in lines) == 12
    assert {x["env_steps"] for x in lines if x["kind"] == "episode" and x["phase"] == "final"} == {11}
    for p in plans:  # the record gives back each eval exactly as the run folder stored it
        record = records.read(out / "scores.jsonl.gz")[p.name]
        assert record["evals"]["final"] == json.loads((p.folder / "eval" / "final.json").read_text())
        assert record["command"] == {"config": "configs/webshop_cpu.yaml", "overrides": TINY}

    for p in sorted((out / "runs").rglob("*"), reverse=True):  # another machine: the record only
        p.unlink() if p.is_file() else p.rmdir()
    again = plan_runs("configs/webshop_cpu.yaml", ["grpo", "empo2"], [0, 1], out, TINY)
    assert [run_status(p) for p in again] == ["finished"] * 4
    (empo2,) = plan_runs("configs/webshop_cpu.yaml", ["empo2"], [1], out, TINY)
    assert compare.earlier_runs("configs/webshop_cpu.yaml", out, TINY, [empo2]) and \
        sorted(p.name for p in compare.earlier_runs("configs/webshop_cpu.yaml", out, TINY, [empo2])) == \
        ["empo2-seed0", "grpo-seed0", "grpo-seed1"]
    with pytest.raises(ConfigError, match="grpo-seed0 was recorded in .* with other settings .*eval_temperature"):
        plan_runs("configs/webshop_cpu.yaml", ["grpo"], [0], out, [*TINY, "policy.eval_temperature=0.7"])
    rebuilt = rebuild(out, tmp_path / "rebuilt")
    assert rebuilt["stats"] == first["stats"] and rebuilt["algorithms"] == first["algorithms"]
    assert rebuilt["runs"] == first["runs"] and (tmp_path / "rebuilt" / "curves.png").is_file()
    assert rebuilt["arm_settings"] == first["arm_settings"] and set(first["arm_settings"]) == {"grpo", "empo2"}
    # the same command again: every run is finished; it says what each arm trains on before anything else
    capsys.readouterr()
    assert main(["compare", *WEBSHOP, "--algos", "grpo,empo2", "--seeds", "0-1", "--out", str(out), *TINY]) == 0
    printed = capsys.readouterr().out
    head = printed[:printed.index("finished already")]
    assert "What each arm trains on" in head and "grpo: reward = the environment's return (its score changes), " \
        "no novelty bonus; advantage = GRPO, ÷ group std; loss = grpo (clip 0.2 / 0.3" in head
    assert "\n  empo2: reward = " in head and "## What each arm trains on" in (out / "summary.md").read_text()
    grpo = [statistics.fmean([10.0 * k, 5.0 - k * k, 3.0]) for k in (0, 2)]  # seeds 0 and 1 of grpo (plans 0 and 2)
    assert rebuilt["stats"]["arms"]["grpo"]["score"]["ci"] == pytest.approx(tdist.mean_interval(grpo), abs=1e-9)
    assert main(["report", str(out), "--out", str(tmp_path / "report")]) == 0  # report reads the record too
    table = json.loads((tmp_path / "report" / "report.json").read_text())["webshop-fixture"]
    assert table["stats"]["arms"] == first["stats"]["arms"]  # report pairs methods in name order: grpo − empo2
    assert table["stats"]["pairs"][0]["diff_mean"] == pytest.approx(-first["stats"]["pairs"][0]["diff_mean"])
    capsys.readouterr()
    damaged = gzip.decompress((out / "scores.jsonl.gz").read_bytes()) + b"{half a line\n"
    (out / "scores.jsonl.gz").write_bytes(gzip.compress(damaged))
    assert main(["report", str(out), "--out", str(tmp_path / "report2")]) == 2
    assert f"scores.jsonl.gz line {len(lines) + 1} is not JSON" in capsys.readouterr().err


def test_user_errors_write_nothing(tmp_path, capsys):
    out = tmp_path / "cmp"
    base = ["compare", *WEBSHOP, "--out", str(out)]
    cases = [(["--algos", "grpo,ppo"], "algo.name"), (["--seeds", "2-1"], "--seeds"), (["--seeds", "x"], "--seeds"),
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
    assert main(["compare", *WEBSHOP, "--algos", "grpo", "--seeds", "0",
                 "--out", str(out)]) == 2
    assert "train.iterations: 9 → 4" in capsys.readouterr().err
    assert sorted(p.name for p in run.iterdir()) == ["config.yaml"]


def test_algorithm_with_another_estimator_is_its_own_run(tmp_path):
    """``empo2+gigpo``: EMPO² with GiGPO's advantage, in its own folder, labelled so by the report."""
    from empo2.experiments.compare_plan import plan_runs
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
    from empo2.experiments.compare_plan import plan_runs
    from empo2.experiments.report import method_label

    algos = ["gigpo", "gigpo-std", "empo2+gigpo", "empo2+gigpo-std", "grpo"]
    config = tmp_path / "std.yaml"  # a config file that asks for the std variant
    Config.load("configs/webshop_cpu.yaml", ["algo.gigpo.normalization=mean_std_norm"]).save(config)
    for cfg_path in ("configs/webshop_cpu.yaml", config):
        plans = plan_runs(str(cfg_path), algos, [0], tmp_path / "out", [])
        assert [p.folder.name for p in plans] == [f"{a}-seed0" for a in algos]
        assert [p.cfg.algo.gigpo.normalization for p in plans] == [
            "mean_norm", "mean_std_norm", "mean_norm", "mean_std_norm", "mean_norm"]
        assert [method_label(p.cfg) for p in plans] == algos
        assert [method_label(p.cfg.to_dict()) for p in plans] == algos  # as report reads a run's config.yaml
    assert method_label({"algo": {"name": "gigpo"}}) == "gigpo"  # the default is mean-only
    base = ["compare", *WEBSHOP, "--out", str(tmp_path / "cmp")]
    for extra, message in [(["--algos", "grpo-std"], "'grpo' uses the 'grpo' advantage"),
                           (["--algos", "empo2-std"], "empo2+gigpo-std"),
                           (["--algos", "gigpo", "algo.gigpo.normalization=mean_std_norm"], "set by compare")]:
        assert main(base + extra) == 2, extra
        err = capsys.readouterr().err.strip()
        assert message in err and len(err.splitlines()) == 1, (extra, err)
    assert not (tmp_path / "cmp").exists()


def test_parse_seeds_lists_and_ranges_never_counts():
    assert parse_seeds("3") == [3] and parse_seeds("4,1,7") == [4, 1, 7] and parse_seeds("0-4") == [0, 1, 2, 3, 4]
    assert parse_seeds("0-2, 9") == [0, 1, 2, 9] and parse_seeds("5-5") == [5]


def test_bad_seeds_are_one_line_exit_2(tmp_path, capsys):
    out = tmp_path / "cmp"
    for text, message in [("1,", "'' is not a seed"), ("", "is not a seed"), ("a", "'a' is not a seed"),
                          ("-1", "'-1' is not a seed"), ("1.5", "'1.5'"), ("3-1", "runs backwards; write 1-3"),
                          ("0-2,2", "names a seed twice"), ("1-", "'1-'")]:
        assert main(["compare", *WEBSHOP, "--out", str(out), f"--seeds={text}"]) == 2
        err = capsys.readouterr().err.strip()
        assert message in err and len(err.splitlines()) == 1, (text, err)
    assert not out.exists()


def _result(algo, seed, scores, start, steps):
    """A finished run as ``run_result`` returns it, from per-episode scores."""
    final = {"score_mean": statistics.fmean(scores), "success_rate": 0.0, "episodes": len(scores)}
    return {"name": f"{algo}-seed{seed}", "algo": algo, "seed": seed, "env_steps": steps, "train_episodes": 8,
            "final": final, "score": statistics.fmean(scores), "success": sum(s >= 100 for s in scores) / len(scores),
            "start": start, "start_from": None if algo == "grpo" else f"grpo-seed{seed}",
            "episodes": [["t", k] for k in range(len(scores))],
            "curve": [[0, start, 0.0], [steps // 2, start / 2, 0.0], [steps, statistics.fmean(scores), 0.0]]}


def test_summary_statistics_against_float64_reference():
    """Three seeds whose EMPO² − GRPO differences are +27.0, 0.0, +20.8 (the CI must include zero): the summary's
    CIs, paired difference and p-value against the t intervals and paired t computed here."""
    episodes = {("grpo", 0): [-40.0, -40.0], ("grpo", 1): [-20.0, -4.0], ("grpo", 2): [-29.0, -29.0],
                ("empo2", 0): [-13.0, -13.0], ("empo2", 1): [-12.0, -12.0], ("empo2", 2): [-16.4, 0.0]}
    results = [_result(a, s, sc, -30.0 + s, 40 + s) for (a, s), sc in episodes.items()]
    per = aggregate(results, ["grpo", "empo2"])
    summary = stats.summarise_arms([{**r, "arm": r["algo"]} for r in results], ["grpo", "empo2"])
    grpo = [statistics.fmean(episodes["grpo", s]) for s in range(3)]
    empo2 = [statistics.fmean(episodes["empo2", s]) for s in range(3)]
    assert summary["arms"]["grpo"]["score"]["ci"] == pytest.approx(tdist.mean_interval(grpo), abs=1e-9)
    d = [e - g for g, e in zip(grpo, empo2)]
    assert d == pytest.approx([27.0, 0.0, 20.8])
    mean, se = statistics.fmean(d), statistics.stdev(d) / math.sqrt(3)
    t = mean / se
    p = 1 - t / math.sqrt(2 + t * t)  # two-sided p of Student t with 2 df, in closed form
    half = math.sqrt(2 * 0.95 ** 2 / (1 - 0.95 ** 2)) * se  # its 97.5% quantile: t / sqrt(2 + t²) = 0.95
    (pair,) = summary["pairs"]
    assert pair["what"] == "empo2 − grpo" and pair["p"] == pytest.approx(p, abs=1e-10)
    assert pair["ci"] == pytest.approx([mean - half, mean + half], abs=1e-9) and pair["ci"][0] < 0 < pair["ci"][1]
    assert per["grpo"]["curve"]["env_steps"] == [0.0, statistics.fmean([20, 20, 21]), 41.0]
    assert [per["grpo"]["curve"]["score_ci_low"][0], per["grpo"]["curve"]["score_ci_high"][0]] == \
        pytest.approx(tdist.mean_interval([-30.0, -29.0, -28.0]), abs=1e-9)
    meta = {"label": "webshop-fixture", "config": "c.yaml", "overrides": [], "budget_text": "2 × 1 × 4 = 8",
            "protocol": {"eval_split": "test", "eval_variations": 40, "eval_episodes_per_task": None,
                         "episodes_per_task": {"t": 2}, "eval_episodes": 2, "same_episodes": True,
                         "eval_temperature": 0.4}}
    md = summary_markdown(meta, per, results, ["empo2-seed3"], summary)
    assert "`env.eval_split=test`, `env.eval_variations=40` → 2 episodes per task × 1 task(s) = 2 episodes" in md
    assert "every arm and seed played the same task variations" in md
    assert "Note: the evidence protocol is ≥ 40 held-out episodes per run (`env.eval_split=test`); these runs used 2 " \
        "on the `test` split." in md
    assert "reused by that seed's other arms (seed 0: grpo-seed0, seed 1: grpo-seed1, seed 2: grpo-seed2)" in md
    lo, hi = stats.fmt_ci(pair["ci"]).strip("[]").split(", ")
    assert f"| empo2 − grpo | 3 | +15.9 | {statistics.stdev(d):.1f} | [{lo}, {hi}] | {t:.2f} (df 2) | {p:.3g} |" in md
    assert "not distinguishable from zero at this n" in md and "paired t-test" in md
    assert "| empo2-seed2 | empo2 | 2 | -28.0 | -8.2 | 0.00 | 2 | 8 | 42 |" in md
    assert "Not finished (left out above): empo2-seed3" in md


def test_success_rates_are_paired_and_drawn_like_scores():
    """Success is the headline: its paired differences (two decimals) and its curve band against a float64
    reference computed here (Student t with 2 df in closed form), and the arm table shows it first."""
    rates = {("grpo", 0): 0.0, ("grpo", 1): 0.1, ("grpo", 2): 0.05, ("empo2", 0): 0.2, ("empo2", 1): 0.1,
             ("empo2", 2): 0.3}
    results = []
    for (algo, seed), rate in rates.items():
        r = _result(algo, seed, [0.0, 10.0], -30.0, 40)
        r["success"], r["curve"][-1][2] = rate, rate
        results.append(r)
    summary = stats.summarise_arms([{**r, "arm": r["algo"]} for r in results], ["grpo", "empo2"])
    d = [0.2, 0.0, 0.25]
    mean, se = statistics.fmean(d), statistics.stdev(d) / math.sqrt(3)
    t = mean / se
    p = 1 - t / math.sqrt(2 + t * t)
    half = math.sqrt(2 * 0.95 ** 2 / (1 - 0.95 ** 2)) * se
    (pair,) = summary["success_pairs"]
    assert pair["what"] == "empo2 − grpo" and pair["diff_mean"] == pytest.approx(mean, abs=1e-12)
    assert pair["p"] == pytest.approx(p, abs=1e-10) and pair["ci"] == pytest.approx([mean - half, mean + half])
    assert pair["verdict"].startswith(f"empo2 − grpo = +0.15 (95% CI {mean - half:+.2f} to {mean + half:+.2f}")
    per = aggregate(results, ["grpo", "empo2"])
    grpo_final = [rates["grpo", s] for s in range(3)]
    lo, hi = tdist.mean_interval(grpo_final)
    assert per["grpo"]["curve"]["success_mean"][-1] == pytest.approx(statistics.fmean(grpo_final))
    assert [per["grpo"]["curve"]["success_ci_low"][-1], per["grpo"]["curve"]["success_ci_high"][-1]] == \
        pytest.approx([max(lo, 0.0), min(hi, 1.0)], abs=1e-9)
    table = stats.arm_table(summary["arms"])
    assert table[0].startswith("| arm | n seeds | success (mean) |") and "| empo2 | 3 | **0.20** |" in table[3]
    md = "\n".join(stats.stats_markdown(summary))
    assert md.index("| empo2 − grpo | 3 | +0.15 |") < md.index("| empo2 − grpo | 3 | +0.0 |")


def test_one_seed_says_the_ci_is_undefined_and_two_give_a_t_interval():
    for seeds in ([0], [0, 1]):
        results = [_result(a, s, [10.0 * s, 5.0 + a.count("e")], 0.0, 10) for a in ALGOS for s in seeds]
        summary = stats.summarise_arms([{**r, "arm": r["algo"]} for r in results], list(ALGOS))
        md = "\n".join(stats.stats_markdown(summary))
        per = aggregate(results, list(ALGOS))
        if seeds == [0]:
            assert summary["arms"]["grpo"]["score"]["ci"] is None and "| n/a |" in md
            assert "CI undefined at n=1" in summary["arms"]["grpo"]["score"]["note"]
            assert per["grpo"]["curve"]["score_ci_low"] == [None, None, None]
        else:
            scores = [r["score"] for r in results if r["algo"] == "grpo"]
            assert summary["arms"]["grpo"]["score"]["ci"] == pytest.approx(tdist.mean_interval(scores), abs=1e-8)
            assert None not in per["grpo"]["curve"]["score_ci_low"]


def _donor(out: Path, algo: str, seed: int, *overrides: str) -> Path:
    (plan,) = plan_runs("configs/webshop_cpu.yaml", [algo], [seed], out, list(overrides))
    (plan.folder / "eval").mkdir(parents=True)
    plan.cfg.save(plan.folder / "config.yaml")
    start = {"label": "webshop-fixture", "split": "test", "summary": {"score_mean": 7.5},
             "episodes": [{"task": "webshop", "variation": 0, "score": 7.5, "success": False}]}
    (plan.folder / "eval" / "start.json").write_text(json.dumps(start))
    (plan.folder / "eval" / "start.md").write_text("start table\n")
    return plan.folder


def test_start_eval_is_shared_only_under_the_same_model_seed_and_eval_settings(tmp_path):
    out = tmp_path / "cmp"
    donor = _donor(out, "grpo", 1)
    plans = plan_runs("configs/webshop_cpu.yaml", ["grpo", "empo2", "gigpo"], [1], out, [])
    stale = plans[1].folder / "checkpoints"  # an earlier attempt's leftovers go; the copy comes in
    stale.mkdir(parents=True)
    assert share_start_eval(plans[1], plans, "fresh") == "grpo-seed1"
    copied = json.loads((plans[1].folder / "eval" / "start.json").read_text())
    assert copied == {**json.loads((donor / "eval" / "start.json").read_text()), "reused_from": "grpo-seed1"}
    assert (plans[1].folder / "eval" / "start.md").read_text() == "start table\n" and not stale.exists()
    assert share_start_eval(plans[2], plans, "fresh") == "grpo-seed1"  # a copy's source is the run that played it
    assert start_eval_key(plans[0].cfg) == start_eval_key(plans[1].cfg)
    for other in (["policy.eval_temperature=0.7"], ["env.eval_variations=3"], ["algo.num_generations=2"]):
        theirs = plan_runs("configs/webshop_cpu.yaml", ["empo2"], [1], tmp_path / "other", other)
        assert share_start_eval(theirs[0], [*plans[:1], *theirs], "fresh") is None, other
        assert not (theirs[0].folder / "eval").exists()
    # a run resumed before its start eval gets the copy (its files kept); one with a checkpoint or its own does not
    resumed = plans[2].folder
    (resumed / "eval" / "start.json").unlink()
    (resumed / "config.yaml").write_text("kept\n")
    assert share_start_eval(plans[2], plans, "resume") == "grpo-seed1"
    assert (resumed / "config.yaml").read_text() == "kept\n"
    assert share_start_eval(plans[2], plans, "resume") is None  # it has one now
    (resumed / "eval" / "start.json").unlink()
    (resumed / "checkpoints" / "iter_000000").mkdir(parents=True)
    (resumed / "checkpoints" / "iter_000000" / ckpt.STATE).write_bytes(b"")
    assert share_start_eval(plans[2], plans, "resume") is None and not (resumed / "eval" / "start.json").exists()
    other_seed = plan_runs("configs/webshop_cpu.yaml", ["empo2"], [2], out, [])
    assert share_start_eval(other_seed[0], [*plans[:1], *other_seed], "fresh") is None


def test_a_start_eval_is_reused_from_a_run_known_only_by_its_record(tmp_path):
    """A comparison continued on another machine (its record in git, its run folders left behind) replays no start
    eval: the record's start eval, episodes included, is copied into the new arm's run."""
    out = tmp_path / "cmp"
    donor = _donor(out, "grpo", 1)
    (plan,) = plan_runs("configs/webshop_cpu.yaml", ["grpo"], [1], out, [])
    played = json.loads((donor / "eval" / "start.json").read_text())
    (donor / "eval" / "final.json").write_text(json.dumps({**played, "summary": {"score_mean": 9.0}}))
    records.merge(plan.record_path, [records.from_folder(donor, "grpo", 1, plan.command)])
    shutil.rmtree(donor)
    (recorded,) = plan_runs("configs/webshop_cpu.yaml", ["grpo"], [1], out, [])
    (new_arm,) = plan_runs("configs/webshop_cpu.yaml", ["empo2"], [1], out, [])
    assert recorded.recorded is not None and not recorded.folder.exists()
    assert share_start_eval(new_arm, [new_arm], "fresh") is None  # this command alone has no donor
    assert share_start_eval(new_arm, [new_arm, recorded], "fresh") == "grpo-seed1"
    assert json.loads((new_arm.folder / "eval" / "start.json").read_text()) == {**played, "reused_from": "grpo-seed1"}
    (other_seed,) = plan_runs("configs/webshop_cpu.yaml", ["empo2"], [2], out, [])
    assert share_start_eval(other_seed, [other_seed, recorded], "fresh") is None


def test_report_prints_cis_and_paired_differences_from_stored_episodes(tmp_path, capsys):
    """``empo2 report`` on run folders (config.yaml + eval/final.json with per-episode scores, as train writes them):
    its statistics against a float64 reference on those episodes; seeds are paired by ``train.seed``."""
    scores = {("grpo", 0): [0.0, 10.0], ("grpo", 1): [5.0, 5.0], ("grpo", 2): [2.0, 0.0],
              ("empo2", 0): [20.0, 30.0], ("empo2", 1): [9.0, 11.0], ("empo2", 2): [40.0, 2.0]}
    for (algo, seed), eps in scores.items():
        run = tmp_path / "cmp" / "runs" / f"{algo}-seed{seed}"
        (run / "eval").mkdir(parents=True)
        Config.load("configs/webshop_cpu.yaml", [f"algo.name={algo}", f"train.seed={seed}"]).save(run / "config.yaml")
        episodes = [{"task": "webshop", "variation": k, "score": s, "success": s >= 30} for k, s in enumerate(eps)]
        (run / "eval" / "final.json").write_text(json.dumps({
            "label": "webshop-fixture", "summary": {"score_mean": statistics.fmean(eps), "success_rate": 0.0},
            "per_task": {}, "episodes": episodes}))
    assert main(["report", str(tmp_path / "cmp"), "--out", str(tmp_path / "report")]) == 0
    got = json.loads((tmp_path / "report" / "report.json").read_text())["webshop-fixture"]["stats"]
    d = [statistics.fmean(scores["grpo", s]) - statistics.fmean(scores["empo2", s]) for s in range(3)]
    mean, se = statistics.fmean(d), statistics.stdev(d) / math.sqrt(3)
    t = mean / se
    (pair,) = got["pairs"]  # methods in name order: grpo − empo2
    assert pair["what"] == "grpo − empo2" and pair["diff_mean"] == pytest.approx(mean, abs=1e-12)
    assert pair["p"] == pytest.approx(1 - abs(t) / math.sqrt(2 + t * t), abs=1e-10)
    assert got["arms"]["empo2"]["success"]["mean"] == pytest.approx(statistics.fmean([0.5, 0.0, 0.5]), abs=1e-12)
    assert pair["ci"][0] < 0 < pair["ci"][1]  # −15.0 ± 21.5 on three seeds
    printed = capsys.readouterr().out
    assert pair["verdict"] in printed and "| grpo − empo2 | 3 | " in printed and "paired t-test" in printed


def _same_results(run: Path) -> dict:
    """What a run computed, without its timings: eval episodes, per-iteration metrics, the tips it wrote."""
    from empo2.memory.store import TipMemory

    rows = [{k: v for k, v in row.items() if k not in ("time", "tokens_per_s", "memory_peak_rss_gb")}
            for row in _metrics(run)]
    with TipMemory(run / "memory.sqlite") as store:
        tips = sorted(tip.text for tip in store.all_tips())
    evals = {tag: json.loads((run / "eval" / f"{tag}.json").read_text())["episodes"] for tag in ("start", "final")}
    return {"metrics": rows, "tips": tips, "evals": evals}


@pytest.mark.slow
def test_runs_at_once_give_the_results_of_runs_one_after_another(tmp_path, tiny_model, capfd, monkeypatch):
    """``--jobs 2``: the seed's second run waits for the first one's start eval and then runs beside it; every run
    computes what it computes alone (the same torch threads in both comparisons)."""
    monkeypatch.setenv("OMP_NUM_THREADS", "1")
    args = ["--algos", "grpo,empo2", "--seeds", "0", f"policy.model={tiny_model}", *TINY, "train.iterations=3"]
    apart, together = tmp_path / "apart", tmp_path / "together"
    assert main(["compare", *WEBSHOP, "--out", str(apart), *args]) == 0
    capfd.readouterr()
    assert main(["compare", *WEBSHOP, "--out", str(together), "--jobs", "2", *args]) == 0
    printed = capfd.readouterr().out
    assert "2 runs, 2 at a time" in printed
    assert "empo2-seed0: start eval (untrained model, seed 0) reused from grpo-seed0" in printed
    for name in ("grpo-seed0", "empo2-seed0"):
        assert _same_results(together / "runs" / name) == _same_results(apart / "runs" / name), name
        assert "final eval (no memory" in (together / "logs" / f"{name}.log").read_text()
    took = {m[0]: (float(m[1]), float(m[2])) for m in
            re.findall(r"\] (\S+): done in (\d+)s \(total (\d+)s\)", printed)}
    assert max(t for _, t in took.values()) < sum(d for d, _ in took.values()), took  # they overlapped
