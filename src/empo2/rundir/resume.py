"""What ``train --resume`` keeps equal: the run's settings, and the memory and the weights of one iteration.

A resumed run is the same run continued: an override that changes what it trains (model, G, tasks, algorithm,
estimator, environment, …) would put two configs into one run folder, so it is refused (exit 2) naming the keys.
:data:`RESUME_SAFE` lists the only keys a resume may change: output, progress, evaluation and checkpoint cadence,
the number of iterations, and knobs that change memory use or speed but not the results.

The trainer writes an iteration's tips to ``memory.sqlite`` before that iteration's checkpoint; a run stopped in
between has a live memory one iteration ahead of the weights it resumes from. :func:`align_memory` puts the
checkpoint's copy back (the live file is kept beside it) so that the replayed iteration sees what it saw the first
time. :func:`truncate_samples` drops the replayed iterations' lines from ``trajectories.jsonl`` likewise.
"""

from __future__ import annotations

import hashlib
import json
import os
import shutil
import sqlite3
from pathlib import Path
from urllib.parse import quote

from empo2.config import Config, ConfigError, SftConfig, flat_settings
from empo2.memory.sqlite_file import check_file
from empo2.parallel import sharding
from empo2.rundir import checkpoint as ckpt
from empo2.rundir.manifest import verify_manifest

RESUME_SAFE = frozenset({
    "train.iterations", "train.output_dir", "train.progress", "train.eval_every",
    "train.eval_at_start", "train.eval_episodes_per_task", "train.save_every", "train.keep_checkpoints",
    "train.sample_trajectories", "train.zero_adv_warn_iters", "train.max_consecutive_env_failures",
    "train.preempt_save", "train.micro_batch_tokens", "train.logprob_chunk_tokens", "train.gradient_checkpointing",
    "train.report_to",
    "policy.device", "policy.vllm_memory", "policy.trust_remote_code", "policy.prefix_sharing", "policy.reuse_heads",
    "memory.overlap_reflection", "env.pool", "env.max_workers",
    "policy.warm_start",  # the folder may move; its checksum (policy.warm_start_sha256) may not change
    *(f"sft.{name}" for name in SftConfig.__dataclass_fields__),  # how a warm start is made: not read by train
})
"""Keys a ``--resume`` override may change (everything else must equal the run's ``config.yaml``)."""


def changed_keys(saved: Config, wanted: Config) -> list[str]:
    """Keys (``section.name``) whose values differ between two configs, outside :data:`RESUME_SAFE`."""
    old, new = flat_settings(saved.to_dict()), flat_settings(wanted.to_dict())
    return [k for k in sorted(set(old) | set(new)) if k not in RESUME_SAFE and old.get(k) != new.get(k)]


def check_same_run(saved: Config, wanted: Config, run_dir: Path) -> None:
    """Raise :class:`ConfigError` (exit 2) if the overrides of ``--resume run_dir`` change what the run is."""
    diff = changed_keys(saved, wanted)
    if not diff:
        return
    old, new = flat_settings(saved.to_dict()), flat_settings(wanted.to_dict())
    shown = ", ".join(f"{k}: {old.get(k)!r} -> {new.get(k)!r}" for k in diff[:4]) + (" …" if len(diff) > 4 else "")
    raise ConfigError(f"--resume {run_dir} would change what the run is ({shown}); a resume may change only output, "
                      "progress, evaluation and checkpoint cadence, train.iterations and speed or memory settings; "
                      "start a new run (another train.output_dir) for other settings")


def run_settings(cfg: Config) -> dict:
    """The settings that make a run what it is: every key outside :data:`RESUME_SAFE`."""
    return {k: v for k, v in flat_settings(cfg.to_dict()).items() if k not in RESUME_SAFE}


def settings_digest(cfg: Config) -> str:
    """sha256 of :func:`run_settings`, stored in each checkpoint's ``state.json`` (``settings_digest``)."""
    text = json.dumps(run_settings(cfg), sort_keys=True, default=str)
    return hashlib.sha256(text.encode()).hexdigest()


