"""A comparison's compact record, ``scores.jsonl.gz``: what its summary, curves and report are computed from.

``empo2 compare`` adds each finished run to ``OUT/scores.jsonl.gz``; a run recorded there with the comparison's settings
is skipped as finished, so a comparison moves to another machine (or into git) with this one file, and its run
folders (checkpoints, trajectories, tips, logs) can stay on the disk that made them, or be deleted.

Gzipped JSON lines (``zcat scores.jsonl.gz`` reads it), written with a fixed gzip timestamp so that the same runs
give the same bytes. A record written before compression, plain ``scores.jsonl``, is read as it is and replaced by the
compressed file on the next write. One JSON object per line; every line has ``kind``, ``run`` (``<arm>-seed<k>``), ``algo`` (the arm) and ``seed``:

- ``kind: run``, one per run: ``config`` (the run's whole config, as its ``config.yaml``), ``command`` (the comparison's
  ``--config`` file and overrides), ``folder`` (where the run folder was), ``machines`` (its ``machine.jsonl``) and
  ``evals``: per phase (``start``, ``final``) the eval result without its episodes (label, split, summary, per task …);
- ``kind: iteration``, one per training iteration: the run's ``metrics.jsonl`` row (env steps, train and periodic
  eval means, advantage, loss, memory, time);
- ``kind: episode``, one per evaluation episode: ``phase`` (``start`` or ``final``), ``env_steps`` (the run's
  environment steps when the eval was played: 0 at the start, the run's total at the end) and the episode as
  ``eval/<phase>.json`` stores it (``task``, ``variation``, ``score``, ``success``, ``steps`` …).

Tidy for a data frame: ``pandas.read_json(path, lines=True, compression="gzip").query("kind == 'episode'")`` is every episode's score.
"""

from __future__ import annotations

import gzip
import io
import json
from pathlib import Path
from typing import Any

import yaml

from empo2 import machine
from empo2.config import ConfigError
from empo2.rundir.metrics import read_metrics

RECORD_FILE = "scores.jsonl.gz"
PLAIN_RECORD_FILE = "scores.jsonl"
"""The uncompressed record of earlier versions, still read where no compressed one exists."""
PHASES = ("start", "final")
_KEYS = ("kind", "run", "algo", "seed")
_EPISODE_KEYS = (*_KEYS, "phase", "env_steps")


def from_folder(folder: Path, algo: str, seed: int, command: dict[str, Any]) -> dict[str, Any]:
    """The record of a finished run folder (``config.yaml``, ``eval/final.json``; ``metrics.jsonl``,
    ``machine.jsonl`` and ``eval/start.json`` when it has them)."""
    folder = Path(folder)
    evals = {}
    for phase in PHASES:
        path = folder / "eval" / f"{phase}.json"
        if path.is_file():
            evals[phase] = json.loads(path.read_text())
    return {"name": f"{algo}-seed{seed}", "algo": algo, "seed": seed, "folder": str(folder),
            "config": yaml.safe_load((folder / "config.yaml").read_text()) or {}, "command": command,
            "machines": machine.read(folder), "metrics": read_metrics(folder), "evals": evals}


def eval_result(record: dict[str, Any], phase: str) -> dict[str, Any] | None:
    """A run's ``eval/<phase>.json`` as the run wrote it (its episodes included), or ``None`` when it has none."""
    return record["evals"].get(phase)


def env_steps(record: dict[str, Any]) -> int:
    """The environment steps the run's training took (its last iteration's running total)."""
    return int(record["metrics"][-1].get("env_steps", 0)) if record["metrics"] else 0


def to_lines(record: dict[str, Any]) -> list[dict[str, Any]]:
    """One run's lines of ``scores.jsonl``."""
    head = {"run": record["name"], "algo": record["algo"], "seed": record["seed"]}
    evals = {phase: {k: v for k, v in result.items() if k != "episodes"} for phase, result in record["evals"].items()}
    lines = [{"kind": "run", **head, "folder": record["folder"], "command": record["command"],
              "config": record["config"], "machines": record["machines"], "evals": evals}]
    lines += [{"kind": "iteration", **head, **row} for row in record["metrics"]]
    steps = {"start": 0, "final": env_steps(record)}
    for phase, result in record["evals"].items():
        lines += [{"kind": "episode", **head, "phase": phase, "env_steps": steps[phase], **e}
                  for e in result.get("episodes", [])]
    return lines


