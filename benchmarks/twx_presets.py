"""The TextWorldExpress presets' numbers: gold path lengths against the step cap, and a uniform-random policy's wins.

    python benchmarks/twx_presets.py                      # every twx preset, the first 100 test games each
    python benchmarks/twx_presets.py --presets twx_coin_cpu --games 40

A preset is useful for exploration when its evaluation games can be won within the cap (the gold path fits: the
shortest route for CoinCollector, the package's gold path for the other games, :mod:`empo2.envs.textworld_express.gold`)
and a policy that does not look where it goes wins only a minority of them. For each preset this plays, on the first
``--games`` games of its evaluation split (and, where the preset trains on other parameters, of its train split):
the gold path, to count its steps; one walk of the uniform-random policy over the valid actions (``empo2 play
--policy random``), seeded by the game, to the preset's cap. Prints a table with 95% Wilson intervals and writes
``records/benchmarks/twx_presets.json``. One JVM, in this process; about a minute per preset.
"""

from __future__ import annotations

import argparse
import json
import random
import statistics
import subprocess
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
PRESETS = ["twx_coin_cpu", "twx_coin_ood_cpu", "twx_mapreader_cpu", "twx_twc_cpu", "twx_cookingworld_cpu"]


def wilson(k: int, n: int) -> list[float]:
    from scipy.stats import binomtest

    ci = binomtest(k, n).proportion_ci(method="wilson")
    return [round(ci.low, 3), round(ci.high, 3)]


def measure(env, task: str, split: str, games: int, cap: int) -> dict:
    """Gold lengths and random-walk wins on ``split``'s first ``games`` games of ``task``."""
    from empo2.envs.textworld_express.gold import play_gold

    seeds = env.variations(task, split)[:games]
    gold = [play_gold(env, task, seed) for seed in seeds]
    wins, walk_steps = 0, []
    for seed in seeds:
        rng = random.Random(seed)
        _, info = env.reset(task, seed)
        valid, steps, result = info["valid_actions"], 0, None
        while steps < cap:
            result = env.step(rng.choice(valid))
            steps, valid = steps + 1, result.info["valid_actions"]
            if result.done:
                break
        wins += bool(result.info["success"])
        walk_steps.append(steps)
    found = [g for g in gold if g is not None]
    fit = sum(g is not None and g <= cap for g in gold)
    return {"task": task, "split": split, "params": env.game_params(task, env.fold_of(task, seeds[0])),
            "games": len(seeds), "seeds": [seeds[0], seeds[-1]], "cap": cap,
            "gold_min": min(found), "gold_median": statistics.median(found), "gold_max": max(found),
            "gold_none": len(gold) - len(found), "gold_fit": fit, "gold_fit_ci": wilson(fit, len(seeds)),
            "random_wins": wins, "random_wins_ci": wilson(wins, len(seeds)), "gold": gold}


def main() -> None:
    from empo2 import machine
    from empo2.config import Config
    from empo2.envs.factory import make_env_kwargs, resolve_tasks
    from empo2.envs.textworld_express.env import TextWorldExpressEnv
    from empo2.envs.textworld_express.games import step_cap

    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--presets", default=",".join(PRESETS), help="comma-separated names from configs/")
    parser.add_argument("--games", type=int, default=100, help="first N games of each split")
    parser.add_argument("--json", default=str(ROOT / "records/benchmarks/twx_presets.json"))
    args = parser.parse_args()
    me = machine.describe()
    flags = subprocess.run("lscpu | grep -i '^flags'", shell=True, capture_output=True, text=True).stdout.split()
    vector = [f for f in flags if f.startswith(("avx", "amx", "sse4", "fma"))]
    print(f"machine: {me['cpu']}, lscpu flags {' '.join(vector) or 'none'}, {me['cpus']} cores")
    rows = []
    for name in [p.strip() for p in args.presets.split(",") if p.strip()]:
        cfg = Config.load(ROOT / "configs" / f"{name}.yaml")
        kwargs = make_env_kwargs(cfg.env)
        start = time.perf_counter()
        with TextWorldExpressEnv(**{**kwargs, "max_steps": 10**6, "step_caps": None}) as env:
            for task in resolve_tasks(cfg.env):
                cap = step_cap(task, cfg.env.max_steps, cfg.env.step_caps)
                ood = (cfg.env.textworld_express.eval_params or {}).get(task)
                splits = [cfg.env.eval_split] + (["train"] if ood else [])
                for split in splits:
                    rows.append({"preset": name, **measure(env, task, split, args.games, cap)})
                    r = rows[-1]
                    print(f"  {name} {task} {split}: gold {r['gold_min']}-{r['gold_max']} (median {r['gold_median']}),"
                          f" {r['gold_fit']}/{r['games']} within {cap}; random {r['random_wins']}/{r['games']}",
                          flush=True)
        rows[-1]["seconds"] = round(time.perf_counter() - start, 1)

    print("\n| preset | game, split | parameters | cap | games | gold steps min / median / max | gold within cap "
          "(95% CI) | random wins (95% CI) |")
    print("|---|---|---|---:|---:|---|---|---|")
    for r in rows:
        params = ", ".join(f"{k}={v}" for k, v in sorted(r["params"].items())) or "package defaults"
        fit_lo, fit_hi = r["gold_fit_ci"]
        lo, hi = r["random_wins_ci"]
        print(f"| {r['preset']} | {r['task']}, {r['split']} {r['seeds'][0]}–{r['seeds'][1]} | {params} | {r['cap']} | "
              f"{r['games']} | {r['gold_min']} / {r['gold_median']:g} / {r['gold_max']} | {r['gold_fit']}/{r['games']} "
              f"[{fit_lo:.2f}, {fit_hi:.2f}] | {r['random_wins']}/{r['games']} = {r['random_wins'] / r['games']:.0%} "
              f"[{lo:.2f}, {hi:.2f}] |")
    Path(args.json).parent.mkdir(parents=True, exist_ok=True)
    Path(args.json).write_text(json.dumps({"machine": me, "lscpu_flags": vector, "games": args.games, "rows": rows},
                                          indent=1) + "\n")
    print(f"\nwrote {args.json}")


if __name__ == "__main__":
    main()
