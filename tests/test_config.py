from pathlib import Path

import pytest

from empo2.config import Config, ConfigError


def test_defaults_match_released_mode_probabilities():
    cfg = Config()
    assert cfg.algorithm.modes(cfg.algo) == pytest.approx({"on": 0.75, "on_tips": 0.08, "off_tips": 0.17})
    assert cfg.algorithm.uses_memory and cfg.algorithm.loss == "empo2"
    cfg = Config.load(None, ["algo.name=grpo"])
    assert cfg.algorithm.modes(cfg.algo) == {"on": 1.0, "on_tips": 0.0, "off_tips": 0.0}
    assert not cfg.algorithm.uses_memory and cfg.algorithm.estimator(cfg.algo) == "grpo"


@pytest.mark.parametrize("override, message", [
    ("algo.name=nope", "algo.name: unknown algorithm 'nope'; valid: "),
    ("algo.advantage=nope", "algo.advantage: unknown advantage estimator 'nope'; valid: "),
    ("env.name=atari", "unknown environment 'atari'; valid environments: scienceworld, textworld_express, webshop"),
    ("env.tasks=[find-dragon]", "unknown ScienceWorld task 'find-dragon'"),
    ("memory.eviction=random", "memory.eviction: unknown eviction policy 'random'; valid: fifo, lru, utility"),
    ("policy.backend=vlm", "policy.backend: unknown rollout backend 'vlm'; valid: auto, hf, merged, vllm"),
])
def test_registry_names_are_checked_at_load(override, message):
    with pytest.raises(ConfigError) as info:
        Config.load(None, [override])
    assert message in str(info.value)


def test_yaml_and_overrides(tmp_path):
    path = tmp_path / "c.yaml"
    path.write_text("env: {tasks: [find-animal]}\nalgo: {beta: 0.05}\n")
    cfg = Config.load(path, ["tasks=[use-thermometer,find-plant]", "train.iterations=7", "low_prob_threshold=0.05"])
    assert cfg.env.tasks == ["use-thermometer", "find-plant"]
    assert cfg.train.iterations == 7 and cfg.algo.low_prob_threshold == 0.05 and cfg.algo.beta == 0.05
    cfg.save(tmp_path / "saved.yaml")
    assert Config.load(tmp_path / "saved.yaml").to_dict() == cfg.to_dict()


@pytest.mark.parametrize("text, override, message", [
    ("algo: {betta: 0.1}\n", [], "unknown config key 'algo.betta'"),
    ("nope: {}\n", [], "unknown config section"),
    ("algo: [1, 2]\n", [], "must be a mapping"),
    ("algo: {beta: [oops\n", [], "malformed YAML"),
    ("", ["train.iterations=many"], "must be an integer"),
    ("", ["algo.low_prob_threshold=1.5"], "algo.low_prob_threshold must be in [0, 1), got 1.5"),
    ("", ["algo.p_off_policy=0.9"], "p_off_policy <= algo.p_memory"),
    ("", ["seed=3"], "ambiguous"),
    ("", ["justakey"], "not key=value"),
    ("", ["policy.lora_dropout=0.05"], "policy.lora_dropout must be 0"),  # π_old has none: the ratio would be noise
])
def test_bad_config_gives_one_clear_error(tmp_path, text, override, message):
    path = tmp_path / "c.yaml"
    path.write_text(text)
    with pytest.raises(ConfigError, match=None) as info:
        Config.load(path, override)
    assert message in str(info.value)


def test_unknown_key_lists_valid_keys():
    with pytest.raises(ConfigError) as info:
        Config.load(None, ["algo.not_a_key=1"])
    assert "algo.beta" in str(info.value) and "train.learning_rate" in str(info.value)


def test_missing_file():
    with pytest.raises(ConfigError, match="config file not found"):
        Config.load("/nonexistent/config.yaml")


