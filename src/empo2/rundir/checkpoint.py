"""Atomic checkpoints that load no code: everything goes into a temporary folder, then one rename makes it visible.

A checkpoint folder ``checkpoints/iter_000007/`` holds the adapter (or full model) as safetensors, ``optimizer.pt``
(tensors and numbers only: read with ``torch.load(weights_only=True)``), ``state.json`` (iteration, counters,
task-sampler / mode-sampler state, Python and numpy RNG states), ``state.safetensors`` (the torch RNG state and the
novelty counts), ``memory.sqlite`` and, written last, ``manifest.json`` (every file's sha256,
:mod:`empo2.rundir.manifest`); under ``train.sharding: fsdp`` the weights and optimizer are a
``sharded/`` folder of ``torch.distributed.checkpoint`` shards instead (:mod:`empo2.parallel.sharding`). A pickle is never unpickled, so a run folder from someone else cannot run
code on ``--resume``. A crash while writing leaves only a ``.tmp-*`` folder that the next save removes.

Older checkpoints kept their state in a pickled ``state.pt``; :func:`convert` rewrites one in this format, for a
folder whose origin the user trusts (``python -m empo2.rundir.checkpoint --convert CHECKPOINT``).
"""

from __future__ import annotations

import contextlib
import errno
import json
import os
import random
import shutil
import sys
import tempfile
from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np
import torch

from empo2.config import ConfigError
from empo2.file_modes import share_tree
from empo2.parallel import sharding
from empo2.rundir.manifest import ChecksumError, verify_manifest, write_manifest

PREFIX = "iter_"
STATE = "state.json"
TENSORS = "state.safetensors"
OLD_STATE = "state.pt"


class CheckpointError(ConfigError):
    """A checkpoint that cannot be used (old pickle format, or none of them loads); exit code 2."""


def rng_state() -> dict[str, Any]:
    version, keys, gauss = random.getstate()
    name, mt, pos, has_gauss, cached = np.random.get_state()
    state = {"python": [version, list(keys), gauss], "numpy": [name, mt, pos, has_gauss, cached],
             "torch": torch.get_rng_state()}
    if torch.cuda.is_available():  # GPU sampling and LoRA dropout draw from the CUDA generators
        state["cuda"] = torch.stack(torch.cuda.get_rng_state_all())
    return state


def set_rng_state(state: dict[str, Any]) -> None:
    version, keys, gauss = state["python"]
    random.setstate((version, tuple(keys), gauss))
    name, mt, pos, has_gauss, cached = state["numpy"]
    np.random.set_state((name, np.asarray(mt, dtype=np.uint32), int(pos), int(has_gauss), float(cached)))
    torch.set_rng_state(torch.as_tensor(state["torch"], dtype=torch.uint8))
    gpu = state.get("cuda")  # absent in a checkpoint written without a GPU
    if gpu is not None and torch.cuda.is_available():
        gpu = torch.as_tensor(gpu, dtype=torch.uint8)
        torch.cuda.set_rng_state_all(list(gpu[: torch.cuda.device_count()]))


@contextlib.contextmanager
def separate_stream(seed: int):
    """Within the block python, numpy and torch draw from streams seeded by ``seed``; after it they continue where
    they were, as if the block had drawn nothing."""
    saved = rng_state()
    random.seed(seed), np.random.seed(seed % 2**32), torch.manual_seed(seed)
    try:
        yield
    finally:
        set_rng_state(saved)


def list_checkpoints(run_dir: Path) -> list[Path]:
    root = Path(run_dir) / "checkpoints"
    if not root.is_dir():
        return []
    return sorted(p for p in root.iterdir() if p.is_dir() and p.name.startswith(PREFIX)
                  and ((p / STATE).is_file() or (p / OLD_STATE).is_file()))


def latest_checkpoint(run_dir: Path) -> Path | None:
    found = list_checkpoints(run_dir)
    return found[-1] if found else None


