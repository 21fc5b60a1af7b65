"""Checksums of a checkpoint: ``manifest.json`` lists the size and sha256 of every file the checkpoint holds.

The trainer writes it last, into the temporary folder that one rename then makes the checkpoint (its own temporary
name and rename too), so a checkpoint either has a manifest that covers all of it or none. ``--resume`` verifies it
before it trusts a file that merely parses: an adapter with flipped bits still loads, and then trains on nonsense.
A checkpoint without a manifest was written by an older empo2; it is loaded as before, on the checks its files'
formats allow (:func:`empo2.rundir.resume.load_checkpoint`).
"""

from __future__ import annotations

import hashlib
import json
import os
from pathlib import Path

MANIFEST = "manifest.json"
MAX_MANIFEST_BYTES = 1 << 20


class ChecksumError(ValueError):
    """A checkpoint file is missing, or differs from what its manifest says."""


def file_sha256(path: Path) -> str:
    digest = hashlib.sha256()
    with open(path, "rb") as fh:
        for block in iter(lambda: fh.read(1 << 20), b""):
            digest.update(block)
    return digest.hexdigest()


def write_manifest(folder: Path) -> None:
    """Write ``folder/manifest.json`` for every file below ``folder`` (atomically: a temporary name, then a rename)."""
    folder = Path(folder)
    files = {p.relative_to(folder).as_posix(): {"size": p.stat().st_size, "sha256": file_sha256(p)}
             for p in sorted(folder.rglob("*")) if p.is_file() and p.name != MANIFEST}
    tmp = folder / f".{MANIFEST}.tmp"
    with open(tmp, "w", encoding="utf-8") as fh:
        json.dump({"format": 1, "files": files}, fh, indent=1, sort_keys=True)
        fh.flush()
        os.fsync(fh.fileno())
    os.replace(tmp, folder / MANIFEST)


def verify_manifest(folder: Path) -> bool:
    """Check every file ``folder/manifest.json`` lists (size, then sha256); raise :class:`ChecksumError` naming the
    first that differs. ``False`` when there is no manifest (an older checkpoint), ``True`` when all match. Files the
    manifest does not list (SQLite's -wal/-shm of a reader) are not checked."""
    folder = Path(folder)
    path = folder / MANIFEST
    if not path.exists():
        return False
    if not path.is_file() or path.stat().st_size > MAX_MANIFEST_BYTES:
        raise ChecksumError(f"{MANIFEST} is not a manifest file")
    try:
        files = json.loads(path.read_bytes())["files"]
        entries = [(str(rel), int(e["size"]), str(e["sha256"])) for rel, e in files.items()]
    except (ValueError, KeyError, TypeError, AttributeError, RecursionError) as exc:
        raise ChecksumError(f"{MANIFEST} is damaged ({type(exc).__name__})") from None
    for rel, size, sha in entries:
        target = folder / rel
        if Path(rel).is_absolute() or ".." in Path(rel).parts:
            raise ChecksumError(f"{MANIFEST} names a file outside the checkpoint ({rel[:80]!r})")
        if not target.is_file():
            raise ChecksumError(f"{rel} is missing")
        if target.stat().st_size != size or file_sha256(target) != sha:
            raise ChecksumError(f"{rel} does not match its checksum in {MANIFEST}")
    return True
