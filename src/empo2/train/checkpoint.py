"""Atomic checkpoints: everything goes into a temporary folder, then one rename makes it visible.

A checkpoint folder ``checkpoints/iter_000007/`` holds the adapter (or full model), ``optimizer.pt``, ``state.pt``
(iteration, task-sampler / mode-sampler / novelty state, python / numpy / torch RNG states) and ``memory.sqlite``.
A crash while writing leaves only a ``.tmp-*`` folder that the next save removes.
"""

from __future__ import annotations

import os
import random
import shutil
import tempfile
from pathlib import Path
from typing import Any, Callable

import numpy as np
import torch

PREFIX = "iter_"


def rng_state() -> dict[str, Any]:
    return {"python": random.getstate(), "numpy": np.random.get_state(), "torch": torch.get_rng_state()}


def set_rng_state(state: dict[str, Any]) -> None:
    random.setstate(state["python"])
    np.random.set_state(state["numpy"])
    torch.set_rng_state(state["torch"])


def list_checkpoints(run_dir: Path) -> list[Path]:
    root = Path(run_dir) / "checkpoints"
    if not root.is_dir():
        return []
    return sorted(p for p in root.iterdir() if p.is_dir() and p.name.startswith(PREFIX) and (p / "state.pt").is_file())


def latest_checkpoint(run_dir: Path) -> Path | None:
    found = list_checkpoints(run_dir)
    return found[-1] if found else None


def save_checkpoint(
    run_dir: Path,
    iteration: int,
    model,
    optimizer,
    state: dict[str, Any],
    memory_copy: Callable[[Path], None] | None,
    keep: int,
) -> Path:
    """Write checkpoint ``iteration`` atomically and keep only the newest ``keep``."""
    root = Path(run_dir) / "checkpoints"
    root.mkdir(parents=True, exist_ok=True)
    for stale in root.glob(".tmp-*"):
        shutil.rmtree(stale, ignore_errors=True)
    tmp = Path(tempfile.mkdtemp(prefix=".tmp-", dir=root))
    try:
        model.save_pretrained(tmp / "model", safe_serialization=True)
        torch.save(optimizer.state_dict(), tmp / "optimizer.pt")
        torch.save({**state, "iteration": iteration, "rng": rng_state()}, tmp / "state.pt")
        if memory_copy is not None:
            memory_copy(tmp / "memory.sqlite")
        _fsync_tree(tmp)
    except BaseException:  # e.g. disk full: give the space back; the previous checkpoints are untouched
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    final = root / f"{PREFIX}{iteration:06d}"
    if final.exists():
        shutil.rmtree(final)
    os.replace(tmp, final)
    for old in list_checkpoints(run_dir)[:-keep] if keep > 0 else []:
        shutil.rmtree(old, ignore_errors=True)
    return final


def load_state(ckpt: Path) -> dict[str, Any]:
    return torch.load(Path(ckpt) / "state.pt", weights_only=False)


def _fsync_tree(folder: Path) -> None:
    for path in folder.rglob("*"):
        if path.is_file():
            with open(path, "rb") as fh:
                os.fsync(fh.fileno())
