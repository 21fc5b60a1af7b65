"""Tip-memory benchmark: top-10 retrieval latency, insert throughput and process RSS at 1k / 10k / 100k tips.

    python benchmarks/memory.py [--sizes 1000 10000 100000] [--queries 200] [--out records/benchmarks/memory.json]

Keys and tip embeddings are random unit vectors (384-d). The worst case is measured: every tip in ONE namespace,
so a query scans all of them (with the default capacity of 1000 per namespace a real run scans at most 1000).
Latency "excl. embedding" is ``TipMemory.retrieve`` for one query embedding; "incl. embedding" adds encoding the
query text with the MiniLM embedder (with torch's default thread count, and with one torch thread). ``add()`` throughput is the validated, de-duplicated, one-transaction-per-tip
path; the bulk fill uses ``bulk_insert`` (one transaction per 10k batch).
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import tempfile
import time
from pathlib import Path

import numpy as np
import psutil

from empo2.memory.store import TipMemory

RECORDS = Path(__file__).resolve().parents[1] / "records" / "benchmarks"


def unit(rng: np.random.Generator, n: int, d: int = 384) -> np.ndarray:
    v = rng.normal(size=(n, d)).astype(np.float32)
    return v / np.linalg.norm(v, axis=1, keepdims=True)


def pct(xs: list[float], q: float) -> float:
    return float(np.percentile(np.asarray(xs) * 1e3, q))


def rss_mb() -> float:
    return psutil.Process().memory_info().rss / 2**20


def bench_size(n: int, queries: int, embedder, rng: np.random.Generator, workdir: Path) -> dict:
    path = workdir / f"mem_{n}.sqlite"
    mem = TipMemory(path, capacity=n + 1000, eviction="utility")
    t0 = time.perf_counter()
    for start in range(0, n, 10_000):
        m = min(10_000, n - start)
        mem.bulk_insert("ns", [f"tip {start + i}: the key is in the drawer" for i in range(m)], unit(rng, m),
                        unit(rng, m), scores=rng.uniform(size=m))
    bulk_s = time.perf_counter() - t0
    rss_after_fill = rss_mb()

    # one query, no embedding. Half the queries are near a stored key so the threshold passes real candidates.
    keys, _ = mem.embeddings(rng.choice(np.arange(1, n + 1), size=queries // 2, replace=False).tolist())
    near = keys + 0.5 * unit(rng, len(keys)) / np.sqrt(2)
    qs = np.concatenate([near, unit(rng, queries - len(keys))])
    mem.retrieve("ns", qs[:5], k=10)  # warm-up
    lat, found = [], 0
    for q in qs:
        t = time.perf_counter()
        hits = mem.retrieve("ns", q, k=10, threshold=0.5)[0]
        lat.append(time.perf_counter() - t)
        found += len(hits)

    # batched: 16 environments' states in one call
    batch = []
    for i in range(max(5, queries // 16)):
        q16 = qs[(16 * i) % (len(qs) - 16):][:16]
        t = time.perf_counter()
        mem.retrieve(["ns"] * 16, q16, k=10, threshold=0.5)
        batch.append(time.perf_counter() - t)

    # including query embedding (MiniLM on CPU)
    texts = [f"task {i}: you are in room {i % 13}; you see a drawer, a key and {i} coins" for i in range(60)]
    embedder.encode(texts[:2])
    import torch

    default_threads = torch.get_num_threads()
    lat_emb, lat_emb1 = [], []
    for threads, into in ((default_threads, lat_emb), (1, lat_emb1)):
        torch.set_num_threads(threads)
        for text in texts:
            t = time.perf_counter()
            mem.retrieve("ns", embedder.encode([text]), k=10, threshold=0.5)
            into.append(time.perf_counter() - t)
    torch.set_num_threads(default_threads)

    # add(): validation + de-duplication scan over the namespace + one transaction per tip
    n_add = 200 if n <= 10_000 else 100
    t = time.perf_counter()
    ok = sum(mem.add("ns", f"fresh tip number {i} about opening the red door", unit(rng, 1)[0],
                     tip_embedding=unit(rng, 1)[0], score=0.5, step=i).ok for i in range(n_add))
    add_s = time.perf_counter() - t
    mem.close()

    t = time.perf_counter()
    TipMemory(path).close()
    reopen_s = time.perf_counter() - t
    size_mb = sum(p.stat().st_size for p in workdir.glob(f"mem_{n}.sqlite*")) / 2**20
    path.unlink()
    for extra in workdir.glob(f"mem_{n}.sqlite-*"):
        extra.unlink()
    return {
        "entries": n,
        "retrieve_p50_ms": pct(lat, 50), "retrieve_p99_ms": pct(lat, 99),
        "retrieve_incl_embed_p50_ms": pct(lat_emb, 50), "retrieve_incl_embed_p99_ms": pct(lat_emb, 99),
        "retrieve_incl_embed_torch1_p50_ms": pct(lat_emb1, 50), "retrieve_incl_embed_torch1_p99_ms": pct(lat_emb1, 99),
        "retrieve_batch16_p50_ms": pct(batch, 50), "retrieve_batch16_per_query_ms": pct(batch, 50) / 16,
        "mean_hits_per_query": found / len(qs),
        "bulk_insert_per_s": n / bulk_s,
        "add_per_s": n_add / add_s, "add_accepted": ok, "add_ms": 1e3 * add_s / n_add,
        "reopen_s": reopen_s, "db_mb": size_mb, "rss_mb_after_fill": rss_after_fill,
    }


def bench_many_namespaces(total: int, per_ns: int, queries: int, rng: np.random.Generator, workdir: Path) -> dict:
    """The realistic layout: ``total`` tips spread over namespaces of ``per_ns`` (the default capacity)."""
    path = workdir / "mem_ns.sqlite"
    mem = TipMemory(path, capacity=per_ns)
    n_ns = total // per_ns
    for j in range(n_ns):
        mem.bulk_insert(f"task-{j}", [f"tip {i}" for i in range(per_ns)], unit(rng, per_ns), unit(rng, per_ns))
    qs = unit(rng, queries)
    lat = []
    for i, q in enumerate(qs):
        t = time.perf_counter()
        mem.retrieve(f"task-{i % n_ns}", q, k=10, threshold=0.5)
        lat.append(time.perf_counter() - t)
    mem.close()
    for p in workdir.glob("mem_ns.sqlite*"):
        p.unlink()
    return {"entries": total, "namespaces": n_ns, "retrieve_p50_ms": pct(lat, 50), "retrieve_p99_ms": pct(lat, 99)}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--sizes", type=int, nargs="+", default=[1_000, 10_000, 100_000])
    ap.add_argument("--queries", type=int, default=200)
    ap.add_argument("--out", default=str(RECORDS / "memory.json"))
    args = ap.parse_args()

    from empo2.memory.embedder import get_embedder

    embedder = get_embedder()
    rng = np.random.default_rng(0)
    rss_start = rss_mb()
    rows = []
    with tempfile.TemporaryDirectory(prefix="empo2-membench-") as tmp:
        for n in args.sizes:
            rows.append(bench_size(n, args.queries, embedder, rng, Path(tmp)))
            print(f"  {n:>7} entries done", flush=True)
        spread = bench_many_namespaces(max(args.sizes), 1000, args.queries, rng, Path(tmp))

    header = ("entries", "p50 ms", "p99 ms", "p50 +emb", "p99 +emb", "p50 +emb1", "p99 +emb1", "batch16/q", "add/s",
              "bulk/s", "RSS MB")
    print("\nTop-10 retrieval, one namespace holding every tip (worst case)")
    print(" | ".join(f"{h:>9}" for h in header))
    for r in rows:
        vals = (r["entries"], r["retrieve_p50_ms"], r["retrieve_p99_ms"], r["retrieve_incl_embed_p50_ms"],
                r["retrieve_incl_embed_p99_ms"], r["retrieve_incl_embed_torch1_p50_ms"],
                r["retrieve_incl_embed_torch1_p99_ms"], r["retrieve_batch16_per_query_ms"], r["add_per_s"],
                r["bulk_insert_per_s"], r["rss_mb_after_fill"])
        print(" | ".join(f"{v:>9.0f}" if i in (0, 8, 9, 10) else f"{v:>9.3f}" for i, v in enumerate(vals)))
    print("(+emb: query text embedded with MiniLM, torch default threads; +emb1: torch.set_num_threads(1))")
    print(f"\n{spread['entries']} tips in {spread['namespaces']} namespaces of 1000 (default capacity): "
          f"p50 {spread['retrieve_p50_ms']:.3f} ms, p99 {spread['retrieve_p99_ms']:.3f} ms")
    result = {
        "benchmark": "memory", "time": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
        "machine": {"cpus": os.cpu_count(), "platform": platform.platform(), "python": platform.python_version(),
                    "numpy": np.__version__},
        "dim": 384, "k": 10, "threshold": 0.5, "rss_mb_start": rss_start, "single_namespace": rows,
        "many_namespaces": spread, "target": "p50 <= 5 ms at 100k entries, one query, excluding embedding",
    }
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(result, indent=2) + "\n")
    print(f"wrote {out}")


if __name__ == "__main__":
    main()
