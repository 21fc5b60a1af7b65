"""One owner per run folder: an advisory lock file that ``train`` and ``adapt`` hold while they write.

The lock is ``fcntl.flock`` on ``RUN/.empo2.lock``: the kernel drops it when the owner's process ends, however it
ends, so a killed run never blocks the next one. The file also records the owner (pid, host, start time, command) so
a refused second process can name it; a file that still names an owner although nobody holds the lock is left over
from a killed run and is taken over with a warning. Read-only commands (``memory``, ``eval``) never take it.
"""

from __future__ import annotations

import fcntl
import os
import socket
import sys
import time
from pathlib import Path

LOCK_NAME = ".empo2.lock"


class RunLockError(RuntimeError):
    """The run folder is held by another live process; the CLI prints it and exits with code 2."""


class RunLock:
    """Context manager holding ``run_dir``'s lock; creates the folder if needed and removes it again on release when
    the lock file is all it holds (a command that fails before writing leaves nothing behind)."""

    def __init__(self, run_dir: str | Path):
        self.run_dir = Path(run_dir)
        self.path = self.run_dir / LOCK_NAME
        self._fh = None
        self._created = False

    def acquire(self) -> "RunLock":
        self._created = not self.run_dir.exists()
        self.run_dir.mkdir(parents=True, exist_ok=True)
        fh = open(self.path, "a+", encoding="utf-8")
        try:
            fcntl.flock(fh.fileno(), fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            fh.seek(0)
            owner = fh.read().strip() or "an unknown process"
            fh.close()
            raise RunLockError(f"{self.run_dir} is in use by {owner}; wait for it to finish or stop it "
                               "(one train/adapt per run folder)") from None
        fh.seek(0)
        stale = fh.read().strip()
        if stale:
            print(f"warning: {self.run_dir}: taking over a stale lock ({stale}; that process is gone)",
                  file=sys.stderr)
        fh.seek(0)
        fh.truncate()
        fh.write(owner_line())
        fh.flush()
        self._fh = fh
        return self

    def release(self) -> None:
        """Clear the owner line and drop the lock (idempotent)."""
        if self._fh is None:
            return
        try:
            self._fh.seek(0)
            self._fh.truncate()
            self._fh.flush()
        except OSError:  # a full or read-only disk: the kernel still drops the flock below
            pass
        fcntl.flock(self._fh.fileno(), fcntl.LOCK_UN)
        self._fh.close()
        self._fh = None
        if self._created and [p.name for p in self.run_dir.iterdir()] == [LOCK_NAME]:
            self.path.unlink(missing_ok=True)
            self.run_dir.rmdir()

    def __enter__(self) -> "RunLock":
        return self.acquire()

    def __exit__(self, *exc) -> None:
        self.release()


def owner_line() -> str:
    """``pid N on HOST since TIME (empo2 CMD)``: what a refused second process prints about the owner."""
    since = time.strftime("%Y-%m-%d %H:%M:%S", time.localtime())
    command = " ".join(sys.argv[1:3]) if len(sys.argv) > 1 else "python"
    return f"pid {os.getpid()} on {socket.gethostname()} since {since} (empo2 {command})"


def clear_run_folder(run_dir: Path) -> None:
    """Delete everything in ``run_dir`` except the lock this process holds (``train --overwrite``)."""
    import shutil

    for child in Path(run_dir).iterdir():
        if child.name != LOCK_NAME:
            shutil.rmtree(child) if child.is_dir() and not child.is_symlink() else child.unlink()
