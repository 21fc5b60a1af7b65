"""The paper's ablations as ``compare`` arms (``empo2.experiments.arm_runs``): each arm's runs get its algorithm and
settings, ``report`` and compare's summary label them by the arm, the paired differences against full EMPO² pair
seeds by ``train.seed``, and a wrong arm or a config that contradicts it is one line, exit 2.

The run folders of the summary and report tests are synthetic (config.yaml as compare writes it, eval/start.json and
eval/final.json with per-episode scores, as train writes them): what is tested is the labelling and the statistics,
and training them would take minutes per run.
"""

from __future__ import annotations

import json
import math
import statistics
from pathlib import Path

import pytest

from empo2.cli import main
from empo2.config import Config

LEARN = "configs/scienceworld_learn_cpu.yaml"  # novelty bonus on (algo.intrinsic_weight=5), off-policy p = 0.3
ARMS = ["empo2", "empo2-no-offpolicy", "empo2-no-novelty", "grpo-novelty"]
TASKS = ("find-animal", "find-living-thing")
# per (arm, seed): the two eval episodes' scores, one per task
FINAL = {("empo2", 1): [10.0, 30.0], ("empo2", 2): [-20.0, 5.0], ("empo2", 3): [0.0, 12.5],
         ("empo2-no-offpolicy", 1): [0.0, 10.0], ("empo2-no-offpolicy", 2): [-30.0, 0.0],
         ("empo2-no-offpolicy", 3): [5.0, -5.0],
         ("empo2-no-novelty", 1): [12.5, 12.5], ("empo2-no-novelty", 2): [-40.0, 0.0],
         ("empo2-no-novelty", 3): [-10.0, 20.0],
         ("grpo-novelty", 1): [-50.0, 0.0], ("grpo-novelty", 2): [-20.0, -20.0], ("grpo-novelty", 3): [7.5, 0.0]}


def test_each_arm_runs_its_settings_and_is_labelled_by_its_name(tmp_path):
    from empo2.experiments.compare_plan import plan_runs
    from empo2.experiments.report import method_label

    names = [*ARMS, "grpo-no-novelty", "grpo"]
    plans = plan_runs(LEARN, names, [1], tmp_path, [])
    assert [p.folder.name for p in plans] == [f"{a}-seed1" for a in names]
    got = [(p.cfg.algo.name, p.cfg.algo.arm, p.cfg.algo.p_off_policy, p.cfg.algo.intrinsic_weight) for p in plans]
    assert got == [("empo2", None, 0.3, 5.0), ("empo2", "empo2-no-offpolicy", 0.0, 5.0),
                   ("empo2", "empo2-no-novelty", 0.3, 0.0), ("grpo", "grpo-novelty", 0.3, 5.0),
                   ("grpo", "grpo-no-novelty", 0.3, 0.0), ("grpo", None, 0.3, 0.0)]
    assert [method_label(p.cfg) for p in plans] == names
    assert [method_label(p.cfg.to_dict()) for p in plans] == names  # as report reads config.yaml
    # under the linear schedule algo.intrinsic_weight is not read: the no-novelty arm switches the schedule off too
    linear = tmp_path / "linear.yaml"
    Config.load(LEARN, ["algo.intrinsic_schedule=linear"]).save(linear)
    (off,) = plan_runs(str(linear), ["empo2-no-novelty"], [1], tmp_path, [])
    assert (off.cfg.algo.intrinsic_schedule, off.cfg.algo.intrinsic_weight) == ("constant", 0.0)
    # a config file's GiGPO estimator does not run under an arm's name, which says GRPO's
    gigpo = tmp_path / "gigpo.yaml"
    Config.load(LEARN, ["algo.advantage=gigpo"]).save(gigpo)
    plans = plan_runs(str(gigpo), ["empo2", "empo2-no-offpolicy"], [1], tmp_path, [])
    assert [(method_label(p.cfg), p.cfg.algo.advantage) for p in plans] == [("empo2+gigpo", "gigpo"),
                                                                           ("empo2-no-offpolicy", "grpo")]
    assert not (tmp_path / "runs").exists()


NOVELTY_ARMS = {"empo2", "empo2_luffy", "empo2-no-offpolicy", "empo2+luffy", "grpo-novelty", "empo2+gigpo",
                "empo2+proxmo", "empo2+gigpo-std", "grpo+novelty", "gigpo+novelty", "gigpo-std+novelty",
                "proxmo+novelty", "luffy+novelty", "elpo+novelty"}