def from_lines(lines: list[dict[str, Any]], source: str = RECORD_FILE) -> dict[str, dict[str, Any]]:
    """The runs of ``scores.jsonl``'s lines, by name, in the order of their ``run`` lines."""
    found: dict[str, dict[str, Any]] = {}
    for n, line in enumerate(lines, 1):
        kind, name = line.get("kind"), line.get("run")
        if kind == "run":
            evals = {phase: {**meta, "episodes": []} for phase, meta in line.get("evals", {}).items()}
            found[name] = {"name": name, "algo": line["algo"], "seed": int(line["seed"]), "folder": line.get("folder"),
                           "command": line.get("command") or {}, "config": line.get("config") or {},
                           "machines": line.get("machines", []), "metrics": [], "evals": evals}
        elif name not in found or kind not in ("iteration", "episode"):
            raise ConfigError(f"{source} line {n}: a {kind!r} line of run {name!r} before that run's 'run' line")
        elif kind == "iteration":
            found[name]["metrics"].append({k: v for k, v in line.items() if k not in _KEYS})
        else:
            episode = {k: v for k, v in line.items() if k not in _EPISODE_KEYS}
            found[name]["evals"].setdefault(line["phase"], {"episodes": []})["episodes"].append(episode)
    return found


def source(path: Path) -> Path:
    """The file that holds the record ``path`` names: ``path`` itself, or the plain ``scores.jsonl`` beside it when only
    that one exists."""
    path = Path(path)
    plain = path.with_name(PLAIN_RECORD_FILE)
    return plain if path.name == RECORD_FILE and not path.exists() and plain.is_file() else path


def read_lines(path: Path, missing_ok: bool = False) -> list[str]:
    """The text lines of the record ``path`` names (gzipped or plain, see :func:`source`). A record that does not
    exist is an error naming the path, or no lines with ``missing_ok`` (a command that creates it)."""
    path = source(path)
    if not path.exists() and missing_ok:
        return []
    if not path.is_file():
        what = "does not exist" if not path.exists() else "is not a file"
        raise ConfigError(f"{path} {what} (a comparison's record, {RECORD_FILE}); check the path")
    data = path.read_bytes()
    try:
        text = gzip.decompress(data).decode() if data[:2] == b"\x1f\x8b" else data.decode()
    except (OSError, EOFError, UnicodeDecodeError) as e:
        raise ConfigError(f"{path} cannot be read ({e}); restore the file (it is the comparison's record)") from None
    return text.splitlines()


def read(path: Path, missing_ok: bool = False) -> dict[str, dict[str, Any]]:
    """The runs ``path`` records; a damaged line is one clear error naming it, and so is a path that does not exist
    unless ``missing_ok`` (a command that creates the record reads none there)."""
    lines = []
    for n, text in enumerate(read_lines(path, missing_ok), 1):
        if not text.strip():
            continue
        try:
            lines.append(json.loads(text))
        except ValueError:
            raise ConfigError(f"{source(path)} line {n} is not JSON; restore the file (it is the comparison's "
                              "record)") from None
    return from_lines(lines, str(source(path)))


def write(path: Path, records: list[dict[str, Any]]) -> None:
    """Write ``records`` (in that order) as ``path``, gzipped when its name ends in ``.gz``, through a temporary file
    so a crash leaves the old one; a plain record of an earlier version beside it is then removed."""
    path = Path(path)
    text = "".join(json.dumps(line, ensure_ascii=False, separators=(",", ":")) + "\n"
                   for r in records for line in to_lines(r)).encode()
    if path.suffix == ".gz":
        buffer = io.BytesIO()
        with gzip.GzipFile(filename="", mode="wb", fileobj=buffer, mtime=0) as f:
            f.write(text)
        text = buffer.getvalue()
    tmp = path.with_name(path.name + ".tmp")
    tmp.write_bytes(text)
    tmp.replace(path)
    plain = path.with_name(PLAIN_RECORD_FILE)
    if path.name == RECORD_FILE and plain.is_file():
        plain.unlink()


def merge(path: Path, records: list[dict[str, Any]]) -> None:
    """Put ``records`` into ``path``: a run already there is replaced, the others are kept (a run left out of this
    summary for its settings stays recorded, for the command that has them)."""
    kept = read(path, missing_ok=True)
    kept.update({r["name"]: r for r in records})
    write(path, list(kept.values()))
