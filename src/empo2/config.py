"""Run configuration: one dataclass per concern, loaded from YAML with ``key=value`` overrides.

Names follow TRL where TRL has the knob (``num_generations``, ``beta``, ``epsilon``, ``epsilon_high``,
``temperature``, ``top_p``, ``top_k``, ``max_completion_length``, ``learning_rate``, ``loss_type``) and its name
does not mislead (PPO's passes are ``ppo_epochs``, not TRL's ``num_iterations``, beside ``train.iterations``);
EMPO²'s own knobs say what they are (``low_prob_threshold``, the paper's δ; ``p_memory``, ``p_off_policy``,
``top_k_tips``). Renamed keys still load, with a warning (:mod:`empo2.config_renames`).

A YAML file has one mapping per section::

    env: {name: scienceworld, tasks: [find-animal]}
    algo: {name: empo2, beta: 0.0}

Overrides on the command line are ``section.key=value`` or, when the key is unique across sections, ``key=value``
(a key ``sft`` shares with another section means the other's: the warm start's knobs are written dotted).
A value is read by its field's declared type, never as YAML: a string or path is taken literally (``output_dir=/scratch/
exp #2`` keeps `` #2``, ``dtype=on`` stays ``"on"``); an integer is decimal digits (``0755`` is 755); a bool is
``true``/``false`` (also ``yes``/``no``/``on``/``off``, as YAML files spell them); a list is ``[a, b]`` or ``a,b``; an
optional field is unset by an empty value or ``null``. A YAML file is read the same way: its plain scalars are typed by
the field, not by YAML's guesses, and aliases (``*name``) are refused. A preset may inherit from another (``base:``,
:mod:`empo2.config_presets`). The sections' fields, with their bounds, are defined and documented in
:mod:`empo2.config_sections`.
"""

from __future__ import annotations

import dataclasses
import os
import re
from dataclasses import dataclass, field, fields
from pathlib import Path
from typing import Any

import yaml

from empo2.config_bounds import MAX_CONFIG_BYTES, ConfigError, check_bounds, check_choices, check_size, shown
from empo2.config_presets import preset_layers
from empo2.config_renames import FOLDED, RENAMED, fold_tensorboard, old_name, warn_renamed
from empo2.config_sections import (  # noqa: F401
    AlgoConfig,
    EnvConfig,
    MemoryConfig,
    PolicyConfig,
    SftConfig,
    TrainConfig,
)