"""The arms that keep the config's novelty bonus: EMPO²'s (the bonus is part of its method) and those named so."""


def test_every_arm_but_the_novelty_ones_runs_without_the_bonus(tmp_path):
    """Arms differ in their method only: on a config with a novelty bonus (weight 5, or the linear schedule), every
    compare arm runs without it except EMPO²'s and the ``+novelty`` / ``-novelty`` ones, and each says so."""
    from empo2.algo.registry import ALGORITHMS
    from empo2.experiments.arm_runs import ARMS as REGISTRY
    from empo2.experiments.arm_runs import arm_settings
    from empo2.experiments.compare_plan import plan_runs
    from empo2.experiments.report import method_label

    warm = {name for name, arm in REGISTRY.items() if arm.needs_warm_start}  # planned only beside a real warm start
    assert warm == {"warm-start", "sft-grpo"}
    for name in warm:  # their bonus is off whatever the config says
        assert {"intrinsic_weight": 0.0, "intrinsic_schedule": "constant"}.items() <= REGISTRY[name].fixed().items()
    names = sorted({*REGISTRY, *ALGORITHMS, "gigpo-std", "empo2+gigpo", "empo2+proxmo", "empo2+gigpo-std",
                    *NOVELTY_ARMS} - warm)
    linear = tmp_path / "linear.yaml"
    Config.load(LEARN, ["algo.intrinsic_schedule=linear"]).save(linear)
    for config in (LEARN, str(linear)):
        for plan in plan_runs(config, names, [1], tmp_path, []):
            a = plan.cfg.algo
            bonus = a.intrinsic_weight_start if a.intrinsic_schedule == "linear" else a.intrinsic_weight
            reward = arm_settings(a)["reward"]
            if plan.algo in NOVELTY_ARMS:
                assert bonus > 0 and "× novelty" in reward, plan.algo
            else:
                assert (a.intrinsic_weight, a.intrinsic_schedule) == (0.0, "constant"), plan.algo
                assert reward.startswith("the environment's return (its score changes), no novelty bonus"), plan.algo
            if plan.algo.endswith("+novelty"):  # the label says what ran
                assert method_label(plan.cfg) == plan.algo
    # the arms of records/results/reach, as they ran then: GiGPO and ProxMO had the bonus; now the plain names run without
    # it, and gigpo+novelty / proxmo+novelty rerun them as they were
    plans = plan_runs("configs/scienceworld_reach_cpu.yaml", ["gigpo", "proxmo", "gigpo+novelty", "proxmo+novelty"],
                      [1], tmp_path, [])
    assert [p.cfg.algo.intrinsic_weight for p in plans] == [0.0, 0.0, 5.0, 5.0]
    assert [method_label(p.cfg) for p in plans] == ["gigpo", "proxmo", "gigpo+novelty", "proxmo+novelty"]