def latest_intact(run_dir: Path, say: Callable[[str], None]) -> Path:
    """The newest checkpoint whose files match its manifest (one of an empo2 from before manifests is taken as it
    is), for commands that read weights without resuming (``eval --run``, ``export``). A newer one that does not
    match is passed over with one ``say`` line; none at all, or none that matches, is a :class:`CheckpointError`."""
    found = list_checkpoints(run_dir)
    if not found:
        raise CheckpointError(f"{run_dir} has no checkpoint")
    reasons = []
    for folder in reversed(found):
        try:
            verify_manifest(folder)
        except ChecksumError as exc:
            reasons.append(f"{folder.name}: {exc}")
            continue
        if reasons:
            say(f"warning: {'; '.join(reasons)}; using {folder}, the newest checkpoint that matches its manifest")
        return folder
    raise CheckpointError(f"no checkpoint of {run_dir} matches its manifest ({'; '.join(reasons)[:400]}); put back "
                          "an intact checkpoint folder")


def save_checkpoint(
    run_dir: Path,
    iteration: int,
    model,
    optimizer,
    state: dict[str, Any],
    memory_copy: Callable[[Path], None] | None,
    keep: int,
    weights: Callable[[Path], None] | None = None,
) -> Path:
    """Write checkpoint ``iteration`` atomically and keep only the newest ``keep``; ``weights`` writes the model and
    optimizer into the temporary folder instead of ``save_pretrained`` and ``optimizer.pt`` (sharded checkpoints)."""
    root = Path(run_dir) / "checkpoints"
    root.mkdir(parents=True, exist_ok=True)
    for stale in root.glob(".tmp-*"):
        shutil.rmtree(stale, ignore_errors=True)
    tmp = Path(tempfile.mkdtemp(prefix=".tmp-", dir=root))
    try:
        if weights is not None:
            weights(tmp)
        else:
            model.save_pretrained(tmp / "model", safe_serialization=True)
            torch.save(optimizer.state_dict(), tmp / "optimizer.pt")
        write_state(tmp, {**state, "iteration": iteration, "rng": rng_state()})
        if memory_copy is not None:
            memory_copy(tmp / "memory.sqlite")
        share_tree(tmp)  # a teammate can read the checkpoint (mkdtemp made it private)
        write_manifest(tmp)  # last: the checksums of everything above
        _fsync_tree(tmp)
    except BaseException as exc:  # e.g. disk full or SIGTERM: give the space back; the previous checkpoints are untouched
        full = isinstance(exc, Exception) and not isinstance(exc, OSError) and _disk_full(root)
        shutil.rmtree(tmp, ignore_errors=True)
        if full:  # torch and safetensors report a full disk in their own words (iostream error, SafetensorError)
            raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC), str(root)) from exc
        raise
    final = root / f"{PREFIX}{iteration:06d}"
    if final.exists():
        shutil.rmtree(final)
    os.replace(tmp, final)
    _fsync_dir(root)
    for old in list_checkpoints(run_dir)[:-keep] if keep > 0 else []:
        shutil.rmtree(old, ignore_errors=True)
    return final


def save_sharded(run_dir: Path, iteration: int, model, optimizer, state: dict, memory_copy, keep: int,
                 dist) -> Path | None:
    """A checkpoint written by all ranks: rank 0 makes the temporary folder and tells the others, every rank writes
    its shards into it, rank 0 adds the state and memory and renames it (atomic, as an unsharded one)."""
    if not dist.is_main:
        sharding.write_shards(dist.broadcast_object(None), model, optimizer)
        return None

    def weights(tmp: Path) -> None:
        sharding.write_shards(dist.broadcast_object(tmp), model, optimizer)

    return save_checkpoint(run_dir, iteration, model, optimizer, state, memory_copy, keep, weights=weights)


# ------------------------------------------------------------------------------------------------ state format
def write_state(folder: Path, state: dict[str, Any]) -> None:
    """``state.json`` with every array replaced by a reference into ``state.safetensors``."""
    from safetensors.torch import save_file

    tensors: dict[str, torch.Tensor] = {}
    plain = _split(state, tensors)
    save_file(tensors, str(Path(folder) / TENSORS))
    (Path(folder) / STATE).write_text(json.dumps(plain))


