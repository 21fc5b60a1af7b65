"""Text environments (ScienceWorld, WebShop) behind one protocol, and a pool that runs them in parallel.

Heavy modules are imported lazily: ``import empo2.envs`` starts no JVM and needs no WebShop data.
"""

from __future__ import annotations

from typing import Any

from empo2.envs.base import EnvError, StepResult, TextEnv

ENV_NAMES = ("scienceworld", "webshop")


def make_env(name: str, **kwargs: Any) -> TextEnv:
    """Build the environment ``name`` (``scienceworld`` or ``webshop``) with its constructor's keyword arguments."""
    if name == "scienceworld":
        from empo2.envs.scienceworld import ScienceWorldEnv

        return ScienceWorldEnv(**kwargs)
    if name == "webshop":
        from empo2.envs.webshop.env import WebShopEnv

        return WebShopEnv(**kwargs)
    raise EnvError(f"unknown environment {name!r}; valid environments: {', '.join(ENV_NAMES)}")


__all__ = ["ENV_NAMES", "EnvError", "StepResult", "TextEnv", "make_env"]
