"""Per-rank memory of full fine-tuning with and without FSDP (``train.sharding``), on CPU with gloo.

    python benchmarks/sharding_memory.py                  # 1, 2 and 4 ranks, a ~120M random Llama
    python benchmarks/sharding_memory.py --ranks 1 2 --layers 24

Each arm launches ``torchrun --nproc_per_node=N`` of this file on a randomly initialised Llama (SmolLM2-135M's
shapes by default: hidden 576, 30 layers, vocabulary 49,152, tied embeddings), float32 weights, AdamW, and runs
``--steps`` optimizer steps of one forward and backward each over a batch of random tokens. ``none`` is today's
data-parallel replica (the N = 1 process), ``fsdp`` wraps the model with the project's own
:func:`empo2.parallel.sharding.wrap`. Per rank it reports the bytes of the training state it holds (weights, gradients,
AdamW moments: its shards under FSDP, everything without), its RSS once the model is built (and sharded) and its
peak RSS. Every rank builds the whole model before sharding it, and the allocator keeps what the full copy used, so
RSS falls less than the state does; activations (the same per rank: every rank runs the same batch) come on top. The table prints next to the prediction 16 bytes × parameters / N.
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
RESULTS = ROOT / "records" / "benchmarks" / "sharding_memory.json"


def local_bytes(tensors) -> int:
    """Bytes this rank stores for ``tensors`` (a DTensor counts its local shard only)."""
    total = 0
    for t in tensors:
        local = t.to_local() if hasattr(t, "to_local") else t
        total += local.numel() * local.element_size()
    return total


def worker(args) -> None:
    import psutil
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    from empo2.config import Config
    from empo2.parallel import distributed as dp
    from empo2.parallel import sharding

    torch.manual_seed(0)
    dist = dp.init_from_env("cpu")
    shape = LlamaConfig(hidden_size=args.hidden, intermediate_size=args.hidden * 8 // 3, num_hidden_layers=args.layers,
                        num_attention_heads=9, num_key_value_heads=3, vocab_size=49152, tie_word_embeddings=True)
    model = LlamaForCausalLM(shape)
    params = sum(p.numel() for p in model.parameters())
    if args.sharding == "fsdp":
        cfg = Config.load(None, ["train.sharding=fsdp", "policy.autocast=none"])
        model, dist = sharding.wrap(model, cfg, dist)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-5)
    built_rss = psutil.Process().memory_info().rss / 1e9  # the runtime, the built (and sharded) model
    ids = torch.randint(0, shape.vocab_size, (args.batch, args.tokens))
    start = time.perf_counter()
    for _ in range(args.steps):
        model(input_ids=ids, labels=ids).loss.backward()
        if args.sharding == "none" and dist.enabled:
            dist.all_reduce_grads(list(model.parameters()), True)
        optimizer.step()
        optimizer.zero_grad(set_to_none=False)  # keep the gradients allocated, as they are during the next backward
    moments = [s for state in optimizer.state.values() for k, s in state.items() if k in ("exp_avg", "exp_avg_sq")]
    row = {"rank": dist.rank, "parameters": params, "seconds": time.perf_counter() - start,
           "weights_gb": local_bytes(model.parameters()) / 1e9,
           "grads_gb": local_bytes(p.grad for p in model.parameters() if p.grad is not None) / 1e9,
           "adam_gb": local_bytes(moments) / 1e9,
           "built_rss_gb": built_rss, "peak_rss_gb": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1e6}
    Path(args.worker_out).with_suffix(f".{dist.rank}.json").write_text(json.dumps(row))
    dist.close()


def arm(ranks: int, sharding_mode: str, args) -> dict:
    with tempfile.TemporaryDirectory() as tmp:
        out = Path(tmp) / "arm"
        cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc_per_node={ranks}", __file__,
               "--worker", "--sharding", sharding_mode, "--worker-out", str(out), "--hidden", str(args.hidden),
               "--layers", str(args.layers), "--tokens", str(args.tokens), "--batch", str(args.batch),
               "--steps", str(args.steps)]
        env = dict(os.environ, PYTHONPATH=str(ROOT / "src"), OMP_NUM_THREADS=str(max(1, (os.cpu_count() or 1) // ranks)))
        subprocess.run(cmd, env=env, check=True)
        rows = [json.loads(p.read_text()) for p in sorted(Path(tmp).glob("arm.*.json"))]
    state = max(r["weights_gb"] + r["grads_gb"] + r["adam_gb"] for r in rows)
    return {"ranks": ranks, "sharding": sharding_mode, "per_rank": rows, "state_gb": state,
            "predicted_gb": 16 * rows[0]["parameters"] / (ranks if sharding_mode == "fsdp" else 1) / 1e9,
            "built_rss_gb": max(r["built_rss_gb"] for r in rows), "peak_rss_gb": max(r["peak_rss_gb"] for r in rows)}


def table(res: dict) -> str:
    lines = [f"CPU {res['cpu']} · {res['parameters'] / 1e6:.0f}M parameters, float32, AdamW, "
             f"batch {res['args']['batch']}×{res['args']['tokens']} tokens", "",
             "| sharding | ranks | training state per rank (GB) | predicted 16 B × P / N (GB) | RSS before training (GB) "
             "| peak RSS per rank (GB) |", "|---|---:|---:|---:|---:|---:|"]
    for a in res["arms"]:
        lines.append(f"| {a['sharding']} | {a['ranks']} | {a['state_gb']:.3f} | {a['predicted_gb']:.3f} | "
                     f"{a['built_rss_gb']:.2f} | {a['peak_rss_gb']:.2f} |")
    return "\n".join(lines)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--ranks", type=int, nargs="+", default=[1, 2, 4])
    ap.add_argument("--hidden", type=int, default=576)
    ap.add_argument("--layers", type=int, default=30)
    ap.add_argument("--tokens", type=int, default=256)
    ap.add_argument("--batch", type=int, default=2)
    ap.add_argument("--steps", type=int, default=2)
    ap.add_argument("--out", type=Path, default=RESULTS)
    ap.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    ap.add_argument("--sharding", default="none", help=argparse.SUPPRESS)
    ap.add_argument("--worker-out", help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.worker:
        worker(args)
        return
    cpu = next((line.split(":", 1)[1].strip() for line in Path("/proc/cpuinfo").read_text().splitlines()
                if line.startswith("model name")), "unknown")
    arms = [arm(1, "none", args)] + [arm(n, "fsdp", args) for n in args.ranks]
    res = {"benchmark": "sharding_memory", "time": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
           "commit": subprocess.run(["git", "rev-parse", "--short", "HEAD"], cwd=ROOT, capture_output=True,
                                    text=True).stdout.strip(),
           "cpu": cpu, "cores": os.cpu_count(), "parameters": arms[0]["per_rank"][0]["parameters"],
           "args": {k: v for k, v in vars(args).items() if k in ("hidden", "layers", "tokens", "batch", "steps")},
           "arms": arms}
    print("\n" + table(res))
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(res, indent=2))
    print(f"\nwrote {args.out}")


if __name__ == "__main__":
    main()
