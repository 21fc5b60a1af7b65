"""Experiment trackers (``train.report_to``): TensorBoard, Weights & Biases and MLflow hold the scalars of
``metrics.jsonl``, each package is imported only when named, and bad or missing trackers stop a run in one line.

W&B runs offline (``WANDB_MODE=offline``), as on CI; its run is read back from its ``.wandb`` transaction log, whose
framing (LevelDB's log format behind a 7-byte W&B header) is decoded here because the installed wandb ships no Python
reader. MLflow is not a test dependency: its test runs where ``mlflow`` is importable and is skipped (untested)
elsewhere."""

from __future__ import annotations

import json
import math
import struct
import subprocess
import sys
import time
from pathlib import Path

import pytest

from empo2.cli import main

WEBSHOP = ["--config", "configs/webshop_cpu.yaml", "--algo", "grpo", "train.iterations=2", "env.max_steps=2",
           "env.eval_variations=1", "algo.num_generations=2", "policy.max_completion_length=8", "train.progress=false"]


def _expected(run: Path) -> dict[str, list[tuple[int, float]]]:
    """Every finite number (not a bool) of ``metrics.jsonl`` by its slash-joined path, as (iteration, value)."""
    out: dict[str, list[tuple[int, float]]] = {}

    def walk(step: int, prefix: str, value) -> None:
        if isinstance(value, dict):
            for key, inner in value.items():
                walk(step, f"{prefix}{key}/", inner)
        elif isinstance(value, (int, float)) and not isinstance(value, bool) and math.isfinite(value):
            out.setdefault(prefix[:-1], []).append((step, float(value)))

    for line in (run / "metrics.jsonl").read_text().splitlines():
        record = json.loads(line)
        walk(record["iteration"], "", record)
    return out


def _tensorboard(run: Path) -> dict[str, list[tuple[int, float]]]:
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    events = EventAccumulator(str(run / "tb"), size_guidance={"scalars": 0})
    events.Reload()
    return {tag: [(e.step, e.value) for e in events.Scalars(tag)] for tag in events.Tags()["scalars"]}


def _wandb_records(path: Path):
    """The protobuf records of a ``.wandb`` file: a header ``<4sHB`` (":W&B", 0xBEE1, version), then LevelDB log
    blocks of 32 KiB, each record chunk behind ``<IHB`` (crc32c, length, type: 1 full, 2 first, 3 middle, 4 last)."""
    from wandb.proto import wandb_internal_pb2

    data = path.read_bytes()
    ident, magic, _ = struct.unpack("<4sHB", data[:7])
    assert (ident, magic) == (b":W&B", 0xBEE1)
    block, pos, pending = 32768, 7, b""
    while pos + 7 <= len(data):
        room = block - pos % block
        _, length, kind = struct.unpack("<IHB", data[pos:pos + 7])
        if room < 7 or (kind == 0 and length == 0):  # the rest of a block is zero padding
            pos += room
            continue
        pending += data[pos + 7: pos + 7 + length]
        pos += 7 + length
        if kind in (1, 4):
            record = wandb_internal_pb2.Record()
            record.ParseFromString(pending)
            yield record
            pending = b""


def _wandb(run: Path) -> tuple[dict[str, list[tuple[int, float]]], dict]:
    """(history scalars without W&B's own ``_step``/``_runtime``/``_timestamp``, the run's config)."""
    [path] = run.glob("wandb/offline-run-*/run-*.wandb")
    history: dict[str, list[tuple[int, float]]] = {}
    config: dict = {}
    for record in _wandb_records(path):
        kind = record.WhichOneof("record_type")
        if kind == "history":
            for item in record.history.item:
                key = item.key or "/".join(item.nested_key)
                if not key.startswith("_"):
                    history.setdefault(key, []).append((record.history.step.num, json.loads(item.value_json)))
        elif kind == "run":
            config = {item.key: json.loads(item.value_json) for item in record.run.config.update}
    return history, config


def _same(got: dict, want: dict, rel: float) -> None:
    assert sorted(got) == sorted(want)
    for key, points in want.items():
        assert [s for s, _ in got[key]] == [s for s, _ in points], key
        assert [v for _, v in got[key]] == pytest.approx([v for _, v in points], rel=rel, abs=1e-30), key


