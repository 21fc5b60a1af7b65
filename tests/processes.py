"""Process helpers shared by the tests that kill a run the way a crash would."""

from __future__ import annotations

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
