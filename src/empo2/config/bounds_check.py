"""How bounds of numeric config fields are checked (each field states its own, next to it, with
:func:`empo2.bounds.bounded`, in :mod:`empo2.config.sections` and in each method's options), the values of every
enumerated field, the size of every string, and the machine's cap on environment workers.

Checked at load (:meth:`empo2.config.Config.validate`), so a nonsense value (``env.max_steps=-1``,
``algo.num_generations=100000``, a 10 MB path) exits with one line before anything starts. The bounds are wide:
they reject what cannot be a run, not what is unusual. The worker cap depends on the machine and is checked only by
commands that start workers here (``train``, ``compare``): a config written for a cluster still loads on a laptop.
"""

from __future__ import annotations

import functools
import math
import os
import types
import typing
from collections.abc import Iterator
from dataclasses import Field, fields, is_dataclass
from pathlib import Path
from typing import Any, Literal

from empo2.bounds import Bounds, bounded, shown  # noqa: F401 - bounded and shown: the config's names for them
from empo2.errors import UserError


class ConfigError(UserError, ValueError):
    """A user error in a config file or override; the CLI prints it and exits with code 2 (re-exported by
    :mod:`empo2.config`, where callers import it from)."""


MAX_TEXT = 4096
"""Characters of one string field or list item (Linux paths are at most 4096 bytes)."""
MAX_ITEMS = 1000
"""Items of one list or mapping field (task lists, LoRA target modules, per-task step caps)."""
MAX_CONFIG_BYTES = 1 << 20
"""Size of a config file: a run's config is a few KB; a bigger file is not a config."""
WORKERS_PER_CORE = 8
"""Environment workers per CPU core by default: a worker mostly waits for the policy, so several share a core."""
WORKER_MEMORY = 512 << 20
"""Available memory reserved per environment worker by default (a ScienceWorld JVM holds about this much)."""


def bounds_of(obj) -> dict[str, Bounds]:
    """``{field: Bounds}`` of a config section (class or instance)."""
    return {f.name: f.metadata["bounds"] for f in fields(obj) if "bounds" in f.metadata}


def is_options(value: Any) -> bool:
    """Whether a section's field holds a method's options (a dataclass instance, ``algo.gigpo``), not one value."""
    return is_dataclass(value) and not isinstance(value, type)


def settings(cfg) -> Iterator[tuple[str, Any, Field]]:
    """Every setting of a config as (dotted key, the object that holds it, its field), a method's options walked
    into: ``algo.beta`` is held by the ``algo`` section, ``algo.gigpo.gamma`` by its ``gigpo`` options."""
    for section in cfg.SECTIONS:
        yield from _settings_of(section, getattr(cfg, section))


def _settings_of(prefix: str, obj: Any) -> Iterator[tuple[str, Any, Field]]:
    for f in fields(obj):
        value = getattr(obj, f.name)
        if is_options(value):
            yield from _settings_of(f"{prefix}.{f.name}", value)
        else:
            yield f"{prefix}.{f.name}", obj, f


def check_size(key: str, value: Any) -> None:
    """Refuse a string longer than :data:`MAX_TEXT` or a list/mapping of more than :data:`MAX_ITEMS` items."""
    if isinstance(value, str) and len(value) > MAX_TEXT:
        raise _error(f"{key} is {len(value):,} characters long; at most {MAX_TEXT} are accepted")
    if isinstance(value, (list, dict)):
        if len(value) > MAX_ITEMS:
            raise _error(f"{key} has {len(value):,} items; at most {MAX_ITEMS} are accepted")
        for item in (list(value) + list(value.values())) if isinstance(value, dict) else value:
            check_size(key, item)


@functools.cache
def choices(section_type: type) -> dict[str, tuple[Any, ...]]:
    """``{field: allowed values}`` of a config section's ``Literal[...]`` fields (``None`` too for an optional one):
    the annotation is the one list of what a field may hold."""
    hints = typing.get_type_hints(section_type)
    out = {}
    for f in fields(section_type):
        hint = hints[f.name]
        parts = typing.get_args(hint) if typing.get_origin(hint) in (typing.Union, types.UnionType) else (hint,)
        allowed = [v for part in parts if typing.get_origin(part) is Literal for v in typing.get_args(part)]
        if allowed:
            out[f.name] = tuple(allowed) + ((None,) if type(None) in parts else ())
    return out


def check_choices(cfg) -> None:
    """Every ``Literal[...]`` field holds one of its values."""
    for key, obj, f in settings(cfg):
        allowed = choices(type(obj)).get(f.name)
        value = getattr(obj, f.name)
        if allowed is not None and not any(value == v and type(value) is type(v) for v in allowed):
            raise _error(f"{key} must be one of {', '.join(map(str, allowed))}, got {shown(value)}")