@pytest.mark.slow
def test_tensorboard_and_wandb_hold_the_scalars_of_metrics_jsonl(tmp_path, tiny_model, monkeypatch):
    pytest.importorskip("wandb", reason="wandb is a test extra (pip install -e '.[dev]')")
    monkeypatch.setenv("WANDB_MODE", "offline")
    monkeypatch.setenv("WANDB_SILENT", "true")
    run = tmp_path / "tracked"
    assert main(["train", *WEBSHOP, f"train.output_dir={run}", f"policy.model={tiny_model}",
                 "train.report_to=[tensorboard, wandb]"]) == 0
    want = _expected(run)
    assert {"loss/rows", "train/score_mean", "advantage/groups"} <= set(want) and len(want["loss/rows"]) == 2
    _same(_tensorboard(run), want, rel=1e-6)  # TensorBoard stores float32
    history, config = _wandb(run)
    _same(history, want, rel=1e-12)
    assert config["train"]["report_to"] == ["tensorboard", "wandb"]  # the run's config travels with it


def test_a_resumed_run_continues_its_wandb_run_unless_it_replays_iterations(tmp_path, monkeypatch):
    wandb = pytest.importorskip("wandb", reason="wandb is a test extra (pip install -e '.[dev]')")
    from empo2.rundir.metrics import MetricsLog
    from empo2.rundir.runlock import clear_run_folder, mark_run_folder

    monkeypatch.setenv("WANDB_MODE", "offline")
    monkeypatch.setenv("WANDB_SILENT", "true")
    run = tmp_path / "run"
    run.mkdir()
    mark_run_folder(run)  # as `train` does: the run's marker names wandb/ as the run's

    def process(iteration: int, kept_through: int | None = None) -> str:
        """A training process (a resume from the checkpoint of ``kept_through``) logging one iteration: the id of
        the W&B run it wrote to."""
        time.sleep(1.1)  # W&B names an offline run's folder by the second it started
        log = MetricsLog(run, ["wandb"], {}, kept_through)
        log.log({"iteration": iteration, "train": {"score_mean": float(iteration)}})
        log.close()
        wandb.teardown()  # what the process's exit does: the W&B service writes out what it holds
        newest = max(run.glob("wandb/offline-run-*/run-*.wandb"), key=lambda p: p.stat().st_mtime)
        [run_id] = {r.run.run_id for r in _wandb_records(newest) if r.WhichOneof("record_type") == "run"}
        return run_id

    first = process(0)
    assert process(1, kept_through=0) == first  # killed after checkpoint 0's iteration: the same W&B run goes on
    replayed = process(1, kept_through=0)  # killed after logging iteration 1, before its checkpoint: 1 is played again
    assert replayed != first  # W&B would drop a step below its run's last
    assert [json.loads(line)["iteration"] for line in (run / "metrics.jsonl").read_text().splitlines()] == [0, 1]
    assert process(2, kept_through=1) == replayed
    clear_run_folder(run)  # train --overwrite
    assert not (run / "wandb").exists()
    assert process(0) not in {first, replayed}


def test_mlflow_holds_the_same_scalars_as_tensorboard(tmp_path, monkeypatch):
    mlflow = pytest.importorskip("mlflow", reason="mlflow is optional and not installed: untested here")
    from empo2.rundir.metrics import MetricsLog

    run = tmp_path / "run"
    run.mkdir()
    monkeypatch.setenv("MLFLOW_TRACKING_URI", (run / "mlruns").as_uri())
    monkeypatch.setenv("MLFLOW_ALLOW_FILE_STORE", "true")  # a database store needs sqlalchemy, not in mlflow-skinny
    log = MetricsLog(run, ["tensorboard", "mlflow"], {"train": {"seed": 0}})
    records = [{"iteration": i, "loss": {"rows": 3 + i, "loss_on_tips": 0.25 * i - 1.0, "skipped": float("nan")},
                "train": {"score_mean": 12.5 * i, "done": True}, "modes": ["on_tips"]} for i in range(3)]
    for record in records:
        log.log(record)
    log.close()
    want = {"iteration": [(i, float(i)) for i in range(3)], "loss/rows": [(i, 3.0 + i) for i in range(3)],
            "loss/loss_on_tips": [(i, 0.25 * i - 1.0) for i in range(3)],
            "train/score_mean": [(i, 12.5 * i) for i in range(3)]}  # NaN, bools and lists are no scalars
    _same(_tensorboard(run), want, rel=1e-6)
    client = mlflow.tracking.MlflowClient((run / "mlruns").as_uri())
    [found] = client.search_runs([client.get_experiment_by_name("empo2").experiment_id])
    got = {key: [(m.step, m.value) for m in sorted(client.get_metric_history(found.info.run_id, key),
                                                     key=lambda m: m.step)] for key in found.data.metrics}
    _same(got, want, rel=1e-12)



