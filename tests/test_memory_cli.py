"""``empo2 memory`` subcommands and the HTML report, on a real memory file."""

from __future__ import annotations

import argparse
import hashlib
import json
import random

import pytest

from empo2.memory.commands import add_memory_parser, run_memory_command
from empo2.memory.store import TipMemory

TIPS = {  # namespace -> [(state, tip, utility)]
    "boil-water": [
        ("you are in the kitchen with a stove and a pot of water", "Activate the stove first, then put the pot <on> it & wait.", 0.9),
        ("you are in the hallway, the kitchen is to the north", "Go north to the kitchen; the stove is there — one room away.", 0.1),
    ],
    "find-animal": [
        ("you are in the garden: flowers, a bee and a pond", "Die Biene im Garten ist ein Tier; 先に focus on it 🐝", None),
    ],
}


@pytest.fixture(scope="module")
def run_dir(tmp_path_factory):
    from empo2.memory.embedder import get_embedder

    emb = get_embedder()
    run = tmp_path_factory.mktemp("run")
    with TipMemory(run / "memory.sqlite", embedder=emb) as mem:
        for ns, items in TIPS.items():
            for state, tip, utility in items:
                tid = mem.add(ns, tip, emb.encode([state])[0], key_text=state, score=0.5).id
                if utility is not None:
                    mem.record_episode([tid], utility, step=1)
        assert mem.add("boil-water", "", emb.encode(["x"])[0]).reason == "empty"
    return run


def cli(*argv):
    parser = argparse.ArgumentParser(prog="empo2")
    add_memory_parser(parser.add_subparsers(dest="command", required=True))
    return run_memory_command(parser.parse_args(["memory", *argv]))


def test_stats_json(run_dir, capsys):
    assert cli("stats", "--json", "--db", str(run_dir)) == 0
    stats = json.loads(capsys.readouterr().out)
    assert stats["tips"] == 3 and stats["namespaces"]["boil-water"]["tips"] == 2
    assert stats["namespaces"]["find-animal"]["tips"] == 1
    assert stats["rejections"] == {"empty": 1}
    assert stats["mean_utility"] == pytest.approx(0.5)
    assert cli("stats", "--db", str(run_dir / "memory.sqlite")) == 0
    assert "3 tips" in capsys.readouterr().out


def test_show(run_dir, capsys):
    assert cli("show", "--db", str(run_dir), "--namespace", "boil-water", "--limit", "1", "--json") == 0
    lines = capsys.readouterr().out.splitlines()
    assert len(lines) == 1 and json.loads(lines[0])["text"] == TIPS["boil-water"][1][1]  # newest first
    assert cli("show", "--db", str(run_dir)) == 0
    out = capsys.readouterr().out
    assert all(tip in out for items in TIPS.values() for _, tip, _ in items)


def test_search_retrieves_by_state(run_dir, capsys):
    assert cli("search", "a kitchen: there is a stove and a pot", "--db", str(run_dir), "-k", "1", "--json") == 0
    hits = [json.loads(line) for line in capsys.readouterr().out.splitlines()]
    assert hits[0]["text"] == TIPS["boil-water"][0][1] and hits[0]["similarity"] >= 0.5
    assert all(h["namespace"] == "boil-water" for h in hits)  # nothing about gardens passes the threshold
    assert cli("search", "a bee near the pond", "--db", str(run_dir), "--namespace", "find-animal") == 0
    assert "🐝" in capsys.readouterr().out


def test_export_jsonl(run_dir, tmp_path, capsys):
    out = tmp_path / "tips.jsonl"
    assert cli("export", str(out), "--db", str(run_dir)) == 0
    rows = [json.loads(line) for line in out.read_text(encoding="utf-8").split("\n") if line]
    assert sorted(r["text"] for r in rows) == sorted(tip for items in TIPS.values() for _, tip, _ in items)
    assert {"id", "namespace", "utility", "use_count", "score", "step", "key_text"} <= set(rows[0])


def test_report_html(run_dir, tmp_path, capsys):
    out = tmp_path / "report.html"
    assert cli("report", str(out), "--db", str(run_dir)) == 0
    html = out.read_text(encoding="utf-8")
    assert html.startswith("<!DOCTYPE html>") and "</html>" in html
    assert "Activate the stove first, then put the pot &lt;on&gt; it &amp; wait." in html  # escaped
    assert "<on>" not in html
    assert "Die Biene im Garten ist ein Tier; 先に focus on it 🐝" in html
    assert html.count("data:image/png;base64,") == 2  # utility and usage histograms, inline
    assert "Most useful tips" in html and "Least useful tips" in html
    most = html.split("Most useful tips")[1].split("Least useful tips")[0]
    assert most.index("Activate the stove") < most.index("Go north")  # ordered by utility
    assert "http://" not in html and "https://" not in html  # self-contained


def test_user_errors_exit_2_with_one_line(tmp_path, capsys):
    assert cli("stats", "--db", str(tmp_path / "missing")) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "no memory database" in err
    bad = tmp_path / "memory.sqlite"
    bad.write_bytes(random.Random(1).randbytes(4096))  # seeded: same bytes on every clone
    digest = hashlib.sha256(bad.read_bytes()).hexdigest()
    assert cli("show", "--db", str(tmp_path)) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "not a SQLite database" in err
    assert hashlib.sha256(bad.read_bytes()).hexdigest() == digest


def test_module_entry_point(run_dir):
    import subprocess
    import sys

    res = subprocess.run([sys.executable, "-m", "empo2.memory.commands", "memory", "stats", "--json", "--db", str(run_dir)],
                         capture_output=True, text=True, timeout=60)
    assert res.returncode == 0 and json.loads(res.stdout)["tips"] == 3


def test_empty_memory_report_and_stats(tmp_path, capsys):
    TipMemory(tmp_path / "memory.sqlite").close()
    assert cli("report", str(tmp_path / "r.html"), "--db", str(tmp_path)) == 0
    html = (tmp_path / "r.html").read_text(encoding="utf-8")
    assert "0 tips" in html and "no data yet" in html
    assert cli("stats", "--json", "--db", str(tmp_path)) == 0
    stats = json.loads(capsys.readouterr().out.split("\n", 1)[1])  # first line is the report's "wrote …"
    assert stats["tips"] == 0 and stats["mean_utility"] is None and stats["namespaces"] == {}
