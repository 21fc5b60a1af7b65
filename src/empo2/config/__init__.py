"""Run configuration: one dataclass per concern, loaded from YAML with ``key=value`` overrides.

Names follow TRL where TRL has the knob (``num_generations``, ``beta``, ``epsilon``, ``epsilon_high``,
``temperature``, ``top_p``, ``top_k``, ``max_completion_length``, ``learning_rate``, ``loss_type``) and its name
does not mislead (PPO's passes are ``ppo_epochs``, not TRL's ``num_iterations``, beside ``train.iterations``);
EMPO²'s own knobs say what they are (``low_prob_threshold``, the paper's δ; ``p_memory``, ``p_off_policy``,
``top_k_tips``). Renamed keys still load, with a warning (:mod:`empo2.config.renames`).

A YAML file has one mapping per section::

    env: {name: scienceworld, tasks: [find-animal]}
    algo: {name: proxmo, beta: 0.0, proxmo: {alpha: 2.0}}

Overrides on the command line are ``section.key=value`` or, when the key is unique across sections, ``key=value``
(a key ``sft`` shares with another section means the other's: the warm start's knobs are written dotted). A method's
own settings sit one level down, under its name, and are always written dotted: ``algo.proxmo.alpha=2.0``; so do an
environment's: ``env.webshop.start=results``.
A value is read by its field's declared type, never as YAML: a string or path is taken literally (``output_dir=/scratch/
exp #2`` keeps `` #2``, ``dtype=on`` stays ``"on"``); an integer is decimal digits (``0755`` is 755); a bool is
``true``/``false`` (also ``yes``/``no``/``on``/``off``, as YAML files spell them); a list is ``[a, b]`` or ``a,b``; an
optional field is unset by an empty value or ``null``. A YAML file is read the same way: its plain scalars are typed by
the field, not by YAML's guesses, and aliases (``*name``) are refused. A preset may inherit from another (``base:``,
:mod:`empo2.config.presets`). The sections' fields, with their bounds, are defined and documented in
:mod:`empo2.config.sections`, a method's own in its file (:class:`empo2.algo.gigpo.GigpoOptions` …), an environment's
in its module (:class:`empo2.envs.webshop.env.WebShopOptions` …); the text of a value is read by
:mod:`empo2.config.values`.

The package: :class:`Config` and its loading and checks (:mod:`.core`), the sections' fields (:mod:`.sections`), the
reading of values (:mod:`.values`), the bounds and choices each value is checked against (:mod:`.bounds_check`),
presets' ``base:`` chains (:mod:`.presets`) and old key names (:mod:`.renames`). Its public names are re-exported
here: ``from empo2.config import Config, ConfigError``.
"""

from empo2.config.bounds_check import ConfigError
from empo2.config.core import Config, flat_settings
from empo2.config.sections import (
    AlgoConfig,
    EnvConfig,
    MemoryConfig,
    PolicyConfig,
    algo_config,
    env_config,
)
from empo2.config.stages import SftConfig, TrainConfig

__all__ = ["AlgoConfig", "Config", "ConfigError", "EnvConfig", "MemoryConfig", "PolicyConfig", "SftConfig",
           "TrainConfig", "algo_config", "env_config", "flat_settings"]
