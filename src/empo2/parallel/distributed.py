"""Data-parallel training over ``torchrun`` / ``accelerate launch`` processes (one rank per GPU, or gloo on CPU).

How the work is split (every rank runs the same :class:`~empo2.train.trainer.Trainer` loop):

- Every rank draws the same global batch of tasks and modes (the samplers are seeded alike); rank ``r`` plays groups
  ``r, r + W, …``, so each group's advantages are computed where its rollouts are; only statistics an estimator
  takes over the whole batch (ProxMO's TF-IDF term counts) are gathered, through :meth:`Dist.all_gather`.
- Gradients are summed over ranks (one flat all-reduce per optimizer step). Each micro-batch's loss is already
  weighted by its share of the *global* token (or row) count, so the sum equals the one-rank gradient.
- The tip memory is a replicated state machine: each rank turns its own episodes into memory operations (uses and
  reflections), the operations of all ranks are gathered and every rank applies them in global group order to its own
  copy. Rank 0's copy is the run's ``memory.sqlite``; the others are private files seeded from rank 0's bytes once at
  start. So every rank retrieves from the same memory, nothing depends on a shared file system, and SQLite never
  sees two writers.
- Rank 0 alone writes the run folder: metrics, samples, checkpoints, evaluation tables, plots.

Nothing here runs a collective unless ``WORLD_SIZE`` > 1: the single-process path is unchanged.
"""

from __future__ import annotations

import atexit
import dataclasses
import os
import random
import shutil
import tempfile
from collections.abc import Callable, Sequence
from datetime import timedelta
from pathlib import Path
from typing import Any

import numpy as np
import torch

Key = tuple[int, int]  # (group, member): the global order of episodes in a batch


def env_rank() -> int:
    """This process's rank from the launcher's environment (0 when not launched by torchrun/accelerate)."""
    return int(os.environ.get("RANK", "0"))


def _seed_from(*parts: int) -> int:
    return int(np.random.SeedSequence([int(p) & 0xFFFFFFFF for p in parts]).generate_state(1)[0])


