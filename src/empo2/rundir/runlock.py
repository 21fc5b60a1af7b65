"""One owner per run folder: an advisory lock file that ``train`` and ``adapt`` hold while they write.

The lock is ``fcntl.flock`` on ``RUN/.empo2.lock``: the kernel drops it when the owner's process ends, however it
ends, so a killed run never blocks the next one. The file also records the owner (pid, host, start time, command) so
a refused second process can name it; a file that still names an owner although nobody holds the lock is left over
from a killed run and is taken over with a warning. Read-only commands (``memory``, ``eval``) never take it.
"""

from __future__ import annotations

import fcntl
import fnmatch
import json
import os
import re
import socket
import sys
import time
from pathlib import Path

from empo2.errors import UserError

LOCK_NAME = ".empo2.lock"
RUN_MARKER = ".empo2-run"
"""A JSON file that only empo2 writes, at the start of a fresh run: the folder is an empo2 run folder, and its
``owns`` list names the entries the run writes there (``train --overwrite`` deletes those and nothing else)."""
RUN_LAYOUT = {"config.yaml", "metrics.jsonl", "memory.sqlite", "memory.sqlite-wal", "memory.sqlite-shm",
              "memory.sqlite-journal", "checkpoints", "eval", "tb", "wandb", "trajectories.jsonl", "scores.png",
              "modes.png", "memory.png", "machine.jsonl", "mlflow-run-id", LOCK_NAME, RUN_MARKER,
              "memory.sqlite.ahead-of-*", "warm_start", ".warm_start-*", "demos.json"}
"""What a run writes in its folder (a pattern for the memories kept aside on resume)."""
EMPO2_ONLY = {"memory.sqlite", "machine.jsonl", "trajectories.jsonl", "scores.png", "modes.png", "memory.png",
              "mlflow-run-id"}
"""Names of :data:`RUN_LAYOUT` that other trainers do not write (``config.yaml``, ``checkpoints/``, ``eval/``,
``tb/`` and ``wandb/`` are everyone's): with a ``checkpoints/iter_NNNNNN`` folder they recognise a run made before
the marker existed, which ``--resume`` continues (and then marks). Names are no proof of origin, so only the marker
lets a fresh run delete or replace anything."""
OLD_CHECKPOINT = re.compile(r"iter_\d{6}")


class RunLockError(UserError, RuntimeError):
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


def run_folder_owns(run_dir: Path) -> list[str] | None:
    """The names (patterns) of ``run_dir``'s entries that empo2 wrote: its marker's ``owns`` list (a marker from before
    the list: :data:`RUN_LAYOUT`). ``None``: no marker, so nothing there is known to be empo2's (file names prove
    nothing: another tool writes ``config.yaml`` and ``checkpoints/`` too, and a user may name a file anything)."""
    marker = Path(run_dir) / RUN_MARKER
    if not marker.is_file():
        return None
    try:
        owns = json.loads(marker.read_text(encoding="utf-8"))["owns"]
        if isinstance(owns, list):  # it may narrow what a run owns, never widen it
            return sorted(n for n in owns if n in RUN_LAYOUT)
    except (OSError, ValueError, KeyError, TypeError):  # the plain-text marker of earlier versions
        pass
    return sorted(RUN_LAYOUT)


def empty_layout_folders(run_dir: Path, names: list[str]) -> set[str]:
    """The entries of ``names`` that are empty real folders a run writes into (``checkpoints/`` of a scratch mount):
    nothing in them can be lost, so they do not make a folder someone else's."""
    empty = set()
    for name in names:
        path = run_dir / name
        if name in RUN_LAYOUT and path.is_dir() and not path.is_symlink() and not any(path.iterdir()):
            empty.add(name)
    return empty


def looks_like_an_old_run(run_dir: Path, names: set[str]) -> bool:
    """``config.yaml`` beside an empo2-only file or an ``iter_NNNNNN`` checkpoint folder: a run folder written before
    the marker existed (``--resume`` of one also needs its ``config.yaml`` to load as an empo2 config)."""
    checkpoints = run_dir / "checkpoints"
    old_checkpoint = checkpoints.is_dir() and any(OLD_CHECKPOINT.fullmatch(p.name) for p in checkpoints.iterdir())
    return "config.yaml" in names and (bool(names & EMPO2_ONLY) or old_checkpoint)


def _owned(name: str, owns) -> bool:
    return any(fnmatch.fnmatchcase(name, pattern) for pattern in owns)


