"""Environment throughput: steps per second with 1 worker vs N workers (EnvPool), ScienceWorld and TextWorldExpress.

    python benchmarks/env_throughput.py                  # 1, 2, 4 workers x {full, lean} x both environments;
                                                         # 15 s each; prints a table (and the CPU's lscpu flags),
                                                         # writes records/benchmarks/env_throughput.json
    python benchmarks/env_throughput.py --workers 1 8 --seconds 30 --modes lean --envs scienceworld

Each worker plays gold paths of a few tasks (ScienceWorld: panel tasks; TextWorldExpress: its four games at the
shipped presets' sizes; first 4 train variations each, cycling), in lockstep through
``EnvPool.step``; finished workers are reset together. Gold paths are fetched once, untimed, during warm-up.
``steps/s`` is agent steps divided by wall time *including* resets (a reset loads the task, as in training; no gold
path is generated). Also reported: JVM/worker start time, mean step and
reset latency as seen by the trainer, resident memory per worker (Python worker + its JVM), the CPU actually used
(``cores_used``) and a CPU probe of how many cores the machine gives us at all (on a shared machine: often ~1).
Modes: ``full`` = default env (``info['valid_actions']`` filled every step); ``lean`` = ``valid_actions_in_info=False``.
TextWorldExpress has one mode, ``full``: the package computes the valid actions with every step.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import subprocess
import time
from pathlib import Path

import psutil

from empo2.envs.pool import EnvPool

RECORDS = Path(__file__).resolve().parents[1] / "records" / "benchmarks"

TASKS = ["find-animal", "use-thermometer", "lifespan-longest-lived", "chemistry-mix"]
TWX_PARAMS = {"coin": {"numLocations": 6, "includeDoors": 1},
              "mapreader": {"numLocations": 4, "maxDistanceApart": 1, "maxDistractorItemsPerLocation": 0},
              "twc": {"numLocations": 1, "numItemsToPutAway": 2},
              "cookingworld": {"numLocations": 1, "numIngredients": 1, "numDistractorItems": 0, "includeDoors": 0}}
"""The games' sizes in configs/twx_*_cpu.yaml."""
ENVS = {"scienceworld": (TASKS, lambda mode: {"valid_actions_in_info": mode == "full"}),
        "textworld_express": (list(TWX_PARAMS), lambda mode: {"params": TWX_PARAMS, "max_steps": 10**6})}
"""Environment -> (tasks, constructor arguments of a mode)."""


def lscpu_flags() -> list[str]:
    """The CPU's vector flags as ``lscpu`` lists them."""
    out = subprocess.run(["lscpu"], capture_output=True, text=True).stdout
    flags = next((line.split(":", 1)[1].split() for line in out.splitlines() if line.lower().startswith("flags")), [])
    return [f for f in flags if f.startswith(("avx", "amx", "sse4", "fma"))]


def _burn(_: int) -> float:
    t = time.perf_counter()
    x = 0
    for i in range(20_000_000):
        x += i
    return time.perf_counter() - t


def available_cores() -> float:
    """How many cores this machine gives us right now: pure-Python work in 1 process vs 2 at once (~2.0 = both)."""
    import multiprocessing as mp

    with mp.get_context("spawn").Pool(2) as workers:
        one = workers.map(_burn, [0])[0]
        two = max(workers.map(_burn, [0, 1]))
    return round(2 * one / two, 2)


def cpu_seconds(pool: EnvPool) -> float:
    """CPU time (user + system) used so far by this process, the workers and their JVMs."""
    procs = [psutil.Process()]
    for pid in pool.worker_pids().values():
        proc = psutil.Process(pid)
        procs += [proc] + proc.children(recursive=True)
    return sum(sum(p.cpu_times()[:2]) for p in procs)


