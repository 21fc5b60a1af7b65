"""From an :class:`~empo2.config.EnvConfig` to environment constructor arguments and a task list."""

from __future__ import annotations

import os

from empo2.config import Config, EnvConfig
from empo2.envs.base import EnvError


def make_env_kwargs(cfg: EnvConfig) -> dict:
    """Keyword arguments of the environment class named by ``cfg.name`` (used by the pool's workers)."""
    if cfg.name == "scienceworld":
        # The per-step valid-action list is most of a step's cost and rollouts do not show it to the model; the
        # corrector still fetches it when the simulator rejects an action.
        return {"simplification": cfg.simplification, "max_steps": cfg.max_steps,
                "action_correction": cfg.action_correction, "step_caps": cfg.step_caps,
                "valid_actions_in_info": False}
    if cfg.name == "webshop":
        return {"data_dir": cfg.webshop_data, "seed": cfg.seed, "max_steps": cfg.max_steps or 15,
                "action_correction": cfg.action_correction, "human_goals": cfg.webshop_human_goals,
                "num_products": cfg.webshop_num_products}
    raise EnvError(f"unknown environment {cfg.name!r}; use scienceworld or webshop")


def resolve_tasks(cfg: EnvConfig) -> list[str]:
    """Task names to train and evaluate on (set names such as ``panel18`` are expanded)."""
    if cfg.name == "webshop":
        return ["webshop"]
    from empo2.envs.scienceworld import expand_tasks

    return expand_tasks(cfg.tasks)


def env_label(cfg: Config) -> str:
    """The name results are reported under: WebShop on the bundled fixture is never called plain ``webshop``."""
    if cfg.env.name == "webshop" and not (cfg.env.webshop_data or os.environ.get("EMPO2_WEBSHOP_DATA")):
        return "webshop-fixture"
    return cfg.env.name
