"""TipMemory on real SQLite files with the real MiniLM embedder."""

from __future__ import annotations

import hashlib
import json
import os
import random
import signal
import sqlite3
import subprocess
import sys
import textwrap

import numpy as np
import pytest

from empo2.memory.store import DimensionMismatchError, MemoryStoreError, TipMemory, check_tip_text

STATES = [
    "boil water: you are in the kitchen. a stove, a sink and a pot are here.",
    "boil water: you are in the hallway. doors lead to the kitchen and the garden.",
    "find an animal: you are in the garden. a bee is on a flower.",
    "find an animal: you are outside. you see a pond with a frog.",
    "grow a plant: you are in the greenhouse. there are seeds and a flower pot.",
    "grow a plant: the seed is in the pot but it is dry.",
    "measure the melting point of ice with the thermometer in the workshop.",
    "connect the battery to the light bulb with two wires.",
    "buy a red cotton t-shirt under 20 dollars: search results page 1.",
    "buy a red cotton t-shirt under 20 dollars: item page, size options S M L.",
    "you are in the art studio. there is red paint, blue paint and an empty cup.",
    "mix red and blue paint to make purple paint in the cup.",
]
QUERIES = [
    "boil water: you are in the kitchen next to the stove",
    "find an animal in the garden near the flowers",
    "buy a red t-shirt: looking at the item page",
    "mix paints in the art studio",
    "the quick brown fox jumps over the lazy dog",
]


@pytest.fixture(scope="session")
def embedder():
    from empo2.memory.embedder import get_embedder

    return get_embedder()


def unit(rng, n, d=384):
    v = rng.normal(size=(n, d)).astype(np.float32)
    return v / np.linalg.norm(v, axis=1, keepdims=True)


def brute_force(keys, ids, scores, q, k, threshold, score_weight=0.0):
    sims = keys @ q
    s = np.asarray(scores, dtype=float)
    norm = (s - s.min()) / (s.max() - s.min()) if s.max() > s.min() else np.zeros_like(s)
    rank = sims + score_weight * norm
    order = sorted((i for i in range(len(ids)) if sims[i] >= threshold), key=lambda i: (-rank[i], -ids[i]))
    return [ids[i] for i in order[:k]]


@pytest.fixture(scope="module")
def filled(tmp_path_factory, embedder):
    """A memory with every STATE as a key, in two namespaces, twice each (different tips)."""
    rng = np.random.default_rng(0)
    keys = embedder.encode(STATES)
    mem = TipMemory(tmp_path_factory.mktemp("filled") / "m.sqlite", embedder=embedder)
    rows = []  # (id, namespace, key, score)
    for rep in range(2):
        tembs = unit(rng, len(STATES))
        for i, state in enumerate(STATES):
            ns = "even" if i % 2 == 0 else "odd"
            score = float(rng.uniform())
            r = mem.add(ns, f"tip {rep}-{i} about: {state}", keys[i] + 0.05 * rep * rng.normal(size=384),
                        key_text=state, score=score, tip_embedding=tembs[i])
            assert r.ok, r
            rows.append((r.id, ns, mem.embeddings([r.id])[0][0], score))
    yield mem, rows
    mem.close()


@pytest.mark.parametrize("k,threshold,score_weight", [(3, 0.3, 0.0), (10, 0.0, 0.0), (2, 0.5, 0.0), (4, 0.2, 1.0)])
def test_retrieve_matches_brute_force(filled, embedder, k, threshold, score_weight):
    mem, rows = filled
    queries = embedder.encode(QUERIES)
    namespaces = ["even", "odd", "even", "odd", "even"]
    got = mem.retrieve(namespaces, queries, k=k, threshold=threshold, score_weight=score_weight)
    assert len(got) == len(QUERIES)
    nonempty = 0
    for ns, q, tips in zip(namespaces, queries, got):
        sub = [r for r in rows if r[1] == ns]
        keys = np.stack([r[2] for r in sub])
        want = brute_force(keys, [r[0] for r in sub], [r[3] for r in sub], q, k, threshold, score_weight)
        assert [t.id for t in tips] == want
        assert all(t.namespace == ns and t.similarity >= threshold for t in tips)
        for t in tips:
            assert t.similarity == pytest.approx(float(keys[[r[0] for r in sub].index(t.id)] @ q), abs=1e-5)
        nonempty += bool(tips)
    assert nonempty >= 2  # the check is not vacuous


