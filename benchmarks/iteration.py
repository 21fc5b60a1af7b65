"""Iteration-cost benchmark: each speed switch off and on, side by side in one process.

    EMPO2_HOME=/tmp/e2home python benchmarks/iteration.py             # defaults: ~10 min on 2 idle cores
    python benchmarks/iteration.py --max-steps 6 --rollout-generations 4 8 --iterations 2   # the issue's settings
                                                                      # (~25 min on 2 idle cores)

Real ``Trainer`` s from ``configs/scienceworld_cpu.yaml`` (SmolLM2-135M + LoRA, ScienceWorld find-animal, sampled
rollouts at temperature 1.0, same seed for every arm). "today" = ``policy.prefix_sharing=false`` (left-padded
``model.generate`` and padded log-prob rows), "shared" = the default (prompt heads computed once, responses' logits
in chunks, and a rollout's heads reused from one step to the next). Arms alternate order; rows of the table are
medians.

1. Rollout env-steps/s at each ``--rollout-generations`` G (one task, G episodes of ``--max-steps`` steps, no memory),
   with a third arm "no_reuse" (``policy.reuse_heads=false``: heads shared within a step only). One untimed rollout
   comes first, so no arm pays for fetching the demonstration (earlier versions charged it to the first arm, "today").
   ``--rollout-only`` stops after this part.
2. Update tokens/s: the same rows (the last shared rollout's steps, advantages ±1) through the trainer's ``PolicyUpdate``.
3. Peak RSS and tokens/s of the update per ``train.micro_batch_tokens`` (``--budgets``).
4. A whole EMPO² iteration (modes forced to ``on_tips``) today vs shared, with the trainer's per-iteration peak RSS.
5. EMPO² ``on_tips`` iteration vs GRPO iteration (both shared), and the reflection's share of the EMPO² iteration;
   a fourth arm, "empo2_overlap", writes the tips while the update trains (``memory.overlap_reflection``; its
   "reflection" column is the wait for them after the update). ``--iterations-only`` runs parts 4 and 5 alone.
6. First-mini-batch |ratio − 1| (median, p99) with ``policy.autocast`` none (float32) and bfloat16: behaviour
   log-probs from a rollout, training log-probs of the same rows in ``train()`` mode, same numerics.

The machine is shared with other agents: absolute times are noisy, the ratios less so; ``uptime`` is recorded.
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
RESULTS = ROOT / "records" / "benchmarks" / "iteration.json"
ROLLOUT_RESULTS = RESULTS.with_name("iteration_rollout.json")
sys.path.insert(0, str(ROOT / "benchmarks"))
from rollout import loadavg, median  # noqa: E402  (the other benchmark's helpers)


def uptime() -> str:
    return subprocess.run(["uptime"], capture_output=True, text=True).stdout.strip()


class Arms:
    """The benchmark's arms as trainers built from one set of parts: the model with its LoRA, the tokenizer, the
    environment workers, the embedder and the memory are made once (by the first trainer) and shared; each arm is a
    ``Trainer`` configured with its own switches, built on first use and kept. The arms also share one cache of
    fetched demonstrations, so no arm pays for a fetch another arm made."""

    def __init__(self, tmp: Path, name: str, args, extra: list[str]):
        self.tmp, self.name = tmp, name
        self.base = make_trainer(tmp, name, args, extra)
        self.built = {}

    def get(self, share: bool = True, dtype: str = "float32", reuse: bool = True, micro_batch_tokens: int = 0,
            overlap: bool = False, generations: int = 0):
        """The trainer with ``policy.prefix_sharing=share``, ``policy.reuse_heads=reuse``, ``policy.autocast``
        (``dtype``), and where given ``train.micro_batch_tokens``, ``memory.overlap_reflection`` and
        ``algo.num_generations``."""
        import copy

        from empo2.train.trainer import Trainer

        key = (share, dtype, reuse, micro_batch_tokens, overlap, generations)
        if key not in self.built:
            base = self.base
            cfg = copy.deepcopy(base.cfg)
            cfg.policy.prefix_sharing, cfg.policy.reuse_heads = share, reuse
            cfg.policy.autocast = "none" if dtype == "float32" else dtype
            cfg.memory.overlap_reflection = True if overlap else cfg.memory.overlap_reflection
            cfg.train.micro_batch_tokens = micro_batch_tokens or cfg.train.micro_batch_tokens
            cfg.algo.num_generations = generations or cfg.algo.num_generations
            arm = Trainer(cfg, model=base.model, tokenizer=base.tokenizer, env=base.pool, memory=base.memory,
                          embedder=base.embedder, output_dir=self.tmp / f"{self.name}_{len(self.built)}")
            arm.ctx.demonstrations = base.ctx.demonstrations
            self.built[key] = arm
        return self.built[key]

    def close(self) -> None:
        for arm in self.built.values():
            arm.close()
        self.base.close()


def make_trainer(tmp: Path, name: str, args, extra: list[str]):
    from empo2.config import Config
    from empo2.train.trainer import Trainer

    overrides = [f"train.seed={args.seed}", "env.tasks=[find-animal]", f"env.max_steps={args.max_steps}",
                 "train.progress=false", "train.report_to=none", "train.eval_every=0", "train.iterations=100",
                 "train.sample_trajectories=0", f"train.micro_batch_tokens={args.micro_batch_tokens}"] + extra
    return Trainer(Config.load(ROOT / "configs" / "scienceworld_cpu.yaml", overrides), output_dir=tmp / name)


def bench_rollout(arms: Arms, args, log) -> tuple[dict, list]:
    from empo2.episodes.rollout import run_episodes
    from empo2.policy.sampling import Sampling

    out, last = {}, None
    # untimed: fetches the demonstration (into the cache every arm shares) and warms the allocator
    run_episodes(arms.get().ctx, [("find-animal", 0, 0, "on")] * max(args.rollout_generations),
                 Sampling.rollout(arms.get().cfg.policy, 1.0))
    for g in args.rollout_generations:
        runs = {"today": [], "no_reuse": [], "shared": []}
        for rnd in range(args.rounds):
            for arm in (list(runs) if rnd % 2 == 0 else list(runs)[::-1]):
                trainer = arms.get(arm != "today", reuse=arm == "shared")
                import torch

                torch.manual_seed(args.seed + rnd)
                t = time.perf_counter()
                eps, st = run_episodes(trainer.ctx, [("find-animal", 0, 0, "on")] * g,
                                       Sampling.rollout(trainer.cfg.policy, 1.0))
                dt = time.perf_counter() - t
                steps = sum(len(e.steps) for e in eps)
                runs[arm].append({"seconds": dt, "steps": steps, "steps_per_s": steps / dt,
                                  "generate_s": st["gen_time"], "prompt_tokens": st["prompt_tokens"]})
                log(f"[rollout] G={g} round {rnd} {arm:6s} {steps} steps in {dt:6.1f}s (gen {st['gen_time']:.1f}s)")
                if arm == "shared":
                    last = eps
        a, c, b = (median([r["steps_per_s"] for r in runs[k]]) for k in ("today", "no_reuse", "shared"))
        out[f"G{g}"] = {"today_steps_per_s": a, "no_reuse_steps_per_s": c, "shared_steps_per_s": b, "speedup": b / a,
                        "reuse_gain": b / c, "runs": runs}
    return out, last


def signed_rows(episodes):
    """The episodes' update rows with advantages ±1 (every row trains)."""
    from empo2.train.rows import update_rows

    return update_rows(episodes, [[1.0 if i % 2 == 0 else -1.0] * len(e.steps) for i, e in enumerate(episodes)])


