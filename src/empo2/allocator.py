"""Run the ``empo2`` command on jemalloc when the machine has it (``scripts/setup.sh`` installs ``libjemalloc2``).

An update's forward/backward allocates and frees hundreds of activation tensors of many sizes. glibc's malloc keeps
much of that freed memory in fragmented arenas: on the main job's micro-batches the process peaked at 5.2 GB on glibc
and 3.6 GB on jemalloc, which was also 7–11% faster (``benchmarks/allocator.py``). The allocator has to be chosen
before the process starts, so the command re-executes itself once with ``LD_PRELOAD`` set. ``EMPO2_ALLOCATOR=system``
keeps glibc's malloc; a ``MALLOC_CONF`` of your own replaces :data:`MALLOC_CONF`.
"""

from __future__ import annotations

import ctypes.util
import os
import sys

MALLOC_CONF = "oversize_threshold:0,dirty_decay_ms:-1,muzzy_decay_ms:-1"
"""Freed pages stay with the process for the next micro-batch: returning them (jemalloc's default, and at once for the
large blocks that most activations are) made each big tensor fault its pages in again, up to 28% slower updates.
The peak, which is what runs out, stays ~30% below glibc's."""


def jemalloc_library() -> str | None:
    """The jemalloc shared library's name as the dynamic loader finds it, or ``None``."""
    return ctypes.util.find_library("jemalloc") if sys.platform.startswith("linux") else None


def preload_env(environ: dict[str, str], library: str | None) -> dict[str, str] | None:
    """The environment to re-execute with, or ``None`` when there is nothing to do (no library, opted out, or it is
    already preloaded: this is what stops a second re-execution)."""
    preload = environ.get("LD_PRELOAD", "")
    if library is None or environ.get("EMPO2_ALLOCATOR", "jemalloc") != "jemalloc" or "jemalloc" in preload:
        return None
    return {"MALLOC_CONF": MALLOC_CONF, **environ, "LD_PRELOAD": f"{library} {preload}".strip()}


def reexec_with_jemalloc() -> None:
    """Replace this process by the same command with jemalloc preloaded (returns only when that does not apply)."""
    env = preload_env(dict(os.environ), jemalloc_library())
    if env is not None:
        sys.stdout.flush()
        os.execve(sys.executable, sys.orig_argv, env)


def active() -> str:
    """``jemalloc`` when this process runs on it, else ``system``."""
    try:
        with open("/proc/self/maps") as maps:
            return "jemalloc" if "libjemalloc" in maps.read() else "system"
    except OSError:
        return "system"
