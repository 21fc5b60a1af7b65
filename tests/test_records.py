"""The committed comparisons are their records: every summary in ``results/`` is recomputed from its ``scores.jsonl.gz``
alone (:func:`empo2.experiments.compare_summary.rebuild`), the evidence protocol's CIs also by hand in float64 from the
record's episode lines, and the README's results table quotes those numbers. ``results/`` stays small.
"""

from __future__ import annotations

import gzip
import json
import statistics
from collections import defaultdict
from pathlib import Path

import pytest

import tdist
from empo2.experiments.compare_summary import rebuild

ROOT = Path(__file__).resolve().parents[1]
RESULTS = ROOT / "results"
EVIDENCE = RESULTS / "evidence"
MAX_BYTES, MAX_FILES = 3_000_000, 100
LOCAL_ONLY = ("runs", "logs")  # what .gitignore keeps out of results/: run folders and logs


def _committed(folder: Path) -> dict:
    return json.loads((folder / "summary.json").read_text())


def _final_scores(folder: Path) -> dict[tuple[str, int], list[float]]:
    """Each run's final-eval episode scores, read from the record's lines without the code under test."""
    scores = defaultdict(list)
    for text in gzip.decompress((folder / "scores.jsonl.gz").read_bytes()).decode().splitlines():
        line = json.loads(text)
        if line["kind"] == "episode" and line["phase"] == "final":
            scores[line["algo"], line["seed"]].append(float(line["score"]))
    return scores


def test_evidence_cis_are_recomputed_from_its_record(tmp_path):
    committed = _committed(EVIDENCE)
    rebuilt = rebuild(EVIDENCE, tmp_path, committed["algos"], committed["seeds"])
    assert rebuilt["stats"] == committed["stats"] and rebuilt["algorithms"] == committed["algorithms"]
    assert rebuilt["runs"] == committed["runs"]
    finals = _final_scores(EVIDENCE)
    assert sorted(len(v) for v in finals.values()) == [40] * 21  # 40 held-out episodes per run: 3 arms × 5 + 2 × 3
    for algo, arm in committed["stats"]["arms"].items():  # float64 by hand: seed means, their mean and t interval
        per_seed = [statistics.fmean(finals[algo, s]) for s in arm["seeds"]]
        assert arm["score"]["mean"] == pytest.approx(statistics.fmean(per_seed), abs=1e-12)
        assert arm["score"]["ci"] == pytest.approx(tdist.mean_interval(per_seed), abs=1e-9)
    for pair in committed["stats"]["pairs"]:
        d = [statistics.fmean(finals[pair["b"], s]) - statistics.fmean(finals[pair["a"], s]) for s in pair["seeds"]]
        assert pair["diff_mean"] == pytest.approx(statistics.fmean(d), abs=1e-12)
        assert pair["ci"] == pytest.approx(tdist.mean_interval(d), abs=1e-9)


def test_the_readme_quotes_the_evidence_record():
    arms = _committed(EVIDENCE)["stats"]["arms"]
    readme = (ROOT / "README.md").read_text()

    def fmt(x: float, sign: str = "") -> str:
        return f"{x:{sign}.1f}".replace("-", "−")

    for label, algo in (("EMPO²", "empo2"), ("GRPO + novelty bonus", "grpo-novelty"), ("GRPO", "grpo-no-novelty")):
        s, g = arms[algo]["score"], arms[algo]["gain"]
        row = (f"| {label} | {s['n']} | {fmt(s['mean'] - g['diff_mean'])} | "  # mean start = mean final − mean gain
               f"{fmt(s['mean'])} [{fmt(s['ci'][0])}, {fmt(s['ci'][1])}] | "
               f"{fmt(g['diff_mean'], '+')} [{fmt(g['ci'][0], '+')}, {fmt(g['ci'][1], '+')}] |")
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