@dataclass
class Config:
    env: EnvConfig = field(default_factory=EnvConfig)
    policy: PolicyConfig = field(default_factory=PolicyConfig)
    memory: MemoryConfig = field(default_factory=MemoryConfig)
    algo: AlgoConfig = field(default_factory=AlgoConfig)
    train: TrainConfig = field(default_factory=TrainConfig)
    sft: SftConfig = field(default_factory=SftConfig)

    SECTIONS = ("env", "policy", "memory", "algo", "train", "sft")

    # ------------------------------------------------------------------ loading
    @classmethod
    def from_dict(cls, data: dict[str, Any] | None) -> Config:
        cfg, used = cls(), {}
        try:
            cfg._set_all(_section_pairs(data or {}), used, "the config")
        finally:
            warn_renamed(used)
        cfg.validate()
        return cfg

    @classmethod
    def load(cls, path: str | os.PathLike | None, overrides: list[str] | tuple[str, ...] = ()) -> Config:
        """The defaults, then the preset at ``path`` (its ``base:`` chain first), then ``key=value`` overrides."""
        cfg, used = cls(), {}
        try:
            for source, data in preset_layers(Path(path), _read_yaml) if path is not None else ():
                cfg._set_all(_section_pairs(data), used, str(source))
            cfg.validate()
            cfg._set_all([_override(item) for item in overrides], used, "an override")
        finally:
            warn_renamed(used)
        cfg.validate()
        return cfg

    # ------------------------------------------------------------------ access
    def valid_keys(self) -> list[str]:
        return [f"{s}.{f.name}" for s in self.SECTIONS for f in fields(getattr(self, s))]

    def resolve_key(self, key: str) -> tuple[str, str]:
        if "." in key:
            section, name = key.split(".", 1)
            if section in self.SECTIONS and name in {f.name for f in fields(getattr(self, section))}:
                return section, name
        else:
            owners = [s for s in self.SECTIONS if key in {f.name for f in fields(getattr(self, s))}]
            if len(owners) > 1 and "sft" in owners:  # the warm start's knobs are reached dotted (sft.learning_rate)
                owners.remove("sft")
            if len(owners) == 1:
                return owners[0], key
            if len(owners) > 1:
                raise ConfigError(f"key {key!r} is ambiguous; write one of: {', '.join(f'{o}.{key}' for o in owners)}")
        raise ConfigError(f"unknown config key {shown(key)}; valid keys: {', '.join(self.valid_keys())}")

    def set(self, key: str, value: Any) -> None:
        used: dict[str, str] = {}
        try:
            self._set_all([(key, value)], used, "Config.set")
        finally:
            warn_renamed(used)

    def _set_all(self, pairs: list[tuple[str, Any]], used: dict[str, str], where: str) -> None:
        """Set each ``(key, value)`` of one source (a file, the overrides), typed by its field. A key's old name
        (:data:`~empo2.config_renames.RENAMED`) sets the new one and is noted in ``used``; a source that gives both
        names different values is refused. An old key folded into another's value (:data:`~empo2.config_renames.FOLDED`)
        applies after the source's other keys, so that it reads the value they set."""
        written: dict[str, tuple[str | None, Any]] = {}  # section.name -> (old name it was given by, value)
        folded: dict[str, Any] = {}
        for key, value in pairs:
            old = None if self._knows(key) else old_name(key)
            if old is not None:
                used.setdefault(old, where)
            if old in FOLDED:
                folded[old] = value
                continue
            section, name = self.resolve_key(RENAMED[old] if old else key)
            obj, dotted = getattr(self, section), f"{section}.{name}"
            setattr(obj, name, _coerce(dotted, value, obj, name))
            earlier, now = written.get(dotted), getattr(obj, name)
            if earlier is not None and (earlier[0] is None) != (old is None) and earlier[1] != now:
                raise ConfigError(f"{where} gives both {old or earlier[0]} and its new name {dotted}, with different "
                                  f"values ({shown(earlier[1])} and {shown(now)}); keep only {dotted}")
            written[dotted] = (old, now)
        if "train.tensorboard" in folded:
            tensorboard = _bool("train.tensorboard", folded["train.tensorboard"])
            self.train.report_to = fold_tensorboard(self.train.report_to, tensorboard)

    def _knows(self, key: str) -> bool:
        """``key`` names a current field, dotted or bare (so an old name is never taken for a current one)."""
        keys = self.valid_keys()
        return key in keys or any(k.endswith(f".{key}") for k in keys)

    def to_dict(self) -> dict[str, Any]:
        return {s: dataclasses.asdict(getattr(self, s)) for s in self.SECTIONS}

    def save(self, path: str | os.PathLike) -> None:
        Path(path).write_text(yaml.safe_dump(self.to_dict(), sort_keys=False))

    # ------------------------------------------------------------------ checks
    def validate(self) -> None:
        """Each enumerated field holds one of its values and each number lies within the bounds stated next to its
        field (:mod:`empo2.config_sections`); then the rules between fields, and the registry names."""
        check_choices(self)
        check_bounds(self)
        a, m, t = self.algo, self.memory, self.train
        rules = [
            (a.p_off_policy <= a.p_memory, f"algo.p_off_policy <= algo.p_memory is required (off_tips rollouts are a "
             f"share of the memory rollouts), got {a.p_off_policy:g} > {a.p_memory:g}"),
            (t.sharding == "none" or m.overlap_reflection is not True, "train.sharding=fsdp cannot overlap the "
             "reflection with the update (it would generate while the update holds the sharded weights); set "
             "memory.overlap_reflection=false"),
            (bool(t.report_to) and set(t.report_to) <= {"tensorboard", "wandb", "mlflow"} or t.report_to == ["none"],
             "train.report_to must name tensorboard, wandb or mlflow (one or a list), or be none"),
        ]
        for ok, message in rules:
            if not ok:
                raise ConfigError(message)
        self._check_registry_names()

    def check_training(self) -> None:
        """Sampling settings a run that trains can use. Behaviour and update log-probs are log-softmax(logits /
        ``policy.temperature``) (TRL's convention), so training samples at a temperature > 0 with no top-p / top-k
        filter, which those log-probs leave out; commands that only sample (``empo2 play``) may use both."""
        p = self.policy
        if p.temperature <= 0:
            raise ConfigError("policy.temperature must be > 0 to train: greedy rollouts sample no distribution for "
                              "the ratio, and a group's rollouts would all be the same")
        if p.top_p < 1 or p.top_k > 0:
            raise ConfigError(f"policy.top_p={p.top_p:g} / policy.top_k={p.top_k} cannot train: the behaviour "
                              "log-probs are of logits / temperature without a top-p or top-k filter; use top_p=1 "
                              "and top_k=0")

    def _check_registry_names(self) -> None:
        """Every registry-backed name (algorithm, estimator, loss, backend, environment, tasks, eviction policy,
        ablation arm) is checked here, at load, so a typo exits before any run folder exists. The registries live in
        the component packages below the config and are imported only now, when they are needed."""
        from empo2.algo.advantages import ADVANTAGE_ESTIMATORS
        from empo2.algo.arms import check_arm
        from empo2.algo.losses import POLICY_LOSSES
        from empo2.algo.registry import ALGORITHMS
        from empo2.envs.base import EnvError
        from empo2.envs.specs import get_env_spec
        from empo2.memory.store import EVICTION_POLICIES
        from empo2.policy.backend import BACKENDS

        def known(kind: str, key: str, name: str, registry) -> None:
            if name not in registry:
                raise ConfigError(f"{key}: unknown {kind} {name!r}; valid: {', '.join(sorted(registry))}")

        known("algorithm", "algo.name", self.algo.name, ALGORITHMS)
        spec = ALGORITHMS[self.algo.name]
        known("advantage estimator", "algo.advantage", spec.estimator(self.algo), ADVANTAGE_ESTIMATORS)
        known("policy loss", f"algorithm {spec.name!r} loss", spec.loss, POLICY_LOSSES)
        if spec.expert_members and self.algo.num_generations <= spec.expert_members:
            raise ConfigError(f"algo.name={spec.name} plays {spec.expert_members} expert member(s) per group, so "
                              f"algo.num_generations must be more than that, got {self.algo.num_generations}")
        known("eviction policy", "memory.eviction", self.memory.eviction, EVICTION_POLICIES)
        known("rollout backend", "policy.backend", self.policy.backend, BACKENDS)
        if (wrong_arm := check_arm(self.algo, self.policy.warm_start)) is not None:
            raise ConfigError(wrong_arm)
        try:
            get_env_spec(self.env.name).tasks(self.env)
        except EnvError as exc:
            raise ConfigError(f"env: {exc}") from None
        try:
            get_env_spec(self.env.name).tasks(self.sft_env())
        except EnvError as exc:
            raise ConfigError(f"sft.tasks: {exc}") from None

    def sft_env(self) -> EnvConfig:
        """The ``env`` section with the warm start's demonstration tasks (``sft.tasks``, or ``env.tasks``)."""
        return dataclasses.replace(self.env, tasks=list(self.sft.tasks or self.env.tasks))

    @property
    def algorithm(self):
        """The :class:`~empo2.algo.registry.AlgorithmSpec` named by ``algo.name``."""
        from empo2.algo.registry import get_algorithm

        return get_algorithm(self.algo.name)