def bench_update(arms: Arms, episodes, args, log) -> dict:
    runs = {"today": [], "shared": []}
    for rnd in range(args.rounds):
        for arm in (("today", "shared") if rnd % 2 == 0 else ("shared", "today")):
            trainer = arms.get(arm == "shared")
            from empo2.rundir.metrics import peak_rss_gb, reset_peak_rss

            reset_peak_rss()
            t = time.perf_counter()
            m = trainer.update(signed_rows(episodes))
            dt = time.perf_counter() - t
            runs[arm].append({"seconds": dt, "tokens": m["tokens"], "tokens_per_s": m["tokens"] / dt,
                              "peak_rss_gb": peak_rss_gb()})
            log(f"[update] round {rnd} {arm:6s} {m['rows']} rows, {m['tokens']} tokens in {dt:6.1f}s, "
                f"peak RSS {runs[arm][-1]['peak_rss_gb']:.2f} GB")
    a, b = (median([r["tokens_per_s"] for r in runs[k]]) for k in ("today", "shared"))
    return {"today_tokens_per_s": a, "shared_tokens_per_s": b, "speedup": b / a, "runs": runs}


def bench_budgets(arms: Arms, episodes, budgets: list[int], log) -> dict:
    """Update peak RSS and tokens/s per ``train.micro_batch_tokens`` (shared path, float32). Smallest budget first:
    memory the allocator keeps after a bigger budget would otherwise count towards the next one's peak."""
    from empo2.rundir.metrics import peak_rss_gb, reset_peak_rss

    out = {}
    for budget in sorted(budgets):
        trainer = arms.get(micro_batch_tokens=budget)
        reset_peak_rss()
        t = time.perf_counter()
        m = trainer.update(signed_rows(episodes))
        dt = time.perf_counter() - t
        out[str(budget)] = {"seconds": dt, "tokens": m["tokens"], "tokens_per_s": m["tokens"] / dt,
                            "peak_rss_gb": peak_rss_gb()}
        log(f"[budget] micro_batch_tokens {budget:5d}: {m['tokens']} tokens in {dt:6.1f}s "
            f"({m['tokens'] / dt:.1f}/s), peak RSS {out[str(budget)]['peak_rss_gb']:.2f} GB")
    return out


