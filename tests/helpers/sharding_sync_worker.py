"""A model sharded with FSDP written as a Hugging Face folder by :mod:`empo2.policy.fsdp_save`: run by
tests/test_sharding_sync.py under torchrun (2 gloo ranks).

Before sharding, rank 0 writes the same model unsharded with ``save_pretrained`` (``OUT/plain``), the reference. Then
every rank writes the sharded model into its own folder (``OUT/rank<r>``) and records the most gathered bytes it held
at once (``OUT/peak<r>.json``): every tensor the writer gathers is counted from its gathering until it is freed.
It also records whether ``sharding.generating`` gathers the weights with and without a separate rollout backend.

usage: python tests/helpers/sharding_sync_worker.py MODEL OUT_DIR LORA(0|1)
"""

from __future__ import annotations

import json
import sys
import weakref
from pathlib import Path

import torch

from empo2.config import Config
from empo2.parallel import distributed as dp
from empo2.parallel import sharding
from empo2.policy import fsdp_save
from empo2.policy.loader import load_model
from empo2.rundir.export import with_adapter


def changed_model(model_name: str, lora: bool, cfg):
    """The model with every weight moved, so what is written is the model in memory and not the files it came from;
    with LoRA, the base as it is (frozen) and a random adapter (lora_B starts at zero). Seeded: equal on every rank,
    which FSDP needs (each rank keeps its shard of its own copy)."""
    torch.manual_seed(0)
    model, _ = load_model(model_name, "cpu", "float32")
    gen = torch.Generator().manual_seed(3)
    with torch.no_grad():
        if not lora:
            for p in model.parameters():
                p.add_(torch.randn(p.shape, generator=gen) * 0.01)
            return model
        model = with_adapter(model, cfg.policy)
        for name, p in model.named_parameters():
            if "lora_" in name:
                p.copy_(torch.randn(p.shape, generator=gen) * 0.05)
    return model


class GatheredBytes:
    """Bytes of the tensors ``fsdp_save`` gathered that are still alive (a finaliser on each), and their maximum."""

    def __init__(self):
        self.alive = self.peak = self.total = 0
        gather = fsdp_save.gathered_tensor

        def counted(tensor: torch.Tensor) -> torch.Tensor:
            full = gather(tensor)
            size = full.numel() * full.element_size()
            self.alive += size
            self.total += size
            self.peak = max(self.peak, self.alive)
            weakref.finalize(full, self._freed, size)
            return full

        fsdp_save.gathered_tensor = counted

    def _freed(self, size: int) -> None:
        self.alive -= size


def gathered_for(model) -> dict[str, bool]:
    """Whether the model's weights are gathered (FSDP swaps in plain full tensors) while generating with the model
    itself (HF) and while a separate backend (vLLM) generates."""
    from torch.distributed.tensor import DTensor

    def full() -> bool:
        return not any(isinstance(p, DTensor) for p in model.parameters())

    with torch.no_grad(), sharding.generating(model, "none"):
        hf = full()
        model(input_ids=torch.zeros((1, 1), dtype=torch.long))  # as generation does (FSDP's state starts at one)
    with sharding.generating(model, "none", backend=object()):
        engine = full()
    return {"hf": hf, "engine": engine}


def main(model_name: str, out: str, lora: str) -> None:
    cfg = Config.load("configs/scienceworld_cpu.yaml", [f"policy.model={model_name}", "train.sharding=fsdp",
                                                        f"policy.lora={lora == '1'}", "policy.autocast=none"])
    dist = dp.init_from_env("cpu")
    model = changed_model(model_name, lora == "1", cfg)
    if dist.is_main:
        model.save_pretrained(str(Path(out) / "plain"))
    model, dist = sharding.wrap(model, cfg, dist)
    gathered = GatheredBytes()
    fsdp_save.save_pretrained(model, Path(out) / f"rank{dist.rank}")
    counts = {"peak": gathered.peak, "total": gathered.total, "alive": gathered.alive,
              "gathered_for": gathered_for(model)}
    (Path(out) / f"peak{dist.rank}.json").write_text(json.dumps(counts))
    dist.close()


if __name__ == "__main__":
    main(*sys.argv[1:])