def test_every_config_field_is_documented():
    """Each setting is followed by its attribute docstring (the reference users read): the sections' fields in
    config/sections.py and each method's own options in its file (``algo.gigpo.*`` in algo/gigpo.py …)."""
    import ast
    import importlib
    import inspect

    from empo2.config.bounds_check import settings

    declared, documented = set(), set()
    for _, obj, f in settings(Config()):
        owner = next(c for c in type(obj).__mro__ if f.name in vars(c).get("__annotations__", {}))
        declared.add(f"{owner.__module__}.{owner.__name__}.{f.name}")
    for module in {name.rsplit(".", 2)[0] for name in declared}:
        tree = ast.parse(Path(inspect.getsourcefile(importlib.import_module(module))).read_text())
        for cls in (n for n in tree.body if isinstance(n, ast.ClassDef)):
            for node, after in zip(cls.body, cls.body[1:]):
                if isinstance(node, ast.AnnAssign) and isinstance(after, ast.Expr) and \
                        isinstance(after.value, ast.Constant) and isinstance(after.value.value, str):
                    documented.add(f"{module}.{cls.name}.{node.target.id}")
    assert len(declared) > 80 and {"empo2.algo.gigpo.GigpoOptions.normalization",
                                    "empo2.algo.elpo.ElpoOptions.lambda_tree"} <= declared
    assert declared - documented == set()


def test_eval_flags_are_typed_and_checked_before_the_model_loads(tmp_path, capsys):
    """``--tasks "a, b"`` is split and stripped like a config override; a bad name exits 2 naming it, and a good one
    gets as far as the model (here a missing one), so the flags were accepted."""
    from empo2.cli import main

    assert main(["eval", "--model", "no-such-model", "--tasks", "find-animal, nosuch", "--out", str(tmp_path)]) == 2
    err = capsys.readouterr().err
    assert "unknown ScienceWorld task 'nosuch'" in err and "no-such-model" not in err
    assert main(["eval", "--model", "no-such-model", "--tasks", "find-animal, find-living-thing",
                 "--max-steps", "3", "--allow-unreachable", "--out", str(tmp_path)]) == 2
    assert "unknown model 'no-such-model'" in capsys.readouterr().err


def test_overrides_may_follow_flags():
    """``train --config X a=1 --overwrite b=2`` keeps both overrides in order; a stray word is still an error."""
    from empo2.cli import parse_cli

    args = parse_cli(["train", "--config", "c.yaml", "train.iterations=2", "--overwrite", "train.output_dir=/tmp/x"])
    assert args.overwrite and args.overrides == ["train.iterations=2", "train.output_dir=/tmp/x"]
    args = parse_cli(["compare", "--config", "c.yaml", "--out", "o", "train.seed=3", "--algos", "grpo", "a.b=1"])
    assert args.overrides == ["train.seed=3", "a.b=1"] and args.algos == "grpo"
    with pytest.raises(SystemExit):
        parse_cli(["train", "--config", "c.yaml", "a.b=1", "--overwrite", "stray"])
    with pytest.raises(SystemExit):
        parse_cli(["eval", "--model", "m", "--out", "o", "x=1"])  # eval takes no overrides


@pytest.mark.parametrize("override, message", [
    ("policy.top_p=0.9", "policy.top_p=0.9 / policy.top_k=0 cannot train: the behaviour log-probs are of logits"),
    ("policy.top_k=20", "policy.top_p=1 / policy.top_k=20 cannot train"),
    ("policy.temperature=0", "policy.temperature must be > 0 to train"),
])
def test_sampling_the_update_cannot_score_is_refused_for_training(override, message):
    """Behaviour and update log-probs are log-softmax(logits / policy.temperature): a run that trains refuses what
    they cannot express (top-p, top-k, greedy); loading the config for sampling alone is fine."""
    cfg = Config.load(None, [override])
    with pytest.raises(ConfigError) as info:
        cfg.check_training()
    assert message in str(info.value) and "\n" not in str(info.value)
    Config.load("configs/scienceworld_cpu.yaml").check_training()  # the shipped settings train


def test_train_with_top_p_exits_2_before_anything_is_written(tmp_path, capsys):
    from empo2.cli import main

    run = tmp_path / "run"
    # an unknown model too: the sampling check comes first, and no run can start even if it did not
    assert main(["train", "--config", "configs/scienceworld_cpu.yaml", "policy.top_p=0.95", "policy.model=no-such",
                 f"train.output_dir={run}"]) == 2
    err = capsys.readouterr().err.strip()
    assert "policy.top_p=0.95 / policy.top_k=0 cannot train" in err and len(err.splitlines()) == 1
    assert not run.exists()