def test_arm_settings_list_reward_loss_and_the_official_runs_they_differ_from():
    from empo2.experiments.arm_runs import arm_settings, settings_line

    def settings(algo, *overrides):
        from empo2.experiments.arm_runs import arm_overrides

        return arm_settings(Config.load("configs/scienceworld_reach_cpu.yaml", [*arm_overrides(algo), *overrides]).algo)

    proxmo = settings("proxmo")
    assert proxmo["loss"] == {"loss": "grpo", "clip": "0.2 / 0.3", "dual_clip": "10", "mask": "off",
                              "kl": "β 0 (k3)", "aggregation": "token_mean", "entropy bonus": "none"}
    assert proxmo["differs_from_official"] == [
        "beta 0 (official 0.01)", "epsilon_high 0.3 (official 0.2)", "dual_clip 10 (official 3)",
        "entropy bonus 0.001 there, none here (empo2's losses have no entropy term)"]
    official = settings("proxmo", "algo.beta=0.01", "algo.epsilon_high=0.2", "algo.dual_clip=3")
    assert official["differs_from_official"] == [
        "entropy bonus 0.001 there, none here (empo2's losses have no entropy term)"]
    luffy = settings("luffy")
    assert luffy["loss"]["clip"].startswith("none on on-policy rows") and "x/(x + 0.1)" in luffy["loss"]["expert_rows"]
    assert luffy["loss"]["aggregation"] == "dr_grpo (L = policy.max_completion_length)"
    assert luffy["differs_from_official"] == ["entropy bonus 0.001 there, none here (empo2's losses have no entropy "
                                              "term)"]
    assert "gold-path member" in luffy["reward"] and "no novelty bonus" in luffy["reward"]
    clipped = arm_settings(Config.load(None, ["algo.name=luffy", "algo.luffy.clip=true", "algo.luffy.gamma=0.2"]).algo)
    assert {"luffy.clip True (official False)", "luffy.gamma 0.2 (official 0.1)"} <= set(clipped["differs_from_official"])
    elpo = settings("elpo")
    assert elpo["differs_from_official"] == [] and "+ 0.115 on the critical suffix" in elpo["loss"]["clip"]
    assert elpo["loss"]["dual_clip"] == "off" and "whole path" in elpo["reward"]
    empo2 = settings("empo2")
    assert empo2["differs_from_official"] == [] and "5 × novelty 1/n" in empo2["reward"]
    assert empo2["loss"]["mask"] == "δ = 0.01 per token"
    line = settings_line("proxmo", proxmo)
    assert line.startswith("proxmo: reward = the environment's return (its score changes), no novelty bonus; "
                           "advantage = ProxMO, PSC α 4 ±0.05, PSA τ 0.1, γ 0.95, ω 1; loss = grpo (clip 0.2 / 0.3")
    assert "differs from ProxMO-RL's scripts" in line


def test_arm_errors_are_one_line_exit_2(tmp_path, capsys):
    out = tmp_path / "cmp"
    cases = [
        (LEARN, ["--algos", "empo2,empo2-no-tips"], "unknown arm 'empo2-no-tips'"),
        (LEARN, ["--algos", "empo2-no-offpolicy", "algo.p_off_policy=0.1"], "fixed by the ablation arm"),
        (LEARN, ["--algos", "empo2-no-novelty", "intrinsic_weight=2"], "fixed by the ablation arm"),
        (LEARN, ["--algos", "empo2", "algo.arm=empo2-no-novelty"], "set by compare"),
        (LEARN, ["--algos", "empo2,grpo-novelty", "algo.advantage=gigpo"], "fixed by the ablation arm grpo-novelty"),
        ("configs/webshop_cpu.yaml", ["--algos", "grpo-novelty"], "has none"),  # no novelty bonus to keep
        ("configs/webshop_cpu.yaml", ["--algos", "gigpo+novelty"], "has none"),
        (LEARN, ["--algos", "empo2+novelty"], "runs its novelty bonus as part of its method"),
    ]
    for config, extra, message in cases:
        assert main(["compare", "--config", config, "--out", str(out), *extra]) == 2, extra
        err = capsys.readouterr().err.strip()
        assert message in err and len(err.splitlines()) == 1, (extra, err)
        if "unknown arm" in message:
            assert all(a in err for a in ("empo2-no-offpolicy", "empo2-no-novelty", "grpo-novelty", "gigpo"))
    assert not out.exists()
    # a config that names an arm must hold its settings, whoever loads it
    for overrides, message in [(["algo.arm=empo2-no-novelty"], "needs algo.intrinsic_weight=0.0, got 5.0"),
                               (["algo.arm=empo2-no-offpolicy", "algo.p_off_policy=0", "algo.advantage=gigpo"],
                                "needs algo.advantage=grpo, got 'gigpo'"),
                               (["algo.arm=grpo-novelty"], "runs algo.name=grpo, got 'empo2'"),
                               (["algo.arm=empo2-big"], "unknown arm 'empo2-big'")]:
        assert main(["train", "--config", LEARN, "--output-dir", str(out), *overrides]) == 2
        err = capsys.readouterr().err.strip()
        assert message in err and len(err.splitlines()) == 1, (overrides, err)
    assert not out.exists()
    cfg = Config.load(LEARN, ["algo.arm=empo2-no-offpolicy", "algo.p_off_policy=0"])
    assert cfg.algo.arm == "empo2-no-offpolicy"


