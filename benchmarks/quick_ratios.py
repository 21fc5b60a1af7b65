"""Prefix sharing and bfloat16, measured in CPU seconds (no simulator): robust to other jobs' load.

    EMPO2_HOME=/tmp/e2home python benchmarks/quick_ratios.py      # ~5 CPU-minutes; JSON: records/benchmarks/quick_ratios.json

SmolLM2-135M + the CPU config's LoRA adapter, one thread. Prompts are ScienceWorld-like ``PromptParts`` (task,
demonstration, hints, observation; ``benchmarks/rollout.py``) for one task rolled out G times: step 0 (identical
prompts), then steps 1 and 2 whose histories differ per rollout. Arms alternate (today, shared, shared, today) and
each is measured in process CPU time and wall time: generation (16 new tokens, sampled), the update's
forward + backward over all rows (today: padded micro-batches; shared: prefix-shared ones), peak RSS of that update,
and the first-mini-batch |ratio − 1| per compute dtype.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from dataclasses import replace
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "benchmarks"))
from iteration import uptime  # noqa: E402
from rollout import realistic_parts  # noqa: E402


def group_prompts(tok, g: int, steps: int = 3) -> list[list[list[int]]]:
    """Per step, the G prompts of one task's rollouts (identical at step 0, diverging histories after)."""
    from empo2.agent.prompts import render_prompt_ids

    base = realistic_parts(0, history=0)
    rooms = ["kitchen", "hallway", "outside", "workshop", "bathroom", "greenhouse", "foundry", "bedroom"]
    out = []
    for t in range(steps):
        parts = []
        for k in range(g):
            hist = [(f"go to {rooms[(k + j) % 8]}", f"You move to the {rooms[(k + j) % 8]}. This room is called the "
                     f"{rooms[(k + j) % 8]}. In it, you see: a table, a door.") for j in range(t)]
            parts.append(replace(base, history=hist, observation=hist[-1][1] if hist else base.observation))
        out.append([render_prompt_ids(tok, p, 2, 1024) for p in parts])
    return out


def timed(fn):
    c, w = time.process_time(), time.perf_counter()
    value = fn()
    return value, time.process_time() - c, time.perf_counter() - w


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--generations", type=int, nargs="+", default=[4, 8])
    ap.add_argument("--budget", type=int, default=4096, help="micro-batch token budget (config: 4096)")
    ap.add_argument("--out", type=Path, default=ROOT / "records" / "benchmarks" / "quick_ratios.json")
    args = ap.parse_args()
    import torch
    from peft import LoraConfig, get_peft_model

    from empo2.policy import prefix as px
    from empo2.policy.generate import generate_batch
    from empo2.policy.loader import load_model
    from empo2.policy.logprobs import micro_batches, response_logprobs, shared_micro_batches
    from empo2.policy.sampling import Sampling
    from empo2.rundir.metrics import peak_rss_gb, reset_peak_rss

    torch.set_num_threads(1)
    model, tok = load_model("smollm2-135m", device="cpu")
    model = get_peft_model(model, LoraConfig(r=8, lora_alpha=16, target_modules=[
        "q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"], task_type="CAUSAL_LM"))
    res = {"benchmark": "quick_ratios", "uptime_start": uptime(), "budget": args.budget, "generation": {}}

    def generate(steps, share, dtype="float32"):
        options = px.ComputeOptions(prefix_sharing=share, compute_dtype=dtype)
        torch.manual_seed(0)
        return [generate_batch(model, tok, p, Sampling(16, temperature=1.0), options=options) for p in steps]

    def update(prompts, responses, share):
        options = px.ComputeOptions(prefix_sharing=share)
        batches = shared_micro_batches(prompts, responses, args.budget) if share else \
            list(micro_batches(prompts, responses, args.budget))
        model.train()
        reset_peak_rss()
        for b in batches:
            lp, mask = response_logprobs(model, [prompts[i] for i in b], [responses[i] for i in b], tok.pad_token_id,
                                         options=options)
            (lp * mask).sum().backward()
        model.zero_grad(set_to_none=True)
        model.eval()
        return len(batches), peak_rss_gb()

    for g in args.generations:
        steps = group_prompts(tok, g)
        arms = {"today": [], "shared": []}
        gens = None
        for arm in ("today", "shared", "shared", "today"):
            gens, cpu, wall = timed(lambda: generate(steps, arm == "shared"))
            arms[arm].append({"cpu_s": cpu, "wall_s": wall})
            print(f"[gen] G={g} {arm:6s} cpu {cpu:6.1f}s wall {wall:6.1f}s", flush=True)
        prompts = [p for step in steps for p in step]
        responses = [x.ids for step in gens for x in step]
        tokens = sum(len(p) + len(r) for p, r in zip(prompts, responses))
        upd = {"today": [], "shared": []}
        for arm in ("today", "shared", "shared", "today"):
            (n, rss), cpu, wall = timed(lambda: update(prompts, responses, arm == "shared"))
            upd[arm].append({"cpu_s": cpu, "wall_s": wall, "micro_batches": n, "peak_rss_gb": rss})
            print(f"[update] G={g} {arm:6s} {len(prompts)} rows {tokens} tokens, {n} micro-batches: cpu {cpu:6.1f}s "
                  f"wall {wall:6.1f}s, peak RSS {rss:.2f} GB", flush=True)
        best = lambda rs, k: min(r[k] for r in rs)  # noqa: E731  (least disturbed run)
        res["generation"][f"G{g}"] = {
            "prompt_tokens": [len(p) for p in prompts], "runs": arms, "update_runs": upd, "update_tokens": tokens,
            "gen_speedup_cpu": best(arms["today"], "cpu_s") / best(arms["shared"], "cpu_s"),
            "gen_speedup_wall": best(arms["today"], "wall_s") / best(arms["shared"], "wall_s"),
            "update_speedup_cpu": best(upd["today"], "cpu_s") / best(upd["shared"], "cpu_s"),
            "update_speedup_wall": best(upd["today"], "wall_s") / best(upd["shared"], "wall_s"),
            "update_peak_rss_gb": {a: max(r["peak_rss_gb"] for r in upd[a]) for a in upd}}
        print(json.dumps({k: v for k, v in res["generation"][f"G{g}"].items() if "speedup" in k or "rss" in k}),
              flush=True)
        args.out.write_text(json.dumps(res, indent=2))

    steps = group_prompts(tok, 4)
    res["ratio"] = {}
    for dtype in ("float32", "bfloat16"):
        gens, cpu, _ = timed(lambda: generate(steps, True, dtype))
        prompts = [p for step in steps for p in step]
        responses = [x.ids for step in gens for x in step]
        model.train()
        with torch.no_grad():
            new, mask = response_logprobs(model, prompts, responses, tok.pad_token_id)
        model.eval()
        old = torch.zeros_like(new)
        for r, x in enumerate([x for step in gens for x in step]):
            old[r, : len(x.logprobs)] = torch.tensor(x.logprobs)
        dev = (new - old)[mask].exp().sub(1).abs()
        res["ratio"][dtype] = {"median": float(dev.median()), "p99": float(dev.quantile(0.99)),
                               "max": float(dev.max()), "tokens": int(mask.sum()), "generate_cpu_s": cpu}
        print(f"[ratio] {dtype}: {res['ratio'][dtype]}", flush=True)
    res["uptime_end"] = uptime()
    args.out.write_text(json.dumps(res, indent=2))
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