def test_retrieve_survives_reopen_and_namespace_isolation(filled, embedder, tmp_path):
    mem, rows = filled
    q = embedder.encode([QUERIES[0]])
    before = [t.id for t in mem.retrieve("even", q, k=5, threshold=0.0)[0]]
    with TipMemory(mem.copy_to(tmp_path / "copy.sqlite"), embedder=embedder) as again:
        assert [t.id for t in again.retrieve(["even"], q, k=5, threshold=0.0)[0]] == before
        assert again.retrieve(["nowhere"], q)[0] == []
        odd_ids = {r[0] for r in rows if r[1] == "odd"}
        assert {t.id for t in again.retrieve("odd", q, k=100, threshold=-1.0)[0]} == odd_ids
        assert again.retrieve("even", q, k=5, threshold=0.99)[0] == []


def test_retrieval_key_is_the_state_not_the_tip(tmp_path, embedder):
    """A tip is found by the state it was written about, even if its own text is about something else."""
    kitchen, garden = embedder.encode(["you are in the kitchen with a stove and a pot",
                                       "you are in the garden with bees and flowers"])
    with TipMemory(tmp_path / "m.sqlite", embedder=embedder) as mem:
        a = mem.add("t", "heat the pot on the stove", garden).id  # deliberately crossed
        b = mem.add("t", "look for bees near the flowers", kitchen).id
        top = mem.retrieve("t", embedder.encode(["a kitchen: stove, pot, sink"]), k=1, threshold=0.0)[0]
        assert [t.id for t in top] == [b] and a != b


@pytest.mark.parametrize("policy,expected_victim", [("fifo", 0), ("lru", 1), ("utility", 2)])
def test_eviction_policy_at_capacity(tmp_path, policy, expected_victim):
    rng = np.random.default_rng(1)
    path = tmp_path / "m.sqlite"
    mem = TipMemory(path, capacity=3, eviction=policy)
    ids = [mem.add("ns", f"distinct tip number {i}", unit(rng, 1)[0], tip_embedding=unit(rng, 1)[0], score=0.5).id
           for i in range(3)]
    other = mem.add("other", "a tip in another namespace", unit(rng, 1)[0], tip_embedding=unit(rng, 1)[0]).id
    mem.record_use([ids[0]], step=1)  # LRU: ids[1] becomes least recent
    for tid, ret in zip(ids, [0.9, 0.8, 0.1]):  # utility: ids[2] is the worst
        mem.update_utility([tid], ret)
    res = mem.add("ns", "the fourth tip", unit(rng, 1)[0], tip_embedding=unit(rng, 1)[0])
    assert res.ok and res.evicted == (ids[expected_victim],)
    left = {t.id for t in mem.all_tips("ns")}
    assert left == (set(ids) - {ids[expected_victim]}) | {res.id}
    assert mem.get(other) is not None  # capacity is per namespace
    assert all(t.id != ids[expected_victim] for t in mem.retrieve("ns", unit(rng, 1), k=10, threshold=-1)[0])
    mem.close()
    with TipMemory(path) as again:
        assert {t.id for t in again.all_tips("ns")} == left
        assert again.stats()["evicted"] == 1
        assert again.capacity == 3 and again.eviction == policy  # settings saved for readers


