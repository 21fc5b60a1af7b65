"""Where a rollout step's and an iteration's time goes, and the model's speed limit at the rollout's shapes.

    flock /work/cpu.lock python benchmarks/profile_rollout.py                       # the reach preset, ~6 min
    python benchmarks/profile_rollout.py --config configs/X.yaml --task T --parts model rollout

Three parts, each printed as a table and written to ``records/benchmarks/profile_rollout_<widest CPU feature>.json``:

1. ``model``: SmolLM2-135M with the trainer's LoRA (unmerged, as rollouts run it) in float32 and bfloat16 autocast:
   prefill tokens/s of B rows × S new tokens on top of a C-token KV cache, and decode tokens/s of B rows on a C-token
   cache (``--shapes``), the medians of ``--repeats`` after one warm-up.
2. ``rollout``: one rollout of G episodes from the preset (``--task``, variation 0, mode ``on``), with forward hooks
   on the model: tokens prefilled and decoded per env step, seconds in prefill forwards, decode forwards, the rest
   of generation (sampling, cache layout: Python), the environment pool, memory and prompt rendering. The
   episodes' actions are then replayed in one in-process ScienceWorld instance whose simulator calls are timed: the
   step itself, the valid-action fetch (only when an action needs correcting), the per-step ``look`` and
   ``inventory`` calls, the score reads.
3. ``iteration``: one whole training iteration (``Trainer.iteration``) with its phases.

From parts 1 and 2 the script gives the limit of env-steps/s that the model's speed sets for today's prompts
(every step prefills what it prefilled here) and for a layout that prefills only the new tokens of each turn.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
RESULTS = ROOT / "records" / "benchmarks"
sys.path.insert(0, str(ROOT / "benchmarks"))
from engines import machine  # noqa: E402  (the CPU's flags, threads and precision)


def trainer_for(args, extra: list[str] = ()):
    from empo2.config import Config
    from empo2.train.trainer import Trainer

    overrides = [f"train.seed={args.seed}", f"env.tasks=[{args.task}]", f"algo.num_generations={args.generations}",
                 "train.progress=false", "train.report_to=none", "train.eval_every=0", "train.iterations=100",
                 "train.eval_at_start=false", "train.sample_trajectories=0", *args.set, *extra]
    return Trainer(Config.load(args.config, overrides), output_dir=Path(tempfile.mkdtemp(prefix="profile_")))


# ----------------------------------------------------------------------------------------------- part 1
def bench_model(trainer, args) -> list[dict]:
    """Prefill and decode tokens/s at the given shapes, float32 and bfloat16 autocast."""
    import torch

    from empo2.policy import kv_cache
    from empo2.policy import prefix as px

    model, rows = trainer.model, []
    vocab = model.config.vocab_size if hasattr(model, "config") else 49152
    for dtype in ("float32", "bfloat16"):
        options = px.ComputeOptions(compute_dtype=dtype)
        for kind, b, s, c in args.shapes:
            times = []
            for _ in range(args.repeats + 1):  # the first is a warm-up (kernel selection, allocator)
                g = torch.Generator().manual_seed(0)
                ctx = torch.randint(100, vocab - 100, (1, c), generator=g)
                new = torch.randint(100, vocab - 100, (b, s if kind == "prefill" else 1), generator=g)
                with torch.no_grad(), px.autocast(model, options):
                    cache = None
                    if c:
                        out = model(input_ids=ctx, use_cache=True, logits_to_keep=1)
                        kv = [(k.expand(b, -1, -1, -1).contiguous(), v.expand(b, -1, -1, -1).contiguous())
                              for k, v in kv_cache.layer_kv(kv_cache.output_cache(out))]
                        cache = kv_cache.make_cache(model, kv, room=new.shape[1] + 1)
                    width = c + new.shape[1]
                    kw = kv_cache.cache_kwargs(model, cache) if cache is not None else {}
                    t = time.perf_counter()
                    model(input_ids=new, attention_mask=torch.ones((b, width), dtype=torch.long),
                          position_ids=torch.arange(c, width)[None].expand(b, -1), use_cache=True,
                          logits_to_keep=1, **kw)
                    times.append(time.perf_counter() - t)
            sec = statistics.median(times[1:])
            tokens = b * new.shape[1]
            rows.append({"dtype": dtype, "kind": kind, "rows": b, "new_tokens": new.shape[1], "cached": c,
                         "seconds": sec, "tokens_per_s": tokens / sec})
            print(f"[model] {dtype:8s} {kind:7s} B={b} S={new.shape[1]} cache={c}: {sec * 1000:.1f} ms, "
                  f"{tokens / sec:.0f} tokens/s", flush=True)
    return rows


# ----------------------------------------------------------------------------------------------- part 2
class ForwardMeter:
    """Forward hooks on the base model: tokens and seconds of prefill (more than one new token a row) and decode
    (one new token a row) forwards."""

    def __init__(self, model):
        base = model.get_base_model() if hasattr(model, "get_base_model") else model
        self.stats = {"prefill_tokens": 0, "prefill_s": 0.0, "prefill_calls": 0, "decode_tokens": 0, "decode_s": 0.0,
                      "decode_calls": 0}
        self._t, self._kind = 0.0, None
        self._hooks = [base.register_forward_pre_hook(self._pre, with_kwargs=True),
                       base.register_forward_hook(self._post)]

    def _pre(self, module, args, kwargs):
        ids = kwargs.get("input_ids", args[0] if args else None)
        mask = kwargs.get("attention_mask")
        width = ids.shape[1]
        real = int(mask[:, -width:].sum()) if mask is not None else ids.numel()
        self._kind = "prefill" if width > 1 else "decode"
        self.stats[f"{self._kind}_tokens"] += real
        self.stats[f"{self._kind}_calls"] += 1
        self._t = time.perf_counter()

    def _post(self, module, args, output):
        self.stats[f"{self._kind}_s"] += time.perf_counter() - self._t

    def close(self):
        for h in self._hooks:
            h.remove()


def bench_rollout(trainer, args) -> dict:
    import torch

    from empo2.episodes import rollout as ro
    from empo2.policy.sampling import Sampling
    from empo2.rundir.metrics import peak_rss_gb

    tasks = [(args.task, 0, 0, "on")] * args.generations
    sampling = Sampling.rollout(trainer.cfg.policy, 1.0)
    ro.run_episodes(trainer.ctx, tasks, sampling)  # untimed: the demonstration fetch, allocator warm-up
    render = {"s": 0.0}
    original = ro._render

    def timed_render(*a, **k):
        t = time.perf_counter()
        try:
            return original(*a, **k)
        finally:
            render["s"] += time.perf_counter() - t

    meter = ForwardMeter(trainer.model)
    ro._render = timed_render
    torch.manual_seed(args.seed)
    t = time.perf_counter()
    try:
        episodes, stats = ro.run_episodes(trainer.ctx, tasks, sampling)
    finally:
        ro._render = original
        meter.close()
    wall = time.perf_counter() - t
    steps = sum(len(e.steps) for e in episodes)
    m = meter.stats
    out = {"wall_s": wall, "env_steps": steps, "steps_per_s": steps / wall, "generate_s": stats["gen_time"],
           "env_s": stats["env_time"], "memory_s": stats["memory_time"], "render_s": render["s"],
           "gen_tokens": stats["gen_tokens"], "prompt_tokens": stats["prompt_tokens"], **m,
           "generate_other_s": stats["gen_time"] - m["prefill_s"] - m["decode_s"],
           "rest_s": wall - stats["gen_time"] - stats["env_time"] - stats["memory_time"] - render["s"],
           "peak_rss_gb": peak_rss_gb(),
           "actions": [[(s.raw_action) for s in e.steps] for e in episodes]}
    per = lambda k: out[k] / max(steps, 1)  # noqa: E731
    print(f"[rollout] {steps} env steps in {wall:.1f} s ({out['steps_per_s']:.2f}/s); per env step: "
          f"prompt {per('prompt_tokens'):.0f} tokens, prefilled {per('prefill_tokens'):.0f}, decoded "
          f"{per('decode_tokens'):.1f}; prefill {out['prefill_s']:.1f} s, decode {out['decode_s']:.1f} s, other "
          f"generation {out['generate_other_s']:.1f} s, env {out['env_s']:.1f} s, render {out['render_s']:.2f} s",
          flush=True)
    return out


def replay_env(trainer, args, actions: list[list[str]]) -> dict:
    """The rollout's actions replayed in one in-process ScienceWorld, its simulator calls timed."""
    from empo2.envs.scienceworld import ScienceWorldEnv

    cfg = trainer.cfg.env
    env = ScienceWorldEnv(simplification=cfg.scienceworld.simplification, max_steps=cfg.max_steps,
                          valid_actions_in_info=False, action_cutoff=cfg.action_cutoff)
    times = {"sim_step": 0.0, "valid_actions": 0.0, "look": 0.0, "inventory": 0.0, "score": 0.0, "step_total": 0.0,
             "reset": 0.0}
    counts = dict.fromkeys(times, 0)

    def wrap(obj, name, key):
        fn = getattr(obj, name)

        def timed(*a, **k):
            t = time.perf_counter()
            try:
                return fn(*a, **k)
            finally:
                times[key] += time.perf_counter() - t
                counts[key] += 1
        setattr(obj, name, timed)

    sim = env._sim
    wrap(env, "_run", "sim_step")
    wrap(env, "_read_score", "score")
    wrap(sim, "get_valid_action_object_combinations", "valid_actions")
    wrap(sim, "look", "look")
    wrap(sim, "inventory", "inventory")
    try:
        for episode in actions:
            t = time.perf_counter()
            env.reset(args.task, 0)
            times["reset"] += time.perf_counter() - t
            for action in episode:
                t = time.perf_counter()
                env.step(action)
                times["step_total"] += time.perf_counter() - t
                counts["step_total"] += 1
    finally:
        env.close()
    out = {"seconds": times, "calls": counts}
    n = max(counts["step_total"], 1)
    print("[env] per step (ms): " + ", ".join(f"{k} {1000 * v / n:.1f}" for k, v in times.items() if k != "reset")
          + f"; reset {1000 * times['reset'] / max(len(actions), 1):.0f} ms per episode", flush=True)
    return out


