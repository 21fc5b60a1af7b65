"""Presets that inherit (``base:``), and renamed keys that still load: the shipped presets resolve to exactly the
configs they gave as full copies, a chain's errors are one line, and a config written with the old names (a preset,
a saved run, a checkpoint) loads with one warning per old name and the same values."""

from __future__ import annotations

import json
import warnings
from pathlib import Path

import pytest
import yaml

from empo2.cli import main
from empo2.config import Config, ConfigError, flat_settings
from empo2.config.renames import RENAMED, ConfigRenameWarning

BEFORE = json.loads((Path(__file__).parent / "data" / "presets_before_inheritance.json").read_text())
"""Every shipped preset's resolved config as the loader gave it when each preset was a full copy (and before the
renames: old key names)."""
OLD_TEXT = {"low_prob_threshold:": "delta:", "ppo_epochs:": "num_iterations:"}
"""How a preset spelled the renamed keys before the renames."""


def flat(sections: dict) -> dict:
    """``{section.name: value}``, as versions before the nested method options flattened a config."""
    return {f"{s}.{k}": v for s, values in sections.items() for k, v in values.items()}


def forward(sections: dict) -> dict:
    """A resolved config from before the renames, under the current names (a method's options spelled out; a
    ``train.tensorboard: true`` folded into ``train.report_to``, where it changes nothing)."""
    out = flat_settings(sections)
    assert out.pop("train.tensorboard", True) is True
    return out


def load(*args) -> tuple[Config, list[str]]:
    """``Config.load(*args)`` and the rename warnings it gave."""
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        cfg = Config.load(*args)
    return cfg, [str(w.message) for w in caught if issubclass(w.category, ConfigRenameWarning)]


# ----------------------------------------------------------------------------------------------------- inheritance
@pytest.mark.parametrize("path", sorted((Path(__file__).parents[1] / "configs").glob("*.yaml")), ids=lambda p: p.name)
def test_every_shipped_preset_loads(path):
    """Every preset in configs/ loads through its base chain and validates (a new one, not in the fixture, too)."""
    cfg = Config.load(path)
    assert cfg.env.name and cfg.policy.model and cfg.train.iterations >= 1


@pytest.mark.parametrize("name", sorted(BEFORE))
def test_each_shipped_preset_resolves_to_the_config_it_had_as_a_full_copy(name):
    cfg, renamed = load(f"configs/{name}")
    assert forward(cfg.to_dict()) == forward(BEFORE[name])
    assert renamed == []  # the shipped presets use the current names


def test_each_variant_names_its_base_and_repeats_none_of_its_values():
    for variant, base in (("scienceworld_learn_cpu", "scienceworld_cpu"), ("webshop_paper", "scienceworld_paper"),
                          ("scienceworld_evidence_cpu", "scienceworld_learn_cpu"), ("webshop_signal_cpu", "webshop_cpu")):
        data = yaml.safe_load(Path(f"configs/{variant}.yaml").read_text())
        assert data.pop("base") == f"{base}.yaml"
        mine, its = (forward(Config.load(f"configs/{name}.yaml").to_dict()) for name in (variant, base))
        assert [key for key in forward(data) if mine[key] == its[key]] == [], variant


def test_a_base_is_found_beside_its_preset_and_merges_key_by_key(tmp_path, monkeypatch):
    (tmp_path / "common").mkdir()
    (tmp_path / "common" / "root.yaml").write_text(
        "env: {tasks: [find-animal, find-plant], step_caps: {find-animal: 9, find-plant: 7}, max_steps: 5}\n"
        "algo: {num_generations: 6, beta: 0.1}\n")
    (tmp_path / "mid.yaml").write_text("base: common/root.yaml\nalgo: {beta: 0.2}\ntrain: {iterations: 3}\n")
    (tmp_path / "leaf.yaml").write_text("base: mid.yaml\nenv: {tasks: [use-thermometer], step_caps: {x: 4}}\n")
    monkeypatch.chdir(tmp_path / "common")  # paths are relative to the preset's file, not the working directory
    cfg = Config.load(tmp_path / "leaf.yaml", ["train.iterations=9"])
    assert cfg.env.tasks == ["use-thermometer"] and cfg.env.step_caps == {"x": 4}  # a value replaces its base's whole
    assert cfg.env.max_steps == 5 and cfg.algo.num_generations == 6  # the rest of a section is inherited
    assert cfg.algo.beta == 0.2 and cfg.train.iterations == 9  # nearer wins; an override wins over every file


