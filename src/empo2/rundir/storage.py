"""Storage faults of a run (disk full, quota, read-only or unwritable folder) reported as one line.

A write that fails deep inside SQLite, torch or safetensors surfaces as an ``OSError``, a
``sqlite3.OperationalError`` ("disk I/O error", "database or disk is full") or a ``RuntimeError`` from a C++
writer. :func:`reported` turns any of them into :class:`RunWriteError`, which names the path and the last good
checkpoint (checkpoints are written to a temporary folder and renamed, so a failed save never touches it).
"""

from __future__ import annotations

import contextlib
import errno
import os
import shutil
import sqlite3
import tempfile
from pathlib import Path

from empo2.errors import UserError

STORAGE_ERRNOS = {errno.ENOSPC, errno.EDQUOT, errno.EROFS, errno.EACCES, errno.EPERM, errno.EFBIG, errno.EIO}
_STORAGE_WORDS = ("no space left", "storagefull", "disk i/o error", "database or disk is full", "read-only file system",
                  "readonly database", "file write failed", "file too large", "permission denied",
                  "unable to open database")


class RunWriteError(UserError, RuntimeError):
    """The run folder cannot be written (disk full, read-only, no permission); exit code 2."""


def describe(exc: BaseException, run_dir: Path) -> str | None:
    """One line for a storage failure anywhere in ``exc``'s cause/context chain, or ``None`` if it is not one."""
    seen = set()
    while exc is not None and id(exc) not in seen:
        seen.add(id(exc))
        line = _describe_one(exc, Path(run_dir))
        if line is not None:
            return line
        exc = exc.__cause__ or exc.__context__
    return None


def _describe_one(exc: BaseException, run_dir: Path) -> str | None:
    if isinstance(exc, OSError) and exc.errno in STORAGE_ERRNOS:
        path, reason = exc.filename or run_dir, exc.strerror or str(exc)
    elif isinstance(exc, (OSError, sqlite3.OperationalError, RuntimeError)) and \
            any(w in str(exc).lower() for w in _STORAGE_WORDS):
        path = run_dir / "memory.sqlite" if isinstance(exc, sqlite3.Error) else run_dir
        reason = str(exc).splitlines()[0][:200] if str(exc) else type(exc).__name__
    else:
        return None
    return f"cannot write {path}: {reason}{_free(Path(path) if Path(path).is_dir() else run_dir)}; " \
           f"{_last_checkpoint(run_dir)}"


def _free(run_dir: Path) -> str:
    try:
        return f" ({shutil.disk_usage(run_dir).free // 1024} KiB free)"
    except OSError:
        return ""


def _last_checkpoint(run_dir: Path) -> str:
    from empo2.rundir.checkpoint import latest_checkpoint

    last = latest_checkpoint(run_dir)
    if last is None:
        return "no checkpoint was written yet"
    return f"the last good checkpoint {last} is intact (free space, then resume with --resume {run_dir})"


def check_writable(folder: Path, flag: str) -> None:
    """Raise :class:`RunWriteError` when ``folder`` (or, while it does not exist, the nearest folder above it) does
    not take a new file: checked before work whose result would be lost, naming the ``flag`` that picks another."""
    probe = Path(folder).absolute()
    while not probe.exists() and probe != probe.parent:
        probe = probe.parent
    try:
        if not probe.is_dir():
            raise NotADirectoryError(errno.ENOTDIR, os.strerror(errno.ENOTDIR), str(probe))
        tempfile.TemporaryFile(dir=probe).close()
    except OSError as exc:
        raise RunWriteError(f"cannot write {folder}: {exc.strerror or exc}; give a writable folder with {flag}") \
            from None


@contextlib.contextmanager
def reported(run_dir: Path):
    """Re-raise storage failures inside the block as :class:`RunWriteError` (other errors pass unchanged)."""
    try:
        yield
    except RunWriteError:
        raise
    except Exception as exc:  # noqa: BLE001 - only storage failures are translated, the rest is re-raised
        line = describe(exc, run_dir)
        if line is None:
            raise
        raise RunWriteError(line) from None