def test_a_resumed_run_continues_its_mlflow_run_unless_it_replays_iterations(tmp_path, monkeypatch):
    mlflow = pytest.importorskip("mlflow", reason="mlflow is optional and not installed: untested here")
    from empo2.rundir.metrics import MetricsLog
    from empo2.rundir.runlock import clear_run_folder

    run = tmp_path / "run"
    run.mkdir()
    store = (tmp_path / "mlruns").as_uri()
    monkeypatch.setenv("MLFLOW_TRACKING_URI", store)
    monkeypatch.setenv("MLFLOW_ALLOW_FILE_STORE", "true")

    def process(iteration: int, kept_through: int | None = None, seed: int = 0) -> str:
        """A training process (a resume from the checkpoint of ``kept_through``, a fresh run for None) logging one
        iteration: the id of the MLflow run it wrote to."""
        log = MetricsLog(run, ["mlflow"], {"train": {"seed": seed}}, kept_through)
        log.log({"iteration": iteration, "train": {"score_mean": float(iteration)}})
        log.close()
        return (run / "mlflow-run-id").read_text().strip()

    first = process(0)
    assert process(1, kept_through=0) == first  # killed after checkpoint 0's iteration: the same MLflow run goes on
    client = mlflow.tracking.MlflowClient(store)
    assert [(m.step, m.value) for m in client.get_metric_history(first, "train/score_mean")] == [(0, 0.0), (1, 1.0)]
    replayed = process(1, kept_through=0)  # killed after logging iteration 1, before its checkpoint: 1 is played again
    assert replayed != first
    assert process(2, kept_through=1, seed=5) == replayed
    config = Path(client.download_artifacts(replayed, "config.json", str(tmp_path)))
    assert json.loads(config.read_text()) == {"train": {"seed": 5}}  # the resume's config, not the first one's
    assert process(0) not in {first, replayed}  # a fresh run never continues a run an old id file names
    (run / "mlflow-run-id").write_text("\n")
    blank = process(1, kept_through=0)  # a blank id file is no id: a new run
    assert blank not in {first, replayed} and (run / "mlflow-run-id").read_text().strip() == blank
    monkeypatch.setenv("MLFLOW_TRACKING_URI", (tmp_path / "elsewhere").as_uri())
    assert process(2, kept_through=1) not in {first, replayed, blank}  # the kept id is not in this store: no crash
    clear_run_folder(run)  # train --overwrite
    assert not (run / "mlflow-run-id").exists()

def test_trackers_are_imported_only_when_named(tmp_path):
    """A fresh interpreter: the default config writes TensorBoard events and imports neither wandb nor mlflow;
    ``none`` and the old ``train.tensorboard=false`` (read as ``report_to`` without it) write no events."""
    script = """
import sys
from pathlib import Path
from empo2.config import Config
from empo2.rundir.metrics import MetricsLog, check_trackers, trackers
for name, overrides in (("default", []), ("none", ["train.report_to=none"]), ("off", ["train.tensorboard=false"])):
    cfg = Config.load(None, overrides)
    check_trackers(cfg.train)
    run = Path(sys.argv[1]) / name
    run.mkdir()
    log = MetricsLog(run, trackers(cfg.train))
    log.log({"iteration": 0, "loss": {"rows": 1}})
    log.close()
    print(name, trackers(cfg.train), sorted(p.name for p in run.iterdir()))
print(sorted(m for m in ("wandb", "mlflow") if m in sys.modules))
"""
    out = subprocess.run([sys.executable, "-c", script, str(tmp_path)], capture_output=True, text=True, check=True)
    assert out.stdout.splitlines() == ["default ['tensorboard'] ['metrics.jsonl', 'tb']", "none [] ['metrics.jsonl']",
                                       "off [] ['metrics.jsonl']", "[]"]
    assert list((tmp_path / "default" / "tb").glob("events.*"))


@pytest.mark.parametrize("value", ["comet", "[none, wandb]", "[]", "[tensorboard, tensorbord]"])
def test_unknown_tracker_is_one_line_and_writes_nothing(tmp_path, capsys, value):
    run = tmp_path / "run"
    assert main(["train", f"train.output_dir={run}", f"train.report_to={value}"]) == 2
    err = capsys.readouterr().err
    assert "train.report_to must name tensorboard, wandb or mlflow" in err and err.count("\n") == 1
    assert not run.exists()


def test_missing_tracker_package_is_one_line_and_writes_nothing(tmp_path, capsys, monkeypatch, tiny_model):
    """``None`` in ``sys.modules`` makes ``import wandb`` fail as an uninstalled package does."""
    monkeypatch.setitem(sys.modules, "wandb", None)
    run = tmp_path / "run"
    assert main(["train", f"train.output_dir={run}", f"policy.model={tiny_model}", "train.report_to=wandb"]) == 2
    err = capsys.readouterr().err
    assert "train.report_to=wandb needs the wandb package: pip install wandb" in err and err.count("\n") == 1
    assert not run.exists()