@pytest.mark.parametrize("files, message", [
    ({"a.yaml": "base: a.yaml\n"}, "a.yaml: presets inherit in a circle (a.yaml -> a.yaml)"),
    ({"a.yaml": "base: b.yaml\n", "b.yaml": "base: ./a.yaml\nalgo: {beta: 0.1}\n"},
     "b.yaml: presets inherit in a circle (a.yaml -> b.yaml -> a.yaml)"),
    ({"a.yaml": "base: missing.yaml\n"}, "a.yaml: its base preset 'missing.yaml' is not a file ("),
    ({"a.yaml": "base: [b.yaml]\n"}, "a.yaml: base must be the path of a preset file, got ['b.yaml']"),
    ({"a.yaml": "base: b.yaml\n", "b.yaml": "algo: {betta: 1}\n"}, "unknown config key 'algo.betta'"),
])
def test_a_broken_chain_exits_2_with_one_line(tmp_path, capsys, files, message):
    for name, text in files.items():
        (tmp_path / name).write_text(text)
    with pytest.raises(ConfigError) as info:
        Config.load(tmp_path / "a.yaml")
    assert message in str(info.value)
    run = tmp_path / "run"
    assert main(["train", "--config", str(tmp_path / "a.yaml"), f"train.output_dir={run}"]) == 2
    err = capsys.readouterr().err
    assert message in err and len(err.strip().splitlines()) == 1 and not run.exists()


def test_a_saved_config_is_resolved_and_needs_no_preset(tmp_path):
    """A run's config.yaml holds every value and no ``base:``: it loads the same with the preset files gone."""
    (tmp_path / "base.yaml").write_text("algo: {num_generations: 6}\n")
    (tmp_path / "child.yaml").write_text("base: base.yaml\ntrain: {iterations: 2}\n")
    cfg = Config.load(tmp_path / "child.yaml")
    cfg.save(tmp_path / "config.yaml")
    saved = yaml.safe_load((tmp_path / "config.yaml").read_text())
    assert "base" not in saved and saved["algo"]["num_generations"] == 6
    (tmp_path / "base.yaml").unlink()
    (tmp_path / "child.yaml").unlink()
    assert Config.load(tmp_path / "config.yaml").to_dict() == cfg.to_dict()


# ----------------------------------------------------------------------------------------------------- renames
def test_a_preset_from_before_the_renames_loads_with_one_warning_per_old_name(tmp_path):
    text = Path("configs/scienceworld_paper.yaml").read_text()
    for new, old in OLD_TEXT.items():
        assert text.count(f"  {new}") == 1
        text = text.replace(f"  {new}", f"  {old}")
    (tmp_path / "old.yaml").write_text(text)
    cfg, renamed = load(tmp_path / "old.yaml", ["delta=0.01"])  # the old name again, bare, in an override
    assert forward(cfg.to_dict()) == forward(BEFORE["scienceworld_paper.yaml"])
    assert sorted(renamed) == [
        f"algo.delta is now called algo.low_prob_threshold: {tmp_path / 'old.yaml'} uses the old name, read as "
        "algo.low_prob_threshold (rename it there)",
        f"train.num_iterations is now called train.ppo_epochs: {tmp_path / 'old.yaml'} uses the old name, read as "
        "train.ppo_epochs (rename it there)"]


def test_a_saved_run_config_with_the_old_names_loads_to_the_same_values(tmp_path):
    (tmp_path / "config.yaml").write_text(yaml.safe_dump(BEFORE["scienceworld_evidence_cpu.yaml"], sort_keys=False))
    cfg, renamed = load(tmp_path / "config.yaml", ["train.num_iterations=3"])
    want = forward(BEFORE["scienceworld_evidence_cpu.yaml"]) | {"train.ppo_epochs": 3}
    assert forward(cfg.to_dict()) == want and len(renamed) == len(RENAMED) + 1  # every old name, and tensorboard
    assert load(tmp_path / "config.yaml")[1] == []  # read again (a resume reads it twice): warned once per process
    with warnings.catch_warnings(record=True) as caught:  # a finished run's record: read as is, nothing to rename
        warnings.simplefilter("always")
        recorded = Config.from_dict(BEFORE["scienceworld_evidence_cpu.yaml"], record=True)
    assert forward(recorded.to_dict()) == forward(BEFORE["scienceworld_evidence_cpu.yaml"]) and caught == []
    cfg.save(tmp_path / "again.yaml")  # saved again: the current names only
    again, renamed = load(tmp_path / "again.yaml")
    assert again.to_dict() == cfg.to_dict() and renamed == []
    assert "num_iterations" not in (tmp_path / "again.yaml").read_text()


