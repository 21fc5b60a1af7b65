"""A warm start's folder, and how a run starts from it.

``empo2 sft`` (:mod:`empo2.sft`) writes its best epoch to ``RUN/warm_start/``: the LoRA adapter (``adapter/``),
``warm_start.json`` (what it was made for, from what, and how it did) and, written last, ``manifest.json`` (every
file's sha256, :mod:`empo2.rundir.manifest`); the folder appears by one rename. The warm start's checksum is the
sha256 of that manifest, so it changes when any byte of the adapter or its record does.

A run with ``policy.warm_start: RUN`` checks, before it writes anything, that the folder is whole, that its checksum is
the one the config pins (``policy.warm_start_sha256``, recorded by the first start) and that it was made for this
tokenizer and this model architecture (:func:`check`); after the model loads, that it was made for these weights
(:func:`start_from`). It then merges the adapter into the weights, so the run's own LoRA starts on top of the
warm-started policy: the start evaluation plays it, and the KL reference (the model with the run's adapter disabled)
is it. Nothing else of how the warm start was made reaches the run.
"""

from __future__ import annotations

import hashlib
import json
import os
import shutil
import tempfile
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from empo2.config import ConfigError
from empo2.file_modes import share_tree
from empo2.rundir.manifest import MANIFEST, ChecksumError, file_sha256, verify_manifest, write_manifest

FOLDER = "warm_start"
"""The warm start inside an ``empo2 sft`` run folder."""
META = "warm_start.json"
ADAPTER = "adapter"
ARCHITECTURE_KEYS = ("model_type", "vocab_size", "hidden_size", "intermediate_size", "num_hidden_layers",
                     "num_attention_heads", "num_key_value_heads", "head_dim", "tie_word_embeddings", "rope_theta",
                     "max_position_embeddings", "rms_norm_eps", "hidden_act")
"""Config entries that make a model's architecture (those its config has; dtype and paths are left out)."""
SAMPLED_VALUES = 64
"""Leading values of every weight tensor that go into the weights fingerprint."""


class WarmStartError(ConfigError):
    """A warm start that cannot be used (missing, damaged, changed, or made for another model); exit code 2."""


@dataclass(frozen=True)
class WarmStart:
    folder: Path
    """The ``warm_start/`` folder."""
    meta: dict[str, Any]
    """``warm_start.json``."""
    sha256: str
    """The checksum: sha256 of ``manifest.json``."""


# ------------------------------------------------------------------------------------------------- fingerprints
def tokenizer_fingerprint(tokenizer) -> str:
    """sha256 of what turns a prompt into token ids and ends a turn: the vocabulary, the end-of-sequence token and
    the chat template."""
    text = json.dumps({"vocab": sorted(tokenizer.get_vocab().items()), "eos": tokenizer.eos_token_id,
                       "chat_template": tokenizer.chat_template}, sort_keys=True)
    return hashlib.sha256(text.encode()).hexdigest()


def architecture_fingerprint(config) -> str:
    """sha256 of a model config's architecture entries (:data:`ARCHITECTURE_KEYS`), readable before the weights load."""
    values = config.to_dict() if hasattr(config, "to_dict") else dict(config)
    text = json.dumps({k: values.get(k) for k in ARCHITECTURE_KEYS}, sort_keys=True, default=str)
    return hashlib.sha256(text.encode()).hexdigest()


@torch.no_grad()
def weights_fingerprint(model) -> str:
    """sha256 of every weight tensor's name, shape and first :data:`SAMPLED_VALUES` values rounded to bfloat16, so the
    same weights loaded in float32 on a CPU and in bfloat16 on a GPU agree, and other weights do not."""
    digest = hashlib.sha256()
    for name, tensor in sorted(model.state_dict().items()):
        head = tensor.detach().flatten()[:SAMPLED_VALUES].to("cpu", torch.bfloat16).view(torch.int16)
        digest.update(f"{name}|{tuple(tensor.shape)}|".encode())
        digest.update(head.numpy().tobytes())
    return digest.hexdigest()


def base_record(model_name: str, model, tokenizer) -> dict[str, str]:
    """What a warm start records of the model it is made for (before its LoRA goes on)."""
    return {"model": model_name, "architecture_sha256": architecture_fingerprint(model.config),
            "weights_sha256": weights_fingerprint(model), "tokenizer_sha256": tokenizer_fingerprint(tokenizer)}


# ------------------------------------------------------------------------------------------------------ writing
def write(run_dir: Path, model, meta: dict[str, Any]) -> WarmStart:
    """Write ``model``'s adapter and ``meta`` as ``run_dir/warm_start/`` (a temporary folder, then one rename, as
    checkpoints are written; an older warm start there is replaced)."""
    run_dir = Path(run_dir)
    for stale in run_dir.glob(f".{FOLDER}-*"):
        shutil.rmtree(stale, ignore_errors=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".{FOLDER}-", dir=run_dir))
    try:
        model.save_pretrained(tmp / ADAPTER, safe_serialization=True)
        (tmp / META).write_text(json.dumps(meta, indent=1, sort_keys=True) + "\n")
        share_tree(tmp)
        write_manifest(tmp)  # last: the checksums of everything above
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    final = run_dir / FOLDER
    if final.exists():
        shutil.rmtree(final)
    os.replace(tmp, final)
    return read(final)


