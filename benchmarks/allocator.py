"""Peak RSS and time of update micro-batches on glibc's malloc vs jemalloc (``empo2.allocator``).

    python benchmarks/allocator.py              # ~3 min on 2 idle cores; writes records/benchmarks/allocator.json

The allocator is fixed when a process starts, so each arm is a child process (this file with ``--child``), and the
arms alternate over ``--rounds``. A child loads SmolLM2-135M with the trainer's LoRA, then runs forward + backward of
``response_logprobs`` on micro-batches shaped like the main job's (a 450-token shared head, 4 rows with 150–210-token
tails and 12-token responses), first shared, then in the padded layout (``prefix_sharing=False``), and reports the
seconds of each and the process's peak RSS (``ru_maxrss``) after the shared part.
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import subprocess
import sys
import time
from pathlib import Path

from empo2.allocator import MALLOC_CONF

RESULTS = Path(__file__).resolve().parents[1] / "records" / "benchmarks" / "allocator.json"


def child(batches: int) -> dict:
    import torch
    from peft import LoraConfig, get_peft_model

    from empo2.allocator import active
    from empo2.policy.loader import load_model
    from empo2.policy.logprobs import response_logprobs
    from empo2.policy.prefix import ComputeOptions

    torch.manual_seed(0)
    model, tok = load_model("smollm2-135m", device="cpu")
    model = get_peft_model(model, LoraConfig(r=8, lora_alpha=16, target_modules="all-linear", task_type="CAUSAL_LM"))
    model.train()
    loaded_gb = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1e6
    g = torch.Generator().manual_seed(0)
    rand = lambda n: torch.randint(100, 40000, (n,), generator=g).tolist()  # noqa: E731
    seconds, peak = {}, 0.0
    for share in (True, False):  # shared first: the peak reported is the shared layout's (ru_maxrss only grows)
        t = time.perf_counter()
        for _ in range(batches):
            head = rand(450)
            prompts = [head + rand(150 + 20 * i) for i in range(4)]
            logp, _ = response_logprobs(model, prompts, [rand(12) for _ in prompts], tok.pad_token_id,
                                        options=ComputeOptions(prefix_sharing=share))
            logp.sum().backward()
        seconds["shared" if share else "padded"] = time.perf_counter() - t
        peak = peak or resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1e6
    return {"allocator": active(), "seconds": seconds["shared"], "padded_seconds": seconds["padded"],
            "peak_rss_gb": peak, "after_load_gb": loaded_gb}


def run_arm(name: str, batches: int) -> dict:
    env = {k: v for k, v in os.environ.items() if k != "LD_PRELOAD"}
    env["EMPO2_ALLOCATOR"] = name
    code = (f"import sys, json; sys.path.insert(0, {str(Path(__file__).parent)!r}); from allocator import child; "
            "from empo2.allocator import reexec_with_jemalloc; reexec_with_jemalloc(); "
            f"print('RESULT', json.dumps(child({batches})))")
    out = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, check=True)
    line = next(x for x in out.stdout.splitlines() if x.startswith("RESULT "))
    return json.loads(line[len("RESULT "):])


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--rounds", type=int, default=2)
    ap.add_argument("--batches", type=int, default=3, help="micro-batches per child")
    ap.add_argument("--out", type=Path, default=RESULTS)
    args = ap.parse_args()
    runs: dict[str, list] = {"system": [], "jemalloc": []}
    for rnd in range(args.rounds):
        for arm in (list(runs) if rnd % 2 == 0 else list(runs)[::-1]):
            r = run_arm(arm, args.batches)
            runs[arm].append(r)
            print(f"round {rnd} {arm:8s} (running on {r['allocator']}): peak RSS {r['peak_rss_gb']:.2f} GB, "
                  f"{r['seconds']:.1f} s", flush=True)
    if runs["jemalloc"][0]["allocator"] != "jemalloc":
        sys.exit("jemalloc is not installed (scripts/setup.sh installs libjemalloc2 as root): nothing to compare")
    med = {arm: {k: sorted(r[k] for r in rs)[len(rs) // 2] for k in ("peak_rss_gb", "seconds", "padded_seconds")}
           for arm, rs in runs.items()}
    res = {"benchmark": "allocator", "time": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
           "loadavg": os.getloadavg(), "args": {"rounds": args.rounds, "batches": args.batches}, "runs": runs,
           "malloc_conf": os.environ.get("MALLOC_CONF", MALLOC_CONF),
           "median": med, "rss_ratio": med["jemalloc"]["peak_rss_gb"] / med["system"]["peak_rss_gb"],
           "time_ratio": med["jemalloc"]["seconds"] / med["system"]["seconds"],
           "padded_time_ratio": med["jemalloc"]["padded_seconds"] / med["system"]["padded_seconds"]}
    print(f"\n{'allocator':10s} {'peak RSS GB':>12s} {'s, shared':>10s} {'s, padded':>10s}")
    for arm, m in med.items():
        print(f"{arm:10s} {m['peak_rss_gb']:12.2f} {m['seconds']:10.1f} {m['padded_seconds']:10.1f}")
    print(f"jemalloc / system: RSS {res['rss_ratio']:.2f}, time {res['time_ratio']:.2f} (shared rows), "
          f"{res['padded_time_ratio']:.2f} (padded rows)")
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(res, indent=2))
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
