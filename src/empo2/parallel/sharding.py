"""Sharded training with FSDP2 (``train.sharding: fsdp``): weights, gradients and AdamW moments split over the ranks.

:func:`wrap` applies ``torch.distributed.fsdp.fully_shard`` to every decoder layer, then to the root (embeddings,
final norm, output layer), with float32 master weights; with ``policy.autocast: bfloat16`` the layers compute in
bfloat16 (gathered in bfloat16, gradients reduced in float32). Full fine-tuning and LoRA both: a LoRA adapter lives
inside its decoder layer and is sharded with it.

Under FSDP every forward and backward of the sharded model is a collective (a layer's weights are all-gathered before
it runs, its gradients reduce-scattered after), so all ranks must run the same forwards in the same order:

- Generation (rollouts, reflection, evaluation) and per-row scoring run different amounts of work on each rank, so
  they run inside :func:`gathered`: the whole model is all-gathered once, by all ranks together, and the forwards
  inside need no collective. It holds one full copy of the weights in the compute dtype, as vLLM would. With
  ``policy.backend: vllm`` the engines generate and nothing is gathered for it; each rank's engine takes the new
  weights after an update one decoder layer at a time (:mod:`empo2.policy.fsdp_save`).
- The update runs each optimizer step's micro-batches on every rank; a rank with fewer runs :func:`idle_passes`
  (zero-loss passes over one token) until it has run as many as the busiest one. Its training forwards run without
  prefix sharing: the shared heads are extra forwards whose number depends on this rank's rows.

Checkpoints are ``torch.distributed.checkpoint`` folders (``sharded/``; every rank writes its shards, any number of
ranks reads them), inside the same atomic checkpoint folder as unsharded ones (:func:`empo2.rundir.checkpoint.
save_checkpoint`). ``empo2 export`` (:mod:`empo2.rundir.export`) turns one into full Hugging Face weights.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from contextlib import contextmanager
from pathlib import Path

import torch

from empo2.config import ConfigError

SHARDS = "sharded"
"""A sharded checkpoint's DCP folder inside ``checkpoints/iter_*/``."""


def wanted(cfg) -> bool:
    return cfg.train.sharding == "fsdp"


def wrap(model: torch.nn.Module, cfg, dist):
    """``model`` sharded over ``dist``'s ranks (one rank: a group of one, the same code path), and the ``Dist`` that
    says so (a new one, ``sharded`` true: what reads it, the update's reductions and the checkpoint, takes that)."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard

    device = next(model.parameters()).device
    _one_rank_group(device)
    mesh = init_device_mesh(device.type, (dist.world_size,))
    low = {"bfloat16": torch.bfloat16}.get(cfg.policy.autocast)  # float16 compute stays under autocast only
    mp = MixedPrecisionPolicy(param_dtype=low, reduce_dtype=torch.float32 if low is not None else None)
    for layer in decoder_layers(model):
        fully_shard(layer, mesh=mesh, mp_policy=mp)
    fully_shard(model, mesh=mesh, mp_policy=mp)
    for unit in _units(model):  # a sum, not FSDP's mean: each micro-batch's loss already has its global share
        unit.set_gradient_divide_factor(1.0)
        unit.set_force_sum_reduction_for_comms(True)  # a plain SUM (gloo has no pre-multiplied sum)
    return model, dataclasses.replace(dist, sharded=True)


def decoder_layers(model: torch.nn.Module) -> list[torch.nn.Module]:
    """The modules transformers says must not be split (``_no_split_modules``: the decoder layers)."""
    base = model.get_base_model() if hasattr(model, "get_base_model") else model
    names = set(getattr(base, "_no_split_modules", None) or ())
    layers = [m for m in model.modules() if type(m).__name__ in names]
    if not layers:
        raise ConfigError(f"train.sharding=fsdp: {type(base).__name__} names no decoder layers (_no_split_modules)")
    return layers


def _one_rank_group(device: torch.device) -> None:
    """A process group of one when no launcher started one (FSDP needs a group even for a single rank)."""
    if torch.distributed.is_initialized():
        return
    backend = "nccl" if device.type == "cuda" else "gloo"
    torch.distributed.init_process_group(backend, store=torch.distributed.HashStore(), rank=0, world_size=1)


def _units(model: torch.nn.Module) -> list:
    from torch.distributed.fsdp import FSDPModule

    return [m for m in model.modules() if isinstance(m, FSDPModule)]


@contextmanager
def gathered(model: torch.nn.Module):
    """The whole model all-gathered for the block: forwards inside run no collective, so each rank may run as many
    as its own work needs. Every rank enters and leaves together. A no-op for a model that is not sharded."""
    units = _units(model)
    if not units:
        yield
        return
    for unit in units:
        unit.reshard()  # a unit left gathered by a forward without backward: every rank now all-gathers each one
    for unit in units:
        unit.unshard()
        unit.set_reshard_after_forward(False, recurse=False)
    try:
        yield
    finally:
        for unit in units:  # FSDP's own defaults: layers free their weights after forward, the root keeps them
            unit.set_reshard_after_forward(unit is not model, recurse=False)
        try:
            model.reset_iter_state()  # reshards all, and forgets this block's forwards (backward prefetch follows them)
        except AttributeError:  # FSDP's lazy init has not run yet (no forward since the wrap): nothing to reset
            pass


@contextmanager
def generating(model: torch.nn.Module, autocast: str, backend=None):
    """The compute context of rollouts, reflection and evaluation: :func:`gathered`, under ``policy.autocast``. With a
    separate rollout ``backend`` (vLLM) the engine generates from its own copy in its own dtype and the model runs no
    forward, so nothing is gathered (the trainer holds only its shards beside the engine) and no autocast is
    entered (the engine's compiled kernels and sampler are not the trainer's)."""
    from empo2.policy.loader import autocast_context

    if backend is not None:
        yield
        return
    with gathered(model), autocast_context(model, autocast):
        yield


def update_options(options, cfg):
    """The update's compute options: without prefix sharing under FSDP (module docstring)."""
    return dataclasses.replace(options, prefix_sharing=False) if wanted(cfg) else options