def bench_bf16_update(arms: Arms, episodes, log) -> dict:
    """Update tokens/s, float32 vs bfloat16 autocast, on the first episode's rows only: without native bf16 matmul
    (no AVX512-BF16/AMX) autocast on this CPU is ~18x slower: the whole G = 8 set took ~14 min."""
    out = {}
    for dtype in ("float32", "bfloat16"):
        trainer = arms.get(dtype=dtype)
        t = time.perf_counter()
        m = trainer.update(signed_rows(episodes[:1]))
        out[f"{dtype}_tokens_per_s"] = m["tokens"] / (time.perf_counter() - t)
        log(f"[update] shared+{dtype} on {m['rows']} rows: {out[f'{dtype}_tokens_per_s']:.1f} tokens/s")
    return {**out, "bf16_rows": len(episodes[0].steps)}


class ReflectTimer:
    """Times ``reflect`` (the end-of-episode reflection the trainer calls) by wrapping it in this process."""

    def __init__(self):
        import empo2.train.trainer as trainer_mod

        self.seconds, orig = 0.0, trainer_mod.reflect

        def wrapped(*a, **kw):
            t = time.perf_counter()
            try:
                return orig(*a, **kw)
            finally:
                self.seconds += time.perf_counter() - t

        trainer_mod.reflect = wrapped


def run_iteration(trainer, it: int, timer: ReflectTimer, label: str, log) -> dict:
    timer.seconds = 0.0
    t = time.perf_counter()
    rec = trainer.iteration(it)
    whole = time.perf_counter() - t
    reflection = timer.seconds if trainer.reflection is None else rec["time"]["memory"]  # overlap: the wait
    row = {"whole": whole, "rollout": rec["time"]["rollout"], "update": rec["time"]["update"],
           "reflection": reflection, "peak_rss_gb": rec["memory_peak_rss_gb"], "modes": rec["modes"],
           "steps": rec["train"]["steps_mean"], "update_tokens": rec["loss"].get("tokens", 0)}
    log(f"[iter] {label:14s} it {it}: whole {whole:6.1f}s rollout {row['rollout']:6.1f}s (reflection "
        f"{row['reflection']:.1f}s) update {row['update']:6.1f}s peak RSS {row['peak_rss_gb']:.2f} GB")
    return row


