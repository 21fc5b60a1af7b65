"""The committed comparisons in ``records/results/`` are their records: every ``summary.json`` is recomputed from its
``scores.jsonl.gz`` alone (:func:`empo2.experiments.compare_summary.rebuild`), the evidence and reach protocols' CIs
also by hand in float64 from the record's episode lines; every ``summary.md`` shows its ``summary.json`` and every OOD
cell's ``adapt.md`` its ``adapt.json``. The README's lead table is the reach summary's numbers. ``records/results/``
stays small.
"""

from __future__ import annotations

import gzip
import json
import statistics
from collections import defaultdict
from pathlib import Path

import pytest

from empo2.experiments import stats
from empo2.experiments.adapt import adaptation_markdown
from empo2.experiments.compare_summary import rebuild
from helpers import tdist

ROOT = Path(__file__).resolve().parents[1]
RECORDS = ROOT / "records"
RESULTS = RECORDS / "results"
EVIDENCE = RESULTS / "evidence"
REACH = RESULTS / "reach"
SUMMARIES = sorted(p.parent.relative_to(RESULTS).as_posix() for p in RESULTS.rglob("summary.json"))
OOD_CELLS = sorted(p.parent.name for p in (RESULTS / "ood").glob("*/adapt.json"))
MAX_BYTES, MAX_FILES = 3_000_000, 100
LOCAL_ONLY = ("runs", "logs")  # what .gitignore keeps out of records/results/: run folders and logs


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


def _by_hand(values: list[float], low: float = -float("inf"), high: float = float("inf")) -> tuple[float, float]:
    """The 95% t interval of a mean in float64, clipped to the metric's range; a point where all values agree."""
    lo, hi = tdist.mean_interval(values) if len(set(values)) > 1 else (values[0], values[0])
    return max(lo, low), min(hi, high)


def test_evidence_summary_is_its_record_in_full(tmp_path):
    """The evidence record rebuilt: statistics, per-arm curves and every run's row, 40 held-out episodes a run."""
    committed = _committed(EVIDENCE)
    rebuilt = rebuild(EVIDENCE, tmp_path, committed["algos"], committed["seeds"])
    assert rebuilt["stats"] == committed["stats"] and rebuilt["algorithms"] == committed["algorithms"]
    assert rebuilt["runs"] == committed["runs"]
    finals = _episodes(EVIDENCE, "final")
    assert sorted(len(v) for v in finals.values()) == [40] * 21  # 3 arms × 5 seeds + 2 × 3


@pytest.mark.parametrize("folder", [EVIDENCE, REACH], ids=["evidence", "reach"])
def test_the_summary_cis_are_recomputed_by_hand_from_the_record(folder):
    """Per arm: seed means of score and success, their mean and t interval, final − start per seed; per pair the
    paired differences of the final score; episodes won and played; all in float64 from the episode lines."""
    committed = _committed(folder)
    start, final = _episodes(folder, "start"), _episodes(folder, "final")
    runs = {(r["algo"], r["seed"]): r for r in committed["runs"]}
    for algo, arm in committed["stats"]["arms"].items():
        score = [statistics.fmean(x for x, _ in final[algo, s]) for s in arm["seeds"]]
        success = [statistics.fmean(float(w) for _, w in final[algo, s]) for s in arm["seeds"]]
        assert arm["score"]["mean"] == pytest.approx(statistics.fmean(score), abs=1e-12)
        assert arm["score"]["ci"] == pytest.approx(_by_hand(score), abs=1e-9)
        assert arm["success"]["mean"] == pytest.approx(statistics.fmean(success), abs=1e-12)
        assert arm["success"]["ci"] == pytest.approx(_by_hand(success, 0.0, 1.0), abs=1e-9)
        if arm["gain"] is not None:
            gain = [score[i] - statistics.fmean(x for x, _ in start[algo, s]) for i, s in enumerate(arm["seeds"])]
            assert arm["gain"]["diff_mean"] == pytest.approx(statistics.fmean(gain), abs=1e-12)
            assert arm["gain"]["ci"] == pytest.approx(_by_hand(gain), abs=1e-9)
        for s in arm["seeds"]:
            assert len(runs[algo, s]["episodes"]) == len(final[algo, s])
            assert round(runs[algo, s]["success"] * len(final[algo, s])) == sum(w for _, w in final[algo, s])
    for pair in committed["stats"]["pairs"]:
        d = [statistics.fmean(x for x, _ in final[pair["b"], s]) - statistics.fmean(x for x, _ in final[pair["a"], s])
             for s in pair["seeds"]]
        assert pair["diff_mean"] == pytest.approx(statistics.fmean(d), abs=1e-12)
        assert pair["ci"] == pytest.approx(_by_hand(d), abs=1e-9)


def _minus(text: str) -> str:
    return text.replace("-", "−")