def literal_fields():
    """``(key, allowed values)`` of every ``Literal[...]`` field of the config sections, read from the annotations."""
    import dataclasses
    import typing

    out = []
    for name in Config.SECTIONS:
        section = type(getattr(Config(), name))
        hints = typing.get_type_hints(section)
        out += [(f"{name}.{f.name}", typing.get_args(hints[f.name])) for f in dataclasses.fields(section)
                if typing.get_origin(hints[f.name]) is typing.Literal]
    return out


def test_every_enumerated_field_is_checked_at_load_from_its_annotation():
    """Each ``Literal[...]`` field refuses a value outside its annotation with one line naming the field, the value
    and the allowed ones, whether the value comes from an override, a YAML file or the code; the default is
    allowed."""
    fields = literal_fields()
    assert {"algo.loss_type", "algo.mask_granularity", "policy.dtype", "policy.autocast", "env.pool",
            "memory.namespace", "algo.intrinsic_schedule"} <= {key for key, _ in fields}
    for key, allowed in fields:
        section, name = key.split(".")
        assert getattr(getattr(Config(), section), name) in allowed
        message = f"{key} must be one of {', '.join(allowed)}, got 'bogus'"
        with pytest.raises(ConfigError) as info:
            Config.load(None, [f"{key}=bogus"])
        assert str(info.value) == message
        cfg = Config()
        setattr(getattr(cfg, section), name, "bogus")
        with pytest.raises(ConfigError) as info:
            cfg.validate()
        assert str(info.value) == message
        for value in allowed:
            assert getattr(getattr(Config.load(None, [f"{key}={value}"]), section), name) == value


def test_a_bad_enumerated_value_exits_2_with_one_line_before_anything_is_written(tmp_path, capsys):
    from empo2.cli import main

    run = tmp_path / "run"
    (tmp_path / "c.yaml").write_text("algo: {loss_type: [token_mean]}\n")
    assert main(["train", "--config", str(tmp_path / "c.yaml"), f"train.output_dir={run}"]) == 2
    assert capsys.readouterr().err.strip() == "error: algo.loss_type must be a string, got ['token_mean']"
    assert main(["train", "algo.loss_type=token", f"train.output_dir={run}"]) == 2
    err = capsys.readouterr().err.strip()
    assert err == "error: algo.loss_type must be one of token_mean, sequence_mean, dr_grpo, got 'token'"
    assert len(err.splitlines()) == 1 and not run.exists()


def test_the_trainer_refuses_sampling_the_update_cannot_score(tmp_path):
    """Not only the CLI: a Trainer built from a config (as the library and the benchmarks build it) checks the
    sampling settings first, before it loads a model or writes a file."""
    from empo2.train.trainer import Trainer

    cfg = Config.load(None, ["policy.top_p=0.9", "policy.model=no-such-model"])
    with pytest.raises(ConfigError, match="policy.top_p=0.9 / policy.top_k=0 cannot train"):
        Trainer(cfg, output_dir=tmp_path / "run")
    assert not (tmp_path / "run").exists()


def test_a_config_survives_pickling_with_its_method_and_environment_options():
    """Worker processes and ranks receive configs by pickle; the ``algo`` and ``env`` sections are classes made from
    the registries."""
    import pickle

    from empo2.config import Config

    cfg = Config()
    cfg.set("algo.proxmo.alpha", 2.5)
    cfg.set("env.textworld_express.params", "{coin: {numLocations: 4}}")
    cfg.set("env.webshop.start", "results")
    back = pickle.loads(pickle.dumps(cfg))
    assert back.to_dict() == cfg.to_dict() and back.algo.proxmo.alpha == 2.5
    assert back.env == cfg.env and back.env.textworld_express.params == {"coin": {"numLocations": 4}}
    assert back.sft_env().webshop.start == "results"  # a copy of the section keeps its class
