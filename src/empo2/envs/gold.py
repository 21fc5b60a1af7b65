"""Gold path lengths of a task's variations, and how many of them an episode's step cap admits.

A variation whose gold path is longer than the step cap cannot be won, so an evaluation on it measures only the first
part of the task. :func:`reachability` counts the evaluation variations whose gold path fits; the CLI refuses an
evaluation or a comparison below :data:`REACHABLE_SHARE` (``--allow-unreachable`` lets it run).

The length is the number of our environment's steps that the gold path takes to succeed: the gold actions are played
through the environment itself with no step cap, and the count stops when the episode ends with success. ``None`` means
the gold path did not succeed when played so (it counts as unreachable at any cap).

* ScienceWorld: the simulator's gold path computed by a fresh JVM (:mod:`empo2.envs.scienceworld.gold`).
* TextWorldExpress: the shortest path to the coin, or the package's gold path
  (:mod:`empo2.envs.textworld_express.gold`).
* WebShop: the environment's own gold path (search, result pages, product, options, buy now), played through
  :class:`~empo2.envs.webshop.env.WebShopEnv` in process (its ``gold_paths``; no cache: no JVM, and a fixture catalog
  loads in a second).

The cached environments keep their gold paths in one JSON file each under :func:`gold_home`, read and written through
:func:`read_cache` and :func:`write_cache`.
"""

from __future__ import annotations

import json
import os
import statistics
import tempfile
from dataclasses import dataclass
from pathlib import Path

from empo2.envs.base import EnvError

REACHABLE_SHARE = 0.9
"""Least share of evaluation variations whose gold path must fit the step cap. Below it, more than one episode in ten
cannot be won whatever the policy does: the success rate's ceiling is under 0.9 and a difference between methods
shrinks with it (at a share of 0.1, success is 0 by construction in nine episodes of ten). A stricter threshold
would refuse settings whose few long variations still leave success measurable."""
UNCAPPED = 10**6  # the step cap while a gold path is measured: the path runs to its end or its success
CACHE_SECTIONS = ("splits", "paths", "actions")  # a cache file's sections: task splits; lengths; gold actions


@dataclass(frozen=True)
class GoldPath:
    task: str
    variation: int
    steps: int | None
    """Our environment's steps to success along the gold path (``None``: it did not succeed)."""
    cap: int
    """The episode step cap of ``task`` under the settings asked about."""

    @property
    def fits(self) -> bool:
        return self.steps is not None and self.steps <= self.cap


def gold_home() -> Path:
    """Folder of the gold-length caches: ``$EMPO2_HOME/gold`` (next to the model cache)."""
    from empo2.home import empo2_home

    return empo2_home() / "gold"


# ------------------------------------------------------------------------------------------------ reachability
def eval_plan_size(cfg) -> int:
    """Variations per task a training run evaluates on: ``env.eval_variations``, capped by
    ``train.eval_episodes_per_task``."""
    cap = cfg.train.eval_episodes_per_task
    return min(cfg.env.eval_variations, cap) if cap is not None else cfg.env.eval_variations


def reachability(env_cfg, tasks: list[str], split: str, per_task: int, say=print) -> list[GoldPath] | None:
    """Gold paths of the first ``per_task`` variations of ``split`` of every task, or ``None`` where the environment
    registers no gold paths."""
    from empo2.envs.specs import get_env_spec

    spec = get_env_spec(env_cfg.name)
    if spec.gold_paths is None:
        return None
    return spec.gold_paths(env_cfg, tasks, split, per_task, say)


def share_line(paths: list[GoldPath], split: str) -> str:
    """``reachable: 2/40 dev variations (5%) have a gold path within the step cap (8) …`` (one line)."""
    fit = sum(p.fits for p in paths)
    caps = sorted({p.cap for p in paths})
    cap_text = ", ".join(map(str, caps)) if len(caps) <= 3 else f"{caps[0]}–{caps[-1]}"
    worst = [p for p in paths if not p.fits]
    longest = max((p.steps for p in worst if p.steps is not None), default=None)
    more = f"; the longest that does not fit takes {longest} steps" if longest is not None else ""
    failed = sum(p.steps is None for p in paths)
    more += f"; {failed} gold path(s) do not succeed in this environment" if failed else ""
    return (f"reachable: {fit}/{len(paths)} {split} variations ({100 * fit / max(len(paths), 1):.0f}%) have a gold path "
            f"within the step cap ({cap_text}){more}")