def _split(value: Any, tensors: dict[str, torch.Tensor]) -> Any:
    if isinstance(value, (np.ndarray, torch.Tensor)):
        key = f"t{len(tensors)}"
        kind = "ndarray" if isinstance(value, np.ndarray) else "tensor"
        tensors[key] = torch.from_numpy(np.ascontiguousarray(value)) if kind == "ndarray" else value.contiguous()
        return {f"__{kind}__": key}
    if isinstance(value, dict):
        return {str(k): _split(v, tensors) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [_split(v, tensors) for v in value]
    return value


def _join(value: Any, tensors: dict[str, torch.Tensor]) -> Any:
    if isinstance(value, dict):
        if set(value) == {"__ndarray__"}:
            return tensors[value["__ndarray__"]].numpy()
        if set(value) == {"__tensor__"}:
            return tensors[value["__tensor__"]]
        return {k: _join(v, tensors) for k, v in value.items()}
    if isinstance(value, list):
        return [_join(v, tensors) for v in value]
    return value


def load_state(ckpt: Path) -> dict[str, Any]:
    """The state of checkpoint ``ckpt`` (JSON + safetensors; nothing executed). An old pickled ``state.pt`` is
    refused with the command that converts it."""
    from safetensors.torch import load_file

    ckpt = Path(ckpt)
    if not (ckpt / STATE).is_file() and (ckpt / OLD_STATE).is_file():
        raise CheckpointError(f"{ckpt} holds a pickled state.pt from an older empo2, which could run code when "
                              "loaded, so it is not read; if you trust where it came from, convert it with: "
                              f"python -m empo2.rundir.checkpoint --convert {ckpt}")
    return _join(json.loads((ckpt / STATE).read_text()), load_file(str(ckpt / TENSORS)))


def load_optimizer(ckpt: Path) -> dict[str, Any]:
    # on the host: each rank moves its own state to its device on load_state_dict (not all of it onto cuda:0 first)
    return torch.load(Path(ckpt) / "optimizer.pt", weights_only=True, map_location="cpu")


def read_weights(ckpt: Path, lora: bool) -> dict[str, torch.Tensor]:
    """The adapter (``lora``) or full-model tensors of a checkpoint."""
    from safetensors.torch import load_file

    folder = Path(ckpt) / "model"
    if lora:
        return load_file(str(folder / "adapter_model.safetensors"))
    state = {}
    for f in sorted(folder.glob("*.safetensors")):
        state.update(load_file(str(f)))
    if not state:
        raise FileNotFoundError(f"no weights in {folder}")
    return state


def convert(ckpt: Path) -> None:
    """Rewrite an older checkpoint (pickled ``state.pt`` and ``optimizer.pt``) in the format above. Unpickles both
    files, so only for checkpoints the user trusts."""
    ckpt = Path(ckpt)
    old = torch.load(ckpt / OLD_STATE, weights_only=False)
    rng = old["rng"]
    version, keys, gauss = rng["python"]
    old["rng"] = {"python": [version, list(keys), gauss], "numpy": list(rng["numpy"]), "torch": rng["torch"]}
    torch.save(torch.load(ckpt / "optimizer.pt", weights_only=False), ckpt / "optimizer.pt")
    write_state(ckpt, old)
    (ckpt / OLD_STATE).unlink()


def _disk_full(folder: Path) -> bool:
    """Less than 1 MiB left where ``folder`` is: a failed write there was the disk's doing."""
    try:
        return shutil.disk_usage(folder).free < 1 << 20
    except OSError:
        return False


def _fsync_tree(folder: Path) -> None:
    for path in folder.rglob("*"):
        if path.is_file():
            with open(path, "rb") as fh:
                os.fsync(fh.fileno())


def _fsync_dir(folder: Path) -> None:
    """Make the rename itself durable (a power loss after it must not bring the temporary name back)."""
    fd = os.open(folder, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


if __name__ == "__main__":
    if len(sys.argv) != 3 or sys.argv[1] != "--convert":
        sys.exit("usage: python -m empo2.rundir.checkpoint --convert CHECKPOINT_FOLDER")
    for folder in [Path(sys.argv[2])] if (Path(sys.argv[2]) / OLD_STATE).is_file() else list_checkpoints(sys.argv[2]):
        convert(folder)
        print(f"converted {folder}")
