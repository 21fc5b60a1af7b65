"""From a run's ``env`` section (:class:`empo2.config.sections.EnvConfig`) to environment constructor arguments, a
task list and a report label, through the environment registry (no branching on the environment's name).

The section comes in as an argument: the environments do not import the run's configuration."""

from __future__ import annotations

from typing import Protocol

from empo2.envs.specs import get_env_spec


class EnvSection(Protocol):
    """What this module reads of the ``env`` section; the registry entry's callables read the fields they need."""

    name: str


def make_env_kwargs(env_cfg: EnvSection) -> dict:
    """Keyword arguments of the environment named by ``env_cfg.name`` (used by the pool's workers)."""
    return get_env_spec(env_cfg.name).kwargs(env_cfg)


def resolve_tasks(env_cfg: EnvSection) -> list[str]:
    """Task names to train and evaluate on (set names such as ``panel18`` are expanded)."""
    return get_env_spec(env_cfg.name).tasks(env_cfg)


def env_label(env_cfg: EnvSection) -> str:
    """The name results are reported under (WebShop on the bundled fixture is ``webshop-fixture``)."""
    spec = get_env_spec(env_cfg.name)
    return spec.label(env_cfg) if spec.label else spec.name