def bench_ratio(arms: Arms, episodes, args, log) -> dict:
    """First-mini-batch |ratio − 1| per compute dtype: behaviour log-probs vs training log-probs, same rows."""
    import numpy as np
    import torch

    from empo2.policy.generate import generate_batch
    from empo2.policy.logprobs import response_logprobs, shared_micro_batches
    from empo2.policy.sampling import Sampling

    prompts = [s.prompt_ids for e in episodes for s in e.steps]
    first = shared_micro_batches(prompts, [[0] * 16] * len(prompts), args.micro_batch_tokens)[0]
    out = {}
    for dtype in ("float32", "bfloat16"):
        trainer = arms.get(dtype=dtype)
        torch.manual_seed(args.seed)
        t = time.perf_counter()
        gens = generate_batch(trainer.model, trainer.tokenizer, [prompts[i] for i in first], Sampling(16, temperature=1.0))
        gen_s = time.perf_counter() - t
        trainer.model.train()
        with torch.no_grad():
            t = time.perf_counter()
            new, mask = response_logprobs(trainer.model, [prompts[i] for i in first], [g.ids for g in gens],
                                          trainer.tokenizer.pad_token_id)
            lp_s = time.perf_counter() - t
        trainer.model.eval()
        old = torch.zeros_like(new)
        for r, g in enumerate(gens):
            old[r, : len(g.logprobs)] = torch.tensor(g.logprobs)
        dev = (new - old)[mask].exp().sub(1).abs().numpy()
        out[dtype] = {"median": float(np.median(dev)), "p99": float(np.quantile(dev, 0.99)), "max": float(dev.max()),
                      "tokens": int(mask.sum()), "rows": len(first), "generate_s": gen_s, "logprob_s": lp_s}
        log(f"[ratio] {dtype:8s} |ratio-1| median {out[dtype]['median']:.2e} p99 {out[dtype]['p99']:.2e} over "
            f"{out[dtype]['tokens']} tokens; generate {gen_s:.1f}s, log-probs {lp_s:.1f}s")
    return out


def bench_iterations(empo2: Arms, grpo: Arms, args, log) -> dict:
    timer = ReflectTimer()
    g = args.generations
    rows = {"empo2_today": [], "empo2_shared": [], "empo2_overlap": [], "grpo_shared": []}
    trainers = {"empo2_today": empo2.get(False, generations=g), "empo2_shared": empo2.get(generations=g),
                "empo2_overlap": empo2.get(overlap=True, generations=g), "grpo_shared": grpo.get(generations=g)}
    run_iteration(trainers["empo2_shared"], 0, timer, "warm-up empo2", log)  # writes the tips later ones retrieve
    arms = list(rows)
    for i in range(args.iterations):
        for arm in (arms if i % 2 == 0 else arms[::-1]):
            rows[arm].append(run_iteration(trainers[arm], 1 + len(arms) * i + arms.index(arm), timer, arm, log))
    med = {arm: {k: median([r[k] for r in rs]) for k in ("whole", "rollout", "update", "reflection", "peak_rss_gb")}
           for arm, rs in rows.items()}
    e, t, g, o = med["empo2_shared"], med["empo2_today"], med["grpo_shared"], med["empo2_overlap"]
    return {"runs": rows, "median": med, "shared_over_today": e["whole"] / t["whole"],
            "memory_over_grpo": e["whole"] / g["whole"], "reflection_share": e["reflection"] / e["whole"],
            "overlap_over_blocking": o["whole"] / e["whole"], "overlap_memory_over_grpo": o["whole"] / g["whole"],
            "peak_rss_gb_max_shared": max(max(r["peak_rss_gb"] for r in rows[a]) for a in ("empo2_shared",
                                                                                            "grpo_shared"))}


