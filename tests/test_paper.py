"""The paper's comparisons: GiGPO training, OOD adaptation presets, the Reflexion baseline and ``empo2 report``.

Runs are real (the real CLI or the Python API, ScienceWorld JVMs, the WebShop fixture catalog, and ``signal_env.ChecksumRoom`` where a
run must show an update) with the tiny random model of ``conftest.tiny_model``: what is tested is the plumbing (which
estimator ran, memory on/off, weights moved or untouched, the tables' numbers = the runs' numbers), not the scores.
"""

from __future__ import annotations

import argparse
import json
from dataclasses import replace
from pathlib import Path

import numpy as np
import pytest
from peft import PeftModel

from empo2 import Config, Trainer
from empo2.cli import build_parser, main
from empo2.cli.policy import policy_context
from empo2.episodes.evaluate import EvalPlan, evaluate, play_split
from empo2.experiments import adapt
from empo2.experiments.report import method_label
from empo2.policy.loader import load_model
from empo2.rundir.checkpoint import latest_checkpoint
from helpers.signal_env import ChecksumRoom, checksum_room

WEBSHOP = ["env.max_steps=2", "env.eval_variations=1", "algo.num_generations=2", "policy.max_completion_length=8",
           "policy.reflection_max_tokens=8", "train.progress=false", "train.iterations=1", "train.report_to=none"]
SCIWORLD = ["env.max_steps=2", "env.eval_variations=1", "algo.num_generations=2", "policy.few_shot=0",
            "policy.max_completion_length=8", "policy.reflection_max_tokens=16", "train.progress=false",
            "train.iterations=1", "train.report_to=none"]
COMPARE = {"gigpo-seed0": ["algo.name=gigpo"], "empo2-seed0": ["algo.name=empo2", "algo.advantage=gigpo",
                                                                  "algo.p_memory=1.0"],
           "grpo-seed0": ["algo.name=grpo"], "grpo-seed1": ["algo.name=grpo", "train.seed=1", "env.seed=1"]}


def _metrics(run: Path) -> list[dict]:
    return [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]


@pytest.fixture(scope="module")
def webshop_compare(tmp_path_factory, tiny_model):
    """A compare folder (``runs/<algo>-seed<k>/``) of four 1-iteration WebShop-fixture runs."""
    root = tmp_path_factory.mktemp("compare")
    for name, extra in COMPARE.items():
        run = root / "runs" / name
        assert main(["train", "--config", "configs/webshop_cpu.yaml", f"train.output_dir={run}",
                     f"policy.model={tiny_model}", *WEBSHOP, *extra]) == 0
    return root


@pytest.mark.slow
def test_gigpo_trains_alone_and_under_empo2(tmp_path, tiny_model, webshop_compare):
    """``algo.name=gigpo`` (on-policy, no memory) and ``algo.name=empo2 algo.advantage=gigpo`` on ChecksumRoom, whose
    groups always have a signal: the GiGPO estimator ran, advantages are non-zero and the update moved every LoRA B
    matrix (they start at zero)."""
    for name, extra, memory in (("gigpo", ["algo.name=gigpo"], False),
                                ("empo2", ["algo.name=empo2", "algo.advantage=gigpo", "algo.p_memory=1.0"], True)):
        with checksum_room():  # registered before the config names it
            cfg = Config.load(None, ["env.name=checksum-room", f"policy.model={tiny_model}", "algo.num_generations=4",
                                     "env.eval_variations=1", "policy.few_shot=0", "policy.max_completion_length=6",
                                     "policy.reflection_max_tokens=8", "train.progress=false", "train.iterations=1",
                                     "train.report_to=none", "train.learning_rate=0.01",
                                     "algo.low_prob_threshold=0", *extra])  # δ = 0: a random model's tokens would all be masked
            with Trainer(cfg, env=ChecksumRoom, output_dir=tmp_path / name) as trainer:
                row = trainer.iteration()  # in this process, through the Python API
                lora_b = {n: p.detach() for n, p in trainer.model.named_parameters() if "lora_B" in n}
        assert row["advantage"]["step_groups"] >= 1  # the GiGPO estimator ran (it reports anchor-state groups)
        assert row["advantage"]["zero_adv_groups"] == 0 and row["advantage"]["adv_abs_mean"] > 0
        assert row["loss"]["optimizer_steps"] == 1 and row["loss"]["kept_tokens"] > 0
        assert (tmp_path / name / "memory.sqlite").exists() == memory
        assert set(row["modes"]) <= ({"on_tips", "off_tips"} if memory else {"on"})
        unmoved = [n for n, t in lora_b.items() if not t.abs().max() > 0]
        assert unmoved == [] and lora_b
    assert "step_groups" not in _metrics(webshop_compare / "runs" / "grpo-seed0")[0]["advantage"]


