"""The committed comparisons are their records: every summary in ``results/`` is recomputed from its ``scores.jsonl.gz``
alone (:func:`empo2.experiments.compare_summary.rebuild`), the evidence protocol's CIs also by hand in float64 from the
record's episode lines, and the README's lead table quotes the reach record's numbers, recomputed the same way.
``results/`` stays small.
"""

from __future__ import annotations

import gzip
import json
import math
import statistics
from collections import defaultdict
from pathlib import Path

import pytest

from empo2.experiments.compare_summary import rebuild
from helpers import tdist

ROOT = Path(__file__).resolve().parents[1]
RESULTS = ROOT / "results"
EVIDENCE = RESULTS / "evidence"
REACH = RESULTS / "reach"
MAX_BYTES, MAX_FILES = 3_000_000, 100
LOCAL_ONLY = ("runs", "logs")  # what .gitignore keeps out of results/: run folders and logs


def _committed(folder: Path) -> dict:
    return json.loads((folder / "summary.json").read_text())


def _episodes(folder: Path, phase: str) -> dict[tuple[str, int], list[tuple[float, bool]]]:
    """Each run's (score, success) per episode of one eval phase, from the record's lines alone."""
    episodes = defaultdict(list)
    for text in gzip.decompress((folder / "scores.jsonl.gz").read_bytes()).decode().splitlines():
        line = json.loads(text)
        if line["kind"] == "episode" and line["phase"] == phase:
            episodes[line["algo"], line["seed"]].append((float(line["score"]), bool(line["success"])))
    return episodes


def test_evidence_cis_are_recomputed_from_its_record(tmp_path):
    committed = _committed(EVIDENCE)
    rebuilt = rebuild(EVIDENCE, tmp_path, committed["algos"], committed["seeds"])
    assert rebuilt["stats"] == committed["stats"] and rebuilt["algorithms"] == committed["algorithms"]
    assert rebuilt["runs"] == committed["runs"]
    finals = {run: [x for x, _ in eps] for run, eps in _episodes(EVIDENCE, "final").items()}
    assert sorted(len(v) for v in finals.values()) == [40] * 21  # 40 held-out episodes per run: 3 arms × 5 + 2 × 3
    for algo, arm in committed["stats"]["arms"].items():  # float64 by hand: seed means, their mean and t interval
        per_seed = [statistics.fmean(finals[algo, s]) for s in arm["seeds"]]
        assert arm["score"]["mean"] == pytest.approx(statistics.fmean(per_seed), abs=1e-12)
        assert arm["score"]["ci"] == pytest.approx(tdist.mean_interval(per_seed), abs=1e-9)
    for pair in committed["stats"]["pairs"]:
        d = [statistics.fmean(finals[pair["b"], s]) - statistics.fmean(finals[pair["a"], s]) for s in pair["seeds"]]
        assert pair["diff_mean"] == pytest.approx(statistics.fmean(d), abs=1e-12)
        assert pair["ci"] == pytest.approx(tdist.mean_interval(d), abs=1e-9)


def test_the_readme_quotes_the_reach_record():
    """The README's lead table, each number recomputed in float64 from the reach record's episode lines."""
    start, final = _episodes(REACH, "start"), _episodes(REACH, "final")
    readme = (ROOT / "README.md").read_text()

    def fmt(x: float, form: str = ".1f") -> str:
        return f"{x:{form}}".replace("-", "−")

    def interval(values: list[float], form: str = ".1f", low: float = -math.inf, high: float = math.inf) -> str:
        lo, hi = tdist.mean_interval(values) if len(set(values)) > 1 else (values[0], values[0])
        return f"[{fmt(max(lo, low), form)}, {fmt(min(hi, high), form)}]"

    # the record's arm names as they ran then: its gigpo and proxmo had the novelty bonus, its ELPO the prefix defect
    labels = {"empo2": "EMPO²", "grpo-no-novelty": "GRPO", "gigpo": "GiGPO + novelty bonus", "luffy": "LUFFY",
              "proxmo": "ProxMO + novelty bonus", "grpo-novelty": "GRPO + novelty bonus",
              "empo2+luffy": "EMPO² + expert member", "elpo": "ELPO (branches scored without their prefix)"}
    for algo, label in labels.items():
        seeds = sorted(seed for a, seed in final if a == algo)
        assert len(seeds) >= 2, algo
        score = [statistics.fmean(x for x, _ in final[algo, k]) for k in seeds]
        success = [statistics.fmean(float(w) for _, w in final[algo, k]) for k in seeds]
        gain = [score[i] - statistics.fmean(x for x, _ in start[algo, k]) for i, k in enumerate(seeds)]
        won = sum(w for k in seeds for _, w in final[algo, k])
        row = (f"| {label} | {len(seeds)} | {statistics.fmean(success):.2f} {interval(success, '.2f', 0.0, 1.0)} | "
               f"{won} of {sum(len(final[algo, k]) for k in seeds)} | {fmt(statistics.fmean(score))} {interval(score)} | "
               f"{fmt(statistics.fmean(gain), '+.1f')} {interval(gain, '+.1f')} |")
        assert row in readme, row


