"""``empo2 export RUN OUT``: a run's last checkpoint as a plain Hugging Face model folder (safetensors + tokenizer).

A sharded checkpoint (``train.sharding: fsdp``) is read by one process into an unsharded model
(``torch.distributed.checkpoint`` reshards any number of ranks' shards); an unsharded one is read from its tensors.
With LoRA the adapter is merged into the base weights, so ``transformers.AutoModelForCausalLM.from_pretrained(OUT)``
loads the trained policy without peft.
"""

from __future__ import annotations

import os
import shutil
import sys
import tempfile
from pathlib import Path

import torch

from empo2.config import Config, ConfigError
from empo2.file_modes import share_tree
from empo2.parallel import sharding
from empo2.rundir import checkpoint as ckpt


def export(run_dir: Path, out: Path) -> Path:
    """Write ``run_dir``'s newest checkpoint that matches its manifest to ``out`` (which must not exist, or be empty);
    returns the checkpoint."""
    from empo2.policy.loader import load_model

    run_dir, out = Path(run_dir), Path(out)
    if not (run_dir / "config.yaml").is_file():
        raise ConfigError(f"{run_dir} is not a run folder (no config.yaml)")
    last = ckpt.latest_intact(run_dir, lambda line: print(line, file=sys.stderr))
    if out.exists() and (not out.is_dir() or any(out.iterdir())):
        raise ConfigError(f"{out} exists and is not empty; give a new folder")
    cfg = Config.load(run_dir / "config.yaml")
    model, tokenizer = load_model(cfg.policy.model, "cpu", cfg.policy.dtype, cfg.policy.trust_remote_code)
    if cfg.policy.warm_start and cfg.policy.lora:  # the run's adapter was trained on top of its warm start
        from empo2.rundir.warm_start import start_from

        model, _ = start_from(model, cfg.policy)
    if cfg.policy.lora:
        model = with_adapter(model, cfg.policy)
    if sharding.is_sharded(last):
        sharding.read_shards(last, model)
    else:
        sharding.load_weights(model, ckpt.read_weights(last, cfg.policy.lora), cfg.policy.lora)
    if cfg.policy.lora:
        model = model.merge_and_unload()
    _write(model, tokenizer, out)
    return last


def with_adapter(model, pc):
    """The run's LoRA adapter on ``model``, as the trainer builds it (its weights come from the checkpoint)."""
    from peft import LoraConfig, get_peft_model

    lora = LoraConfig(r=pc.lora_r, lora_alpha=pc.lora_alpha, lora_dropout=pc.lora_dropout,
                      target_modules=list(pc.lora_target_modules), task_type="CAUSAL_LM")
    return get_peft_model(model, lora)


def _write(model, tokenizer, out: Path) -> None:
    """Into a temporary folder beside ``out``, then one rename: a stopped export leaves no half model at ``out``."""
    out.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".{out.name}.tmp-", dir=out.parent))
    try:
        with torch.no_grad():
            model.save_pretrained(tmp, safe_serialization=True)
        tokenizer.save_pretrained(tmp)
        share_tree(tmp)  # an exported model is for others to load (mkdtemp made it private)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    if out.exists():
        out.rmdir()  # empty (checked above)
    os.replace(tmp, out)