@pytest.mark.slow
def test_report_from_a_compare_folder(webshop_compare, tmp_path):
    out = tmp_path / "report"
    assert main(["report", str(webshop_compare), "--out", str(out)]) == 0
    tables = json.loads((out / "report.json").read_text())
    assert list(tables) == ["webshop-fixture"]  # the fixture is never reported as WebShop
    methods = tables["webshop-fixture"]["methods"]
    assert set(methods) == {"gigpo", "empo2+gigpo", "grpo"} and methods["grpo"]["n"] == 2
    finals = [json.loads((webshop_compare / "runs" / f"grpo-seed{k}" / "eval" / "final.json").read_text())["summary"]
              for k in (0, 1)]
    assert methods["grpo"]["score"] == pytest.approx(np.mean([f["score_mean"] for f in finals]))
    assert methods["grpo"]["success"] == pytest.approx(100 * np.mean([f["success_rate"] for f in finals]))
    md = (out / "report.md").read_text()
    assert "env `webshop-fixture`" in md and "| grpo | 2 |" in md and "| empo2+gigpo | 1 |" in md
    assert (out / "webshop-fixture.png").read_bytes()[:4] == b"\x89PNG"


def test_report_errors_write_nothing(tmp_path, capsys):
    (tmp_path / "empty").mkdir()
    unfinished = tmp_path / "unfinished"
    unfinished.mkdir()
    (unfinished / "config.yaml").write_text("algo: {name: grpo}\n")
    corrupt = tmp_path / "corrupt"
    (corrupt / "eval").mkdir(parents=True)
    (corrupt / "config.yaml").write_text("algo: {name: grpo}\n")
    (corrupt / "eval" / "final.json").write_text('{"summary": ')
    for folder, message in ((tmp_path / "empty", "is not a run folder"), (unfinished, "has no eval/final.json"),
                            (tmp_path / "missing", "no such folder"), (corrupt, "unreadable")):
        assert main(["report", str(folder), "--out", str(tmp_path / "out")]) == 2
        assert message in capsys.readouterr().err
    assert not (tmp_path / "out").exists()


@pytest.mark.slow
def test_adapt_presets_reflexion_and_ood_report(tmp_path, tiny_model):
    """Train on a Biology1 task, adapt to Biology2 with tips and with Reflexion (weights proven unchanged), report."""
    run = tmp_path / "bio1"
    assert main(["train", "--config", "configs/scienceworld_cpu.yaml", "--algo", "grpo", f"train.output_dir={run}",
                 f"policy.model={tiny_model}", "env.tasks=[identify-life-stages-1]", *SCIWORLD]) == 0
    cut = ["--max-tasks", "1", "--trials", "2", "--variations", "2", "--batch", "2", "--max-steps", "2"]
    for baseline in ("memory", "reflexion"):
        out = tmp_path / baseline
        assert main(["adapt", "--run", str(run), "--preset", "bio1-to-bio2", "--baseline", baseline, *cut,
                     "--out", str(out)]) == 0
        report = json.loads((out / "adapt.json").read_text())
        assert report["tasks"] == ["lifespan-longest-lived"] and report["pair"] == "biology1→biology2"
        assert [t["trial"] for t in report["trials"]] == [0, 1] and report["best"] == max(report["scores"])
        row = report["trials"][1]["per_task"]["lifespan-longest-lived"]
        assert row["episodes"] == 2 and 0 <= row["success_rate"] <= 1
        assert report["method"] == ("grpo + tips" if baseline == "memory" else "reflexion")
        assert (out / "memory.sqlite").exists() == (baseline == "memory")
        assert (out / "adapt.png").read_bytes()[:4] == b"\x89PNG" and "| 1 |" in (out / "adapt.md").read_text()
    # the recorded checksum is the one of the run's weights, loaded afresh
    model, _ = load_model(tiny_model, "cpu")
    model = PeftModel.from_pretrained(model, str(latest_checkpoint(run) / "model"))
    assert report["weights_sha256"] == adapt.parameter_checksum(model)

    out = tmp_path / "report"
    assert main(["report", str(run), str(tmp_path / "memory"), str(tmp_path / "reflexion"), "--out", str(out)]) == 0
    tables = json.loads((out / "report.json").read_text())
    assert set(tables) == {"scienceworld", "ood"}
    assert tables["scienceworld"]["tasks"] == ["identify-life-stages-1"]
    assert set(tables["ood"]["pairs"]["biology1→biology2"]) == {"grpo + tips (scienceworld)",
                                                                "reflexion (scienceworld)"}
    md = (out / "report.md").read_text()
    assert "| **average** |" in md and "| biology1→biology2 |" in md
    assert (out / "ood.png").is_file() and (out / "scienceworld.png").is_file()


def _ctx_args(**kw):
    base = dict(run=None, model=None, config=None, env=None, tasks=None, max_steps=2, batch=1)
    return argparse.Namespace(**{**base, **kw})


