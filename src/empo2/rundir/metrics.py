"""Run observability: ``metrics.jsonl`` (one line per iteration), the experiment trackers of ``train.report_to``
(TensorBoard, Weights & Biases, MLflow; each imported only when chosen), and PNG plots at the end."""

from __future__ import annotations

import importlib
import json
import logging
import math
import os
import resource
import uuid
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from empo2.config import ConfigError

log = logging.getLogger(__name__)

TRACKER_PACKAGES = {"tensorboard": "torch.utils.tensorboard", "wandb": "wandb", "mlflow": "mlflow"}
"""The module each tracker imports; ``pip install NAME`` installs it (torch.utils.tensorboard needs tensorboard)."""


def trackers(train) -> list[str]:
    """The trackers a run writes to: ``train.report_to`` without ``none``."""
    return [name for name in train.report_to if name != "none"]


def check_trackers(train) -> None:
    """Import each chosen tracker's package now, before the run writes anything: a missing one is one line."""
    for name in trackers(train):
        try:
            importlib.import_module(TRACKER_PACKAGES[name])
        except ImportError:
            raise ConfigError(f"train.report_to={name} needs the {name} package: pip install {name}") from None


class MetricsLog:
    """Appends each iteration's record to ``metrics.jsonl`` and its finite numeric leaves (``loss/rows``, …) to
    every tracker, at step = iteration, so all trackers hold the same scalars."""

    def __init__(self, run_dir: Path, report_to: Sequence[str] = ("tensorboard",), config: dict | None = None,
                 kept_through: int | None = None):
        """``kept_through``: on a resume, the checkpoint's iteration (−1 for none); the lines of later iterations
        are dropped, since the run plays them again, and a W&B run that holds them is not continued."""
        run_dir = Path(run_dir)
        self.path = run_dir / "metrics.jsonl"
        # a tracker run is continued only by a resume that plays no logged iteration again
        new_run = kept_through is None or self.truncate_after(kept_through)
        opened = {"tensorboard": _TensorBoard, "wandb": lambda d, c: _WandB(d, c, new_run=new_run),
                  "mlflow": lambda d, c: _MLflow(d, c, new_run=new_run)}
        self.trackers = [opened[name](run_dir, config or {}) for name in report_to]

    def truncate_after(self, iteration: int) -> bool:
        """Drop lines of iterations after ``iteration`` (a run killed after logging but before its checkpoint);
        whether any was dropped."""
        if not self.path.is_file():
            return False
        lines = [line for line in self.path.read_text().splitlines() if line.strip()]
        kept = [line for line in lines if _safe_iter(line) <= iteration]
        self.path.write_text("".join(line + "\n" for line in kept))
        return len(kept) < len(lines)

    def log(self, record: dict[str, Any]) -> None:
        with open(self.path, "a") as fh:
            fh.write(json.dumps(record, default=_jsonable) + "\n")
            fh.flush()
        values = scalars(record)
        for tracker in self.trackers:
            tracker.log(values, int(record["iteration"]))

    def close(self) -> None:
        for tracker in self.trackers:
            tracker.close()


def scalars(record: dict[str, Any]) -> dict[str, float]:
    """The record's finite numbers (not bools), named by their path: ``{"loss": {"rows": 3}}`` → ``loss/rows``."""
    return {key: value for key, value in _flatten(record).items()
            if isinstance(value, (int, float)) and not isinstance(value, bool) and math.isfinite(value)}


class _TensorBoard:
    def __init__(self, run_dir: Path, config: dict):
        from torch.utils.tensorboard import SummaryWriter

        self.writer = SummaryWriter(str(run_dir / "tb"))

    def log(self, values: dict[str, float], step: int) -> None:
        for key, value in values.items():
            self.writer.add_scalar(key, value, step)
        self.writer.flush()

    def close(self) -> None:
        self.writer.close()


class _WandB:
    """One W&B run per run folder, its files under ``RUN/wandb``: a resumed run continues the W&B run its last
    process opened (the id kept in ``RUN/wandb/run-id``), unless it plays logged iterations again (``new_run``):
    W&B ignores a step below its run's last, so those are logged to a new W&B run. ``WANDB_MODE=offline`` keeps it
    local (``wandb sync`` uploads it later) and ``WANDB_PROJECT`` names the project (default ``empo2``)."""

    def __init__(self, run_dir: Path, config: dict, new_run: bool = False):
        import wandb

        id_file = run_dir / "wandb" / "run-id"
        run_id = (None if new_run else _kept_id(id_file)) or uuid.uuid4().hex[:16]
        id_file.parent.mkdir(exist_ok=True)
        id_file.write_text(run_id + "\n")
        self.run = wandb.init(project=os.environ.get("WANDB_PROJECT", "empo2"), name=run_dir.name,
                              dir=str(run_dir), config=config, id=run_id, resume="allow")

    def log(self, values: dict[str, float], step: int) -> None:
        self.run.log(values, step=step)

    def close(self) -> None:
        self.run.finish()