@pytest.mark.parametrize("text, overrides, message", [
    ("algo: {delta: 0.02, low_prob_threshold: 0.03}\n", [],
     "gives both algo.delta and its new name algo.low_prob_threshold, with different values (0.02 and 0.03)"),
    ("", ["train.ppo_epochs=2", "num_iterations=3"],
     "an override gives both train.num_iterations and its new name train.ppo_epochs, with different values (2 and 3)"),
])
def test_an_old_and_a_new_name_with_different_values_are_refused(tmp_path, text, overrides, message):
    (tmp_path / "c.yaml").write_text(text)
    with pytest.raises(ConfigError) as info:
        load(tmp_path / "c.yaml", overrides)
    assert message in str(info.value)


def test_old_and_new_names_that_agree_or_sit_in_different_files_load(tmp_path):
    (tmp_path / "c.yaml").write_text("algo: {delta: 0.02, low_prob_threshold: 2.0e-2}\n")
    cfg, renamed = load(tmp_path / "c.yaml")
    assert cfg.algo.low_prob_threshold == 0.02 and len(renamed) == 1
    (tmp_path / "base.yaml").write_text("algo: {delta: 0.05}\ntrain: {num_iterations: 2}\n")
    (tmp_path / "child.yaml").write_text("base: base.yaml\nalgo: {low_prob_threshold: 0.0}\n")
    cfg, renamed = load(tmp_path / "child.yaml", ["algo.delta=0.0"])  # the preset states the new name: it wins
    assert cfg.algo.low_prob_threshold == 0.0 and cfg.train.ppo_epochs == 2 and len(renamed) == 2


@pytest.mark.parametrize("text, report_to", [
    ("train: {report_to: [wandb, tensorboard], tensorboard: false}\n", ["wandb"]),
    ("train: {tensorboard: false, report_to: [tensorboard]}\n", ["none"]),  # a saved run's order: read as a whole
    ("train: {tensorboard: true, report_to: [wandb]}\n", ["wandb"]),  # true only allowed what report_to named
    ("train: {tensorboard: true}\n", ["tensorboard"]),
])
def test_the_old_tensorboard_switch_is_read_into_report_to_with_one_warning(tmp_path, text, report_to):
    (tmp_path / "c.yaml").write_text(text)
    cfg, renamed = load(tmp_path / "c.yaml")
    assert cfg.train.report_to == report_to
    assert renamed == [f"train.tensorboard is now part of train.report_to: {tmp_path / 'c.yaml'} uses the old key, "
                       "read into train.report_to (state it there)"]
    assert "tensorboard:" not in yaml.safe_dump(cfg.to_dict())  # saved again: report_to only


def test_an_old_tensorboard_override_reads_the_report_to_its_files_set(tmp_path):
    (tmp_path / "c.yaml").write_text("train: {report_to: [mlflow, tensorboard]}\n")
    assert load(tmp_path / "c.yaml", ["tensorboard=off"])[0].train.report_to == ["mlflow"]
    assert load(None, ["train.tensorboard=false"])[0].train.report_to == ["none"]


def test_an_old_tensorboard_switch_that_is_not_a_bool_is_one_error(tmp_path):
    with pytest.raises(ConfigError, match=r"^train.tensorboard must be true or false, got 'maybe'$"):
        load(None, ["train.tensorboard=maybe"])