# ------------------------------------------------------------------------------------------------------ reading
def locate(path: str | os.PathLike) -> Path:
    """The ``warm_start/`` folder that ``path`` names: an ``empo2 sft`` run folder, or the folder itself."""
    path = Path(path).expanduser()
    if (path / FOLDER / MANIFEST).is_file():
        return path / FOLDER
    if (path / MANIFEST).is_file() and (path / META).is_file():
        return path
    if path.is_dir() and (path / "config.yaml").is_file():
        raise WarmStartError(f"policy.warm_start: {path} holds no warm start yet ({path / FOLDER} is missing: the "
                             "sft run ended before its first epoch, or was not an sft run)")
    raise WarmStartError(f"policy.warm_start: {path} is not a warm start (give the run folder of `empo2 sft`)")


def read(path: str | os.PathLike) -> WarmStart:
    """The warm start at ``path``, its files checked against its manifest."""
    folder = locate(path)
    try:
        verify_manifest(folder)
        meta = json.loads((folder / META).read_text())
    except (ChecksumError, OSError, ValueError) as exc:
        raise WarmStartError(f"policy.warm_start: {folder} is damaged ({exc})") from None
    if not isinstance(meta, dict) or not isinstance(meta.get("base"), dict):
        raise WarmStartError(f"policy.warm_start: {folder / META} does not say which model it was made for")
    return WarmStart(folder, meta, file_sha256(folder / MANIFEST))


def check(policy_cfg) -> WarmStart | None:
    """Before a run writes anything: the warm start ``policy_cfg`` names is whole, has the pinned checksum, and was made
    for this tokenizer and model architecture (read from the model's files, not its weights). ``None`` without one."""
    if not policy_cfg.warm_start:
        return None
    from transformers import AutoConfig

    from empo2.policy.loader import load_tokenizer, resolve_model_path

    ws = read(policy_cfg.warm_start)
    _check_pinned(ws, policy_cfg)
    base = ws.meta["base"]
    tokenizer = load_tokenizer(policy_cfg.model, policy_cfg.trust_remote_code)
    if tokenizer_fingerprint(tokenizer) != base.get("tokenizer_sha256"):
        raise _another(ws, policy_cfg, "tokenizer")
    path = resolve_model_path(policy_cfg.model, policy_cfg.trust_remote_code)
    config = AutoConfig.from_pretrained(path, trust_remote_code=policy_cfg.trust_remote_code)
    if architecture_fingerprint(config) != base.get("architecture_sha256"):
        raise _another(ws, policy_cfg, "model architecture")
    return ws


def settle(policy_cfg) -> None:
    """Pin the checksum of the warm start ``policy_cfg`` names, as a run records it at its start (a comparison
    plans its runs with it, so a finished run's saved config matches its plan)."""
    if policy_cfg.warm_start and not policy_cfg.warm_start_sha256:
        policy_cfg.warm_start_sha256 = read(policy_cfg.warm_start).sha256


def start_from(model, policy_cfg) -> tuple[Any, str]:
    """``model`` (as loaded, without adapters) with the warm start ``policy_cfg`` names merged into its weights, and
    the warm start's checksum; refused when it was made for other weights or its checksum is not the pinned one."""
    if hasattr(model, "peft_config"):
        raise WarmStartError("policy.warm_start: the model given already carries adapters; give the plain model, "
                             "the warm start's adapter is merged into it")
    from peft import PeftModel

    ws = read(policy_cfg.warm_start)
    _check_pinned(ws, policy_cfg)
    if weights_fingerprint(model) != ws.meta["base"].get("weights_sha256"):
        raise _another(ws, policy_cfg, "model's weights")
    merged = PeftModel.from_pretrained(model, str(ws.folder / ADAPTER)).merge_and_unload()
    merged.eval()
    return merged, ws.sha256


def _check_pinned(ws: WarmStart, policy_cfg) -> None:
    pinned = policy_cfg.warm_start_sha256
    if pinned and pinned != ws.sha256:
        raise WarmStartError(f"policy.warm_start: {ws.folder} has changed since this run or preset recorded it "
                             f"(sha256 {ws.sha256[:12]}…, recorded {pinned[:12]}…); use the warm start it was made "
                             "with, or start a new run")


def _another(ws: WarmStart, policy_cfg, what: str) -> WarmStartError:
    made_for = ws.meta["base"].get("model", "another model")
    return WarmStartError(f"policy.warm_start: {ws.folder} was made for another {what} (made for {made_for}, this "
                          f"run loads {policy_cfg.model}); make a warm start for this model with `empo2 sft`")