class _MLflow:
    """One MLflow run per run folder in experiment ``MLFLOW_EXPERIMENT_NAME`` (default ``empo2``), in the store or
    server that MLflow's own settings name (``MLFLOW_TRACKING_URI``), as TRL and Hugging Face's MLflow callback leave
    it. A resumed run continues the MLflow run its last process opened (the id kept in ``RUN/mlflow-run-id``), unless
    it plays logged iterations again (``new_run``: MLflow would hold two values at their steps) or that run is not in
    the store the settings name now."""

    def __init__(self, run_dir: Path, config: dict, new_run: bool = False):
        import mlflow
        from mlflow.exceptions import MlflowException

        self.mlflow = mlflow
        id_file = run_dir / "mlflow-run-id"
        mlflow.set_experiment(os.environ.get("MLFLOW_EXPERIMENT_NAME", "empo2"))
        self.run, kept = None, None if new_run else _kept_id(id_file)
        if kept:
            try:
                self.run = mlflow.start_run(run_id=kept)
            except MlflowException as exc:
                log.warning("MLflow run %s not found (%s); logging to a new one", kept, exc)
        if self.run is None:
            self.run = mlflow.start_run(run_name=run_dir.name)
        mlflow.log_dict(config, "config.json")  # a resume may change the config: the run keeps the one in use
        id_file.write_text(self.run.info.run_id + "\n")

    def log(self, values: dict[str, float], step: int) -> None:
        self.mlflow.log_metrics(values, step=step)

    def close(self) -> None:
        self.mlflow.end_run()


def _kept_id(id_file: Path) -> str | None:
    """The tracker run id a run folder kept; None when there is none (a missing or blank file)."""
    return (id_file.read_text().strip() or None) if id_file.is_file() else None


def read_metrics(run_dir: Path) -> list[dict[str, Any]]:
    path = Path(run_dir) / "metrics.jsonl"
    if not path.is_file():
        return []
    return [json.loads(line) for line in path.read_text().splitlines() if line.strip()]


def _safe_iter(line: str) -> int:
    try:
        return int(json.loads(line)["iteration"])
    except (ValueError, KeyError, TypeError):
        return 1 << 30  # an unreadable (half-written) line is dropped


def _jsonable(value: Any) -> Any:
    if hasattr(value, "item"):
        return value.item()
    return str(value)


def _flatten(record: dict[str, Any], prefix: str = "") -> dict[str, Any]:
    flat: dict[str, Any] = {}
    for key, value in record.items():
        name = f"{prefix}{key}"
        if isinstance(value, dict):
            flat.update(_flatten(value, name + "/"))
        else:
            flat[name] = value
    return flat


def plot_run(run_dir: Path) -> list[Path]:
    """Write ``scores.png`` (train/eval score vs iteration), ``modes.png`` and ``memory.png``; returns the paths."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    rows = read_metrics(run_dir)
    if not rows:
        return []
    its = [r["iteration"] for r in rows]

    def figure(height: float):
        return plt.subplots(figsize=(6, height))

    def save(fig, ax, name: str, ylabel: str, grid: bool = True) -> Path:
        ax.set_xlabel("iteration")
        ax.set_ylabel(ylabel)
        if grid:
            ax.grid(alpha=0.3)
        ax.legend()
        fig.tight_layout()
        path = Path(run_dir) / name
        fig.savefig(path, dpi=110)
        plt.close(fig)
        return path

    fig, ax = figure(3.5)
    ax.plot(its, [r["train"]["score_mean"] for r in rows], marker="o", label="train score (mean)")
    evals = [(r["iteration"], r["eval"]["score_mean"]) for r in rows if r.get("eval")]
    final = Path(run_dir) / "eval" / "final.json"
    if final.is_file():  # the end-of-run evaluation, drawn at the last iteration
        evals.append((its[-1], json.loads(final.read_text())["summary"]["score_mean"]))
    if evals:
        ax.plot(*zip(*evals), marker="s", label="eval score, no memory")
    out = [save(fig, ax, "scores.png", "score")]

    fig, ax = figure(3)
    bottom = [0] * len(rows)
    for mode in ("on", "on_tips", "off_tips"):
        counts = [r["mode_counts"].get(mode, 0) for r in rows]
        ax.bar(its, counts, bottom=bottom, label=mode)
        bottom = [b + c for b, c in zip(bottom, counts)]
    out.append(save(fig, ax, "modes.png", "groups", grid=False))

    fig, ax = figure(3)
    ax.plot(its, [r["memory"]["size"] for r in rows], marker="o", label="tips in memory")
    ax.plot(its, [r["memory"]["added"] for r in rows], marker=".", label="added this iteration")
    out.append(save(fig, ax, "memory.png", "tips"))
    return out


def iteration_line(r: dict[str, Any]) -> str:
    """One console line per iteration (kept on one line in logs too)."""
    line = (f"iter {r['iteration']:>3} | modes {','.join(sorted(set(r['modes'])))} | "
            f"score {r['train']['score_mean']:6.1f} | success {r['train']['success_rate']:.2f} | "
            f"acted {r['train']['accepted_rate']:.0%} | "
            f"memory {r['memory']['size']:>4} (+{r['memory']['added']}) | "
            f"zero-adv groups {r['advantage']['zero_adv_groups']:.0f}/{r['advantage']['groups']:.0f} | "
            f"rollout {r['time']['rollout']:.0f}s update {r['time']['update']:.0f}s")
    if r.get("expert"):
        line += f" | expert kept {r['expert']['kept']}/{r['expert']['slots']}, {r['expert']['rows']} rows"
    if r.get("eval"):
        line += f" | eval {r['eval']['score_mean']:.1f}"
    return line


def reset_peak_rss() -> None:
    """Restart the kernel's peak-RSS counter (Linux) so ``peak_rss_gb`` measures one iteration."""
    try:
        Path("/proc/self/clear_refs").write_text("5")
    except OSError:
        pass  # not Linux / not permitted: peak_rss_gb reports the process-lifetime peak


def peak_rss_gb() -> float:
    """Peak resident memory since the last ``reset_peak_rss`` (VmHWM), else the process-lifetime peak, in GB."""
    try:
        for line in Path("/proc/self/status").read_text().splitlines():
            if line.startswith("VmHWM:"):
                return int(line.split()[1]) * 1024 / 1e9
    except OSError:
        pass
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024 / 1e9  # Linux reports KiB