def test_the_cli_prints_one_warning_line_per_old_name(tmp_path, capsys):
    (tmp_path / "old.yaml").write_text("algo: {delta: 0.02}\ntrain: {num_iterations: 2}\n")
    # policy.top_p=0.9 stops the command before a model loads, after the config (and its warnings) is read
    assert main(["train", "--config", str(tmp_path / "old.yaml"), "policy.top_p=0.9", "delta=0.02",
                 f"train.output_dir={tmp_path / 'run'}"]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert [line.split(" is now called ")[0] for line in err[:-1]] == ["warning: algo.delta",
                                                                      "warning: train.num_iterations"]
    assert err[-1].startswith("error: policy.top_p=0.9")


# ------------------------------------------------------------------------------------- a method's own settings
def test_a_method_setting_under_its_old_flat_name_lands_in_the_method_options_with_one_warning(tmp_path):
    """``algo.proxmo_alpha`` (a file) and ``proxmo_alpha`` (a bare override) set ``algo.proxmo.alpha``, one warning
    each; ``algo.gamma``, once shared by GiGPO and ProxMO, sets both methods' discount with one warning."""
    (tmp_path / "old.yaml").write_text("algo: {name: proxmo, proxmo_alpha: 2.0, gamma: 0.9}\n")
    cfg, renamed = load(tmp_path / "old.yaml")
    assert cfg.algo.proxmo.alpha == 2.0 and cfg.algo.proxmo.gamma == cfg.algo.gigpo.gamma == 0.9
    assert sorted(renamed) == [
        f"algo.gamma is now called algo.gigpo.gamma and algo.proxmo.gamma: {tmp_path / 'old.yaml'} uses the old "
        "name, read as algo.gigpo.gamma and algo.proxmo.gamma (rename it there)",
        f"algo.proxmo_alpha is now called algo.proxmo.alpha: {tmp_path / 'old.yaml'} uses the old name, read as "
        "algo.proxmo.alpha (rename it there)"]
    cfg, renamed = load(None, ["proxmo_alpha=3", "algo.proxmo.tau=0.5"])
    assert (cfg.algo.proxmo.alpha, cfg.algo.proxmo.tau) == (3.0, 0.5) and len(renamed) == 1
    cfg.save(tmp_path / "saved.yaml")  # written nested, read back the same without a warning
    assert yaml.safe_load((tmp_path / "saved.yaml").read_text())["algo"]["proxmo"]["alpha"] == 3.0
    again, renamed = load(tmp_path / "saved.yaml")
    assert again.to_dict() == cfg.to_dict() and renamed == []


@pytest.mark.parametrize("text, overrides, message", [
    ("", ["algo.gigpo.normalisation=mean_std_norm"], "unknown config key 'algo.gigpo.normalisation'; algo.gigpo "
     "holds: normalization, gamma, step_advantage_weight, step_similarity"),
    ("algo: {luffy: {gama: 0.2}}\n", [], "unknown config key 'algo.luffy.gama'; algo.luffy holds: gamma, shaping, "
     "clip, std"),
    ("", ["algo.gigpo=mean_std_norm"], "algo.gigpo holds settings, not one value: set algo.gigpo.<name>, one of "
     "normalization, gamma, step_advantage_weight, step_similarity"),
    ("", ["algo.proxmo.alpha=200"], "algo.proxmo.alpha must be in [0, 100], got 200.0"),
    ("algo: {gamma: 0.9, gigpo: {gamma: 0.8}}\n", [], "gives both algo.gamma and its new name algo.gigpo.gamma, "
     "with different values (0.9 and 0.8)"),
    ("", ["env.webshop.strat=results"], "unknown config key 'env.webshop.strat'; env.webshop holds: data, "
     "human_goals, num_products, start"),
    ("env: {textworld_express: {param: {coin: {numLocations: 4}}}}\n", [], "unknown config key "
     "'env.textworld_express.param'; env.textworld_express holds: params, eval_params"),
    ("", ["env.scienceworld=hard"], "env.scienceworld holds settings, not one value: set env.scienceworld.<name>, "
     "one of simplification"),
    ("", ["env.webshop.num_products=0"], "env.webshop.num_products must be in [1, 1000000000], got 0"),
    ("", ["env.webshop.start=item"], "env.webshop.start must be one of search, results, got 'item'"),
    ("env: {simplification: hard, scienceworld: {simplification: easy}}\n", [], "gives both env.simplification "
     "and its new name env.scienceworld.simplification, with different values ('hard' and 'easy')"),
])
def test_a_wrong_method_or_environment_setting_exits_2_with_one_line(tmp_path, capsys, text, overrides, message):
    (tmp_path / "c.yaml").write_text(text)
    with pytest.raises(ConfigError) as info:
        load(tmp_path / "c.yaml", overrides)
    assert message in str(info.value)
    assert main(["train", "--config", str(tmp_path / "c.yaml"), *overrides,
                 f"train.output_dir={tmp_path / 'run'}"]) == 2
    err = [line for line in capsys.readouterr().err.splitlines() if not line.startswith("warning: ")]
    assert len(err) == 1 and message in err[0] and not (tmp_path / "run").exists()


# ------------------------------------------------------------------------------- an environment's own settings
OLD_ENV = {"simplification": ("scienceworld.simplification", "hard"), "webshop_data": ("webshop.data", "/data/ws"),
           "webshop_human_goals": ("webshop.human_goals", True), "webshop_num_products": ("webshop.num_products", 22),
           "webshop_start": ("webshop.start", "results"),
           "twx_params": ("textworld_express.params", {"coin": {"numLocations": 4}}),
           "twx_eval_params": ("textworld_express.eval_params", {"coin": {"numLocations": 9}})}
"""Each old flat name of an environment's setting: its current name under ``env`` and a value that is not the
default."""


def env_option(cfg: Config, name: str):
    owner, field = name.split(".")
    return getattr(getattr(cfg.env, owner), field)


def test_an_environment_setting_under_its_old_flat_name_lands_in_its_options_with_one_warning(tmp_path):
    """Every old flat name, in a file, sets the nested option with one warning naming both; in an override (dotted or
    bare) too; a finished run's record is read as is, and flattened under the current names."""
    old = {"env": {"name": "textworld_express", "tasks": ["coin"],
                   **{name: value for name, (_, value) in OLD_ENV.items()}}}
    (tmp_path / "old.yaml").write_text(yaml.safe_dump(old))
    cfg, renamed = load(tmp_path / "old.yaml")
    assert {name: env_option(cfg, new) for name, (new, _) in OLD_ENV.items()} == \
        {name: value for name, (_, value) in OLD_ENV.items()}
    assert sorted(renamed) == sorted(f"env.{name} is now called env.{new}: {tmp_path / 'old.yaml'} uses the old name, "
                                     f"read as env.{new} (rename it there)" for name, (new, _) in OLD_ENV.items())
    cfg, renamed = load(None, ["env.twx_params={coin: {numLocations: 5}}", "webshop_start=results"])
    assert cfg.env.textworld_express.params == {"coin": {"numLocations": 5}} and cfg.env.webshop.start == "results"
    assert renamed == ["env.twx_params is now called env.textworld_express.params: an override uses the old name, "
                       "read as env.textworld_express.params (rename it there)",
                       "env.webshop_start is now called env.webshop.start: an override uses the old name, read as "
                       "env.webshop.start (rename it there)"]
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        recorded = Config.from_dict(old, record=True)
    assert caught == [] and recorded.env.scienceworld.simplification == "hard"
    settings = flat_settings(old)
    assert settings["env.textworld_express.eval_params"] == {"coin": {"numLocations": 9}}
    assert not any(f"env.{name}" in settings for name in OLD_ENV)
    cfg.save(tmp_path / "saved.yaml")  # written nested, read back the same without a warning
    assert yaml.safe_load((tmp_path / "saved.yaml").read_text())["env"]["webshop"]["start"] == "results"
    again, renamed = load(tmp_path / "saved.yaml")
    assert again.to_dict() == cfg.to_dict() and renamed == []


def test_a_run_saved_before_the_renames_resumes_and_its_checkpoint_is_still_compared(tmp_path):
    """The checkpoint's stored settings (old names, a digest of them) are read under the current names: equal values
    let the resume through, and a value edited since is still named."""
    import hashlib

    from empo2.rundir.resume import RESUME_SAFE, check_checkpoint_settings, check_same_run

    old = BEFORE["scienceworld_cpu.yaml"]
    run = tmp_path / "run"
    (run / "checkpoints" / "iter_000000").mkdir(parents=True)
    (run / "config.yaml").write_text(yaml.safe_dump(old, sort_keys=False))
    resume_safe = RESUME_SAFE | {"train.tensorboard"}  # that version's (tensorboard was a key of its own)
    settings = {k: v for k, v in flat(old).items() if k not in resume_safe}  # as the checkpoint's version digested
    state = {"config": old, "settings_digest": hashlib.sha256(json.dumps(settings, sort_keys=True).encode()).hexdigest()}
    (run / "checkpoints" / "iter_000000" / "state.json").write_text(json.dumps(state))
    cfg, _ = load(run / "config.yaml", ["train.iterations=6"])
    check_same_run(load(run / "config.yaml")[0], cfg, run)
    check_checkpoint_settings(cfg, run)
    state["config"]["train"]["num_iterations"] = 2  # trained with 2 passes, config.yaml says 1
    (run / "checkpoints" / "iter_000000" / "state.json").write_text(json.dumps(state))
    with pytest.raises(ConfigError, match=r"\(train.ppo_epochs: 2 -> 1\)"):
        check_checkpoint_settings(cfg, run)