def check_new_run_folder(run_dir: Path, overwrite: bool) -> None:
    """Refuse to start a fresh run in ``run_dir`` when that would destroy something: a run already there (without
    ``--overwrite``), or any folder that holds files empo2 did not write (another trainer's run, a project): a run
    writes ``config.yaml``, ``checkpoints/``, ``eval/`` … and ``--overwrite`` deletes them. Raises
    :class:`RunLockError` naming what was found, before anything is written."""
    run_dir = Path(run_dir)
    if run_dir.exists() and not run_dir.is_dir():
        raise RunLockError(f"{run_dir} is a file, not a folder; choose another train.output_dir")
    names = sorted(p.name for p in run_dir.iterdir()) if run_dir.is_dir() else []
    if not set(names) - {LOCK_NAME} - empty_layout_folders(run_dir, names):
        return  # a new or empty folder (a lock file left by a command that wrote nothing, empty layout folders)
    owns = run_folder_owns(run_dir)
    if owns is None and looks_like_an_old_run(run_dir, set(names)):
        raise RunLockError(f"{run_dir} holds a run without the {RUN_MARKER} marker (a run of an empo2 from before "
                           "the marker, or files of another tool named alike); nothing was deleted or written — "
                           f"continue an empo2 run with --resume {run_dir}, or choose another train.output_dir")
    if owns is None:
        unusual = [n for n in names if not _owned(n, RUN_LAYOUT)] or [n for n in names if n != LOCK_NAME]
        found = ", ".join(unusual[:5]) + (f" and {len(unusual) - 5} more" if len(unusual) > 5 else "")
        raise RunLockError(f"{run_dir} is not an empo2 run folder (it holds {found}); nothing was deleted or "
                           "written — choose another train.output_dir (a new run starts in an empty folder or an "
                           "empo2 run folder)")
    if "metrics.jsonl" in names and not overwrite:
        raise RunLockError(f"{run_dir} already holds a run; resume it with --resume {run_dir}, "
                           "or pass --overwrite / another train.output_dir")


def check_run_to_resume(run_dir: Path) -> None:
    """``--resume`` continues only an empo2 run: a folder with the marker, or with ``config.yaml`` beside files only
    empo2 writes (a run made before the marker existed); raises :class:`RunLockError` otherwise."""
    run_dir = Path(run_dir)
    names = {p.name for p in run_dir.iterdir()} if run_dir.is_dir() else set()
    if "config.yaml" not in names:
        raise RunLockError(f"{run_dir} is not a run folder (no config.yaml)")
    if RUN_MARKER not in names and not looks_like_an_old_run(run_dir, names):
        raise RunLockError(f"{run_dir} is not an empo2 run folder (no {RUN_MARKER}, and no file only empo2 writes: "
                           "metrics of another trainer are not continued)")


def mark_run_folder(run_dir: Path, ours=None) -> None:
    """Write the marker. The run owns every name of :data:`RUN_LAYOUT` except those the folder already holds for
    someone else: an entry already there is the run's only if it matches ``ours`` (default: what the folder's marker
    lists; an unmarked folder: its empty layout folders; ``--resume`` of a run made before the marker passes
    :data:`RUN_LAYOUT`). A fresh run's folder holds only its user's entries after :func:`clear_run_folder`."""
    run_dir = Path(run_dir)
    if ours is None:
        names = [p.name for p in run_dir.iterdir()]
        ours = run_folder_owns(run_dir) or sorted(empty_layout_folders(run_dir, names))
    others = {p.name for p in run_dir.iterdir() if not _owned(p.name, ours)} - {LOCK_NAME, RUN_MARKER}
    owns = sorted(n for n in RUN_LAYOUT if n not in others)
    tmp = run_dir / f".{RUN_MARKER}.tmp"
    tmp.write_text(json.dumps({"written_by": "empo2", "owns": owns}, indent=1) + "\n", encoding="utf-8")
    os.replace(tmp, run_dir / RUN_MARKER)


def start_run_folder(run_dir: Path, overwrite: bool) -> None:
    """A fresh run's folder: emptied with ``--overwrite`` (after :func:`check_new_run_folder`), then marked."""
    if overwrite:
        clear_run_folder(run_dir)
    mark_run_folder(run_dir)


def is_run_file(name: str) -> bool:
    """Whether an entry of a run folder is one a run writes (:data:`RUN_LAYOUT`, or a memory kept aside on resume)."""
    return _owned(name, RUN_LAYOUT)


def clear_run_folder(run_dir: Path) -> None:
    """Delete what empo2 wrote in ``run_dir`` (``train --overwrite``): the entries its marker lists, except the lock
    this process holds and the marker, which the fresh run rewrites; anything else stays. Of an unmarked folder only
    its empty layout folders go (nothing in them can be lost)."""
    import shutil

    owns = run_folder_owns(run_dir)
    if owns is None:
        owns = sorted(empty_layout_folders(Path(run_dir), [p.name for p in Path(run_dir).iterdir()]))
    for child in Path(run_dir).iterdir():
        if child.name not in (LOCK_NAME, RUN_MARKER) and _owned(child.name, owns):
            shutil.rmtree(child) if child.is_dir() and not child.is_symlink() else child.unlink()
