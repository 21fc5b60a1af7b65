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
RUN_MARKER = ".empo2-run"
"""Written into a run folder when a run starts there: ``train --overwrite`` empties only folders that hold it (or,
for runs made before the marker existed, nothing but what a run writes: :data:`RUN_LAYOUT`)."""
RUN_LAYOUT = {"config.yaml", "metrics.jsonl", "memory.sqlite", "memory.sqlite-wal", "memory.sqlite-shm",
              "memory.sqlite-journal", "checkpoints", "eval", "tb", "wandb", "trajectories.jsonl", "scores.png",
              "modes.png", "memory.png", "machine.jsonl", "mlflow-run-id", LOCK_NAME, RUN_MARKER}


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

    def acquire(self) -> RunLock:
        self._created = not self.run_dir.exists()
        try:
            self.run_dir.mkdir(parents=True, exist_ok=True)
            fh = open(self.path, "a+", encoding="utf-8")
        except OSError as exc:  # a read-only or foreign folder: nothing can be written there, so no run either
            raise RunLockError(f"cannot write {self.run_dir}: {exc.strerror or exc}") from None
        try:
            fcntl.flock(fh.fileno(), fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            fh.seek(0)
            owner = fh.read().strip() or "an unknown process"
            fh.close()
            raise RunLockError(f"{self.run_dir} is in use by {owner}; wait for it to finish or stop it "
                               "(one train, adapt or compare writes a folder at a time)") from None
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
        left = {p.name for p in self.run_dir.iterdir()} if self.run_dir.is_dir() else None  # None: deleted under us
        if self._created and left is not None and left <= {LOCK_NAME, RUN_MARKER}:
            self.path.unlink(missing_ok=True)
            (self.run_dir / RUN_MARKER).unlink(missing_ok=True)
            self.run_dir.rmdir()

    def __enter__(self) -> RunLock:
        return self.acquire()

    def __exit__(self, *exc) -> None:
        self.release()


def owner_line() -> str:
    """``pid N on HOST since TIME (empo2 CMD)``: what a refused second process prints about the owner."""
    since = time.strftime("%Y-%m-%d %H:%M:%S", time.localtime())
    command = " ".join(sys.argv[1:3]) if len(sys.argv) > 1 else "python"
    return f"pid {os.getpid()} on {socket.gethostname()} since {since} (empo2 {command})"


def check_new_run_folder(run_dir: Path, overwrite: bool) -> None:
    """Refuse to start a fresh run in ``run_dir`` when that would destroy something: a run already there (without
    ``--overwrite``), or a folder this project did not make (a run writes ``config.yaml`` and, with ``--overwrite``,
    empties the folder). Raises :class:`RunLockError` naming what was found."""
    run_dir = Path(run_dir)
    if run_dir.exists() and not run_dir.is_dir():
        raise RunLockError(f"{run_dir} is a file, not a folder; choose another train.output_dir")
    names = sorted(p.name for p in run_dir.iterdir()) if run_dir.is_dir() else []
    foreign = [n for n in names if not is_run_file(n)]
    if foreign and RUN_MARKER not in names and (overwrite or "config.yaml" in names):
        found = ", ".join(foreign[:5]) + (f" and {len(foreign) - 5} more" if len(foreign) > 5 else "")
        raise RunLockError(f"{run_dir} is not an empo2 run folder (it holds {found}); nothing was deleted — choose "
                           "another train.output_dir (--overwrite empties only run folders)")
    if "metrics.jsonl" in names and not overwrite:
        raise RunLockError(f"{run_dir} already holds a run; resume it with --resume {run_dir}, "
                           "or pass --overwrite / another train.output_dir")


def start_run_folder(run_dir: Path, overwrite: bool) -> None:
    """A fresh run's folder: emptied with ``--overwrite`` (after :func:`check_new_run_folder`), then marked."""
    if overwrite:
        clear_run_folder(run_dir)
    (Path(run_dir) / RUN_MARKER).write_text("empo2 run folder\n")


def is_run_file(name: str) -> bool:
    """Whether an entry of a run folder is one a run writes (:data:`RUN_LAYOUT`, or a memory kept aside on resume)."""
    return name in RUN_LAYOUT or name.startswith("memory.sqlite.ahead-of-")


def clear_run_folder(run_dir: Path) -> None:
    """Delete what a run wrote in ``run_dir`` (``train --overwrite``), except the lock this process holds; anything
    else (a user's notes, a report written into the folder) stays, also in a folder that holds the run marker."""
    import shutil

    for child in Path(run_dir).iterdir():
        if child.name != LOCK_NAME and is_run_file(child.name):
            shutil.rmtree(child) if child.is_dir() and not child.is_symlink() else child.unlink()
