"""A model sharded with FSDP2 (``train.sharding: fsdp``) written as a Hugging Face folder, for the vLLM engine's sync.

``save_pretrained`` cannot write a sharded model's DTensors, and gathering the whole state dict first would hold a
second full copy of the weights beside the shards. :func:`save_pretrained` here gathers one FSDP unit at a time (a
decoder layer, or the root's parameters before and after the layers: embeddings; final norm and output layer),
writes it as one safetensors file and drops it before gathering the next. The folder is Hugging Face's sharded
checkpoint (``model-0000i-of-0000n.safetensors`` and ``model.safetensors.index.json``, plus the config), which
``from_pretrained`` and vLLM's ``reload_weights`` read. A LoRA model writes its adapter through PEFT's own
``save_pretrained`` (the adapter is small: gathered at once).

Each gather (``DTensor.full_tensor``) is a collective, so every rank calls this, gathering the same tensors in the
same order, and every rank receives each full tensor. Every rank therefore writes its own folder for its own
engine: that costs no memory or communication beyond the gathers themselves, and needs neither a filesystem shared
between nodes (each rank writes to its own temporary folder) nor a barrier while one rank writes for all.
"""

from __future__ import annotations

import copy
import itertools
import json
from pathlib import Path

import torch

INDEX = "model.safetensors.index.json"


def is_fsdp(model: torch.nn.Module) -> bool:
    """Whether ``model`` holds modules sharded by FSDP2's ``fully_shard`` (its parameters are DTensors)."""
    from torch.distributed.fsdp import FSDPModule

    return any(isinstance(m, FSDPModule) for m in model.modules())


def save_pretrained(model: torch.nn.Module, folder: str | Path) -> None:
    """``model``'s weights (a PEFT model: its adapter) into ``folder`` as ``model.save_pretrained`` would write them
    from the unsharded model. Every rank calls it at the same point, each with a folder of its own."""
    folder = Path(folder)
    folder.mkdir(parents=True, exist_ok=True)
    with torch.no_grad():
        if hasattr(model, "peft_config"):
            adapter = {name: gathered_tensor(p) for name, p in model.named_parameters() if p.requires_grad}
            model.save_pretrained(str(folder), state_dict=adapter)  # PEFT names and filters the keys, writes its config
        else:
            _write_weights(model, folder)
            _write_config(model, folder)


def _write_weights(model: torch.nn.Module, folder: Path) -> None:
    from safetensors.torch import save_file

    state = model.state_dict()  # FSDP's state-dict hook gives the shards: nothing is gathered here
    skipped = _not_saved(model)
    files = _files(model, [name for name in state if name not in skipped])
    weight_map, total = {}, 0
    for i, names in enumerate(files):
        file = f"model-{i + 1:05d}-of-{len(files):05d}.safetensors"
        tensors = _reverted(model, {name: gathered_tensor(state[name]) for name in names})
        save_file(tensors, str(folder / file), metadata={"format": "pt"})
        weight_map.update(dict.fromkeys(tensors, file))
        total += sum(t.numel() * t.element_size() for t in tensors.values())
        del tensors  # this unit's full tensors are freed before the next unit is gathered
    index = {"metadata": {"total_size": total}, "weight_map": weight_map}
    (folder / INDEX).write_text(json.dumps(index, indent=2, sort_keys=True) + "\n")


def weight_items(model: torch.nn.Module, dtype: torch.dtype | None = None):
    """``(name, tensor)`` of ``model``'s full weights in the checkpoint format ``save_pretrained`` writes, one FSDP
    unit gathered at a time, on the model's device, cast to ``dtype``: for an engine that loads tensors, not files.
    Every rank of a sharded model iterates it at the same point (each gather is a collective)."""
    state = model.state_dict()
    skipped = _not_saved(model)
    with torch.no_grad():
        for names in _files(model, [name for name in state if name not in skipped]):
            tensors = _reverted(model, {name: _full(state[name]) for name in names})
            for name, tensor in tensors.items():
                yield name, tensor if dtype is None else tensor.to(dtype)
            del tensors  # this unit's full tensors are freed before the next unit is gathered


def _full(tensor: torch.Tensor) -> torch.Tensor:
    from torch.distributed.tensor import DTensor

    return (tensor.full_tensor() if isinstance(tensor, DTensor) else tensor).detach()


def gathered_tensor(tensor: torch.Tensor) -> torch.Tensor:
    """The full tensor of a shard (a collective), in host memory: a GPU holds one gathered tensor at a time."""
    return _full(tensor).cpu().contiguous()


def _not_saved(model: torch.nn.Module) -> set[str]:
    """The names ``save_pretrained`` leaves out: a tied parameter's later names (the output layer that shares the
    embeddings' weight; ``from_pretrained`` ties it again) and the model's ``_keys_to_ignore_on_save``."""
    skipped = set(getattr(model, "_keys_to_ignore_on_save", None) or ())
    seen = set()
    for name, param in model.named_parameters(remove_duplicate=False):
        if id(param) in seen:
            skipped.add(name)
        seen.add(id(param))
    return skipped


def _files(model: torch.nn.Module, names: list[str]) -> list[list[str]]:
    """``names`` in state-dict order, cut wherever the FSDP unit that shards them changes."""
    from torch.distributed.fsdp import FSDPModule

    prefixes = [f"{name}." for name, m in model.named_modules() if name and isinstance(m, FSDPModule)]

    def unit(name: str) -> str:
        return max((p for p in prefixes if name.startswith(p)), key=len, default="")

    return [list(group) for _, group in itertools.groupby(names, key=unit)]


def _reverted(model: torch.nn.Module, tensors: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """Names and layouts of the checkpoint format, as ``save_pretrained`` writes them: transformers may rename or
    fuse weights on load (a mixture of experts' experts, within one decoder layer) and reverts that on save."""
    from transformers.core_model_loading import revert_weight_conversion

    return revert_weight_conversion(model, tensors)


def _write_config(model: torch.nn.Module, folder: Path) -> None:
    """``config.json`` (and ``generation_config.json``) as ``save_pretrained`` writes them: the architecture's own
    class name, not FSDP's subclass of it, and the weights' dtype."""
    config = copy.deepcopy(model.config)
    config.architectures = [type(model).__name__.removeprefix("FSDP")]
    config.dtype = str(model.dtype).removeprefix("torch.")
    config.save_pretrained(str(folder))
    if model.can_generate():
        model.generation_config.save_pretrained(str(folder))
