"""Process helpers shared by the tests that kill a run the way a crash would."""

from __future__ import annotations

import os

import psutil


def kill_tree(pid: int) -> None:
    """SIGKILL ``pid`` and every process under it, and wait until they are gone. torchrun starts its ranks in
    sessions of their own, so killing the launcher's process group alone would leave them running (and holding the
    run folder's lock)."""
    tree = [psutil.Process(pid), *psutil.Process(pid).children(recursive=True)]
    for p in tree:
        try:
            p.kill()
        except psutil.NoSuchProcess:
            pass
    psutil.wait_procs(tree, timeout=60)


def cli_env(**extra: str) -> dict[str, str]:
    """The environment for an ``empo2`` child: the one the command re-executes itself into (jemalloc preloaded, where
    the machine has it), so that the child starts there at once instead of importing torch, re-executing and importing
    it again. The re-execution itself is tests/test_allocator.py's and the start-up signal tests' to check."""
    from empo2.allocator import jemalloc_library, preload_env

    env = dict(os.environ)
    return {**(preload_env(env, jemalloc_library()) or env), **extra}