def _readme_row(label: str, arm: dict, runs: list[dict]) -> str:
    """One row of the README's lead table from the reach summary: success, episodes won, score and final − start."""
    ok, score, gain = arm["success"], arm["score"], arm["gain"]
    won = sum(round(r["success"] * len(r["episodes"])) for r in runs)
    played = sum(len(r["episodes"]) for r in runs)
    return _minus(f"| {label} | {score['n']} | {ok['mean']:.2f} [{ok['ci'][0]:.2f}, {ok['ci'][1]:.2f}] | "
                  f"{won} of {played} | {score['mean']:.1f} [{score['ci'][0]:.1f}, {score['ci'][1]:.1f}] | "
                  f"{gain['diff_mean']:+.1f} [{gain['ci'][0]:+.1f}, {gain['ci'][1]:+.1f}] |")


def test_the_readme_lead_table_is_the_reach_summary():
    """Each row of the README's lead table is built from ``records/results/reach/summary.json`` (which the tests
    above tie to its episode lines) and found in the README; a changed number in either fails here."""
    committed, readme = _committed(REACH), (ROOT / "README.md").read_text()
    # the record's arm names as they ran then: its gigpo and proxmo had the novelty bonus, its ELPO the prefix defect
    labels = {"empo2": "EMPO²", "grpo-no-novelty": "GRPO", "gigpo": "GiGPO + novelty bonus", "luffy": "LUFFY",
              "proxmo": "ProxMO + novelty bonus", "grpo-novelty": "GRPO + novelty bonus",
              "empo2+luffy": "EMPO² + expert member", "elpo": "ELPO (branches scored without their prefix)"}
    assert set(labels) == set(committed["stats"]["arms"])
    rows = {algo: _readme_row(label, committed["stats"]["arms"][algo],
                              [r for r in committed["runs"] if r["algo"] == algo]) for algo, label in labels.items()}
    assert [row for row in rows.values() if row not in readme] == []
    arm = committed["stats"]["arms"]["empo2"]
    shifted = {**arm, "score": {**arm["score"], "mean": arm["score"]["mean"] + 0.1}}
    assert _readme_row(labels["empo2"], shifted, []) not in readme  # a changed number is not found


def _run_rows(summary: dict) -> list[str]:
    """The start of each run's row in a ``summary.md``'s runs table (later versions add a machine column)."""
    rows = []
    for r in summary["runs"]:
        start = "n/a" if r["start"] is None else f"{r['start']:.1f}"
        rows.append(f"| {r['name']} | {r['algo']} | {r['seed']} | {start} | {r['score']:.1f} | {r['success']:.2f} "
                    f"| {len(r['episodes'])} | {r['train_episodes']} | {r['env_steps']} |")
    return rows


@pytest.mark.parametrize("folder", SUMMARIES)
def test_every_summary_md_shows_its_summary_json(folder):
    """``summary.md`` holds the arms' table and the paired differences as ``summary.json`` renders them, line for
    line, and every run's row (the prose around them may be an earlier version's)."""
    committed = _committed(RESULTS / folder)
    shown = (RESULTS / folder / "summary.md").read_text().splitlines()
    assert [line for line in stats.stats_markdown(committed["stats"]) if line and line not in shown] == []
    assert [row for row in _run_rows(committed) if not any(line.startswith(row) for line in shown)] == []


def test_the_learn_cpu_summary_md_shows_its_json():
    """The learning preset's summary (an earlier version's layout, no ``scores.jsonl.gz``): every run's row and each
    arm's final score as its JSON has them."""
    summary = json.loads((RECORDS / "learn_cpu_summary.json").read_text())
    shown = (RECORDS / "learn_cpu_summary.md").read_text().splitlines()
    assert [row for row in _run_rows(summary) if row not in shown] == []
    arms = [f"| {arm} | {a['score']['n']} | **{a['score']['mean']:.1f}** | {stats.fmt_ci(a['score']['ci'])} |"
            for arm, a in summary["stats"]["arms"].items()]
    assert [arm for arm in arms if not any(line.startswith(arm) for line in shown)] == []


@pytest.mark.parametrize("cell", OOD_CELLS)
def test_every_ood_cell_md_shows_its_json(cell):
    """An OOD cell's ``adapt.md``: its trial table as ``adapt.json`` renders it, and the best trial, trial 0 and the
    CI stored in the JSON (the statistics line was written by the version that made the cell)."""
    report = json.loads((RESULTS / "ood" / cell / "adapt.json").read_text())
    shown = (RESULTS / "ood" / cell / "adapt.md").read_text()

    def table(text: str) -> list[str]:
        return [line for line in text.splitlines() if line.startswith("|")]

    assert len(table(shown)) == 2 + len(report["trials"]) and table(shown) == table(adaptation_markdown(report))
    assert (f"best trial {report['best']:.1f} (95% CI {stats.fmt_ci(report['best_ci'])}); "
            f"trial 0 {report['trial0']:.1f}; ") in shown


@pytest.mark.parametrize("folder", SUMMARIES)
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
