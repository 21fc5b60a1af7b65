"""Rollout benchmark: two ratios from one run, a table on stdout, JSON in records/benchmarks/rollout.json.

    EMPO2_HOME=/tmp/e2home python benchmarks/rollout.py    # defaults (G=2, 3 steps, 512-token prompt cap, 2 timed
                                                           # iterations, 2 rounds): ~5 min on 2 idle cores, ~11 loaded
    python benchmarks/rollout.py --rounds 3 --iterations 3 --generations 4 --max-steps 5 --max-prompt-length 1024
                                                           # the issue's full settings: 30+ min on 2 cores (the PPO
                                                           # update of 20 x ~600-token rows dominates)
    python benchmarks/rollout.py --skip-train        # only the generation ratio (~1-2 min)
    python benchmarks/rollout.py --skip-generation   # only the iteration-overhead ratio

1. **Batched vs one-by-one generation** (target >= 4x at batch 8). ``--batch`` realistic ScienceWorld-like prompts
   (task, a solved demonstration, a 1-step history window, hints, current observation; different per row; a few
   hundred tokens each) are rendered with ``PromptParts`` + ``render_prompt_ids`` and generated with
   ``generate_batch`` either in one call (batched arm) or one call per prompt (one-by-one arm). Throughput =
   generated tokens (up to and including EOS) / wall time. The arms are interleaved (A,B,A,B,... for ``--rounds``
   rounds, order flipped every round) and the median is reported, once greedy (identical outputs, so identical token
   counts) and once with sampling (temperature 1.0, same seeds; token counts may differ a little).

2. **EMPO² memory-mode iteration vs GRPO iteration** (paper: ~19% overhead; target <= 10%). Two real ``Trainer`` s
   from ``configs/scienceworld_cpu.yaml`` with identical overrides (same seed, one task, G=--generations, --max-steps steps, few_shot=1,
   rollouts sampled at ``policy.temperature`` ``--temperature``, 1.0 by default; training refuses 0): the EMPO² arm forced to
   ``on_tips`` (``algo.p_memory=1 algo.p_off_policy=0``), the GRPO arm ``algo.name=grpo``. Both run one untimed
   warm-up iteration (the EMPO² one writes the tips the timed iterations retrieve), then ``--iterations`` timed
   iterations, interleaved (G,E then E,G, ...). The same seed gives both arms the same task variation at each
   iteration, so per-iteration paired ratios are reported too. Reported per arm (median over timed iterations):
   whole iteration, rollout, generation, env, memory time (per-step state embedding + retrieval, and end-of-episode
   reflection + embedding + insertion, split by wrapping ``_reflect_and_update``), update, and the prompt length
   (tips make EMPO² prompts longer, which costs generation and update time — that is part of the overhead, not
   hidden). Overhead = median(EMPO²) / median(GRPO) - 1.

The machine is often shared: the load average before and after is recorded in the JSON and printed.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import random
import statistics
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
RESULTS = ROOT / "records" / "benchmarks" / "rollout.json"

# ----------------------------------------------------------------------------------------------- realistic prompts
ROOMS = ["kitchen", "bathroom", "workshop", "art studio", "greenhouse", "outside", "foundry", "bedroom", "living room",
         "hallway"]
OBJECTS = {
    "kitchen": ["a chair", "a counter with a bowl on it", "a cupboard (closed)", "a freezer (closed)",
                "a fridge (closed)", "a glass jar containing sodium chloride", "an oven, which is turned off",
                "a sink, which is turned off", "a stove, which is turned off", "a thermometer, currently reading 10 °C"],
    "bathroom": ["a bathtub, which is turned off", "a glass cup (containing nothing)", "a picture",
                 "a sink, which is turned off", "a toilet", "a drawing"],
    "workshop": ["a table with a battery, a black wire, a red wire and a green light bulb on it",
                 "an ultra low temperature freezer", "a wood cup (containing nothing)", "a blue wire",
                 "a switch, which is off"],
    "art studio": ["a large cupboard (closed)", "a table with a wood cup containing yellow paint on it",
                   "a jug (containing nothing)", "a red paint bottle", "a blue paint bottle"],
    "greenhouse": ["a bee hive", "a flower pot 1 with a apple tree in the adult stage", "a flower pot 2 (empty)",
                   "a jug (containing nothing)", "a shovel", "a sink, which is turned off", "a seed jar"],
    "outside": ["an axe", "a baby brown bear", "a fire pit (containing nothing)", "a fountain (containing water)",
                "the ground", "a baby dove", "a turtle egg", "a parrot egg", "a wood pile"],
    "foundry": ["a blast furnace, which is turned off", "a sink, which is turned off", "a table (empty)"],
    "bedroom": ["a bed with a mattress and a white pillow on it", "a closet (closed)", "a picture",
                "a table (empty)", "a book shelf with a book (Moby Dick) on it"],
    "living room": ["a chair", "a couch with a white pillow on it", "a desk with a drawer",
                    "a painting", "a book shelf"],
    "hallway": ["a picture", "a doorway"],
}
TASKS = [
    "Your task is to find a(n) animal. First, focus on the thing. Then, move it to the {box} in the {room}.",
    "Your task is to find a(n) living thing. First, focus on the thing. Then, move it to the {box} in the {room}.",
    "Your task is to determine if {obj} is electrically conductive. The {obj} is located around the {room}. "
    "First, focus on the {obj}. If it is electrically conductive, place it in the {box}. If not, place it in the "
    "orange box.",
    "Your task is to measure the melting point of {obj}, which is located around the {room}. First, focus on the "
    "thermometer. Next, focus on the {obj}. If the melting point is above 50.0 degrees, focus on the {box}. "
    "If below, focus on the orange box.",
    "Your task is to boil water. For compounds without a boiling point, combusting the substance is also acceptable. "
    "First, focus on the substance. Then, take actions that will cause it to change its state of matter.",
    "Your task is to grow a apple plant from seed. Seeds can be found in the {room}. First, focus on a seed. Then, "
    "make changes to the environment that grow the plant until it reaches the reproducing stage.",
    "Your task is to create green paint. Paint can be found in the {room}. When you are done, focus on the green "
    "paint.",
    "Your task is to use chemistry to create the substance 'salt water'. A recipe and some of the ingredients might "
    "be found near the {room}. When you are done, focus on the salt water.",
]
BOXES = ["red box", "green box", "blue box", "purple box", "yellow box"]
SUBSTANCES = ["unknown substance B", "metal fork", "plastic spoon", "lead", "chocolate", "ice cream", "wax"]


def room_text(room: str, rng: random.Random) -> str:
    objs = list(OBJECTS[room])
    rng.shuffle(objs)
    objs = objs[:5]
    doors = rng.sample([r for r in ROOMS if r != room], 2)
    return (f"This room is called the {room}. In it, you see: \n\tthe agent\n\ta substance called air\n\t"
            + "\n\t".join(objs) + "\nYou also see:\n\t"
            + "\n\t".join(f"A door to the {d} (that is open)" for d in doors))


def realistic_parts(row: int, history: int = 1):
    """ScienceWorld-like PromptParts for row ``row`` (different task, rooms, objects and history per row)."""
    from empo2.agent.prompts import PromptParts

    rng = random.Random(1000 + row)
    room = rng.choice(ROOMS)
    task = TASKS[row % len(TASKS)].format(box=rng.choice(BOXES), room=rng.choice(ROOMS), obj=rng.choice(SUBSTANCES))
    demo_room = rng.choice(ROOMS)
    demo = "\n".join([
        f"Task: {TASKS[(row + 3) % len(TASKS)].format(box=rng.choice(BOXES), room=demo_room, obj=rng.choice(SUBSTANCES))}",
        room_text(demo_room, rng)[:160],
        f"> teleport to {rng.choice(ROOMS)}", "You teleport to the outside.",
        f"> focus on {rng.choice(['baby dove', 'turtle egg', 'parrot egg'])}", "You focus on the parrot egg.",
        f"> move parrot egg to {rng.choice(BOXES)}", "You move the parrot egg to the red box.",
    ])
    init = room_text(room, rng)
    hist = []
    here = room
    for _ in range(history):
        here = rng.choice([r for r in ROOMS if r != here])
        hist.append((f"go to {here}" if rng.random() < 0.5 else f"teleport to {here}", room_text(here, rng)))
    obs = hist[-1][1] if hist else init
    hints = f"Objects you may focus on: {rng.choice(SUBSTANCES)}, {rng.choice(BOXES)}, animal\n" \
            f"In your inventory, you see:\n\tan orange\n\ta {rng.choice(['glass cup', 'wood cup', 'jug'])}"
    return PromptParts(env="scienceworld", task=task, observation=obs, history=hist, initial_observation=init,
                       demonstration=demo, hints=hints)


def median(xs):
    return float(statistics.median(xs)) if xs else float("nan")


def loadavg() -> list[float]:
    try:
        return [round(x, 2) for x in os.getloadavg()]
    except OSError:
        return []


# ----------------------------------------------------------------------------------------------- 1. generation
def bench_generation(args) -> dict:
    import torch

    from empo2.agent.prompts import render_prompt_ids
    from empo2.policy.generate import generate_batch
    from empo2.policy.loader import load_model
    from empo2.policy.sampling import Sampling

    t = time.perf_counter()
    model, tok = load_model("smollm2-135m", device="cpu")
    model.eval()
    load_s = time.perf_counter() - t
    prompts = [render_prompt_ids(tok, realistic_parts(r), history_window=1, max_prompt_length=1024)
               for r in range(args.batch)]
    lengths = [len(p) for p in prompts]
    print(f"[gen] model loaded in {load_s:.1f}s; {args.batch} prompts of {min(lengths)}-{max(lengths)} tokens "
          f"(mean {statistics.mean(lengths):.0f}); torch threads {torch.get_num_threads()}", flush=True)

    def run(arm: str, greedy: bool, seed: int) -> tuple[float, int, list[list[int]]]:
        sampling = Sampling(args.max_new_tokens, temperature=args.gen_temperature, top_p=1.0, greedy=greedy)
        t0 = time.perf_counter()
        if arm == "batched":
            gens = generate_batch(model, tok, prompts, sampling, generator_seed=seed)
        else:
            gens = [generate_batch(model, tok, [p], sampling, generator_seed=seed + i)[0] for i, p in enumerate(prompts)]
        dt = time.perf_counter() - t0
        return dt, sum(len(g.ids) for g in gens), [g.ids for g in gens]

    # Warm-up (untimed): first calls allocate, build kernels, fill caches.
    generate_batch(model, tok, prompts[:2], 4, greedy=True)
    generate_batch(model, tok, prompts[:1], 4, greedy=True)

    out = {"batch": args.batch, "max_new_tokens": args.max_new_tokens, "prompt_tokens": lengths,
           "torch_threads": torch.get_num_threads(), "model_load_s": load_s}
    for label, greedy in (("greedy", True), ("sampling", False)):
        runs = {"batched": [], "one_by_one": []}
        same_outputs = None
        for rnd in range(args.rounds):
            order = ("batched", "one_by_one") if rnd % 2 == 0 else ("one_by_one", "batched")
            ids = {}
            for arm in order:
                dt, ntok, ids[arm] = run(arm, greedy, seed=100 * rnd)
                runs[arm].append({"seconds": dt, "tokens": ntok, "tokens_per_s": ntok / dt})
                print(f"[gen] {label:8s} round {rnd} {arm:10s} {ntok:4d} tokens in {dt:6.2f}s "
                      f"= {ntok / dt:6.1f} tok/s", flush=True)
            if greedy:
                same = ids["batched"] == ids["one_by_one"]
                same_outputs = same if same_outputs is None else (same_outputs and same)
        b = median([r["tokens_per_s"] for r in runs["batched"]])
        o = median([r["tokens_per_s"] for r in runs["one_by_one"]])
        out[label] = {"batched_tok_s": b, "one_by_one_tok_s": o, "speedup": b / o, "runs": runs,
                      "batched_tokens": median([r["tokens"] for r in runs["batched"]]),
                      "one_by_one_tokens": median([r["tokens"] for r in runs["one_by_one"]])}
        if greedy:
            out[label]["identical_greedy_outputs"] = bool(same_outputs)
    model = None  # frees the weights; run() is not called after this
    return out


# ----------------------------------------------------------------------------------------------- 2. iteration
class Probe:
    """Wraps (in this process only) run_episodes / reflect / the embedder to split the times further."""

    def __init__(self):
        import empo2.episodes.drivers as drivers_mod
        import empo2.train.trainer as trainer_mod

        self.last: dict = {}
        self.reflect_s = 0.0
        orig_run, orig_reflect = drivers_mod.run_episodes, trainer_mod.reflect

        def run_episodes(ctx, specs, *a, **kw):
            self.reflect_s = 0.0
            episodes, stats = orig_run(ctx, specs, *a, **kw)
            steps = [s for ep in episodes for s in ep.steps]
            self.last = {
                "stats": dict(stats), "episodes": len(episodes),
                "steps": len(steps), "steps_per_episode": [len(ep.steps) for ep in episodes],
                "scores": [ep.score for ep in episodes],
                "prompt_tokens_mean": statistics.mean(len(s.prompt_ids) for s in steps) if steps else 0.0,
                "tips_per_step": statistics.mean(len(s.tip_ids) for s in steps) if steps else 0.0,
                "update_tokens": sum(len(s.train_prompt_ids) + len(s.response_ids) for s in steps),
            }
            return episodes, stats

        def reflect(*a, **kw):
            t = time.perf_counter()
            try:
                return orig_reflect(*a, **kw)
            finally:
                self.reflect_s += time.perf_counter() - t

        drivers_mod.run_episodes = run_episodes  # the trainer's G-episode driver plays through this name
        trainer_mod.reflect = reflect


def bench_iterations(args) -> dict:
    from empo2.config import Config
    from empo2.train.trainer import Trainer

    probe = Probe()
    common = [
        f"train.seed={args.seed}", "env.tasks=[find-animal]", f"algo.num_generations={args.generations}",
        f"env.max_steps={args.max_steps}", "policy.few_shot=1", "train.progress=false", "train.report_to=none",
        f"policy.temperature={args.temperature}", f"policy.max_prompt_length={args.max_prompt_length}", "train.eval_every=0", f"train.iterations={args.iterations + 1}",
        "train.sample_trajectories=0",
    ]
    arms = {
        "grpo": common + ["algo.name=grpo"],
        "empo2": common + ["algo.name=empo2", "algo.p_memory=1.0", "algo.p_off_policy=0.0"],
    }
    tmp = Path(tempfile.mkdtemp(prefix="rollout_bench_"))
    trainers, setup_s = {}, {}
    try:
        for name, overrides in arms.items():
            t = time.perf_counter()
            trainers[name] = Trainer(Config.load(ROOT / "configs" / "scienceworld_cpu.yaml", overrides),
                                     output_dir=tmp / name)
            setup_s[name] = time.perf_counter() - t
            print(f"[iter] {name} trainer ready in {setup_s[name]:.1f}s", flush=True)
        records: dict[str, list[dict]] = {n: [] for n in arms}
        for it in range(args.iterations + 1):
            order = list(arms) if it % 2 == 0 else list(arms)[::-1]
            for name in order:
                t = time.perf_counter()
                rec = trainers[name].iteration(it)
                whole = time.perf_counter() - t
                p = probe.last
                row = {
                    "iteration": it, "warmup": it == 0, "modes": rec["modes"], "whole": whole,
                    "rollout": rec["time"]["rollout"], "generate": rec["time"]["generate"], "env": rec["time"]["env"],
                    "memory": rec["time"]["memory"], "reflection": probe.reflect_s,
                    "retrieval": rec["time"]["memory"] - probe.reflect_s, "update": rec["time"]["update"],
                    "other": whole - rec["time"]["rollout"] - rec["time"]["update"],
                    "gen_tokens": p["stats"]["gen_tokens"], "prompt_tokens": p["stats"]["prompt_tokens"],
                    "prompt_tokens_mean": p["prompt_tokens_mean"], "steps": p["steps"],
                    "steps_per_episode": p["steps_per_episode"], "scores": p["scores"],
                    "tips_per_step": p["tips_per_step"], "memory_size": rec["memory"]["size"],
                    "tips_added": rec["memory"]["added"], "update_rows": rec["loss"].get("rows", 0),
                    "update_tokens": rec["loss"].get("tokens", 0), "loadavg": loadavg(),
                }
                records[name].append(row)
                print(f"[iter] {name:5s} it {it}{' (warm-up)' if it == 0 else '          '} whole {whole:6.1f}s | "
                      f"rollout {row['rollout']:6.1f}s (gen {row['generate']:5.1f} env {row['env']:5.1f} "
                      f"mem {row['memory']:5.1f} [refl {row['reflection']:5.1f}]) | update {row['update']:5.1f}s | "
                      f"steps {row['steps']:2d} prompt {row['prompt_tokens_mean']:5.0f} tok, "
                      f"tips/step {row['tips_per_step']:.1f}, mem {row['memory_size']}", flush=True)
    finally:
        for tr in trainers.values():
            tr.close()

    keys = ["whole", "rollout", "generate", "env", "memory", "retrieval", "reflection", "update", "other",
            "prompt_tokens_mean", "gen_tokens", "steps", "update_tokens", "tips_per_step"]
    summary = {}
    for name, rows in records.items():
        timed = [r for r in rows if not r["warmup"]]
        summary[name] = {k: median([r[k] for r in timed]) for k in keys}
        summary[name]["per_step_whole"] = median([r["whole"] / max(r["steps"], 1) for r in timed])
        summary[name]["memory_share"] = summary[name]["memory"] / summary[name]["whole"]
    g, e = summary["grpo"], summary["empo2"]
    paired = [re["whole"] / rg["whole"] - 1 for rg, re in zip(records["grpo"], records["empo2"]) if not rg["warmup"]]
    ratio = {
        "overhead_whole": e["whole"] / g["whole"] - 1,
        "overhead_whole_paired_median": median(paired),
        "overhead_rollout": e["rollout"] / g["rollout"] - 1,
        "overhead_per_step": e["per_step_whole"] / g["per_step_whole"] - 1,
        "memory_share_of_empo2_iteration": e["memory_share"],
        "extra_memory_s": e["memory"] - g["memory"],
        "extra_generate_s": e["generate"] - g["generate"],
        "extra_update_s": e["update"] - g["update"],
        "prompt_growth": e["prompt_tokens_mean"] / max(g["prompt_tokens_mean"], 1) - 1,
    }
    return {"overrides": arms, "setup_s": setup_s, "records": records, "summary": summary, "ratios": ratio}


# ----------------------------------------------------------------------------------------------- report
def table(res: dict) -> str:
    lines = []
    gen = res.get("generation")
    if gen:
        lines += [f"Batched vs one-by-one generation (batch {gen['batch']}, {gen['max_new_tokens']} new tokens, "
                  f"prompts {min(gen['prompt_tokens'])}-{max(gen['prompt_tokens'])} tok, median of rounds)",
                  f"  {'':10s} {'batched tok/s':>14s} {'1-by-1 tok/s':>13s} {'speedup':>8s}  target >= 4x"]
        for label in ("greedy", "sampling"):
            r = gen[label]
            lines.append(f"  {label:10s} {r['batched_tok_s']:14.1f} {r['one_by_one_tok_s']:13.1f} "
                         f"{r['speedup']:7.2f}x  {'PASS' if r['speedup'] >= 4 else 'MISS'}")
        lines.append(f"  greedy outputs identical batched vs one-by-one: {gen['greedy'].get('identical_greedy_outputs')}")
    it = res.get("iteration")
    if it:
        s, r = it["summary"], it["ratios"]
        lines += ["", "EMPO² on_tips iteration vs GRPO iteration (median of timed iterations, seconds)",
                  f"  {'':20s} {'GRPO':>8s} {'EMPO²':>8s} {'Δ':>8s}"]
        for k, lab in (("whole", "whole iteration"), ("rollout", "rollout"), ("generate", "  generation"),
                       ("env", "  env"), ("memory", "  memory (all)"), ("retrieval", "    embed+retrieve"),
                       ("reflection", "    reflection"), ("update", "update"), ("other", "other (novelty..)"),
                       ("prompt_tokens_mean", "prompt tokens/step"), ("steps", "agent steps"),
                       ("gen_tokens", "generated tokens"), ("tips_per_step", "tips per step")):
            lines.append(f"  {lab:20s} {s['grpo'][k]:8.2f} {s['empo2'][k]:8.2f} {s['empo2'][k] - s['grpo'][k]:+8.2f}")
        lines += [
            f"  overhead (whole, median ratio)      {100 * r['overhead_whole']:+6.1f}%   target <= +10% "
            f"{'PASS' if r['overhead_whole'] <= 0.10 else 'MISS'}  (paper ~ +19%)",
            f"  overhead (whole, paired median)     {100 * r['overhead_whole_paired_median']:+6.1f}%",
            f"  overhead (rollout only)             {100 * r['overhead_rollout']:+6.1f}%",
            f"  overhead (per agent step)           {100 * r['overhead_per_step']:+6.1f}%",
            f"  memory time share of EMPO² iteration {100 * r['memory_share_of_empo2_iteration']:5.1f}%",
            f"  prompt growth from tips             {100 * r['prompt_growth']:+6.1f}%",
        ]
    m = res["machine"]
    lines += ["", f"machine: {m['cpus']} cpus, load average before {m['loadavg_start']} after {m['loadavg_end']} "
                  f"(shared machine; wall {res['wall_s']:.0f}s)"]
    return "\n".join(lines)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--batch", type=int, default=8, help="generation batch size (default 8)")
    ap.add_argument("--rounds", type=int, default=2, help="interleaved rounds per generation arm (default 2)")
    ap.add_argument("--max-new-tokens", type=int, default=16, help="new tokens per generation (config: 16)")
    ap.add_argument("--gen-temperature", type=float, default=1.0, help="temperature of the sampling run")
    ap.add_argument("--iterations", type=int, default=2, help="timed trainer iterations per arm (after 1 warm-up)")
    ap.add_argument("--generations", type=int, default=2, help="algo.num_generations (G)")
    ap.add_argument("--max-steps", type=int, default=3, help="env.max_steps")
    ap.add_argument("--temperature", type=float, default=1.0,
                    help="policy.temperature of the trainer rollouts (> 0: the trainer samples to train)")
    ap.add_argument("--max-prompt-length", type=int, default=512,
                    help="policy.max_prompt_length of the trainer arms (config: 1024; older history is dropped first)")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--skip-generation", action="store_true")
    ap.add_argument("--skip-train", action="store_true")
    ap.add_argument("--out", type=Path, default=RESULTS)
    args = ap.parse_args()

    import torch

    t0 = time.perf_counter()
    res: dict = {"benchmark": "rollout", "time": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
                 "args": {k: (str(v) if isinstance(v, Path) else v) for k, v in vars(args).items()},
                 "machine": {"cpus": os.cpu_count(), "platform": platform.platform(),
                             "python": platform.python_version(), "torch": torch.__version__,
                             "torch_threads": torch.get_num_threads(), "loadavg_start": loadavg()}}
    if not args.skip_generation:
        res["generation"] = bench_generation(args)
    if not args.skip_train:
        res["iteration"] = bench_iterations(args)
    res["machine"]["loadavg_end"] = loadavg()
    res["wall_s"] = time.perf_counter() - t0
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(res, indent=2))
    print()
    print(table(res))
    print(f"\nwrote {args.out}")


if __name__ == "__main__":  # the env pool uses multiprocessing spawn: workers re-import this file
    main()