@pytest.mark.parametrize("folder", sorted(p.parent.relative_to(RESULTS).as_posix()
                                          for p in RESULTS.rglob("summary.json")))
def test_every_committed_summary_is_its_record(folder, tmp_path):
    """Each summary from its own record; the ablations' from the evidence record, filtered to their arms and seeds."""
    committed = _committed(RESULTS / folder)
    record = RESULTS / folder if (RESULTS / folder / "scores.jsonl.gz").is_file() else (RESULTS / folder).parent
    rebuilt = rebuild(record, tmp_path, committed["algos"], committed["seeds"])
    assert rebuilt["stats"] == committed["stats"]
    assert [r["name"] for r in rebuilt["runs"]] == [r["name"] for r in committed["runs"]]


def test_results_stay_small():
    kept = [p for p in RESULTS.rglob("*") if p.is_file() and not set(LOCAL_ONLY) & set(p.relative_to(RESULTS).parts)
            and p.name not in ("console.log",) and not p.name.startswith("memory.sqlite")]
    assert len(kept) < MAX_FILES and sum(p.stat().st_size for p in kept) < MAX_BYTES


def test_a_plain_record_of_an_earlier_version_is_read_and_replaced_by_the_gzipped_one(tmp_path):
    """A comparison recorded before compression (plain ``scores.jsonl``) continues: it is read as it is, and the
    next write leaves only ``scores.jsonl.gz``, byte-identical for the same runs (no timestamp in the gzip header)."""
    from empo2.experiments import records

    runs = records.read(RESULTS / "webshop" / records.RECORD_FILE)
    plain = tmp_path / "scores.jsonl"
    plain.write_text("".join(json.dumps(line) + "\n" for r in runs.values() for line in records.to_lines(r)))
    target = tmp_path / records.RECORD_FILE
    assert records.read(target) == runs  # the name of the new file, the content of the old one
    records.write(target, list(runs.values()))
    assert not plain.exists() and records.read(target) == runs
    first = target.read_bytes()
    records.write(target, list(runs.values()))
    assert target.read_bytes() == first and first[:2] == b"\x1f\x8b"
    target.write_bytes(first[: len(first) // 2])  # a truncated copy: one line naming the file, nothing written
    with pytest.raises(records.ConfigError, match="scores.jsonl.gz cannot be read"):
        records.read(target)


def test_a_record_that_does_not_exist_is_an_error_unless_the_command_creates_it(tmp_path, capsys):
    """A mistyped record path is one line naming it (it read as a comparison of no runs); ``compare`` and ``merge``,
    which create the record, read none there; ``report --out`` of an existing file is one line, before any input is
    read, and the file is left as it was."""
    from empo2.cli import main
    from empo2.config import ConfigError
    from empo2.experiments import records

    missing = tmp_path / "cmp" / records.RECORD_FILE
    with pytest.raises(ConfigError, match=f"{missing} does not exist"):
        records.read(missing)
    assert records.read(missing, missing_ok=True) == {}
    runs = records.read(RESULTS / "webshop" / records.RECORD_FILE)
    missing.parent.mkdir()
    records.merge(missing, list(runs.values()))  # the first write of a comparison
    assert records.read(missing) == runs

    taken = tmp_path / "report.txt"
    taken.write_text("mine")
    assert main(["report", str(RESULTS / "webshop"), "--out", str(taken)]) == 2
    err = capsys.readouterr().err
    assert err == f"error: --out {taken} is a file; give a folder for report.md, report.json and the PNGs\n"
    assert taken.read_text() == "mine"
