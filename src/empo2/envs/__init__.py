"""Text environments (ScienceWorld, WebShop) behind one protocol, a registry, and a pool that runs them in parallel.

Heavy modules are imported lazily: ``import empo2.envs`` starts no JVM and needs no WebShop data.
"""

from __future__ import annotations

from typing import Any

from empo2.envs.base import EnvError, StepResult, TextEnv
from empo2.envs.specs import EnvSpec, env_names, get_env_spec, register_env


def make_env(name: str, **kwargs: Any) -> TextEnv:
    """Build the registered environment ``name`` with its constructor's keyword arguments."""
    return get_env_spec(name).factory(**kwargs)


__all__ = ["EnvError", "EnvSpec", "StepResult", "TextEnv", "env_names", "get_env_spec", "make_env", "register_env"]
