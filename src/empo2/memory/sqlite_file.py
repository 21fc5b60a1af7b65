"""The tip memory as a file on disk, before and around SQLite: the header check, read-only connections (also on a
read-only mount), the integrity check, and the -wal/-shm files a check must not leave behind. Nothing here writes the
file."""

from __future__ import annotations

import os
import sqlite3
import struct
from pathlib import Path
from urllib.parse import quote

from .schema import APPLICATION_ID, check_objects
from .validate import MemoryStoreError

SQLITE_MAGIC = b"SQLite format 3\x00"
INTEGRITY_CHECKS = ("none", "quick", "full")


def check_header(path: Path) -> None:
    """Refuse a file that is not an empo2 memory before SQLite touches it (so it is never modified)."""
    try:
        with open(path, "rb") as f:
            head = f.read(100)
    except OSError as exc:
        raise MemoryStoreError(f"cannot read memory file {path}: {exc}") from None
    if len(head) < 100 or not head.startswith(SQLITE_MAGIC):
        raise MemoryStoreError(f"{path} is not a SQLite database (corrupt or foreign file); it was left unchanged")
    (app_id,) = struct.unpack(">I", head[68:72])
    if app_id != APPLICATION_ID:
        raise MemoryStoreError(f"{path} is a SQLite database but not an empo2 tip memory "
                               f"(application_id {app_id:#x}); it was left unchanged")


def restore_hint(path: Path) -> str:
    """Where a damaged run memory can be restored from: the newest checkpoint's copy, when there is one."""
    copies = sorted(Path(path).parent.glob("checkpoints/iter_*/memory.sqlite"))
    if copies:
        return f"restore it from the last checkpoint's copy: cp {copies[-1]} {path}"
    return "restore it from the last checkpoint's copy (RUN/checkpoints/iter_*/memory.sqlite)"


def connect_readonly(path: Path, timeout: float = 30) -> sqlite3.Connection:
    """A connection that never writes ``path``. In a folder this process cannot write (a read-only mount, another
    user's run) SQLite cannot make the WAL index it needs, so the file is read as immutable: sound when no
    write-ahead log holds commits the main file lacks (refused otherwise)."""
    uri = f"file:{quote(str(Path(path).resolve()))}?mode=ro"
    try:
        conn = sqlite3.connect(uri, uri=True, timeout=timeout, check_same_thread=False)
        conn.execute("SELECT count(*) FROM sqlite_master").fetchone()
        return conn
    except sqlite3.OperationalError:
        if os.access(Path(path).parent, os.W_OK) and not _read_only_mount(Path(path).parent):
            raise
    wal = Path(f"{path}-wal")
    if wal.exists() and wal.stat().st_size > 0:
        raise MemoryStoreError(f"{path} is in a folder this process cannot write and has an unmerged write-ahead "
                               f"log ({wal.name}); read it where the folder is writable") from None
    return sqlite3.connect(uri + "&immutable=1", uri=True, timeout=timeout, check_same_thread=False)


def open_connection(path: Path, synchronous: str, read_only: bool = False) -> sqlite3.Connection:
    """The connection of a :class:`~empo2.memory.store.TipMemory` (autocommit; transactions are explicit)."""
    try:
        conn = connect_readonly(path) if read_only else \
            sqlite3.connect(str(path), isolation_level=None, check_same_thread=False, timeout=30)
        conn.execute("PRAGMA busy_timeout = 30000")
        conn.execute(f"PRAGMA synchronous = {synchronous.upper()}")
        return conn
    except sqlite3.Error as exc:
        raise MemoryStoreError(f"cannot open memory file {path}: {exc}") from None


def _read_only_mount(folder: Path) -> bool:
    """True on a read-only file system (``os.access`` says yes to root there)."""
    try:
        return bool(os.statvfs(folder).f_flag & os.ST_RDONLY)
    except OSError:
        return False


def existing_sidecars(path: Path) -> set[Path]:
    """The -wal/-shm files of ``path`` that exist now (see :func:`remove_new_sidecars`)."""
    return {p for p in (Path(f"{path}-wal"), Path(f"{path}-shm")) if p.exists()}


def remove_new_sidecars(path: Path, existed: set[Path]) -> None:
    """Remove the -wal/-shm files a read-only connection made (it cannot checkpoint them away on close); a -wal
    that holds commits is kept."""
    for p in (Path(f"{path}-wal"), Path(f"{path}-shm")):
        if p not in existed and p.exists() and (p.name.endswith("-shm") or p.stat().st_size == 0):
            p.unlink(missing_ok=True)


def check_integrity(path: Path, level: str = "quick") -> None:
    """Run ``PRAGMA quick_check`` (``full``: ``integrity_check``) on a read-only connection; raise if damaged.

    Read-only, so a damaged file is never written (no WAL checkpoint on close); -wal/-shm files that only this
    check created are removed again.
    """
    if level not in INTEGRITY_CHECKS:
        raise MemoryStoreError(f"integrity check must be one of {', '.join(INTEGRITY_CHECKS)}, got {level!r}")
    if level == "none":
        return
    path = Path(path)
    existed = existing_sidecars(path)
    pragma = "integrity_check" if level == "full" else "quick_check"
    try:
        conn = connect_readonly(path)
        try:
            problems = [r[0] for r in conn.execute(f"PRAGMA {pragma}(5)")]
        finally:
            conn.close()
    except sqlite3.DatabaseError as exc:
        problems = [str(exc)]
    finally:
        remove_new_sidecars(path, existed)
    if problems != ["ok"]:
        first = [line for line in problems[0].splitlines() if line.strip() and not line.startswith("***")]
        raise MemoryStoreError(f"{path} is damaged ({pragma}: {(first or ['?'])[0]}); it was left unchanged — "
                               f"{restore_hint(path)}")


def check_regular_file(path: Path) -> None:
    """Refuse a memory path that exists but is no regular file (a folder, a link to ``/dev/null``, a pipe) or is a
    dangling link, before SQLite opens it: it would write its journal beside whatever the path leads to."""
    path = Path(path)
    if path.is_file() or not (path.exists() or path.is_symlink()):
        return
    where = f" (a link to {os.path.realpath(path)})" if path.is_symlink() else ""
    kind = "a folder" if path.is_dir() else "a link that leads nowhere" if not path.exists() else "not a regular file"
    raise MemoryStoreError(f"{path} is {kind}{where}; a tip memory must be a regular file: move it away, or point "
                           "the run elsewhere")


def check_file(path: Path, level: str = "quick") -> None:
    """:func:`check_header` + :func:`check_integrity` + :func:`check_objects` of an existing non-empty file (a
    missing one passes), all read-only; a path that is not a regular file is refused (:func:`check_regular_file`)."""
    path = Path(path)
    check_regular_file(path)
    if path.is_file() and path.stat().st_size > 0:
        check_header(path)
        check_integrity(path, level)
        conn = connect_readonly(path)
        try:
            check_objects(conn, path)
        finally:
            conn.close()


def check_seed_file(path: Path) -> None:
    """``memory.seed_from``: an existing, sound tip memory with nothing but its own schema, checked before it is
    copied into a run."""
    if not path.is_file():
        raise MemoryStoreError(f"memory.seed_from: no such file {path}")
    try:
        check_file(path)
    except MemoryStoreError as exc:
        raise MemoryStoreError(f"memory.seed_from: {exc}") from None