def check_reachable(cfg, split: str, per_task: int, what: str, allow: bool, refuse: bool = True, say=print) -> None:
    """Print the share of ``what``'s evaluation variations whose gold path fits the step cap; below
    :data:`REACHABLE_SHARE` raise :class:`EnvError` (one line, exit 2) unless ``allow``; with ``refuse=False`` only
    warn."""
    from empo2.envs.factory import resolve_tasks

    try:
        paths = reachability(cfg.env, resolve_tasks(cfg.env), split, per_task, say)
    except EnvError as exc:
        if refuse and not allow:
            raise
        say(f"warning: reachability unknown ({exc})")  # a run that only warns does not stop for its measurement
        return
    if paths is None or not paths:
        return
    line = share_line(paths, split)
    share = sum(p.fits for p in paths) / len(paths)
    if share >= REACHABLE_SHARE:
        say(line)
        return
    below = (f"{line}, under the {REACHABLE_SHARE:.0%} an evaluation needs: success is 0 by construction on the rest "
             f"(raise env.max_steps, or list the lengths with `empo2 gold TASK`)")
    if allow or not refuse:
        say(f"warning: {below}" + ("; --allow-unreachable: running anyway" if allow else ""))
        return
    raise EnvError(f"{what} refused: {below}; --allow-unreachable runs it anyway")


# ----------------------------------------------------------------------------------------------------- cache
def read_cache(path: Path) -> dict:
    try:
        data = json.loads(path.read_text())
    except (OSError, ValueError):  # absent or damaged: computed again
        data = None
    if not isinstance(data, dict) or not all(isinstance(data.get(k, {}), dict) for k in CACHE_SECTIONS):
        data = {}
    return {k: data.get(k, {}) for k in CACHE_SECTIONS}


def write_cache(path: Path, found: dict) -> None:
    """Merge ``found`` into the cache file (re-read first: another process may have added entries) and replace it
    atomically, so that a reader never sees half a file."""
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        data = read_cache(path)
        for key, entries in found.items():
            data[key].update(entries)
        fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=".gold-", suffix=".json")
        with os.fdopen(fd, "w") as fh:
            json.dump(data, fh, sort_keys=True)
        os.chmod(tmp, 0o644)  # mkstemp's 0600 would hide the cache from other users of a shared EMPO2_HOME
        os.replace(tmp, path)
    except OSError as exc:
        raise EnvError(f"EMPO2_HOME cannot hold the gold-length cache ({path}: {exc.strerror or exc}); point "
                       "EMPO2_HOME at a writable folder") from None



# ------------------------------------------------------------------------------------------------------ listing
def length_summary(paths: list[GoldPath], caps: list[int]) -> str:
    """``min 8 · median 12 · max 16 · within 8: 2/20 (10%) · within 16: 20/20 (100%)``."""
    steps = [p.steps for p in paths if p.steps is not None]
    parts = [f"min {min(steps)} · median {statistics.median(steps):g} · max {max(steps)}"] if steps else []
    parts += [f"within {c}: {sum(p.steps is not None and p.steps <= c for p in paths)}/{len(paths)} "
              f"({100 * sum(p.steps is not None and p.steps <= c for p in paths) / max(len(paths), 1):.0f}%)"
              for c in caps]
    failed = sum(p.steps is None for p in paths)
    return " · ".join(parts + ([f"{failed} do not succeed"] if failed else []))


def parse_caps(text: str) -> list[int]:
    try:
        caps = [int(c) for c in text.split(",") if c.strip()]
    except ValueError:
        caps = []
    if not caps or min(caps) < 1:
        raise EnvError(f"--caps takes step caps as positive integers, e.g. 8,10,12; got {text!r}")
    return caps