def test_compare_help_lists_every_arm(capsys, monkeypatch):
    from empo2.experiments.arm_runs import ARMS as REGISTRY

    monkeypatch.setenv("COLUMNS", "2000")  # argparse wraps at the terminal width, also inside hyphenated names
    with pytest.raises(SystemExit):
        main(["compare", "--help"])
    text = capsys.readouterr().out
    assert all(f"{name}: {arm.what}" in text for name, arm in REGISTRY.items())
    assert "algo.p_off_policy=0" in text and "algo.intrinsic_weight=0" in text


def _runs(root: Path) -> list:
    """Synthetic finished run folders of every arm and seed (seeds 3, 1, 2 written in that order)."""
    from empo2.experiments.compare_plan import plan_runs

    plans = plan_runs(LEARN, ARMS, [3, 1, 2], root, [])
    for plan in plans:
        (plan.folder / "eval").mkdir(parents=True)
        plan.cfg.save(plan.folder / "config.yaml")
        scores = FINAL[plan.algo, plan.seed]
        for tag, eps in (("final", scores), ("start", [-10.0, -10.0])):
            episodes = [{"task": t, "variation": 0, "score": s, "success": False} for t, s in zip(TASKS, eps)]
            (plan.folder / "eval" / f"{tag}.json").write_text(json.dumps({
                "label": "scienceworld", "summary": {"score_mean": statistics.fmean(eps), "success_rate": 0.0},
                "per_task": {t: {"score_mean": s, "success_rate": 0.0} for t, s in zip(TASKS, eps)},
                "episodes": episodes}))
    return plans


def _reference(arm: str) -> tuple[float, float]:
    """(mean, two-sided paired-t p) of ``arm`` − empo2 over seeds 1–3, in float64 here."""
    d = [statistics.fmean(FINAL[arm, s]) - statistics.fmean(FINAL["empo2", s]) for s in (1, 2, 3)]
    mean, se = statistics.fmean(d), statistics.stdev(d) / math.sqrt(3)
    t = mean / se
    return mean, 1 - abs(t) / math.sqrt(2 + t * t)  # Student t with 2 df, closed form


def test_report_and_summary_pair_each_ablation_with_full_empo2(tmp_path, capsys):
    from empo2.experiments.compare_summary import write_summary

    plans = _runs(tmp_path / "cmp")
    assert main(["report", str(tmp_path / "cmp"), "--out", str(tmp_path / "report")]) == 0
    table = json.loads((tmp_path / "report" / "report.json").read_text())["scienceworld"]
    assert set(table["methods"]) == set(ARMS) and all(m["n"] == 3 for m in table["methods"].values())
    summary = write_summary(plans, plans, tmp_path / "cmp", {"config": LEARN, "overrides": [], "algos": ARMS,
                                                              "seeds": [3, 1, 2], "label": "scienceworld"}, ARMS)
    for pairs in (table["stats"]["pairs"], summary["stats"]["pairs"]):
        for arm in ARMS[1:]:
            (pair,) = [q for q in pairs if q["what"] == f"{arm} − empo2"]
            mean, p = _reference(arm)
            assert pair["seeds"] == [1, 2, 3] and pair["n"] == 3
            assert pair["diff_mean"] == pytest.approx(mean, abs=1e-12) and pair["p"] == pytest.approx(p, abs=1e-10)
    md = (tmp_path / "report" / "report.md").read_text()
    assert all(f"{arm} (n=3)" in md and f"| {arm} − empo2 | 3 |" in md for arm in ARMS[1:])
    summary_md = (tmp_path / "cmp" / "summary.md").read_text()
    assert "| empo2-no-offpolicy − empo2 | 3 |" in summary_md
    from empo2.experiments.arm_runs import ARMS as REGISTRY

    for text in (md, summary_md):  # each table says what its ablations are
        assert all(f"`{arm}`: {REGISTRY[arm].what}" in text for arm in ARMS[1:])
    # and what every arm trains on: its reward and loss settings, from its runs' recorded config
    assert set(summary["arm_settings"]) == set(ARMS)
    assert summary["arm_settings"]["empo2-no-novelty"]["reward"].endswith("no novelty bonus")
    assert "5 × novelty 1/n" in summary["arm_settings"]["grpo-novelty"]["reward"]
    assert "## What each arm trains on" in summary_md
    assert "| empo2-no-novelty | the environment's return (its score changes), no novelty bonus | GRPO, ÷ group std " \
           "| empo2: clip 0.2 / 0.3, dual clip 10, mask δ = 0.01 per token" in summary_md
