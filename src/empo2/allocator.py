"""Run the ``empo2`` command on jemalloc when the machine has it (``scripts/setup.sh`` installs ``libjemalloc2``).

An update's forward/backward allocates and frees hundreds of activation tensors of many sizes. glibc's malloc keeps
much of that freed memory in fragmented arenas, so the process peaks higher on glibc than on jemalloc at about the
same speed (``benchmarks/allocator.py``; records/benchmarks.md). The
allocator has to be chosen before the process starts, so the command re-executes itself once with ``LD_PRELOAD`` set.
``EMPO2_ALLOCATOR=system`` keeps glibc's malloc; a ``MALLOC_CONF`` of your own replaces :data:`MALLOC_CONF`.
"""

from __future__ import annotations

import ctypes.util
import os
import sys

MALLOC_CONF = "oversize_threshold:0,background_thread:true"
"""Large blocks (most activations) share the normal arenas, whose freed pages a background thread returns after
jemalloc's usual delay; by default they get an arena that returns them at once, so each big tensor faulted its pages in
again. Keeping pages for good (``dirty_decay_ms:-1``) is faster on one update but lets a whole training run keep
growing, as pages freed by one phase (rollout, update) do not fit the next."""


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