def _section_pairs(data: dict[str, Any]) -> list[tuple[str, Any]]:
    """``(section.key, value)`` of a mapping of sections, each section checked to be one and a mapping."""
    pairs = []
    for section, values in data.items():
        if section not in Config.SECTIONS:
            raise ConfigError(f"unknown config section {section!r}; valid sections: {', '.join(Config.SECTIONS)}")
        if values is None:
            continue
        if not isinstance(values, dict):
            raise ConfigError(f"config section {section!r} must be a mapping, got {type(values).__name__}")
        pairs += [(f"{section}.{key}", value) for key, value in values.items()]
    return pairs


def _override(item: str) -> tuple[str, str]:
    if "=" not in item:
        raise ConfigError(f"override {item!r} is not key=value")
    key, raw = item.split("=", 1)
    return key.strip(), raw


def _read_yaml(p: Path) -> dict[str, Any]:
    """One config file's mapping (its plain scalars kept as text), or one line saying why it is not one."""
    if not p.is_file():
        raise ConfigError(f"config file not found: {p}")
    if p.stat().st_size > MAX_CONFIG_BYTES:
        raise ConfigError(f"{p} is {p.stat().st_size:,} bytes; a config file is at most {MAX_CONFIG_BYTES:,}")
    try:
        data = yaml.load(p.read_text(), Loader=_ConfigLoader) or {}
    except yaml.YAMLError as exc:
        raise ConfigError(f"malformed YAML in {p}: {_yaml_problem(exc)}") from None
    if not isinstance(data, dict):
        raise ConfigError(f"{p} must hold a mapping of sections, got {type(data).__name__}")
    return data


