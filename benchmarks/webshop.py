"""WebShop environment speed on the fixture catalog: BM25 search latency and environment steps per second.

    python benchmarks/webshop.py            # prints a table, writes records/benchmarks/webshop.json

Set ``EMPO2_WEBSHOP_DATA`` to time the official small set instead (the label then says so).
"""

from __future__ import annotations

import json
import platform
import random
import statistics
import time
from dataclasses import replace
from pathlib import Path

from empo2.envs.webshop import WebShopEnv
from empo2.envs.webshop.search import SearchEngine


def percentile(values: list[float], q: float) -> float:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, int(round(q / 100 * (len(ordered) - 1))))]


def main(repeats: int = 5, random_episodes: int = 200) -> dict:
    t0 = time.perf_counter()
    env = WebShopEnv(seed=0)
    init_s = time.perf_counter() - t0

    queries = [g.base_instruction for g in env.goals] + [p.title for p in env.catalog.products]
    latencies = []
    for _ in range(repeats):
        for q in queries:
            t = time.perf_counter()
            env.engine.search(q)
            latencies.append((time.perf_counter() - t) * 1e3)

    # the same queries against a 1000-document index (the fixture repeated 15×, the official small set's size)
    big = SearchEngine([replace(p, asin=f"{p.asin}{k}") for k in range(15) for p in env.catalog.products])
    latencies_1k = []
    for q in queries:
        t = time.perf_counter()
        big.search(q)
        latencies_1k.append((time.perf_counter() - t) * 1e3)

    steps, t = 0, time.perf_counter()
    for v in range(len(env.goals)):           # gold episodes (search, item, options, buy)
        env.reset("webshop", v)
        for a in env.gold_actions():
            env.step(a)
            steps += 1
    gold_sps = steps / (time.perf_counter() - t)

    rng, steps, t = random.Random(0), 0, time.perf_counter()
    for e in range(random_episodes):          # random valid actions (search page: a goal's query)
        env.reset("webshop", e % len(env.goals))
        done = False
        while not done:
            valid = [a for a in env.valid_actions() if not a.startswith("search[<")]
            action = rng.choice(valid) if valid else f"search[{env.goals[rng.randrange(len(env.goals))].query}]"
            done = env.step(action).done
            steps += 1
    random_sps = steps / (time.perf_counter() - t)

    result = dict(
        env=env.name, products=len(env.catalog.products), goals=len(env.goals), init_s=round(init_s, 3),
        search_queries=len(latencies), search_p50_ms=round(statistics.median(latencies), 3),
        search_p99_ms=round(percentile(latencies, 99), 3), search_mean_ms=round(statistics.fmean(latencies), 3),
        search_990docs_p50_ms=round(statistics.median(latencies_1k), 3),
        search_990docs_p99_ms=round(percentile(latencies_1k, 99), 3),
        gold_steps_per_s=round(gold_sps, 1), random_steps_per_s=round(random_sps, 1),
        machine=f"{platform.machine()} {platform.python_implementation()} {platform.python_version()}",
    )
    width = max(map(len, result))
    print(f"WebShop environment benchmark ({result['env']})")
    for k, v in result.items():
        print(f"  {k:<{width}}  {v}")
    out = Path(__file__).resolve().parents[1] / "records" / "benchmarks" / "webshop.json"
    out.parent.mkdir(exist_ok=True)
    out.write_text(json.dumps(result, indent=2) + "\n")
    print(f"wrote {out}")
    return result


if __name__ == "__main__":
    main()