def rollout_table(rollout: dict) -> list[str]:
    ok = lambda cond: "PASS" if cond else "MISS"  # noqa: E731
    lines = ["Rollout env-steps/s (find-animal, sampled, no memory)   today  no_reuse  shared  speedup  reuse gain"
             "  target >= 3x"]
    for g, r in rollout.items():
        lines.append(f"  {g:50s} {r['today_steps_per_s']:6.3f}  {r['no_reuse_steps_per_s']:8.3f}  "
                     f"{r['shared_steps_per_s']:6.3f}  {r['speedup']:6.2f}x  {r['reuse_gain']:9.2f}x  "
                     f"{ok(r['speedup'] >= 3)}")
    return lines


def table(res: dict) -> str:
    ok = lambda cond: "PASS" if cond else "MISS"  # noqa: E731
    lines = []
    if "rollout" in res:
        lines += rollout_table(res["rollout"])
        u = res["update"]
        lines += ["", f"Update tokens/s                                                {u['today_tokens_per_s']:6.1f}  "
                      f"{u['shared_tokens_per_s']:6.1f}  {u['speedup']:6.2f}x  target >= 2x {ok(u['speedup'] >= 2)}"]
        if res.get("budgets"):
            lines += ["", "Update by train.micro_batch_tokens    tokens/s  peak RSS GB"]
            lines += [f"  {b:>34s}  {r['tokens_per_s']:8.1f}  {r['peak_rss_gb']:6.2f}"
                      for b, r in res["budgets"].items()]
        if "bfloat16_tokens_per_s" in u:
            lines.append(f"  one episode's rows, shared: float32 {u['float32_tokens_per_s']:.1f} tokens/s, bfloat16 "
                         f"autocast {u['bfloat16_tokens_per_s']:.1f} tokens/s")
        lines.append("")
    it = res["iterations"]
    m = it["median"]
    lines += ["Whole iterations (median s)       whole  rollout  reflection  update  peak RSS GB"]
    for arm, r in m.items():
        lines.append(f"  {arm:30s} {r['whole']:6.1f}  {r['rollout']:6.1f}  {r['reflection']:9.1f}  {r['update']:6.1f}"
                     f"  {r['peak_rss_gb']:6.2f}")
    lines += [f"  EMPO² iteration shared / today   {it['shared_over_today']:.2f}   target <= 0.33 "
              f"{ok(it['shared_over_today'] <= 1 / 3)}",
              f"  on_tips iteration / GRPO         {it['memory_over_grpo']:.2f}   target <= 1.10 "
              f"{ok(it['memory_over_grpo'] <= 1.10)}",
              f"  reflection share of EMPO² iter.  {100 * it['reflection_share']:.0f}%",
              f"  overlap / blocking reflection    {it['overlap_over_blocking']:.2f}   (on_tips with overlap / GRPO "
              f"{it['overlap_memory_over_grpo']:.2f})",
              f"  peak RSS (shared arms, max)      {it['peak_rss_gb_max_shared']:.2f} GB  target <= 3 GB "
              f"{ok(it['peak_rss_gb_max_shared'] <= 3)}"]
    if "ratio" in res:
        lines += ["", "First-mini-batch |ratio - 1|       median      p99"]
        for dtype, r in res["ratio"].items():
            lines.append(f"  {dtype:30s} {r['median']:.2e}  {r['p99']:.2e}  (generate {r['generate_s']:.1f}s, "
                         f"log-probs {r['logprob_s']:.1f}s)")
    lines += ["", f"load: {res['uptime_start']}  ->  {res['uptime_end']} (wall {res['wall_s']:.0f}s)"]
    return "\n".join(lines)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--rollout-generations", type=int, nargs="+", default=[4, 8])
    ap.add_argument("--generations", type=int, default=4, help="G of the whole iterations")
    ap.add_argument("--max-steps", type=int, default=3, help="env.max_steps (the issue: 6)")
    ap.add_argument("--rounds", type=int, default=1, help="rounds of each rollout/update arm pair")
    ap.add_argument("--iterations", type=int, default=1, help="timed iterations per arm (after one warm-up)")
    ap.add_argument("--micro-batch-tokens", type=int, default=1024)
    ap.add_argument("--budgets", type=int, nargs="*", default=[256, 512, 1024],
                    help="micro_batch_tokens values for the peak-RSS sweep of the update (none: skip it)")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--skip-iterations", action="store_true")
    ap.add_argument("--rollout-only", action="store_true", help="only part 1 (the rollout arms)")
    ap.add_argument("--iterations-only", action="store_true", help="only parts 4 and 5 (whole iterations)")
    ap.add_argument("--threads", type=int, default=0, help="torch threads (0 = torch's default); on a machine "
                    "loaded by other jobs 1 thread avoids stalls at every parallel region")
    ap.add_argument("--out", type=Path, default=None,
                    help=f"default {RESULTS.name}; with --rollout-only {ROLLOUT_RESULTS.name} (in {RESULTS.parent})")
    args = ap.parse_args()
    from empo2.allocator import active, reexec_with_jemalloc

    reexec_with_jemalloc()  # as the `empo2` command does (peak RSS figures are what a user gets)
    args.out = args.out or (ROLLOUT_RESULTS if args.rollout_only else
                            RESULTS.with_name("iteration_whole.json") if args.iterations_only else RESULTS)
    if args.threads:
        import torch

        torch.set_num_threads(args.threads)
    log = lambda s: print(s, flush=True)  # noqa: E731

    t0 = time.perf_counter()
    res = {"benchmark": "iteration", "time": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
           "args": {k: (str(v) if isinstance(v, Path) else v) for k, v in vars(args).items()},
           "uptime_start": uptime(), "loadavg_start": loadavg(), "malloc": active()}
    tmp = Path(tempfile.mkdtemp(prefix="iteration_bench_"))
    g_max = max(args.rollout_generations + [args.generations])
    empo2 = Arms(tmp, "empo2", args, [f"algo.num_generations={g_max}", "algo.p_memory=1.0",
                                              "algo.p_off_policy=0.0"])
    grpo = None
    save = lambda: args.out.write_text(json.dumps(res, indent=2))  # noqa: E731  (partial results survive)
    args.out.parent.mkdir(parents=True, exist_ok=True)
    try:
        if not args.iterations_only:
            res["rollout"], episodes = bench_rollout(empo2, args, log)
            save()
            if args.rollout_only:
                print("\n" + "\n".join(rollout_table(res["rollout"])))
                return
            res["budgets"] = bench_budgets(empo2, episodes, args.budgets, log)
            save()
            res["update"] = bench_update(empo2, episodes, args, log)
            save()
            res["update"].update(bench_bf16_update(empo2, episodes, log))
            res["ratio"] = bench_ratio(empo2, episodes, args, log)
            save()
        if not args.skip_iterations:
            grpo = Arms(tmp, "grpo", args, [f"algo.num_generations={args.generations}", "algo.name=grpo"])
            grpo.base.ctx.demonstrations = empo2.base.ctx.demonstrations  # fetched by the warm-up: no arm pays for it
            res["iterations"] = bench_iterations(empo2, grpo, args, log)
    finally:
        empo2.close()
        if grpo is not None:
            grpo.close()
        res["uptime_end"], res["loadavg_end"], res["wall_s"] = uptime(), loadavg(), time.perf_counter() - t0
        save()
    if "iterations" in res:
        print("\n" + table(res))
    print(f"\nwrote {args.out}")


if __name__ == "__main__":  # the env pool uses multiprocessing spawn: workers re-import this file
    main()