def _yaml_problem(exc: Exception) -> str:
    """A YAML parser error as one line: what went wrong, and where (the parser's own text spans several lines)."""
    mark = getattr(exc, "problem_mark", None)
    where = f" (line {mark.line + 1}, column {mark.column + 1})" if mark is not None else ""
    return " ".join(str(getattr(exc, "problem", None) or exc).split()) + where


class _ConfigLoader(yaml.SafeLoader):
    """YAML for configs: a plain scalar stays text (typed later by its field; only ``null``/``~``/empty mean unset),
    and aliases are refused, so a few bytes cannot expand into gigabytes."""

    yaml_implicit_resolvers: dict = {}
    max_depth = 64
    """Deeper nesting is refused: composing it recurses once per level, and Python's stack ends near 1,000."""
    _depth = 0

    def compose_node(self, parent, index):
        if self.check_event(yaml.AliasEvent):
            event = self.peek_event()
            raise yaml.MarkedYAMLError(problem=f"YAML aliases (*{event.anchor[:40]}) are not accepted in a config",
                                       problem_mark=event.start_mark)
        if self._depth >= self.max_depth:
            raise yaml.MarkedYAMLError(problem=f"lists or mappings nested deeper than {self.max_depth} levels are "
                                       "not accepted in a config", problem_mark=self.peek_event().start_mark)
        self._depth += 1
        try:
            return super().compose_node(parent, index)
        finally:
            self._depth -= 1


_ConfigLoader.add_implicit_resolver("tag:yaml.org,2002:null", re.compile(r"^(?:~|null|Null|NULL|)$"),
                                    ["~", "n", "N", ""])
_TRUE, _FALSE = ("true", "yes", "on"), ("false", "no", "off")
_INT = re.compile(r"^[+-]?[0-9]+$")


def _coerce(key: str, value: Any, obj: Any, name: str) -> Any:
    """Type a value by the field's declared annotation; text (an override, a plain YAML scalar) is parsed for it."""
    hint = str({f.name: f.type for f in fields(obj)}[name])
    check_size(key, value)
    if isinstance(value, str) and "None" in hint and value.strip() in ("", "null", "~"):
        value = None
    if value is None:
        if "None" in hint:
            return None
        raise ConfigError(f"{key} may not be empty")
    for prefix, parse in _PARSERS:
        if hint.startswith(prefix):
            return parse(key, value)
    return value


