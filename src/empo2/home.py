"""``$EMPO2_HOME``: the folder of the caches every package shares (converted models, gold-path lengths)."""

from __future__ import annotations

import os
from pathlib import Path


def empo2_home() -> Path:
    """``$EMPO2_HOME``, or ``~/.cache/empo2`` when it is unset or empty (an empty one used to mean the current folder,
    so a model cache landed in whatever folder a command ran from)."""
    return Path(os.environ.get("EMPO2_HOME") or Path.home() / ".cache" / "empo2")
