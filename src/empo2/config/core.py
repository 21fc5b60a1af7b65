"""The :class:`Config` of a run: its sections, loading (a preset's ``base:`` chain, then ``key=value`` overrides),
access by dotted key, and the checks at load (:mod:`empo2.config` describes the rules a user sees)."""

from __future__ import annotations

import dataclasses
import os
from collections.abc import Iterator
from dataclasses import dataclass, field, fields
from pathlib import Path
from typing import Any

import yaml

from empo2.config.bounds_check import ConfigError, check_bounds, check_choices, is_options, settings, shown
from empo2.config.presets import preset_layers
from empo2.config.renames import FOLDED, fold_tensorboard, forward_flat, new_names, old_name, warn_renamed
from empo2.config.sections import (
    AlgoConfig,
    EnvConfig,
    MemoryConfig,
    PolicyConfig,
    algo_config,
    env_config,
)
from empo2.config.stages import SftConfig, TrainConfig
from empo2.config.values import as_bool, coerce, read_yaml


@dataclass
class Config:
    env: EnvConfig = field(default_factory=env_config)
    policy: PolicyConfig = field(default_factory=PolicyConfig)
    memory: MemoryConfig = field(default_factory=MemoryConfig)
    algo: AlgoConfig = field(default_factory=algo_config)
    train: TrainConfig = field(default_factory=TrainConfig)
    sft: SftConfig = field(default_factory=SftConfig)

    SECTIONS = ("env", "policy", "memory", "algo", "train", "sft")

    # ------------------------------------------------------------------ loading
    @classmethod
    def from_dict(cls, data: dict[str, Any] | None, record: bool = False) -> Config:
        """The defaults, then ``data`` (a mapping of sections). ``record``: ``data`` is a finished run's stored config
        (``scores.jsonl.gz``), which nobody edits, so its old names are read without a warning to rename them."""
        cfg, used = cls(), {}
        try:
            cfg._set_all(_section_pairs(data or {}), used, "the config")
        finally:
            warn_renamed({} if record else used)
        cfg.validate()
        return cfg

    @classmethod
    def load(cls, path: str | os.PathLike | None, overrides: list[str] | tuple[str, ...] = ()) -> Config:
        """The defaults, then the preset at ``path`` (its ``base:`` chain first), then ``key=value`` overrides."""
        cfg, used = cls(), {}
        try:
            for source, data in preset_layers(Path(path), read_yaml) if path is not None else ():
                cfg._set_all(_section_pairs(data), used, str(source))
            cfg.validate()
            cfg._set_all([_override(item) for item in overrides], used, "an override")
        finally:
            warn_renamed(used)
        cfg.validate()
        return cfg

    # ------------------------------------------------------------------ access
    def valid_keys(self) -> list[str]:
        return [key for key, _, _ in settings(self)]

    def resolve_key(self, key: str) -> tuple[str, ...]:
        """The path of the setting ``key`` names: ``(section, name)``, or ``(section, owner, name)`` for a method's or
        an environment's own setting (``algo.gigpo.gamma``, ``env.webshop.start``). A bare ``key`` names a section's
        own field that one section has."""
        parts = tuple(key.split(".")) if "." in key else (self._section_of(key), key)
        if parts[0] not in self.SECTIONS or len(parts) > 3 or parts[1] not in _fields_of(getattr(self, parts[0])):
            raise self._unknown(key)
        options = getattr(getattr(self, parts[0]), parts[1])
        if not is_options(options):
            if len(parts) == 2:
                return parts
            raise self._unknown(key)
        group, names = f"{parts[0]}.{parts[1]}", ", ".join(_fields_of(options))
        if len(parts) == 2:
            raise ConfigError(f"{group} holds settings, not one value: set {group}.<name>, one of {names}")
        if parts[2] not in _fields_of(options):
            raise ConfigError(f"unknown config key {shown(key)}; {group} holds: {names}")
        return parts

    def _section_of(self, name: str) -> str:
        """The one section with a field ``name`` (a bare key), ``""`` when none has it."""
        owners = [s for s in self.SECTIONS if name in _fields_of(getattr(self, s))]
        if len(owners) > 1 and "sft" in owners:  # the warm start's knobs are reached dotted (sft.learning_rate)
            owners.remove("sft")
        if len(owners) > 1:
            raise ConfigError(f"key {name!r} is ambiguous; write one of: {', '.join(f'{o}.{name}' for o in owners)}")
        return owners[0] if owners else ""

    def _unknown(self, key: str) -> ConfigError:
        return ConfigError(f"unknown config key {shown(key)}; valid keys: {', '.join(self.valid_keys())}")

    def current_keys(self, key: str) -> tuple[str, ...]:
        """The dotted keys of the settings ``key`` sets: its own, or an old name's current ones (``algo.gamma``:
        ``algo.gigpo.gamma`` and ``algo.proxmo.gamma``)."""
        old = None if self._knows(key) else old_name(key)
        return tuple(".".join(self.resolve_key(k)) for k in (new_names(old) if old else (key,)))

    def set(self, key: str, value: Any) -> None:
        used: dict[str, str] = {}
        try:
            self._set_all([(key, value)], used, "Config.set")
        finally:
            warn_renamed(used)

    def _set_all(self, pairs: list[tuple[str, Any]], used: dict[str, str], where: str) -> None:
        """Set each ``(key, value)`` of one source (a file, the overrides), typed by its field. A key's old name
        (:data:`~empo2.config.renames.RENAMED`) sets the new one (or ones) and is noted in ``used``; a source that
        gives both names different values is refused. An old key folded into another's value
        (:data:`~empo2.config.renames.FOLDED`) applies after the source's other keys, so that it reads the value they
        set."""
        written: dict[str, tuple[str | None, Any]] = {}  # dotted key -> (old name it was given by, value)
        folded: dict[str, Any] = {}
        for key, value in self._spelled_out(pairs):
            old = None if self._knows(key) else old_name(key)
            if old is not None:
                used.setdefault(old, where)
            if old in FOLDED:
                folded[old] = value
                continue
            for target in new_names(old) if old else (key,):
                path = self.resolve_key(target)
                dotted, now = ".".join(path), self._assign(path, value)
                earlier = written.get(dotted)
                if earlier is not None and (earlier[0] is None) != (old is None) and earlier[1] != now:
                    raise ConfigError(f"{where} gives both {old or earlier[0]} and its new name {dotted}, with "
                                      f"different values ({shown(earlier[1])} and {shown(now)}); keep only {dotted}")
                written[dotted] = (old, now)
        if "train.tensorboard" in folded:
            tensorboard = as_bool("train.tensorboard", folded["train.tensorboard"])
            self.train.report_to = fold_tensorboard(self.train.report_to, tensorboard)

    def _spelled_out(self, pairs: list[tuple[str, Any]]) -> Iterator[tuple[str, Any]]:
        """The pairs, a method's or an environment's options given as one mapping (``algo: {gigpo: {gamma: 0.9}}`` in
        a file) spelled out one setting each (``algo.gigpo.gamma``); an empty one (``gigpo:``) sets nothing."""
        for key, value in pairs:
            if key in self._option_keys() and (value is None or isinstance(value, dict)):
                yield from ((f"{key}.{name}", v) for name, v in (value or {}).items())
            else:
                yield key, value

    def _assign(self, path: tuple[str, ...], value: Any) -> Any:
        """Set the setting at ``path`` (:meth:`resolve_key`) to ``value`` typed by its field; returns what was set. A
        method's or an environment's options are frozen: the section gets a copy with the one setting changed."""
        section = getattr(self, path[0])
        if len(path) == 2:
            setattr(section, path[1], coerce(".".join(path), value, section, path[1]))
            return getattr(section, path[1])
        options = getattr(section, path[1])
        typed = coerce(".".join(path), value, options, path[2])
        setattr(section, path[1], dataclasses.replace(options, **{path[2]: typed}))
        return typed

    def _knows(self, key: str) -> bool:
        """``key`` names a current setting, dotted or bare (so an old name is never taken for a current one)."""
        if "." not in key:
            return any(key in _fields_of(getattr(self, s)) for s in self.SECTIONS)
        try:
            self.resolve_key(key)
        except ConfigError:
            return False
        return True

    def _option_keys(self) -> set[str]:
        """``{"algo.gigpo", "env.webshop", …}``: the fields of the sections that hold a method's or an environment's
        options."""
        return {f"{s}.{name}" for s in self.SECTIONS for name in _fields_of(getattr(self, s))
                if is_options(getattr(getattr(self, s), name))}

    def to_dict(self) -> dict[str, Any]:
        return {s: dataclasses.asdict(getattr(self, s)) for s in self.SECTIONS}

    def save(self, path: str | os.PathLike) -> None:
        Path(path).write_text(yaml.safe_dump(self.to_dict(), sort_keys=False))

    # ------------------------------------------------------------------ checks
    def validate(self) -> None:
        """Each enumerated field holds one of its values and each number lies within the bounds stated next to its
        field (:mod:`empo2.config.sections`); then the rules between fields, and the registry names."""
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


def flat_settings(sections: dict[str, Any]) -> dict[str, Any]:
    """``{dotted key: value}`` of a config as a mapping of sections (:meth:`Config.to_dict`, a saved
    ``config.yaml``, a checkpoint's stored config): options spelled out (``algo.gigpo.gamma``), old names
    under the current ones (:func:`~empo2.config.renames.forward_flat`), keys this version does not know as they are."""
    grouped, out = Config()._option_keys(), {}
    for section, values in sections.items():
        for name, value in values.items():
            key = f"{section}.{name}"
            if key in grouped and isinstance(value, dict):
                out.update((f"{key}.{k}", v) for k, v in value.items())
            else:
                out[key] = value
    return forward_flat(out)


def _fields_of(obj: Any) -> list[str]:
    """The field names of a section or of a method's or an environment's options."""
    return [f.name for f in fields(obj)]