def test_reflections_are_shown_and_weight_changes_are_caught(tiny_model):
    cfg, ctx = policy_context(_ctx_args(model=tiny_model, env="webshop"), None)
    try:
        buffer = adapt.use_reflexion(ctx)
        variation = list(ctx.pool.call(0, "variations", "webshop", "test"))[0]
        for k in range(4):
            buffer.push(f"webshop#{variation}", f"reflection {k}")
        assert not buffer.push("webshop#0", "  ")  # empty reflections are not kept
        episodes = play_split(ctx, ["webshop"], EvalPlan("test", 1, None, 0.4, 1, with_memory=True))
        assert episodes[0].steps and all(s.tips == ["reflection 1", "reflection 2", "reflection 3"]
                                         for s in episodes[0].steps)  # the last 3, oldest first, at every step

        def tamper(_line):
            next(ctx.model.parameters()).data.add_(1.0)

        with pytest.raises(adapt.WeightsChanged):
            adapt.run_trials(ctx, ["webshop"], 1, "test", 1, 0.4, 1, "reflexion", say=tamper)
    finally:
        ctx.pool.close()


def test_an_evaluation_with_memory_reads_the_memory_and_writes_nothing(tmp_path, tiny_model, embedder):
    """``empo2 eval --run RUN --with-memory`` opens the run's own memory: its held-out episodes are shown the tips
    but may not count as their uses or move their utilities, which would change what a resumed run retrieves and
    evicts. A tip every state retrieves (threshold -1) is shown at every step and is left untouched."""
    from empo2.memory.store import TipMemory

    memory = TipMemory(tmp_path / "memory.sqlite", dim=embedder.dim)
    tip = "compare the price with the budget first"
    assert memory.add("webshop", tip, embedder.encode(["a shop page"]), key_text="a shop page",
                      tip_embedding=embedder.encode([tip])).id is not None
    cfg, ctx = policy_context(_ctx_args(model=tiny_model, env="webshop", batch=2), None)
    try:
        ctx = replace(ctx, memory=memory, memory_cfg=replace(ctx.memory_cfg, similarity_threshold=-1.0))
        plan = EvalPlan("test", 2, None, 0.4, 2, with_memory=True)
        shown = play_split(ctx, ["webshop"], plan, update_memory=False)
        assert all(s.tips == [tip] for ep in shown for s in ep.steps)
        result = evaluate(ctx, ["webshop"], plan)
        assert result["summary"]["episodes"] == 2 and result["with_memory"]
    finally:
        ctx.pool.close()
    (tip,) = memory.all_tips()
    assert (tip.use_count, tip.last_use_step, tip.utility, tip.utility_n) == (0, None, None, 0)
    memory.close()


def test_an_untrained_model_plays_under_a_given_config(tmp_path, tiny_model, capsys):
    config = tmp_path / "trained.yaml"  # the settings a trained run would have played under
    config.write_text("env: {name: webshop, max_steps: 3}\n"
                      "policy: {history_window: 3, max_completion_length: 9, few_shot: 0}\nmemory: {top_k_tips: 2}\n")
    cfg, ctx = policy_context(_ctx_args(model=tiny_model, config=str(config), max_steps=None), None)
    try:
        assert cfg.policy.model == tiny_model and cfg.env.max_steps == 3
        assert (ctx.policy_cfg.history_window, ctx.policy_cfg.max_completion_length, ctx.policy_cfg.few_shot,
                ctx.memory_cfg.top_k_tips) == (3, 9, 0, 2)
    finally:
        ctx.pool.close()
    run, out = tmp_path / "run", tmp_path / "out"
    run.mkdir()
    assert main(["adapt", "--run", str(run), "--config", str(config), "--out", str(out)]) == 2
    assert main(["adapt", "--preset", "bio1-to-bio2", "--out", str(out)]) == 2
    assert not out.exists()  # refused before anything is written
    err = capsys.readouterr().err
    assert "--config goes with --model" in err and "give --run RUN_DIR, --model NAME or --config YAML" in err


def test_method_labels():
    assert method_label({"algo": {"name": "empo2", "advantage": "grpo"}}) == "empo2"
    assert method_label({"algo": {"name": "empo2", "advantage": "gigpo"}}) == "empo2+gigpo"
    assert method_label({"algo": {"name": "gigpo", "advantage": "grpo"}}) == "gigpo"  # gigpo always uses its own
    assert method_label({}) == "empo2"


def test_preset_flags():
    assert adapt.resolve_tasks("elec-to-chem", None, None, None) == (
        "scienceworld", "chemistry-mix,chemistry-mix-paint-secondary-color,chemistry-mix-paint-tertiary-color")
    assert adapt.resolve_tasks("bio2-to-elec", None, 2, None)[1] == \
        "power-component,power-component-renewable-vs-nonrenewable-energy"
    assert adapt.resolve_tasks(None, "biology2", 1, None)[1] == "lifespan-longest-lived"
    assert adapt.resolve_tasks(None, None, None, "webshop") == ("webshop", None)
    assert main(["adapt", "--model", "x", "--preset", "bio1-to-bio2", "--tasks", "find-animal", "--out", "o"]) == 2
    for name in adapt.PRESETS:  # the CLI offers exactly the presets the module knows
        assert build_parser().parse_args(["adapt", "--model", "m", "--preset", name, "--out", "o"]).preset == name
    with pytest.raises(SystemExit):
        build_parser().parse_args(["adapt", "--model", "m", "--preset", "bio1-to-chem", "--out", "o"])