def test_utility_unrated_tips_use_score_and_capacity_shrink(tmp_path):
    rng = np.random.default_rng(2)
    mem = TipMemory(tmp_path / "m.sqlite", capacity=10, eviction="utility")
    ids = [mem.add("ns", f"tip {i} text here", unit(rng, 1)[0], tip_embedding=unit(rng, 1)[0], score=s).id
           for i, s in enumerate([0.3, 0.05, 0.6, 0.4])]
    mem.update_utility([ids[1]], 1.0)  # rated high: now the unrated ids[0] (score 0.3) is the lowest
    mem.close()
    mem = TipMemory(tmp_path / "m.sqlite", capacity=2)
    res = mem.add("ns", "new tip arrives", unit(rng, 1)[0], tip_embedding=unit(rng, 1)[0], score=0.9)
    # eviction keys: utility if rated else score -> ids0 0.3, ids1 1.0, ids2 0.6, ids3 0.4; keep 1 old + the new one
    assert sorted(res.evicted) == sorted([ids[0], ids[3], ids[2]])
    assert {t.id for t in mem.all_tips("ns")} == {ids[1], res.id}
    mem.close()


def test_utility_running_mean_and_use_counts(tmp_path):
    rng = np.random.default_rng(3)
    path = tmp_path / "m.sqlite"
    with TipMemory(path) as mem:
        a = mem.add("ns", "tip a is here", unit(rng, 1)[0], tip_embedding=unit(rng, 1)[0], score=0.0).id
        b = mem.add("ns", "tip b is here", unit(rng, 1)[0], tip_embedding=unit(rng, 1)[0], score=1.0).id
        mem.record_episode([a, b, a], 1.0, step=4)  # duplicate ids in one episode count once
        mem.update_utility([a], 0.0)
        mem.update_utility([a, 12345], 0.5)  # unknown/evicted ids are ignored
        mem.record_use([a], step=7)
    with TipMemory(path) as mem:
        ta, tb = mem.get(a), mem.get(b)
        assert ta.utility == pytest.approx(0.5) and ta.utility_n == 3
        assert tb.utility == pytest.approx(1.0) and tb.utility_n == 1
        assert (ta.use_count, ta.last_use_step, tb.use_count, tb.last_use_step) == (2, 7, 1, 4)
        # utility re-ranking reads the updated values: b (1.0) outranks a (0.5) at equal similarity
        q = mem.embeddings([a])[0] + mem.embeddings([b])[0]
        hits = mem.retrieve("ns", q, k=2, threshold=-1, utility_weight=5.0)[0]
        assert [t.id for t in hits] == [b, a]
        assert mem.stats()["mean_utility"] == pytest.approx(0.75)
        with pytest.raises(MemoryStoreError):
            mem.update_utility([a], float("nan"))


CONTEXT = ["Task: boil water. You are in the kitchen. In it, you see: a stove, which is turned off. a sink. a pot."]


@pytest.mark.parametrize("text,reason", [
    ("", "empty"),
    ("   \n\t ", "empty"),
    (" ".join(f"word{i}" for i in range(101)), "too_long"),
    ("\x00\x01\x02\x03\x04\x05\x06\x07\x08 ok", "non_printable"),
    ("\ufffd\ufffd\ufffd\ufffd\ufffd\ufffd ab", "non_printable"),
    ("!!! ??? ... ---", "non_printable"),
    ("go north " * 20, "repetitive"),
    ("ab" * 60, "repetitive"),
    ("You are in the kitchen. In it, you see: a stove, which is turned off.", "copy_of_context"),
    ("task boil water you are in the kitchen", "copy_of_context"),
    ("bad \ud800 surrogate", "invalid_unicode"),
])
def test_validation_rejects(tmp_path, embedder, text, reason):
    assert check_tip_text(text, 100, CONTEXT) == reason
    path = tmp_path / "m.sqlite"
    with TipMemory(path, embedder=embedder) as mem:
        res = mem.add("ns", text, np.ones(384), context_texts=CONTEXT)
        assert not res.ok and res.reason == reason and len(mem) == 0
    with TipMemory(path) as mem:
        assert mem.stats()["rejections"] == {reason: 1}


