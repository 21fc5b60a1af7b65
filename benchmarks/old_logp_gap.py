"""π_old from the engine against the trainer's recompute: |log π_trainer − log π_engine| per response token, with the HF
engine, in each compute dtype. This is the gap `algo.old_logprobs: auto` decides on (docs/fidelity.md).

    python benchmarks/old_logp_gap.py              # bfloat16 and float32; writes records/benchmarks/old_logp_gap.json

The engine's log-probs are those recorded while sampling (:func:`empo2.policy.generate.generate_batch`: one token at a
time against a KV cache, shared prompt heads), the trainer's those of the update's forward on the same prompt and
response (:func:`empo2.policy.logprobs.response_logprobs`), as `PolicyUpdate._trainer_old_logp` takes them. Prompts:
the first observation of 8 real ScienceWorld episodes, rendered as the rollout renders them. bfloat16 runs natively on
a CPU with AVX512-BF16 or AMX and is emulated (slow, same numbers) elsewhere.
"""

from __future__ import annotations

import argparse
import json
import subprocess
import time
from pathlib import Path

import torch

from empo2.agent.prompts import PromptParts, hints_text, render_prompt_ids
from empo2.config import Config
from empo2.envs.scienceworld import ScienceWorldEnv
from empo2.policy.generate import generate_batch
from empo2.policy.loader import autocast_context, load_model, make_trainable
from empo2.policy.logprobs import response_logprobs
from empo2.policy.prefix import compute_options
from empo2.policy.sampling import Sampling


def prompts_of(cfg, tokenizer, n: int) -> list[list[int]]:
    env = ScienceWorldEnv(max_steps=cfg.env.max_steps, valid_actions_in_info=False)
    try:
        out = []
        for task in cfg.env.tasks:
            for variation in env.variations(task, "train")[: max(1, n // len(cfg.env.tasks))]:
                obs, info = env.reset(task, variation)
                parts = PromptParts(env="scienceworld", task=info["task_description"], observation=obs,
                                    initial_observation=obs, demonstration=env.demonstration(task, variation, 1),
                                    hints=hints_text(info))
                out.append(render_prompt_ids(tokenizer, parts, cfg.policy.history_window, cfg.policy.max_prompt_length))
        return out[:n]
    finally:
        env.close()


def gap(cfg, model, tokenizer, prompts, autocast: str, seed: int) -> dict:
    cfg.policy.autocast = autocast
    options = compute_options(cfg.policy, cfg.train)
    torch.manual_seed(seed)
    t0 = time.perf_counter()
    with torch.no_grad(), autocast_context(model, autocast):
        gens = generate_batch(model, tokenizer, prompts, Sampling(cfg.policy.max_completion_length, temperature=cfg.policy.temperature), options=options)
        trainer, _ = response_logprobs(model, prompts, [g.ids for g in gens], tokenizer.pad_token_id,
                                       temperature=cfg.policy.temperature, options=options)
    diffs = torch.cat([(trainer[i, : len(g.ids)].double() - torch.tensor(g.logprobs, dtype=torch.float64)).abs()
                       for i, g in enumerate(gens)])
    return {"autocast": autocast, "tokens": int(diffs.numel()), "gap_mean": float(diffs.mean()),
            "gap_max": float(diffs.max()), "gap_p99": float(diffs.quantile(0.99)),
            "ratio_max": float(torch.exp(diffs.max())), "seconds": round(time.perf_counter() - t0, 1)}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--config", default="configs/scienceworld_learn_cpu.yaml")
    ap.add_argument("--prompts", type=int, default=8)
    ap.add_argument("--out", default="records/benchmarks/old_logp_gap.json")
    args = ap.parse_args()
    flags = subprocess.run("lscpu | grep -o -E 'avx2|avx512_bf16|amx_bf16' | sort -u | tr '\\n' ' '", shell=True,
                           capture_output=True, text=True).stdout.strip()
    cfg = Config.load(args.config)
    model, tokenizer = load_model(cfg.policy.model, "cpu", "float32")
    model = make_trainable(model, cfg.policy, False).eval()
    prompts = prompts_of(cfg, tokenizer, args.prompts)
    rows = [gap(cfg, model, tokenizer, prompts, autocast, seed=0) for autocast in ("bfloat16", "none")]
    Path(args.out).write_text(json.dumps({"cpu_flags": flags, "config": args.config, "prompts": len(prompts),
                                          "rows": rows}, indent=2))
    print(f"cpu flags: {flags}; {len(prompts)} ScienceWorld prompts, {args.config}")
    print("| compute | tokens | mean gap | p99 | max gap | max e^gap | s |\n|---|---|---|---|---|---|---|")
    for r in rows:
        print(f"| {r['autocast'] if r['autocast'] != 'none' else 'float32'} | {r['tokens']} | {r['gap_mean']:.2e} | "
              f"{r['gap_p99']:.2e} | {r['gap_max']:.2e} | {r['ratio_max']:.3f} | {r['seconds']} |")


if __name__ == "__main__":
    main()
