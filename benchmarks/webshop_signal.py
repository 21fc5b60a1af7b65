"""Does the untrained model earn any WebShop reward? The share of episodes with a reward above 0, per setting.

    python benchmarks/webshop_signal.py                      # every setting, 41 test goals each
    python benchmarks/webshop_signal.py --episodes 4 --settings preset   # a quick look

GRPO-style training learns only from groups whose episodes differ in reward, so a preset is useful only if the
untrained model already gets some reward in some episodes (target: at least 10%). Each setting plays the test goals
of the bundled fixture catalog with ``configs/webshop_cpu.yaml``'s policy at the training temperature (1.0 unless a
setting changes it), through ``empo2 train`` with no iterations, so the episodes are the ones training would see.
Prints a table (share with a 95% Wilson interval, mean score) and writes ``records/benchmarks/webshop_signal.json``
with every episode's score and this machine.
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]

SETTINGS: dict[str, list[str]] = {
    "preset": [],                                    # configs/webshop_cpu.yaml as it is (10 steps, 66 products)
    "steps-15": ["env.max_steps=15"],                # more steps to reach "buy now"
    "products-22": ["env.webshop.num_products=22"],  # the first 22 products: fewer categories, nearer results
    "steps-15+products-22": ["env.max_steps=15", "env.webshop.num_products=22"],
    "cutoff-55": ["env.action_cutoff=55"],            # text like no button is a no-op, not the nearest button
    "cutoff-55+steps-15": ["env.action_cutoff=55", "env.max_steps=15"],
    # cooler sampling for rollouts and these episodes alike: fewer queries that match no product
    "temp-0.7+steps-15": ["policy.temperature=0.7", "policy.eval_temperature=0.7", "env.max_steps=15"],
    "steps-20": ["env.max_steps=20"],
    "from-results": ["env.webshop.start=results"],   # start on the results of the instruction's stem
    "from-results+steps-15": ["env.webshop.start=results", "env.max_steps=15"],
    "from-results+eval-0.4": ["env.webshop.start=results", "policy.eval_temperature=0.4"],  # as evals play
}


def play(name: str, overrides: list[str], episodes: int, out: Path) -> dict:
    """The untrained model's eval episodes under one setting (a ``train`` run with no iterations)."""
    run = out / name
    cmd = [sys.executable, "-m", "empo2.cli", "train", "--config", str(ROOT / "configs/webshop_cpu.yaml"),
           "train.iterations=0", "train.eval_at_start=false", f"env.eval_variations={episodes}",
           "policy.eval_temperature=1.0", "policy.autocast=none", f"train.output_dir={run}", *overrides]
    start = time.perf_counter()
    subprocess.run(cmd, check=True, stdout=subprocess.DEVNULL)
    seconds = time.perf_counter() - start
    scores = [e["score"] for e in json.loads((run / "eval" / "final.json").read_text())["episodes"]]
    return {"setting": name, "overrides": overrides, "scores": scores, "seconds": round(seconds, 1)}


def summarize(result: dict) -> dict:
    from scipy.stats import binomtest

    scores = result["scores"]
    hits = sum(s > 0 for s in scores)
    ci = binomtest(hits, len(scores)).proportion_ci(method="wilson") if scores else None
    return {**result, "n": len(scores), "nonzero": hits, "share": hits / len(scores) if scores else None,
            "share_ci": [ci.low, ci.high] if ci else None,
            "mean_score": sum(scores) / len(scores) if scores else None}


def main() -> None:
    from empo2 import machine

    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--episodes", type=int, default=41, help="test goals per setting (the fixture has 41)")
    parser.add_argument("--settings", default=",".join(SETTINGS), help="comma-separated, from: " + ", ".join(SETTINGS))
    parser.add_argument("--json", default=str(ROOT / "records/benchmarks/webshop_signal.json"))
    args = parser.parse_args()
    names = [n.strip() for n in args.settings.split(",") if n.strip()]
    unknown = [n for n in names if n not in SETTINGS]
    if unknown:
        parser.error(f"unknown setting(s) {unknown}; choose from {list(SETTINGS)}")
    if args.episodes < 1:
        parser.error("--episodes must be at least 1")

    me = machine.describe()
    print(f"machine: {me['cpu']}, flags {' '.join(me['isa']) or 'none'}, {me['cpus']} cores, torch {me['torch']}")
    rows = []
    with tempfile.TemporaryDirectory() as tmp:
        for name in names:
            rows.append(summarize(play(name, SETTINGS[name], args.episodes, Path(tmp))))
            r = rows[-1]
            print(f"  {name}: {r['nonzero']}/{r['n']} episodes with reward > 0 ({r['seconds']:.0f} s)", flush=True)

    print("\n| setting | episodes | reward > 0 | share, 95% Wilson CI | mean score | wall s |")
    print("|---|---:|---:|---|---:|---:|")
    for r in rows:
        lo, hi = r["share_ci"]
        print(f"| {r['setting']} | {r['n']} | {r['nonzero']} | {r['share']:.0%} [{lo:.0%}, {hi:.0%}] | "
              f"{r['mean_score']:.1f} | {r['seconds']:.0f} |")
    Path(args.json).parent.mkdir(parents=True, exist_ok=True)
    Path(args.json).write_text(json.dumps({"machine": me, "episodes": args.episodes, "rows": rows}, indent=1))
    print(f"\nwrote {args.json}")


if __name__ == "__main__":
    main()