def test_validation_accepts_good_tips_and_rejects_near_duplicates(tmp_path, embedder):
    key = embedder.encode(["kitchen"])[0]
    good = ["Turn on the stove before putting the pot on it; I am two steps from boiling the water.",
            "Die Biene sitzt auf der Blume im Garten; zuerst dorthin gehen.",
            "青い絵の具と赤い絵の具を混ぜると紫になる。"]
    for g in good:
        assert check_tip_text(g, 100, CONTEXT) is None
    with TipMemory(tmp_path / "m.sqlite", embedder=embedder, dedup_threshold=0.95) as mem:
        first = mem.add("ns", good[0], key, context_texts=CONTEXT)
        assert first.ok
        dup = mem.add("ns", good[0].replace("the water", "the water!"), key)
        assert dup.reason == "duplicate"
        assert mem.add("other", good[0], key).ok  # dedup is per namespace
        assert mem.add("ns", good[1], key).ok and mem.add("ns", good[2], key).ok
        assert mem.stats()["rejections"] == {"duplicate": 1}


def test_unicode_round_trips(tmp_path, embedder):
    texts = ["emoji 👩‍👩‍👧‍👦 family and 🏳️‍🌈 flag then go east",
             "עברית מימין לשמאל ואז English",
             "combining: e\u0301 a\u0308 and cjk 漢字 かな 한국어",
             "nul \x00 inside and line\u2028separator kept",
             "math 𝔘𝔫𝔦𝔠𝔬𝔡𝔢 ∀x∈ℝ: x² ≥ 0"]
    path = tmp_path / "m.sqlite"
    with TipMemory(path, embedder=embedder) as mem:
        ids = {}
        for t in texts:
            res = mem.add("名前空間 ✓", t, embedder.encode([t])[0], key_text=f"état {t}")
            assert res.ok, res
            ids[res.id] = t
        mem.export_jsonl(tmp_path / "out.jsonl")
    with TipMemory(path) as mem:
        assert {t.id: t.text for t in mem.all_tips("名前空間 ✓")} == ids
        assert all(mem.get(i).key_text == f"état {t}" for i, t in ids.items())
        hits = mem.retrieve("名前空間 ✓", embedder.encode([texts[2]]), k=1, threshold=0.0)[0]
        assert hits[0].text == texts[2]
    lines = [json.loads(line) for line in (tmp_path / "out.jsonl").read_text(encoding="utf-8").splitlines()]
    assert {d["id"]: d["text"] for d in lines} == ids


def test_dimension_mismatch(tmp_path, embedder):
    path = tmp_path / "m.sqlite"
    with TipMemory(path, embedder=embedder) as mem:
        with pytest.raises(DimensionMismatchError, match="384"):
            mem.add("ns", "a fine tip", np.ones(128, np.float32), tip_embedding=np.ones(384, np.float32))
        with pytest.raises(DimensionMismatchError):
            mem.retrieve(["ns"], np.ones((1, 768), np.float32))
        assert mem.add("ns", "a fine tip", np.ones(384, np.float32)).ok
    with pytest.raises(DimensionMismatchError, match="384-d"):
        TipMemory(path, dim=768)
    with TipMemory(path, dim=None) as mem:
        assert mem.dim == 384 and len(mem) == 1


def _digest(path):
    return hashlib.sha256(path.read_bytes()).hexdigest()