def idle_count(dist, done: int) -> int:
    """Under FSDP, how many :func:`idle_passes` this rank runs after its ``done`` micro-batches of an optimizer step
    (the busiest rank's count minus its own); asked before any of them runs, each being a collective."""
    if not dist.sharded or not dist.enabled:
        return 0
    return int(dist.all_reduce([done], op="max")[0]) - done


def idle_passes(model: torch.nn.Module, count: int, reference: Callable | None = None) -> None:
    """``count`` zero-loss forward (and, with a ``reference`` context, reference forward) and backward passes over
    one token, so that this rank joins every all-gather and reduce-scatter of the busier ranks' micro-batches, in
    the same order. Their gradient is exactly zero."""
    if count <= 0:
        return
    ids = torch.zeros((1, 1), dtype=torch.long, device=next(model.parameters()).device)
    for _ in range(count):
        logits = model(input_ids=ids, use_cache=False).logits
        if reference is not None:
            with torch.no_grad(), reference():
                model(input_ids=ids, use_cache=False)
        (logits.float().sum() * 0.0).backward()


# ------------------------------------------------------------------------------------------------------ checkpoints
def is_sharded(folder: Path) -> bool:
    """Whether checkpoint ``folder`` holds DCP shards (its ``.metadata`` is written once every rank's shards are)."""
    return (Path(folder) / SHARDS / ".metadata").is_file()


def _state_dicts(model, optimizer) -> dict:
    from torch.distributed.checkpoint.state_dict import StateDictOptions, get_state_dict

    # frozen weights (a LoRA base) are the model the run started from: not copied into every checkpoint
    msd, osd = get_state_dict(model, optimizer, options=StateDictOptions(ignore_frozen_params=True))
    return {"model": msd, "optimizer": osd}


def write_shards(folder: Path, model, optimizer) -> None:
    import torch.distributed.checkpoint as dcp

    dcp.save(_state_dicts(model, optimizer), checkpoint_id=str(Path(folder) / SHARDS))


def read_shards(folder: Path, model, optimizer=None) -> None:
    """Load a sharded checkpoint into ``model`` (and ``optimizer``), sharded over any number of ranks or not at all."""
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint import state_dict as sd

    options = sd.StateDictOptions(ignore_frozen_params=True, strict=False)  # DCP itself fails on a missing tensor
    if optimizer is None:
        state = {"model": sd.get_model_state_dict(model, options=options)}
        dcp.load(state, checkpoint_id=str(Path(folder) / SHARDS))
        sd.set_model_state_dict(model, state["model"], options=options)
        return
    state = _state_dicts(model, optimizer)
    dcp.load(state, checkpoint_id=str(Path(folder) / SHARDS))
    sd.set_state_dict(model, optimizer, model_state_dict=state["model"], optim_state_dict=state["optimizer"],
                      options=options)


def restore(model, optimizer, folder: Path, weights: dict | None, optimizer_state: dict | None, lora: bool) -> None:
    """Put a checkpoint's weights and optimizer state into ``model`` and ``optimizer``: a sharded one (``weights``
    is ``None``) through DCP, an unsharded one from its tensors."""
    if weights is None:
        read_shards(folder, model, optimizer)
        return
    load_weights(model, weights, lora)
    optimizer.load_state_dict(optimizer_state)


def load_weights(model, weights: dict[str, torch.Tensor], lora: bool) -> None:
    """An unsharded checkpoint's adapter (``lora``) or full-model tensors into ``model``."""
    if lora:
        from peft import set_peft_model_state_dict

        set_peft_model_state_dict(model, weights)
    else:
        model.load_state_dict(weights, strict=False)