def _names(key: str, value: Any) -> list[str]:
    """A list of names from a list, or from override text ``[a, b]`` / ``a,b``."""
    if isinstance(value, str):
        text = value.strip()
        text = text[1:-1] if text.startswith("[") and text.endswith("]") else text
        value = [v.strip().strip("'\"") for v in text.split(",") if v.strip()]
    if not isinstance(value, list) or not all(isinstance(v, str) for v in value):
        raise ConfigError(f"{key} must be a list of names, got {shown(value)}")
    return value


def _bool(key: str, value: Any) -> bool:
    if isinstance(value, str) and value.strip().lower() in _TRUE + _FALSE:
        return value.strip().lower() in _TRUE
    if isinstance(value, bool):
        return value
    raise ConfigError(f"{key} must be true or false, got {shown(value)}")


def _int(key: str, value: Any) -> int:
    if isinstance(value, str) and _INT.match(value.strip()):
        return int(value.strip())
    if isinstance(value, bool) or not isinstance(value, int):
        raise ConfigError(f"{key} must be an integer, got {shown(value)}")
    return value


def _float(key: str, value: Any) -> float:
    if isinstance(value, str):
        try:
            value = float(value.strip())
        except ValueError:
            raise ConfigError(f"{key} must be a number, got {shown(value)}") from None
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        raise ConfigError(f"{key} must be a number, got {shown(value)}")
    return float(value)


def _text(key: str, value: Any) -> str:
    if isinstance(value, (dict, list)):
        raise ConfigError(f"{key} must be a string, got {shown(value)}")
    return str(value)


def _mapping_of_ints(key: str, value: Any) -> dict[str, int]:
    """``{task: N}`` from a mapping, or from override text such as ``{chemistry-mix: 90}``."""
    if isinstance(value, str):
        try:
            value = yaml.load(value, Loader=_ConfigLoader)
        except yaml.YAMLError as exc:
            raise ConfigError(f"{key} must be a mapping like {{task: 30}}: {_yaml_problem(exc)}") from None
    if not isinstance(value, dict):
        raise ConfigError(f"{key} must be a mapping like {{task: 30}}, got {shown(value)}")
    out = {}
    for k, v in value.items():
        if isinstance(v, str) and _INT.match(v.strip()):
            v = int(v)
        if not isinstance(k, str) or isinstance(v, bool) or not isinstance(v, int):
            raise ConfigError(f"{key} must map task names to integers, got {shown(k)}: {shown(v)}")
        out[k] = v
    return out


def _table_of_ints(key: str, value: Any) -> dict[str, dict[str, int]]:
    """``{name: {name: N}}`` from a mapping of mappings, or from override text such as ``{coin: {numLocations: 5}}``."""
    like = f"{key} must be a mapping like {{coin: {{numLocations: 5}}}}"
    if isinstance(value, str):
        try:
            value = yaml.load(value, Loader=_ConfigLoader)
        except yaml.YAMLError as exc:
            raise ConfigError(f"{like}: {_yaml_problem(exc)}") from None
    if not isinstance(value, dict) or not all(isinstance(v, dict) or v is None for v in value.values()):
        raise ConfigError(f"{like}, got {shown(value)}")
    out: dict[str, dict[str, int]] = {}
    for outer, inner in value.items():
        out[str(outer)] = {}
        for name, number in (inner or {}).items():
            if isinstance(number, str) and _INT.match(number.strip()):
                number = int(number)
            if not isinstance(name, str) or isinstance(number, bool) or not isinstance(number, int):
                raise ConfigError(f"{key}.{outer} must map names to integers, got {shown(name)}: {shown(number)}")
            out[str(outer)][name] = number
    return out


_PARSERS = (("list", _names), ("dict[str, dict", _table_of_ints), ("dict", _mapping_of_ints), ("bool", _bool), ("int", _int), ("float", _float),
            ("str", _text), ("Literal", _text))
"""How a field's value is read, by the start of its annotation."""
