"""Warm starts for an evidence preset (``--preset reach``: ScienceWorld's find-non-living-thing; ``coin``:
TextWorldExpress's CoinCollector): held-out success and the share of raw outputs that are valid actions, by number of
gold demonstrations and epoch (records/evidence.md, "A warm start"; the cost in records/benchmarks.md).

Each setting is one ``empo2 sft`` run of the preset's warm config with its demonstrations and ``--epochs`` epochs;
after every epoch it plays the first ``--eval-variations`` dev variations as a training run evaluates (no memory,
temperature 0.4). Prints one row per (setting, epoch) with the success's 95%
Wilson interval, and merges the rows, the runs' times and peak memory and this machine into
``records/benchmarks/warm_start.json``, e.g.::

    python benchmarks/warm_start.py --preset coin --settings own-8,own-32
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
PRESETS = {"reach": "configs/scienceworld_reach_warm_cpu.yaml", "coin": "configs/twx_coin_warm_cpu.yaml"}
NEIGHBOURS = {"reach": ["sft.tasks=[find-animal, find-plant]", "env.step_caps={find-animal: 30, find-plant: 30}"],
              "coin": ["env.textworld_express.params={coin: {numLocations: 3, includeDoors: 1}}",
                       "env.textworld_express.eval_params={coin: {numLocations: 6, includeDoors: 1}}"]}
OWN = {"reach": ["sft.tasks=[find-non-living-thing]"], "coin": []}


def settings(preset: str) -> dict[str, list[str]]:
    """Demonstrations of the task itself (train split), or of its neighbours: find-animal and find-plant for
    find-non-living-thing (their gold paths, 8-16 steps, need a longer cap than the preset's 12), 3-room houses for
    the 6-room coin preset (evaluated on 6 rooms)."""
    out = {f"own-{n}": [f"sft.demos={n}", *OWN[preset]] for n in (8, 32, 128)}
    out |= {f"neighbours-{n}": [f"sft.demos={n}", *NEIGHBOURS[preset]] for n in (32, 128)}
    return out


def run_setting(preset: str, name: str, out: Path, epochs: int, eval_variations: int, extra: list[str]) -> dict:
    from empo2.experiments.stats import wilson

    folder = out / preset / name
    chosen = settings(preset)[name]
    cmd = [sys.executable, "-m", "empo2.cli", "sft", "--config", PRESETS[preset], "--overwrite", *chosen,
           f"sft.epochs={epochs}", f"sft.eval_variations={eval_variations}", f"sft.output_dir={folder}",
           f"policy.warm_start={folder}",
           "train.report_to=none", *extra]
    t0 = time.perf_counter()
    subprocess.run(cmd, check=True, cwd=ROOT)
    wall = time.perf_counter() - t0
    lines = [json.loads(line) for line in (folder / "metrics.jsonl").read_text().splitlines()]
    demos = json.loads((folder / "demos.json").read_text())
    rows = []
    for r in lines[1:]:
        ev = r.get("eval") or {}
        n = ev.get("episodes", 0)
        k = round(ev.get("success_rate", 0.0) * n)
        rows.append({"epoch": r["epoch"], "train_loss": r["train_loss"], "validation_loss": r["validation_loss"],
                     "episodes": n, "successes": k, "success_rate": k / n if n else None, "wilson": wilson(k, n),
                     "score_mean": ev.get("score_mean"), "raw_valid_rate": ev.get("raw_valid_rate"),
                     "train_s": r["time"]["train"], "eval_s": r["time"]["eval"], "peak_rss_gb": r["peak_rss_gb"]})
    best = json.loads((folder / "warm_start" / "warm_start.json").read_text())["epoch"]
    return {"preset": preset, "setting": name, "overrides": chosen + extra, "demos": len(demos["train"]),
            "steps": demos["train_steps"], "skipped": len(demos["train_skipped"]),
            "validation_loss_before": lines[0]["validation_loss"], "demos_s": lines[0]["time"]["demos"],
            "wall_s": wall, "best_epoch": best, "epochs": rows, "folder": str(folder)}


def table(results: list[dict]) -> str:
    out = ["| setting | demos (steps) | epoch | train loss | validation loss | held-out success, 95% Wilson CI | "
           "raw outputs valid | training s | eval s |", "|---|---|---:|---:|---:|---|---:|---:|---:|"]
    for res in results:
        for r in res["epochs"]:
            ci = r["wilson"]
            held = f"{r['successes']}/{r['episodes']} [{ci[0]:.3f}, {ci[1]:.3f}]" if ci else "n/a"
            mark = " (kept)" if r["epoch"] == res["best_epoch"] else ""
            out.append(f"| {res.get('preset', 'reach')} {res['setting']} | {res['demos']} ({res['steps']}) | {r['epoch']}{mark} | "
                       f"{r['train_loss']:.3f} | {r['validation_loss']:.3f} | {held} | {r['raw_valid_rate']:.0%} | "
                       f"{r['train_s']:.0f} | {r['eval_s']:.0f} |")
    return "\n".join(out)


def main() -> None:
    from empo2 import machine

    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--preset", choices=sorted(PRESETS), default="reach")
    parser.add_argument("--settings", default="own-8,own-32,own-128,neighbours-32",
                        help="comma-separated, from: " + ", ".join(settings("reach")))
    parser.add_argument("--epochs", type=int, default=3)
    parser.add_argument("--eval-variations", type=int, default=40)
    parser.add_argument("--out", default="runs/warm_start_curve", help="the sft run folders")
    parser.add_argument("--json", default=str(ROOT / "records/benchmarks/warm_start.json"))
    parser.add_argument("overrides", nargs="*", help="config overrides for every setting")
    args = parser.parse_args()
    path = Path(args.json)
    kept = json.loads(path.read_text()) if path.is_file() else {"results": []}
    done = []
    for name in [s.strip() for s in args.settings.split(",") if s.strip()]:
        print(f"== {name}", flush=True)
        done.append(run_setting(args.preset, name, Path(args.out), args.epochs, args.eval_variations,
                                list(args.overrides)))
        kept["results"] = [r for r in kept["results"]
                           if (r.get("preset", "reach"), r["setting"]) != (args.preset, name)] + [done[-1]]
        kept["machine"] = machine.describe()
        kept["lscpu_flags"] = subprocess.run(["lscpu"], capture_output=True, text=True).stdout.split("Flags:")[-1].strip()
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(json.dumps(kept, indent=1) + "\n")
    print(table(done))


if __name__ == "__main__":
    main()