@dataclasses.dataclass
class Dist:
    """The process's place in the job; ``world_size == 1`` means plain single-process training."""

    rank: int = 0
    world_size: int = 1
    local_rank: int = 0
    sharded: bool = False
    """The policy is sharded with FSDP (:mod:`empo2.parallel.sharding`): its gradients arrive reduce-scattered."""

    @property
    def enabled(self) -> bool:
        return self.world_size > 1

    @property
    def is_main(self) -> bool:
        return self.rank == 0

    # ------------------------------------------------------------------ work split
    def owns(self, group: int) -> bool:
        """Whether this rank plays group ``group`` of the global batch (round robin)."""
        return group % self.world_size == self.rank

    def max_local(self, n: int) -> int:
        """The most of ``n`` round-robin items any rank gets (sizes the per-rank environment pool)."""
        return -(-n // self.world_size)

    def shard(self, items: Sequence) -> list:
        return list(items[self.rank::self.world_size])

    # ------------------------------------------------------------------ collectives (no-ops on one rank)
    def barrier(self) -> None:
        if self.enabled:
            torch.distributed.barrier()

    def broadcast_object(self, obj: Any) -> Any:
        """Rank 0's ``obj`` on every rank."""
        if not self.enabled:
            return obj
        box = [obj]
        torch.distributed.broadcast_object_list(box, src=0)
        return box[0]

    def gather_ordered(self, pairs: list[tuple[Key, Any]]) -> list[tuple[Key, Any]]:
        """Every rank's ``(key, value)`` pairs, on every rank, sorted by key (the one-rank order)."""
        if not self.enabled:
            return list(pairs)
        parts: list[Any] = [None] * self.world_size
        torch.distributed.all_gather_object(parts, pairs)
        return sorted((p for part in parts for p in part), key=lambda kv: kv[0])

    def all_gather(self, obj: Any) -> list[Any]:
        """Every rank's ``obj``, in rank order, on every rank (``[obj]`` on one rank)."""
        return _all(self, obj) if self.enabled else [obj]

    def all_reduce(self, values: Sequence[float], op: str = "sum") -> list[float]:
        """Element-wise sum or max of a few numbers over ranks (float64)."""
        if not self.enabled:
            return [float(v) for v in values]
        t = torch.tensor([float(v) for v in values], dtype=torch.float64, device=self._device())
        torch.distributed.all_reduce(t, op=torch.distributed.ReduceOp.MAX if op == "max" else
                                     torch.distributed.ReduceOp.SUM)
        return t.tolist()

    def all_reduce_grads(self, params: list[torch.nn.Parameter], inputs_ok: bool) -> bool:
        """Sum the gradients of ``params`` over ranks (a missing gradient counts as zero) in one flat all-reduce.

        Returns whether every rank's inputs were finite, so all ranks skip or take the step together.
        """
        if not self.enabled:
            return inputs_ok
        if self.sharded:  # FSDP has summed each shard's gradient already: only the ranks' verdicts are combined
            return self.all_reduce([0.0 if inputs_ok else 1.0])[0] == 0.0
        grads = [p.grad if p.grad is not None else torch.zeros_like(p) for p in params]
        device = grads[0].device
        flat = torch.cat([g.reshape(-1).float() for g in grads] +
                         [torch.tensor([0.0 if inputs_ok else 1.0], device=device)])  # [sum numel + 1]
        torch.distributed.all_reduce(flat)
        offset = 0
        for p, g in zip(params, grads):
            n = g.numel()
            p.grad = flat[offset:offset + n].view_as(g).to(g.dtype)
            offset += n
        return bool(flat[-1].item() == 0.0)

    def broadcast_params(self, params: list[torch.nn.Parameter]) -> None:
        """Make every rank's trainable weights rank 0's (start and resume); sharded weights are one copy already."""
        if not self.enabled or self.sharded:
            return
        with torch.no_grad():
            for p in params:
                torch.distributed.broadcast(p.data, src=0)

    def whole_batch(self, batch):
        """A training :class:`~empo2.train.batch.Batch` as rank 0 reports it: every rank's episodes (the others' as
        :func:`light_episode`) and their returns, rollout stats, advantage and loss metrics (:func:`merge_stats`); on
        one rank, the batch itself."""
        if not self.enabled:
            return batch
        episodes = gather_episodes(self, batch.episodes)
        returns = self.gather_ordered([((ep.group, ep.member), r) for ep, r in zip(batch.ran, batch.returns)])
        stats, adv, losses = merge_stats(self, batch.stats, batch.advantage_metrics, batch.losses)
        return dataclasses.replace(batch, episodes=episodes, stats=stats, advantage_metrics=adv, losses=losses,
                                   returns=np.array([r for _, r in returns], dtype=np.float64))

    def seed_iteration(self, seed: int, iteration: int) -> None:
        """Per-rank, per-iteration seeds for python/numpy/torch: ranks draw different streams, and an iteration draws
        the same whatever came before it in this process (an evaluation, a resume, another run, a cached embedder's
        load), so a resumed run draws what the uninterrupted one would have."""
        s = _seed_from(seed, iteration, self.rank)
        random.seed(s), np.random.seed(s % 2**32), torch.manual_seed(s)

    def close(self) -> None:
        if (self.enabled or self.sharded) and torch.distributed.is_initialized():  # sharded: maybe a group of one
            torch.distributed.destroy_process_group()

    def _device(self) -> torch.device:
        # this rank's own GPU, named explicitly: a library sharing the process (vLLM) may move the current device
        if torch.distributed.get_backend() == "nccl":
            return torch.device("cuda", self.local_rank)
        return torch.device("cpu")


def process_group_backend(device: str, cuda_available: bool) -> str:
    """nccl for a model on a GPU, gloo for one on the CPU (``policy.device``), also where CUDA exists: NCCL
    collectives take no CPU tensors."""
    kind = ("cuda" if cuda_available else "cpu") if device == "auto" else torch.device(device).type
    return "nccl" if kind == "cuda" else "gloo"


def init_from_env(device: str = "auto") -> Dist:
    """Join the process group the launcher describes (``RANK``, ``WORLD_SIZE``, ``LOCAL_RANK``, ``MASTER_ADDR``…).

    nccl when the model is on a GPU (``device``: ``policy.device``; each rank on ``cuda:LOCAL_RANK``), gloo
    otherwise. ``EMPO2_DIST_TIMEOUT_S`` (default 3600) bounds how long a rank waits for the others (a rank still
    rolling out, rank 0 saving).
    """
    world = int(os.environ.get("WORLD_SIZE", "1"))
    if world <= 1:
        return Dist()
    rank, local = env_rank(), int(os.environ.get("LOCAL_RANK", "0"))
    if not torch.distributed.is_initialized():
        backend = process_group_backend(device, torch.cuda.is_available())
        extra = {}
        if backend == "nccl":
            torch.cuda.set_device(local)
            extra["device_id"] = torch.device("cuda", local)  # binds the group to this rank's GPU
        timeout = timedelta(seconds=float(os.environ.get("EMPO2_DIST_TIMEOUT_S", "3600")))
        torch.distributed.init_process_group(backend, timeout=timeout, **extra)
    return Dist(rank=rank, world_size=world, local_rank=local)


def local_mini_size(dist: Dist, mini_batch_size: int, n_rows: int) -> int:
    """Rows per optimizer step on this rank: all of them (``mini_batch_size`` 0), else this rank's share of a global
    mini-batch of ``mini_batch_size`` rows."""
    if not mini_batch_size:
        return max(n_rows, 1)
    return max(-(-mini_batch_size // dist.world_size), 1)


def step_count(dist: Dist, n_minis: int) -> int:
    """Optimizer steps of this pass: the most mini-batches any rank has (each step all-reduces gradients, so all
    ranks must take the same number; a rank with fewer adds zero gradient)."""
    return int(dist.all_reduce([n_minis], op="max")[0]) if dist.enabled else n_minis


def memory_sync(dist: Dist) -> Callable:
    """The rollout hook that hands every rank all ranks' memory operations in global order, with the step count
    the one-rank run would have (each rank counted only its own batched steps)."""
    def sync(uses: list, adds: list, step: int) -> tuple[list, list, int]:
        step = int(dist.all_reduce([step], op="max")[0])
        return dist.gather_ordered(uses), dist.gather_ordered(adds), step
    return sync


# ---------------------------------------------------------------------------------------------- episode helpers
def light_episode(ep):
    """A copy of an episode without token ids, prompts and embeddings: what rank 0 needs for metrics and tables."""
    steps = [dataclasses.replace(s, prompt_ids=[], train_prompt_ids=[], response_ids=[], logp_old=[],
                                 state_embedding=None, observation="")
             for s in ep.steps]
    return dataclasses.replace(ep, steps=steps)


def gather_episodes(dist: Dist, episodes: list) -> list:
    """All ranks' episodes in global (group, member) order; other ranks' episodes come as :func:`light_episode`."""
    if not dist.enabled:
        return list(episodes)
    pairs = dist.gather_ordered([((ep.group, ep.member), light_episode(ep)) for ep in episodes])
    mine = {(ep.group, ep.member): ep for ep in episodes}
    return [mine.get(k, ep) for k, ep in pairs]


def gather_in_order(dist: Dist, episodes: list, values: list, fn: Callable[[list], list]) -> list:
    """Apply ``fn`` to every rank's per-episode ``values`` in global order; return this rank's results.

    Used for state that must see the whole batch in the one-rank order (the novelty counts): every rank runs ``fn``
    on the same full list, so the state stays identical on all ranks.
    """
    if not dist.enabled:
        return fn(values)
    keys = [(ep.group, ep.member) for ep in episodes]
    pairs = dist.gather_ordered(list(zip(keys, values)))
    results = fn([v for _, v in pairs])
    by_key = dict(zip([k for k, _ in pairs], results))
    return [by_key[k] for k in keys]


def merge_stats(dist: Dist, rstats: dict[str, float], adv: dict[str, float],
                loss: dict[str, float]) -> tuple[dict, dict, dict]:
    """Rollout stats, advantage metrics and loss metrics of the whole batch (counts summed, times the slowest rank,
    means weighted by each rank's share)."""
    if not dist.enabled:
        return rstats, adv, loss
    r_keys, r_vals = zip(*sorted(rstats.items()))
    timed = [k.endswith("_time") for k in r_keys]
    sums = dist.all_reduce([0.0 if t else v for v, t in zip(r_vals, timed)])
    maxes = dist.all_reduce([v if t else 0.0 for v, t in zip(r_vals, timed)], op="max")
    rstats = {k: (m if t else s) for k, s, m, t in zip(r_keys, sums, maxes, timed)}
    adv = _weighted(dist, adv, weight="groups", counts=("groups", "zero_adv_groups", "singleton_groups"))
    loss = _weighted(dist, loss, weight="rows", counts=("rows", "computed_rows", "expert_rows", "response_tokens",
                                                        "tokens", "tokens_forwarded"),
                     same=("optimizer_steps", "skipped_steps"))
    return rstats, adv, loss


def _weighted(dist: Dist, metrics: dict[str, float], weight: str, counts: tuple, same: tuple = ()) -> dict:
    keys = sorted(set().union(*[set(d) for d in _all(dist, list(metrics))]))  # a loss key may exist on one rank only
    w = float(metrics.get(weight, 0.0))
    vals = [float(metrics.get(k, 0.0)) * (1.0 if k in counts else w) for k in keys]
    present = [w if k in metrics and k not in counts else 0.0 for k in keys]
    tot, wsum = dist.all_reduce(vals), dist.all_reduce(present)
    out = {k: (_number(t) if k in counts else t / ws if ws > 0 else 0.0) for k, t, ws in zip(keys, tot, wsum)}
    out.update({k: metrics[k] for k in same if k in metrics})
    return out


def _number(x: float) -> float | int:
    return int(x) if float(x).is_integer() else x


def _all(dist: Dist, obj: Any) -> list:
    parts: list[Any] = [None] * dist.world_size
    torch.distributed.all_gather_object(parts, obj)
    return parts


# ---------------------------------------------------------------------------------------------- memory replicas
def database_bytes(memory) -> bytes:
    """A consistent snapshot of a :class:`~empo2.memory.store.TipMemory` file (SQLite online backup), as bytes."""
    folder = tempfile.mkdtemp(prefix="empo2-memory-")
    try:
        path = memory.copy_to(Path(folder) / "memory.sqlite")
        return path.read_bytes()
    finally:
        shutil.rmtree(folder, ignore_errors=True)


def write_replica(data: bytes, rank: int) -> Path:
    """Write rank 0's memory bytes to this rank's private file (removed when the process exits)."""
    folder = Path(tempfile.mkdtemp(prefix=f"empo2-rank{rank}-"))
    atexit.register(shutil.rmtree, folder, True)
    path = folder / "memory.sqlite"
    path.write_bytes(data)
    return path