# ----------------------------------------------------------------------------------------------- part 3
def bench_iteration(trainer, args) -> dict:
    t = time.perf_counter()
    rec = trainer.iteration(0)
    wall = time.perf_counter() - t
    out = {"wall_s": wall, "time": rec["time"], "env_steps": rec["train"]["env_steps"], "modes": rec["modes"],
           "update_tokens": rec["loss"].get("tokens"), "peak_rss_gb": rec["memory_peak_rss_gb"]}
    tm = rec["time"]
    print(f"[iteration] {wall:.1f} s: rollout {tm['rollout']:.1f} (generate {tm['generate']:.1f}, env "
          f"{tm['env']:.1f}, memory {tm['memory']:.1f}), update {tm['update']:.1f}, sync {tm['sync']:.1f}; "
          f"{out['env_steps']} env steps, {out['update_tokens']} update tokens, modes {rec['modes']}", flush=True)
    return out


def limits(model_rows: list[dict], roll: dict) -> dict:
    """Env-steps/s the model's speed allows, prefilling what this rollout prefilled (today) or only each turn's new
    tokens (its response and the next user turn), at the measured prefill and decode rates."""
    out = {}
    steps = max(roll["env_steps"], 1)
    prefill_per_step = roll["prefill_tokens"] / steps
    decode_per_step = roll["decode_tokens"] / steps
    new_per_step = roll.get("new_tokens_per_step")
    for dtype in ("float32", "bfloat16"):
        pre = [r for r in model_rows if r["dtype"] == dtype and r["kind"] == "prefill"]
        dec = [r for r in model_rows if r["dtype"] == dtype and r["kind"] == "decode"]
        if not pre or not dec:
            continue
        p_rate = max(r["tokens_per_s"] for r in pre)
        d_rate = statistics.median(r["tokens_per_s"] for r in dec)
        today = 1 / (prefill_per_step / p_rate + decode_per_step / d_rate)
        out[dtype] = {"prefill_tokens_per_s": p_rate, "decode_tokens_per_s": d_rate, "today_steps_per_s": today}
        if new_per_step:
            out[dtype]["append_steps_per_s"] = 1 / (new_per_step / p_rate + decode_per_step / d_rate)
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--config", type=Path, default=ROOT / "configs" / "scienceworld_reach_cpu.yaml")
    ap.add_argument("--task", default="find-non-living-thing")
    ap.add_argument("--generations", type=int, default=8)
    ap.add_argument("--seed", type=int, default=1)
    ap.add_argument("--set", nargs="*", default=[], help="more config overrides (key=value)")
    ap.add_argument("--parts", nargs="+", default=["model", "rollout", "iteration"],
                    choices=["model", "rollout", "iteration"])
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--shapes", type=lambda s: (s.split(":")[0], *map(int, s.split(":")[1:])), nargs="+",
                    default=[("prefill", 1, 600, 0), ("prefill", 8, 300, 300), ("prefill", 8, 150, 600),
                             ("decode", 8, 1, 700), ("decode", 8, 1, 1500)],
                    help="kind:B:S:C (prefill or decode, rows, new tokens, cached tokens)")
    ap.add_argument("--out", type=Path)
    args = ap.parse_args()
    from empo2.policy.precision import cpu_flags, isa_flags

    widest = isa_flags(cpu_flags())
    args.out = args.out or RESULTS / f"profile_rollout_{widest[-1] if widest else 'cpu'}.json"
    res = {"benchmark": "profile_rollout", "time": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
           "commit": subprocess.run(["git", "rev-parse", "--short", "HEAD"], cwd=ROOT, capture_output=True,
                                    text=True).stdout.strip(),
           "args": {k: str(v) for k, v in vars(args).items()}, "machine": machine(),
           "lscpu_flags": sorted(cpu_flags() or [])}
    print(f"CPU {res['machine']['cpu']} · flags {' '.join(res['machine']['flags'])} · "
          f"{res['machine']['torch_threads']} torch threads · load {os.getloadavg()}", flush=True)
    trainer = trainer_for(args)
    try:
        if "model" in args.parts:
            res["model"] = bench_model(trainer, args)
        if "rollout" in args.parts:
            res["rollout"] = bench_rollout(trainer, args)
            if trainer.cfg.env.name == "scienceworld":
                res["env"] = replay_env(trainer, args, res["rollout"]["actions"])
            else:
                print(f"[env] simulator calls are timed for ScienceWorld only; {trainer.cfg.env.name}'s time is the "
                      "rollout's env column", flush=True)
            if "model" in args.parts:
                res["limits"] = limits(res["model"], res["rollout"])
                print(f"[limits] {json.dumps(res['limits'])}")
        if "iteration" in args.parts:
            res["iteration"] = bench_iteration(trainer, args)
    finally:
        trainer.close()
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(res, indent=2))
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
