"""Cost of the algorithm core on CPU: the EMPO² loss + backward, and the novelty reward.

    python benchmarks/loss.py            # prints a table, writes records/benchmarks/loss.json

- ``loss_only``: ``policy_loss`` + ``backward`` on log-prob tensors [B, T] = [64, 512] (the part this project owns;
  the model forward/backward dominates a real step and is not included).
- ``loss_from_logits``: the same plus the token log-prob head — gather and logsumexp over random logits
  [64, 512, V] (V = 1024, a small vocabulary) — and its backward.
- ``novelty``: ``NoveltyReward.reward`` on 1k new 384-d states (the MiniLM size) against 10k stored states, for
  1k fresh states (mostly new) and for 1k repeats of stored states.
"""

from __future__ import annotations

import json
import platform
import statistics
import time
from pathlib import Path

import numpy as np
import torch

from empo2.algo.losses import policy_loss
from empo2.config.sections import AlgoConfig
from empo2.memory.novelty import NoveltyReward

B, T, V, D = 64, 512, 1024, 384


def timed(fn, repeats: int) -> dict[str, float]:
    fn()  # warm-up
    times = []
    for _ in range(repeats):
        t = time.perf_counter()
        fn()
        times.append((time.perf_counter() - t) * 1e3)
    return {"median_ms": statistics.median(times), "min_ms": min(times), "repeats": repeats}


def bench_loss(repeats: int) -> dict[str, dict[str, float]]:
    g = torch.Generator().manual_seed(0)
    logp_old = -torch.rand(B, T, generator=g) * 5  # [B, T]
    logp_new0 = logp_old + 0.3 * torch.randn(B, T, generator=g)  # [B, T]
    logp_ref = logp_old + 0.1 * torch.randn(B, T, generator=g)  # [B, T]
    adv = torch.randn(B, generator=g)  # [B]
    lengths = torch.randint(T // 4, T + 1, (B,), generator=g)
    mask = torch.arange(T)[None, :] < lengths[:, None]  # [B, T]
    modes = ["on"] * 48 + ["off_tips"] * 16
    logits0 = torch.randn(B, T, V, generator=g)  # [B, T, V]
    tokens = torch.randint(0, V, (B, T), generator=g)  # [B, T]

    def loss_only():
        new = logp_new0.clone().requires_grad_(True)
        loss, _ = policy_loss(new, logp_old, adv, mask, AlgoConfig(beta=0.01), logp_ref=logp_ref, modes=modes)
        loss.backward()

    def from_logits():
        logits = logits0.clone().requires_grad_(True)
        tok = logits.gather(-1, tokens[..., None]).squeeze(-1)  # [B, T]
        new = tok - torch.logsumexp(logits, dim=-1)  # [B, T]
        loss, _ = policy_loss(new, new.detach() + 0.1, adv, mask, AlgoConfig(beta=0.01), logp_ref=logp_ref, modes=modes)
        loss.backward()

    return {"loss_only": timed(loss_only, repeats), "loss_from_logits": timed(from_logits, max(repeats // 4, 3))}


def bench_novelty(repeats: int) -> dict[str, dict[str, float]]:
    rng = np.random.default_rng(0)
    stored = rng.normal(size=(10_000, D)).astype(np.float32)
    base = NoveltyReward(0.9)
    base.visits(stored)  # random 384-d vectors are nearly orthogonal: all 10k are stored as distinct
    state = base.state_dict()
    fresh = rng.normal(size=(1000, D)).astype(np.float32)
    repeats_of_stored = stored[rng.integers(0, 10_000, 1000)]
    out = {}
    for name, x in (("novelty_1k_new", fresh), ("novelty_1k_repeats", repeats_of_stored)):
        nov = NoveltyReward(0.9)

        def run():
            nov.load_state_dict(state)
            nov.visits(x)

        out[name] = timed(run, repeats)
    out["stored_states"] = {"count": float(len(base))}
    return out


def main(repeats: int = 20) -> dict:
    torch.manual_seed(0)
    result = {
        "shape": {"B": B, "T": T, "vocab_for_logits": V, "embedding_dim": D},
        "torch_threads": torch.get_num_threads(),
        "torch": torch.__version__,
        "machine": platform.platform(),
        "processor": platform.processor() or platform.machine(),
        **bench_loss(repeats),
        **bench_novelty(max(repeats // 4, 3)),
    }
    print(f"{'benchmark':<28}{'median ms':>12}{'min ms':>12}")
    for key in ("loss_only", "loss_from_logits", "novelty_1k_new", "novelty_1k_repeats"):
        print(f"{key:<28}{result[key]['median_ms']:>12.2f}{result[key]['min_ms']:>12.2f}")
    print(f"(B×T = {B}×{T}; novelty against {int(result['stored_states']['count'])} stored {D}-d states; "
          f"{result['torch_threads']} torch threads)")
    out = Path(__file__).resolve().parents[1] / "records" / "benchmarks" / "loss.json"
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(result, indent=2) + "\n")
    print(f"wrote {out}")
    return result


if __name__ == "__main__":
    main()
