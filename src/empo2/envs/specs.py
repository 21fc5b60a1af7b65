"""Environments as registry entries: one :class:`EnvSpec` per ``env.name``.

A spec bundles what the rest of the code needs from an environment: how to build it (``factory``, run inside the pool's
worker processes), its constructor arguments from an :class:`~empo2.config.EnvConfig`, the task names a config selects,
the system-prompt guide the agent gets, the label results are reported under, and its own settings. Adding an
environment is one module with the environment class plus one ``register_env(EnvSpec(...))`` call; nothing else
branches on its name.

The built-in environments register themselves when their module is imported; :func:`get_env_spec` imports them lazily,
so ``import empo2.envs`` starts no JVM and loads no WebShop catalog.
"""

from __future__ import annotations

import importlib
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from empo2.bounds import check_options
from empo2.envs.base import EnvError

BUILTIN_MODULES = {"scienceworld": "empo2.envs.scienceworld.env", "webshop": "empo2.envs.webshop.env",
                   "textworld_express": "empo2.envs.textworld_express.env"}


@dataclass(frozen=True)
class EnvSpec:
    name: str
    factory: Callable[..., Any]
    """``factory(**kwargs) -> TextEnv``; a module-level callable, so worker processes can unpickle it."""
    kwargs: Callable[[Any], dict]
    """``EnvConfig -> constructor keyword arguments``."""
    guide: str
    """The agent's system prompt: what the environment is and which actions it takes."""
    tasks: Callable[[Any], list[str]]
    """``EnvConfig -> task names`` (raises :class:`EnvError` for unknown names)."""
    label: Callable[[Any], str] | None = None
    """``EnvConfig -> report label`` (default: ``name``)."""
    gold_paths: Callable[..., list] | None = None
    """``(EnvConfig, tasks, split, per_task, say) -> [GoldPath]``: gold path lengths of the first ``per_task``
    variations of ``split`` (``None`` = all) against the step cap (:mod:`empo2.envs.gold`); ``None`` = unknown."""
    options: type | None = None
    """Its own settings: a frozen dataclass whose class attribute ``key`` names its place in the ``env`` section
    (``env.<key>.<field>``: ``env.webshop.start``), each field with its default, its bounds
    (:func:`empo2.bounds.bounded`) and its docstring, as the config's own fields have. Every ``env`` section holds the
    options of every registered environment (:func:`env_options`); ``kwargs`` reads them (``cfg.webshop.start``)."""


ENVIRONMENTS: dict[str, EnvSpec] = {}


def register_env(spec: EnvSpec) -> EnvSpec:
    if spec.name in ENVIRONMENTS:
        raise ValueError(f"environment {spec.name!r} is already registered")
    if spec.options is not None:
        check_options(spec.options, f"environment {spec.name!r}", "env", _registered_options())
    ENVIRONMENTS[spec.name] = spec
    return spec


def env_options() -> dict[str, type]:
    """``{key: options class}`` of every environment, the built-in ones imported for it, ordered by key: the settings
    the ``env`` section holds besides its shared fields (``{"scienceworld": ScienceWorldOptions, …}``)."""
    for module in BUILTIN_MODULES.values():
        importlib.import_module(module)  # registers itself
    return dict(sorted(_registered_options().items()))


def _registered_options() -> dict[str, type]:
    return {spec.options.key: spec.options for spec in ENVIRONMENTS.values() if spec.options is not None}


def env_names() -> list[str]:
    return sorted(set(ENVIRONMENTS) | set(BUILTIN_MODULES))


def get_env_spec(name: str) -> EnvSpec:
    if name not in ENVIRONMENTS and name in BUILTIN_MODULES:
        importlib.import_module(BUILTIN_MODULES[name])  # registers itself
    if name not in ENVIRONMENTS:
        raise EnvError(f"unknown environment {name!r}; valid environments: {', '.join(env_names())}")
    return ENVIRONMENTS[name]
