"""Pre-flight memory check: will one rank's peak fit its GPU? Asked before the first rollout, refused with one line.

A run that does not fit dies at its first optimizer step, after a whole rollout phase. The estimate here is plain
arithmetic over the model's shapes and the run's settings, per rank, in bytes:

- resident all run: weights ``P·w`` and AdamW's two moments ``2·T·t`` (``P`` parameters of ``w`` bytes, ``T`` trainable
  of ``t`` bytes), both divided by ``N`` ranks under ``train.sharding: fsdp``;
- in the update: gradients ``T·t`` (``/N`` sharded); autocast's low-precision copy of the trainable weights ``2·T``
  (unsharded; FSDP gathers two decoder layers in the compute dtype instead); the foreach AdamW step's temporary
  ``T·t`` (``/N``); stored activations per micro-batch of ``m`` tokens over ``L`` layers of width ``h`` and MLP width
  ``I`` — each decoder layer keeps about ``8h + 4I`` values per token (attention and MLP inputs, gate, up and their
  product), only its input ``h`` under gradient checkpointing (plus one layer replayed in backward); and the
  log-prob logits, three float32 copies of ``min(m, chunk)·V``;
- in the rollout: a sharded model generating with Hugging Face gathers one whole copy in the compute dtype; a
  full fine-tune reflecting on a second thread keeps a snapshot of the trainable weights;
- a vLLM engine holds ``vllm_memory`` of the device's total memory for the whole run.

Peak = max(update, rollout) + engine. Not counted: the KV cache of Hugging Face generation and the allocator's
fragmentation, so a run the check passes can still run out; one it refuses would not fit.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass

GiB = 2**30
LOW_PRECISION_BYTES = 2  # bfloat16 / float16 compute copies


@dataclass(frozen=True)
class Footprint:
    """What the estimate reads: the model's shapes and the run's memory-relevant settings."""

    params: int
    """All parameters ``P`` (the unsharded model)."""
    trainable: int
    """Trainable parameters ``T`` (all of them for full fine-tuning, the adapter's with LoRA)."""
    weight_bytes: int
    """Bytes per frozen or trainable weight as loaded (``policy.dtype``)."""
    trainable_bytes: int
    """Bytes per trainable weight, its gradient and each AdamW moment."""
    hidden: int
    layers: int
    intermediate: int
    vocab: int
    world: int = 1
    """Ranks of the run."""
    sharded: bool = False
    """``train.sharding: fsdp``."""
    autocast: bool = False
    """A low-precision compute dtype (``policy.autocast`` bfloat16/float16)."""
    checkpointing: bool = False
    """``train.gradient_checkpointing``."""
    micro_batch_tokens: int = 1024
    logprob_chunk_tokens: int = 1024
    engine_fraction: float = 0.0
    """``policy.vllm_memory`` when a vLLM engine shares the device, else 0."""
    hf_generation: bool = True
    """Rollouts generate with the training model (``policy.backend: hf``)."""
    reflection_snapshot: bool = False
    """A background reflection holds a copy of the trainable weights (full fine-tuning, overlapped reflection)."""

    @property
    def compute_bytes(self) -> int:
        return LOW_PRECISION_BYTES if self.autocast else self.weight_bytes


def estimate(fp: Footprint, device_total: float) -> dict[str, float]:
    """Bytes per rank, by part, and ``peak``: max(update, rollout) + engine (module docstring)."""
    shards = fp.world if fp.sharded else 1
    weights = fp.params * fp.weight_bytes / shards
    optimizer = 2 * fp.trainable * fp.trainable_bytes / shards
    gradients = fp.trainable * fp.trainable_bytes / shards
    step_temporary = fp.trainable * fp.trainable_bytes / shards
    if fp.sharded:  # FSDP gathers the running layer and prefetches the next one, in the compute dtype
        low_copies = 2 * fp.params / fp.layers * fp.compute_bytes
    else:  # autocast caches a low-precision copy of each weight that requires grad
        low_copies = fp.trainable * LOW_PRECISION_BYTES if fp.autocast else 0.0
    per_token_layer = fp.hidden if fp.checkpointing else 8 * fp.hidden + 4 * fp.intermediate
    activations = fp.micro_batch_tokens * fp.layers * per_token_layer * fp.weight_bytes
    if fp.checkpointing:  # the replayed layer's own activations in backward
        activations += fp.micro_batch_tokens * (8 * fp.hidden + 4 * fp.intermediate) * fp.compute_bytes
    logits = 3 * min(fp.micro_batch_tokens, fp.logprob_chunk_tokens) * fp.vocab * 4
    gathered = fp.params * fp.compute_bytes if fp.sharded and fp.hf_generation else 0.0
    snapshot = fp.trainable * fp.trainable_bytes if fp.reflection_snapshot else 0.0
    engine = fp.engine_fraction * device_total
    update = weights + optimizer + gradients + step_temporary + low_copies + activations + logits
    rollout = weights + optimizer + gathered + snapshot
    parts = {"weights": weights, "optimizer": optimizer, "gradients": gradients, "step_temporary": step_temporary,
             "low_precision_copies": low_copies, "activations": activations, "logits": logits,
             "generation_gather": gathered, "reflection_snapshot": snapshot, "engine": engine,
             "update": update, "rollout": rollout}
    parts["peak"] = max(update, rollout) + engine
    return parts


def _changes(fp: Footprint) -> list[tuple[str, Footprint]]:
    """Settings to try, cheapest change first: each a config override and the footprint it gives."""
    out = []
    if not fp.sharded and fp.world > 1:
        out.append(("train.sharding=fsdp", dataclasses.replace(fp, sharded=True)))
    if not fp.checkpointing:
        out.append(("train.gradient_checkpointing=true", dataclasses.replace(fp, checkpointing=True)))
    if not fp.sharded and fp.world > 1 and not fp.checkpointing:
        out.append(("train.sharding=fsdp train.gradient_checkpointing=true",
                    dataclasses.replace(fp, sharded=True, checkpointing=True)))
    tokens = fp.micro_batch_tokens // 2
    while tokens >= 256:
        out.append((f"train.micro_batch_tokens={tokens}", dataclasses.replace(fp, micro_batch_tokens=tokens)))
        tokens //= 2
    if fp.engine_fraction > 0.2:
        out.append(("policy.vllm_memory=0.2", dataclasses.replace(fp, engine_fraction=0.2)))
    return out


def _gpus_needed(fp: Footprint, device_total: float, budget: float, most: int = 512) -> int | None:
    """The fewest ranks whose FSDP shards (with gradient checkpointing) fit, or ``None``."""
    world = max(fp.world, 1)
    while world <= most:  # powers of two from the run's own rank count
        trial = dataclasses.replace(fp, world=world, sharded=True, checkpointing=True)
        if estimate(trial, device_total)["peak"] <= budget:
            return world
        world *= 2
    return None


def verdict(fp: Footprint, budget: float, device_total: float, device: str = "the GPU") -> str | None:
    """``None`` when the estimated peak fits ``budget`` bytes; otherwise one line: the estimate by part, the budget,
    and the setting that would fit."""
    parts = estimate(fp, device_total)
    if parts["peak"] <= budget:
        return None
    shown = ", ".join(f"{k.replace('_', ' ')} {v / GiB:.1f}" for k, v in parts.items()
                      if v and k not in ("update", "rollout", "peak"))
    fix = next((f"{o} (≈ {estimate(t, device_total)['peak'] / GiB:.1f} GiB)" for o, t in _changes(fp)
                if estimate(t, device_total)["peak"] <= budget), None)
    if fix is None and fp.trainable == fp.params and _lora_fits(fp, budget, device_total):
        fix = "policy.lora=true train.gradient_checkpointing=true"
    gpus = _gpus_needed(fp, device_total, budget)
    more = f"train.sharding=fsdp train.gradient_checkpointing=true on {gpus} GPUs" if gpus and gpus > fp.world \
        else None
    advice = " or ".join(x for x in (fix, more) if x) or "nothing tried fits: a smaller model"
    return (f"pre-flight: this run needs ≈ {parts['peak'] / GiB:.1f} GiB per rank on {device} ({shown} GiB) but "
            f"{budget / GiB:.1f} GiB is free; try {advice} (train.memory_check=false skips this check)")


def _lora_fits(fp: Footprint, budget: float, device_total: float) -> bool:
    adapter = max(fp.params // 200, 1)  # rank-16 adapters on every projection: well under 1 % of a 7B model
    trial = dataclasses.replace(fp, trainable=adapter, trainable_bytes=4, checkpointing=True, reflection_snapshot=False)
    return estimate(trial, device_total)["peak"] <= budget


# ------------------------------------------------------------------------------------------------ from a live run
def footprint(model, cfg, world: int, overlap_snapshot: bool) -> Footprint:
    """The :class:`Footprint` of a loaded (unsharded) ``model`` under config ``cfg`` on ``world`` ranks."""
    params = list(model.parameters())
    trainable = [p for p in params if p.requires_grad]
    mc = getattr(model, "config", None)
    mc = mc.get_text_config() if hasattr(mc, "get_text_config") else mc
    hidden = int(getattr(mc, "hidden_size", 0) or 0)
    return Footprint(
        params=sum(p.numel() for p in params), trainable=sum(p.numel() for p in trainable),
        weight_bytes=params[0].element_size(), trainable_bytes=trainable[0].element_size() if trainable else 4,
        hidden=hidden, layers=int(getattr(mc, "num_hidden_layers", 1) or 1),
        intermediate=int(getattr(mc, "intermediate_size", 0) or 4 * hidden), vocab=int(getattr(mc, "vocab_size", 0)),
        world=world, sharded=cfg.train.sharding == "fsdp", autocast=cfg.policy.autocast in ("bfloat16", "float16"),
        checkpointing=cfg.train.gradient_checkpointing, micro_batch_tokens=cfg.train.micro_batch_tokens,
        logprob_chunk_tokens=cfg.train.logprob_chunk_tokens,
        engine_fraction=cfg.policy.vllm_memory if cfg.policy.backend == "vllm" else 0.0,
        hf_generation=cfg.policy.backend == "hf", reflection_snapshot=overlap_snapshot)


def check(model, cfg, world: int, overlap_snapshot: bool = False, memory: tuple[float, float] | None = None) -> None:
    """Raise :class:`~empo2.config.ConfigError` (exit 2) when ``model`` under ``cfg`` would not fit its GPU.

    ``memory``: (budget, total) bytes; by default the device's free memory plus what this process already holds
    there (the loaded weights are counted in the estimate), and its total. A model on a CPU is not checked."""
    import torch

    from empo2.config import ConfigError

    device = next(model.parameters()).device
    if memory is None:
        if device.type != "cuda" or not getattr(cfg.train, "memory_check", True):
            return
        free, total = torch.cuda.mem_get_info(device)
        memory = (free + torch.cuda.memory_reserved(device), total)
    budget, total = memory
    line = verdict(footprint(model, cfg, world, overlap_snapshot), budget, total, str(device))
    if line is not None:
        raise ConfigError(line)
