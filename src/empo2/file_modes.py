"""File modes of what a run shares with its team: checkpoints and the model cache are readable as the umask allows.

Temporary folders (``tempfile.mkdtemp``) are made 0700 and some writers (safetensors) create files 0600, whatever the
umask; a folder built that way and then renamed into place would be private to its owner, so a teammate's ``eval``
of the run would fail with ``PermissionError``. :func:`share_tree` gives such a tree the modes a plain ``mkdir`` and
``open`` would have given it.
"""

from __future__ import annotations

import os
import threading
from pathlib import Path

_LOCK = threading.Lock()


def current_umask() -> int:
    """The process's umask (``os.umask`` can only be read by setting it, so it is set back at once, under a lock)."""
    with _LOCK:
        mask = os.umask(0o022)
        os.umask(mask)
    return mask


def share_tree(folder: Path) -> None:
    """Folders ``0o777`` and files ``0o666`` (an executable file keeps its x bits) under ``folder`` and itself,
    each less the umask; symbolic links are left alone."""
    mask = current_umask()
    folder = Path(folder)
    for path in [folder, *folder.rglob("*")]:
        if path.is_symlink():
            continue
        mode = path.stat().st_mode
        wanted = 0o777 if path.is_dir() or mode & 0o111 else 0o666
        os.chmod(path, (wanted & ~mask) | (mode & 0o700))