def check_bounds(cfg) -> None:
    """Every int and float field within the bounds declared next to it (``bounded``, in :mod:`empo2.config.sections`
    and in the methods' options; ``None`` passes where the field allows it)."""
    for key, obj, f in settings(cfg):
        value = getattr(obj, f.name)
        if isinstance(value, bool) or value is None:
            continue
        if isinstance(value, float) and not math.isfinite(value):
            raise _error(f"{key} must be a finite number, got {value}")
        bounds = f.metadata.get("bounds")
        if bounds is not None and not bounds.holds(value):
            raise _error(bounds.refusal(key, value))
    steps = bounds_of(cfg.env)["max_steps"]
    for task, cap in (cfg.env.step_caps or {}).items():
        if not steps.holds(cap):
            raise _error(steps.refusal(f"env.step_caps: {shown(task)}", cap))


def worker_cap() -> tuple[int, str]:
    """The default cap on environment workers here, and how it was derived (for the error message)."""
    import psutil

    cores = os.cpu_count() or 1
    available = psutil.virtual_memory().available
    cap = max(1, min(WORKERS_PER_CORE * cores, available // WORKER_MEMORY))
    return cap, (f"{WORKERS_PER_CORE} per core × {cores} cores, one per {WORKER_MEMORY >> 20} MiB of the "
                 f"{available / 2 ** 30:.1f} GiB available")


def check_machine_limits(cfg) -> None:
    """The environment pool (``train.tasks_per_batch × algo.num_generations`` local workers) fits this machine."""
    check_worker_count(cfg.train.tasks_per_batch * cfg.algo.num_generations, cfg.env,
                       "train.tasks_per_batch × algo.num_generations")


def check_worker_count(workers: int, env, what: str) -> None:
    """``workers`` local environment workers fit this machine; ``env.max_workers`` overrides the derived cap. Ray
    workers run anywhere on a cluster and are not capped here."""
    if env.pool != "process":
        return
    cap, why = (env.max_workers, "env.max_workers") if env.max_workers is not None else worker_cap()
    if not 1 <= workers <= cap:
        raise _error(f"{what} = {workers} environment workers; this machine's cap is {cap} ({why}): lower it, or "
                     f"set env.max_workers={workers} if the machine can take it")
    check_process_limit(workers, what)


def worker_tasks() -> int:
    """Processes and threads one environment worker holds: its Python process (4 threads) and a ScienceWorld JVM
    (about 13 threads plus garbage-collector threads that grow with the cores), with room to spare."""
    return 24 + (os.cpu_count() or 1)


def check_process_limit(workers: int, what: str) -> None:
    """``workers`` environment workers fit under the process limit (``ulimit -u``, which counts every thread of the
    user): refused before any is forked, since a fork past it fails half-way with ``BlockingIOError``."""
    import resource

    import psutil

    limit = resource.getrlimit(resource.RLIMIT_NPROC)[0]
    if limit == resource.RLIM_INFINITY or exempt_from_process_limit():
        return
    uid = os.getuid()
    used = 0
    for proc in psutil.process_iter(["uids", "num_threads"]):
        if proc.info["uids"] is not None and proc.info["uids"].real == uid:
            used += proc.info["num_threads"] or 0
    needed = workers * worker_tasks()
    if used + needed > limit:
        raise _error(f"{what} = {workers} environment workers need about {needed} processes and threads, but the "
                     f"process limit (ulimit -u) is {limit} with {used} in use: lower it, or raise the limit")


def exempt_from_process_limit() -> bool:
    """Whether the kernel lets this process fork past ``ulimit -u``: it holds root of the initial user namespace to
    no process limit, nor a process with CAP_SYS_RESOURCE or CAP_SYS_ADMIN there (root inside a container's own user
    namespace is another user to the kernel, and is held to it)."""
    try:
        maps = [tuple(map(int, line.split())) for line in Path("/proc/self/uid_map").read_text().splitlines()]
        status = Path("/proc/self/status").read_text().splitlines()
        caps = int(next(line.split()[1] for line in status if line.startswith("CapEff:")), 16)
    except (OSError, ValueError, StopIteration, IndexError):  # no /proc: assume the limit holds
        return False
    uid = os.getuid()
    kernel_uid = next((outside + uid - inside for inside, outside, count in maps if inside <= uid < inside + count),
                      None)
    initial_namespace = maps == [(0, 0, 2**32 - 1)]
    cap_sys_admin, cap_sys_resource = 1 << 21, 1 << 24
    return kernel_uid == 0 or (initial_namespace and bool(caps & (cap_sys_admin | cap_sys_resource)))


def _error(message: str) -> ConfigError:
    return ConfigError(message)