def check_checkpoint_settings(wanted: Config, run_dir: Path) -> None:
    """Raise :class:`ConfigError` (exit 2) when the run's newest readable checkpoint was trained with other settings
    than ``wanted`` (a ``config.yaml`` edited by hand since: G, the model, the tasks …). The checkpoint's
    ``settings_digest`` settles it; when the digests differ, the ``config`` it also stores names the keys, and keys
    only one side knows (a field added or removed by another empo2 version) do not count."""
    for folder in reversed(ckpt.list_checkpoints(run_dir)):
        try:
            state = json.loads((folder / ckpt.STATE).read_text(encoding="utf-8"))
        except (OSError, ValueError):  # unreadable or cut short: resume falls back past it too
            continue
        if not isinstance(state, dict) or "config" not in state and "settings_digest" not in state:
            continue  # written before checkpoints recorded their settings
        if state.get("settings_digest") == settings_digest(wanted):
            return
        stored, now = _stored_settings(state.get("config")), run_settings(wanted)
        diff = [k for k in sorted(now) if k in stored and _canonical(stored[k]) != _canonical(now[k])]
        if not diff and stored:
            return
        shown = ", ".join(f"{k}: {stored[k]!r} -> {now[k]!r}" for k in diff[:4]) + (" …" if len(diff) > 4 else "")
        raise ConfigError(f"{run_dir}/config.yaml no longer matches the settings {folder} was trained with "
                          f"({shown or 'settings digest differs'}); put the run's settings back, or start a new run "
                          "(another train.output_dir) for other settings")


def _stored_settings(config) -> dict:
    """A checkpoint's stored ``config`` flattened, renamed keys under their current names; ``{}`` when it is not a
    mapping of sections."""
    if not isinstance(config, dict) or not all(isinstance(v, dict) for v in config.values()):
        return {}
    return flat_settings(config)


def _canonical(value) -> str:
    return json.dumps(value, sort_keys=True, default=str)


# ------------------------------------------------------------------------------------------------------ memory
def memory_digest(path: Path) -> str | None:
    """A hash of every row of every table (read-only, WAL included); ``None`` if the file cannot be read. -wal/-shm
    files that only this read created are removed again (a checkpoint folder stays as it was written)."""
    sidecars = [Path(f"{path}{s}") for s in ("-wal", "-shm")]
    existed = [p.exists() for p in sidecars]
    try:
        return _digest(path)
    finally:
        for p, was in zip(sidecars, existed):
            if not was and p.exists() and (p.name.endswith("-shm") or p.stat().st_size == 0):
                p.unlink(missing_ok=True)


def _digest(path: Path) -> str | None:
    try:
        conn = sqlite3.connect(f"file:{quote(str(Path(path).resolve()))}?mode=ro", uri=True, timeout=30)
    except sqlite3.Error:
        return None
    digest = hashlib.sha256()
    try:
        conn.execute("BEGIN")  # one snapshot of all tables
        tables = [r[0] for r in conn.execute("SELECT name FROM sqlite_master WHERE type = 'table' ORDER BY name")]
        for table in tables:
            digest.update(table.encode())
            for row in conn.execute(f'SELECT * FROM "{table}" ORDER BY rowid'):
                digest.update(repr(row).encode())
    except sqlite3.Error:
        return None
    finally:
        conn.close()
    return digest.hexdigest()


def align_memory(run_dir: Path, checkpoint: Path | None, say, seed: str | None = None) -> None:
    """Make ``run_dir/memory.sqlite`` the memory saved with ``checkpoint`` (none: the run's start, empty or
    ``seed``) when the live one is missing or has moved on. The live one is kept as
    ``memory.sqlite.ahead-of-<checkpoint>``, and ``say`` gets one line."""
    live = Path(run_dir) / "memory.sqlite"
    saved = Path(checkpoint) / "memory.sqlite" if checkpoint is not None else (Path(seed) if seed else None)
    if saved is not None and not saved.is_file():
        return
    if live.is_file() and (memory_digest(live) == memory_digest(saved) if saved is not None else _empty(live)):
        return
    if live.is_file():
        backup = live.with_name(f"memory.sqlite.ahead-of-{Path(checkpoint).name if checkpoint else 'start'}")
        for suffix in ("", "-wal", "-shm"):  # the live file with its WAL, moved as one
            if live.with_name(live.name + suffix).exists():
                os.replace(live.with_name(live.name + suffix), backup.with_name(backup.name + suffix))
        say(f"[warning] {live} was ahead of {checkpoint or 'the run start'} (written by an iteration that did not "
            f"finish); resuming with the memory of that point, the live one is kept as {backup}")
    if saved is not None:
        tmp = live.with_name(".memory.sqlite.restoring")
        shutil.copyfile(saved, tmp)
        os.replace(tmp, live)