def run(n: int, seconds: float, env: str, mode: str) -> dict:
    tasks, kwargs = ENVS[env]
    t0 = time.perf_counter()
    pool = EnvPool(env, kwargs(mode), size=n)
    start_s = time.perf_counter() - t0
    try:
        pairs = [(t, v) for t in tasks for v in pool.call(0, "variations", t, "train")[:4]]
        gold: dict[tuple[str, int], list[str]] = {}
        for k in range(0, len(pairs), n):  # untimed: gold paths (cached, so timed resets skip them) + JIT warm-up
            batch = dict(enumerate(pairs[k:k + n]))
            pool.reset([(i, t, v) for i, (t, v) in batch.items()])
            for i, pair in batch.items():
                gold[pair] = pool.call(i, "gold_actions")
            for k2 in range(max(len(gold[pair]) for pair in batch.values())):
                pool.step({i: gold[pair][k2] for i, pair in batch.items() if k2 < len(gold[pair])})
        episode = [0] * n
        playing: dict[int, tuple[str, int]] = {}

        def reset(workers: list[int]) -> tuple[dict[int, list[str]], float]:
            for i in workers:
                playing[i] = pairs[(episode[i] * n + i) % len(pairs)]
                episode[i] += 1
            t = time.perf_counter()
            pool.reset([(i, *playing[i]) for i in workers])
            return {i: gold[playing[i]] for i in workers}, time.perf_counter() - t

        steps, step_time, reset_time, n_resets, n_step_calls = 0, 0.0, 0.0, 0, 0
        cpu0 = cpu_seconds(pool)
        began = time.perf_counter()
        golds, dt = reset(list(range(n)))
        reset_time, n_resets = dt, 1
        cursor = {i: 0 for i in range(n)}
        while time.perf_counter() - began < seconds:
            actions = {i: golds[i][cursor[i]] for i in range(n)}
            t = time.perf_counter()
            results = pool.step(actions)
            step_time += time.perf_counter() - t
            n_step_calls += 1
            steps += len(actions)
            finished = []
            for i, r in results.items():
                cursor[i] += 1
                if r.done or cursor[i] >= len(golds[i]):
                    finished.append(i)
            if finished:
                fresh, dt = reset(finished)
                golds.update(fresh)
                cursor.update({i: 0 for i in finished})
                reset_time += dt
                n_resets += 1
        wall = time.perf_counter() - began
        cores_used = (cpu_seconds(pool) - cpu0) / wall
        rss = []
        for pid in pool.worker_pids().values():
            proc = psutil.Process(pid)
            rss.append(sum(p.memory_info().rss for p in [proc] + proc.children(recursive=True)))
        return {"env": env, "mode": mode, "workers": n, "steps": steps, "wall_s": round(wall, 2),
                "steps_per_s": round(steps / wall, 1),
                "start_s": round(start_s, 2), "step_call_ms": round(1000 * step_time / max(n_step_calls, 1), 1),
                "reset_call_ms": round(1000 * reset_time / max(n_resets, 1), 1),
                "rss_mb_per_worker": round(sum(rss) / len(rss) / 2**20), "cores_used": round(cores_used, 2)}
    finally:
        pool.close()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--workers", type=int, nargs="+", default=[1, 2, 4])
    parser.add_argument("--seconds", type=float, default=15.0)
    parser.add_argument("--modes", nargs="+", choices=["full", "lean"], default=["full", "lean"])
    parser.add_argument("--envs", nargs="+", choices=list(ENVS), default=list(ENVS))
    parser.add_argument("--out", default=str(RECORDS / "env_throughput.json"))
    args = parser.parse_args()

    load_before = os.getloadavg()
    cores = available_cores()
    rows = []
    for env in args.envs:
        for mode in args.modes if env == "scienceworld" else ["full"]:
            mode_rows = [run(n, args.seconds, env, mode) for n in args.workers]
            for row in mode_rows:
                row["ratio_vs_first"] = round(row["steps_per_s"] / mode_rows[0]["steps_per_s"], 2)
            rows += mode_rows

    flags = lscpu_flags()
    print(f"lscpu flags: {' '.join(flags) or 'none'}")
    print(f"{'env':>17} {'mode':>5} {'workers':>7} {'steps/s':>8} {'ratio':>6} {'start s':>8} {'step ms':>8} "
          f"{'reset ms':>9} {'MB/worker':>10} {'cores used':>10}")
    for r in rows:
        print(f"{r['env']:>17} {r['mode']:>5} {r['workers']:>7} {r['steps_per_s']:>8} {r['ratio_vs_first']:>6} "
              f"{r['start_s']:>8} {r['step_call_ms']:>8} {r['reset_call_ms']:>9} {r['rss_mb_per_worker']:>10} "
              f"{r['cores_used']:>10}")
    print(f"load average before/after: {load_before[0]:.1f} / {os.getloadavg()[0]:.1f} on {os.cpu_count()} CPUs; "
          f"cores available to us (CPU probe): {cores}")
    out = {"benchmark": "env_throughput", "envs": args.envs,
           "tasks": {env: ENVS[env][0] for env in args.envs}, "seconds": args.seconds,
           "cpus": os.cpu_count(), "lscpu_flags": flags, "available_cores_probe": cores,
           "loadavg_1min_before_after": [round(load_before[0], 2), round(os.getloadavg()[0], 2)],
           "python": platform.python_version(), "machine": platform.machine(),
           "note": "steps/s = agent steps / wall time including resets; step ms = one EnvPool.step call "
                   "(all workers in lockstep); reset ms = one EnvPool.reset call for the finished workers; "
                   "cores_used = CPU seconds of this process + workers + JVMs per wall second",
           "results": rows}
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps(out, indent=2) + "\n")
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
