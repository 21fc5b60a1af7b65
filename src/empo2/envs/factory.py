"""From an :class:`~empo2.config.EnvConfig` to environment constructor arguments, a task list and a report label,
through the environment registry (no branching on the environment's name)."""

from __future__ import annotations

from empo2.config import Config, EnvConfig
from empo2.envs.registry import get_env_spec


def make_env_kwargs(cfg: EnvConfig) -> dict:
    """Keyword arguments of the environment named by ``cfg.name`` (used by the pool's workers)."""
    return get_env_spec(cfg.name).kwargs(cfg)


def resolve_tasks(cfg: EnvConfig) -> list[str]:
    """Task names to train and evaluate on (set names such as ``panel18`` are expanded)."""
    return get_env_spec(cfg.name).tasks(cfg)


def env_label(cfg: Config) -> str:
    """The name results are reported under (WebShop on the bundled fixture is ``webshop-fixture``)."""
    spec = get_env_spec(cfg.env.name)
    return spec.label(cfg.env) if spec.label else spec.name