def _empty(path: Path) -> bool:
    try:
        conn = sqlite3.connect(f"file:{quote(str(Path(path).resolve()))}?mode=ro", uri=True, timeout=30)
        try:
            return conn.execute("SELECT COUNT(*) FROM tips").fetchone()[0] == 0
        finally:
            conn.close()
    except sqlite3.Error:
        return True  # not a readable memory: the store's own checks report it


# ------------------------------------------------------------------------------------------------------ samples
def truncate_samples(run_dir: Path, iteration: int) -> None:
    """Drop ``trajectories.jsonl`` lines of iterations after ``iteration`` (they are played again)."""
    path = Path(run_dir) / "trajectories.jsonl"
    if not path.is_file():
        return
    kept = []
    for line in path.read_text(encoding="utf-8", errors="replace").splitlines():
        try:
            if json.loads(line)["iteration"] <= iteration:
                kept.append(line + "\n")
        except (ValueError, KeyError, TypeError):  # a line cut by a kill
            continue
    tmp = path.with_name(".trajectories.jsonl.tmp")
    tmp.write_text("".join(kept), encoding="utf-8")
    os.replace(tmp, path)


# ------------------------------------------------------------------------------------------------- checkpoints
STATE_KEYS = ("iteration", "rng", "task_sampler", "mode_sampler", "novelty")
"""What a checkpoint's ``state.json`` must hold for a resume to restore it."""


def load_checkpoint(folder: Path, lora: bool) -> tuple[Path, dict, dict, dict]:
    """(folder, state, optimizer state, weights) of one checkpoint, all read (nothing executed); a sharded one's
    optimizer state and weights are ``None``: every rank reads its own shards into the sharded model.

    Raises for any damage: a file that differs from the checkpoint's manifest (checksums), a memory copy that fails
    the memory checks, a state without what a resume restores. A checkpoint of an older empo2 has no manifest; it
    is held to the other checks only."""
    verify_manifest(folder)
    state = ckpt.load_state(folder)  # an old pickled state is refused here, with how to convert it
    check_state(state, Path(folder))
    check_file(Path(folder) / "memory.sqlite")  # a missing copy (a run without memory) passes
    if sharding.is_sharded(folder):
        return folder, state, None, None
    return folder, state, ckpt.load_optimizer(folder), ckpt.read_weights(folder, lora)


def check_state(state: object, folder: Path) -> None:
    """Raise ``ValueError`` if ``state`` lacks a key of :data:`STATE_KEYS` or names another iteration than its
    folder."""
    if not isinstance(state, dict):
        raise ValueError("state.json does not hold a JSON object")
    missing = [key for key in STATE_KEYS if key not in state]
    if missing:
        raise ValueError(f"state.json lacks {', '.join(missing)}")
    if state["iteration"] != int(folder.name[len(ckpt.PREFIX):]):
        raise ValueError(f"state.json is of iteration {str(state['iteration'])[:20]}, not of {folder.name}")


def pick_checkpoint(run_dir: Path, lora: bool, say, dist) -> tuple[Path, dict, dict, dict] | None:
    """The newest checkpoint of ``run_dir`` that loads whole; one that does not (cut short, unreadable) is skipped
    with one warning line through ``say``. ``None`` when there is none; an old-format one stops the resume. Rank 0
    decides which one; the other ranks load that one."""
    found = ckpt.list_checkpoints(run_dir) if dist.is_main else []
    loaded = None
    for i in range(len(found) - 1, -1, -1):
        try:
            loaded = load_checkpoint(found[i], lora)
            break
        except ckpt.CheckpointError:
            raise
        except Exception as exc:  # noqa: BLE001 - whatever a cut or foreign file raises: try the one before
            reason = (str(exc).splitlines() or [""])[0][:160]
            then = f"resuming from {found[i - 1]}" if i else "no older checkpoint to resume from"
            say(f"[warning] checkpoint {found[i]} does not load ({type(exc).__name__}: {reason}); {then}")
    if found and loaded is None:
        raise ckpt.CheckpointError(f"no checkpoint in {Path(run_dir) / 'checkpoints'} loads; start again with "
                                   "--overwrite, or put back an intact checkpoint folder")
    chosen = dist.broadcast_object(loaded[0] if loaded else None)
    return loaded if dist.is_main or chosen is None else load_checkpoint(chosen, lora)
