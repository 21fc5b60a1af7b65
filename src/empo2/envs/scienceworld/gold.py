"""ScienceWorld's gold paths: the simulator's gold path of a variation, computed by a fresh JVM and cached, and its
length in our environment's steps (for :func:`empo2.envs.gold.reachability`).

Bare ``0`` actions in a gold path (grow-fruit, grow-plant, mendelian-genetics) answer the simulator's "Ambiguous
request" prompt; our environment answers that prompt with ``0`` itself inside the step that raised it, so these actions
are not played and not counted. A gold path may also succeed before its last action (grow-plant's trailing waits), and
the count stops there. Computing starts one JVM per variation not yet known (its gold path) and one that plays them
all; the gold actions, the lengths and the task splits are cached per (task, variation, simplification) in
``$EMPO2_HOME/gold/scienceworld-<package version>-fresh-jvm.json``, so a second call starts no JVM. Gold paths can
differ between package versions and JVMs: each length records the raw gold length and the version of the JVM it was
computed on.
"""

from __future__ import annotations

from pathlib import Path

from empo2.envs.actions import replayable_gold
from empo2.envs.base import EnvError
from empo2.envs.gold import UNCAPPED, GoldPath, gold_home, read_cache, write_cache
from empo2.envs.scienceworld.simulator import fresh_gold_path
from empo2.envs.scienceworld.tasks import SPLITS, expand_tasks, step_cap

SAVE_EVERY = 50  # computed gold paths between cache writes


def cache_path() -> Path:
    from importlib.metadata import version

    return gold_home() / f"scienceworld-{version('scienceworld')}-fresh-jvm.json"


def gold_actions(task: str, variation: int, simplification: str) -> list[str]:
    """The simulator's gold path of (``task``, ``variation``) as a fresh JVM computes it (:func:`fresh_gold_path`),
    cached: every run, worker and evaluation that shows or plays it (demonstrations, LUFFY's expert, the lengths here)
    gets the same path, whatever its JVM ran before."""
    path, key = cache_path(), _path_key(task, variation, simplification)
    actions = read_cache(path)["actions"].get(key)
    if actions is None:
        actions = fresh_gold_path(task, variation, simplification)
        write_cache(path, {"actions": {key: actions}})
    return list(actions)


def _path_key(task: str, variation: int, simplification: str) -> str:
    return f"{task}|{variation}|{simplification}"


def gold_paths(make_env, env_cfg, tasks: list[str], split: str, per_task: int | None, say=print) -> list[GoldPath]:
    """:class:`GoldPath` of the first ``per_task`` (``None``: all) variations of ``split`` of every task, from the cache
    or computed in one JVM for all that are missing. ``make_env(**kwargs)`` builds the ScienceWorld environment."""
    tasks = expand_tasks(tasks)
    if split not in SPLITS:
        raise EnvError(f"unknown split {split!r}; valid splits: {', '.join(SPLITS)}")
    sim_split = SPLITS[split]  # the simulator's name (``eval`` is ``dev``)
    path = cache_path()
    cache = read_cache(path)
    if any(t not in cache["splits"] for t in tasks) or _missing(cache, env_cfg, tasks, sim_split, per_task):
        cache = _compute(make_env, env_cfg, tasks, sim_split, per_task, cache, path, say)
    return [GoldPath(t, v, cache["paths"][_path_key(t, v, env_cfg.scienceworld.simplification)]["steps"],
                     step_cap(t, env_cfg.max_steps, env_cfg.step_caps))
            for t, v in _wanted(cache, tasks, sim_split, per_task)]


def _wanted(cache: dict, tasks: list[str], split: str, per_task: int | None) -> list[tuple[str, int]]:
    return [(t, v) for t in tasks for v in cache["splits"][t][split][:per_task]]


def _missing(cache: dict, env_cfg, tasks: list[str], split: str, per_task: int | None) -> list[tuple[str, int]]:
    return [(t, v) for t, v in _wanted(cache, tasks, split, per_task)
            if _path_key(t, v, env_cfg.scienceworld.simplification) not in cache["paths"]]


def _compute(make_env, env_cfg, tasks: list[str], split: str, per_task: int | None, cache: dict, path: Path,
             say) -> dict:
    """The splits of ``tasks`` not cached, then the gold paths not cached, in one JVM; written to the cache, which is
    returned."""
    found: dict = {"splits": {}, "paths": {}}
    simplification = env_cfg.scienceworld.simplification
    with make_env(simplification=simplification, max_steps=UNCAPPED, valid_actions_in_info=False) as env:
        for task in tasks:
            if task not in cache["splits"]:
                found["splits"][task] = cache["splits"][task] = {s: env.variations(task, s)
                                                                 for s in ("train", "dev", "test")}
        missing = _missing(cache, env_cfg, tasks, split, per_task)
        if missing:
            say(f"gold paths: computing {len(missing)} ScienceWorld variation(s) in one JVM (cached in {path})")
        java = env.java_version() if missing else ""
        for k, (task, variation) in enumerate(missing, 1):
            gold, steps = _play_gold(env, task, variation)
            found["paths"][_path_key(task, variation, simplification)] = {
                "gold": len(gold), "steps": steps, "java": java}
            if k % SAVE_EVERY == 0:  # a long listing that is stopped keeps what it computed
                write_cache(path, found)
                say(f"gold paths: {k}/{len(missing)}")
    write_cache(path, found)
    cache["paths"].update(found["paths"])
    return cache


def _play_gold(env, task: str, variation: int) -> tuple[list[str], int | None]:
    """The simulator's gold path of (task, variation) and the steps our environment takes to succeed along it."""
    env.reset(task, variation)
    gold = env.gold_actions()
    for steps, action in enumerate(replayable_gold(gold), 1):
        result = env.step(action)
        if result.done:
            return gold, steps if result.info["success"] else None
    return gold, None