def test_corrupt_and_foreign_files_are_refused_and_untouched(tmp_path):
    garbage = tmp_path / "garbage.sqlite"
    garbage.write_bytes(random.Random(2).randbytes(8192))  # seeded
    foreign = tmp_path / "foreign.sqlite"
    con = sqlite3.connect(foreign)
    con.execute("CREATE TABLE tips (id INTEGER, text TEXT)")
    con.execute("INSERT INTO tips VALUES (1, 'not ours')")
    con.commit()
    con.close()
    damaged = tmp_path / "damaged.sqlite"
    rng = np.random.default_rng(4)
    with TipMemory(damaged) as mem:
        for i in range(300):
            mem.add("ns", f"tip number {i} with words", unit(rng, 1)[0], tip_embedding=unit(rng, 1)[0])
    data = bytearray(damaged.read_bytes())
    data[4096:len(data) - 4096] = random.Random(3).randbytes(len(data) - 8192)  # keep page 1 (header) intact
    damaged.write_bytes(bytes(data))
    for path in (garbage, foreign, damaged):
        before = _digest(path)
        with pytest.raises(MemoryStoreError) as info:
            TipMemory(path)
        assert str(path) in str(info.value)
        assert _digest(path) == before
        assert not os.path.exists(str(path) + "-wal") or os.path.getsize(str(path) + "-wal") == 0


def test_copy_to_seeds_another_run(tmp_path, embedder):
    src = tmp_path / "a" / "memory.sqlite"
    with TipMemory(src, embedder=embedder) as mem:
        tid = mem.add("ns", "open the door before walking through it", embedder.encode(["door"])[0]).id
        mem.update_utility([tid], 0.25)
        dest = mem.copy_to(tmp_path / "b" / "memory.sqlite")
        with pytest.raises(MemoryStoreError, match="not overwriting"):
            mem.copy_to(dest)
    with TipMemory(dest, embedder=embedder) as copy:
        t = copy.get(tid)
        assert t.text == "open the door before walking through it" and t.utility == 0.25
        copy.add("ns", "a second, unrelated tip about bees", embedder.encode(["bees"])[0])
    with TipMemory(src) as mem:
        assert len(mem) == 1  # the copy is independent


CHILD = textwrap.dedent("""
    import sys, numpy as np
    from empo2.memory.store import TipMemory
    rng = np.random.default_rng(int(sys.argv[2]))
    mem = TipMemory(sys.argv[1], capacity=100000)
    i = 0
    while True:
        v = rng.normal(size=(2, 384))
        r = mem.add("ns" + str(i % 3), "tip %d: the drawer holds the key, open it first" % i, v[0],
                    tip_embedding=v[1], score=i % 7, step=i)
        print(r.id, flush=True)
        i += 1
""")


def test_sigkill_during_inserts_loses_nothing_committed(tmp_path):
    path = tmp_path / "memory.sqlite"
    all_committed: set[int] = set()
    for round_, n_before_kill in enumerate((150, 60)):  # the second child appends to a previously killed file
        proc = subprocess.Popen([sys.executable, "-c", CHILD, str(path), str(round_)], stdout=subprocess.PIPE,
                                text=True)
        committed = []
        try:
            for line in proc.stdout:
                committed.append(int(line))
                if len(committed) >= n_before_kill:
                    break
            proc.send_signal(signal.SIGKILL)
            rest = proc.stdout.read()  # the child is dead: read to EOF, including lines buffered on our side
            proc.wait(timeout=30)
        finally:
            if proc.poll() is None:
                proc.kill()
        committed += [int(x) for x in rest.split()]
        all_committed |= set(committed)
        assert proc.returncode == -signal.SIGKILL
        con = sqlite3.connect(path)
        assert con.execute("PRAGMA integrity_check").fetchone()[0] == "ok"
        con.close()
        with TipMemory(path) as mem:
            stored = {t.id for t in mem.all_tips()}
            assert all_committed <= stored
            assert len(stored - all_committed) <= round_ + 1  # at most the unprinted last add of each child
            assert len(mem) == len(stored)  # the in-RAM index matches the file
            assert mem.retrieve(["ns0"], np.ones((1, 384)), k=3, threshold=-1)[0]
