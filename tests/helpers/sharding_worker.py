"""One policy update on a fixed batch, sharded or not: run by tests/test_sharding.py as a plain process and under
torchrun (2 gloo ranks). Writes the full weights after the update (rank 0) and the batch's loss metrics as JSON.

usage: python tests/helpers/sharding_worker.py MODEL OUT_DIR SHARDING(none|fsdp) LORA(0|1) [key=value ...]
"""

from __future__ import annotations

import json
import random
import sys
from pathlib import Path

import torch
from safetensors.torch import save_file

from empo2.algo.losses import get_policy_loss
from empo2.config import Config
from empo2.parallel import distributed as dp
from empo2.parallel import sharding
from empo2.policy.loader import load_model
from empo2.rundir.export import with_adapter
from empo2.train.rows import UpdateRow
from empo2.train.update import PolicyUpdate

# AdamW's step is lr·g/(|g| + eps): where g ≈ 0 it turns an absolute rounding difference δg into lr·δg/eps of weight.
# At the default 1e-8 that magnifies float32 summation-order noise 1e5×; 1e-4 keeps it at rounding level while the
# other elements still move by ~lr.
ADAM_EPS = 1e-4
GROUPS, MEMBERS = 3, 2  # rank 0 of 2 plays groups 0 and 2, rank 1 group 1: unequal micro-batch counts


def batch(vocab: int) -> list[tuple[int, UpdateRow]]:
    """(group, row) pairs, the same on every process: random prompts and responses, group 1 with zero advantage."""
    rng = random.Random(7)
    rows = []
    for g in range(GROUPS):
        for m in range(MEMBERS):
            prompt = [rng.randrange(vocab) for _ in range(rng.randint(4, 9))]
            response = [rng.randrange(vocab) for _ in range(rng.randint(2, 5))]
            advantage = 0.0 if g == 1 else (1.0 if m == 0 else -1.0)
            logp_old = [-rng.uniform(5.0, 7.0) for _ in response]
            rows.append((g, UpdateRow(prompt, response, logp_old, advantage, "on")))
    return rows


def main(model_name: str, out: str, mode: str, lora: str, *overrides: str) -> None:
    cfg = Config.load("configs/scienceworld_cpu.yaml", [f"policy.model={model_name}", f"train.sharding={mode}",
                                                        f"policy.lora={lora == '1'}", *overrides])
    torch.manual_seed(cfg.train.seed)
    dist = dp.init_from_env("cpu")
    model, tokenizer = load_model(cfg.policy.model, "cpu", cfg.policy.dtype)
    model = with_adapter(model, cfg.policy) if cfg.policy.lora else model
    for p in model.parameters() if not cfg.policy.lora else ():  # full fine-tuning, as the trainer sets it
        p.requires_grad_(True)
    if sharding.wanted(cfg):
        model, dist = sharding.wrap(model, cfg, dist)
    optimizer = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], eps=ADAM_EPS,
                                  lr=cfg.train.learning_rate, weight_decay=cfg.train.weight_decay)
    update = PolicyUpdate(cfg, model, tokenizer, optimizer, get_policy_loss(cfg.algorithm.loss), dist)
    mine = [row for g, row in batch(len(tokenizer)) if dist.owns(g)]
    losses = [update(mine), update(mine)]  # two optimizer steps: the second uses the AdamW moments of the first
    merged = [dp.merge_stats(dist, {"n": 1.0}, {"groups": 1}, loss)[2] for loss in losses]
    weights = full_weights(model, sharding.wanted(cfg))
    if dist.is_main:
        Path(out).mkdir(parents=True, exist_ok=True)
        save_file(weights, str(Path(out) / "weights.safetensors"))
        (Path(out) / "metrics.json").write_text(json.dumps(merged))
    dist.close()


def full_weights(model, sharded: bool) -> dict[str, torch.Tensor]:
    if not sharded:
        return {k: v.detach().clone().contiguous() for k, v in model.state_dict().items()}
    from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict

    full = get_model_state_dict(model, options=StateDictOptions(full_state_dict=True, cpu_offload=True))
    return {k: v.clone().contiguous() for k, v in full.items()}


if __name__ == "__main__":
    main(*sys.argv[1:])
