"""Reflection off the critical path (``memory.overlap_reflection``): the end-of-episode tips of an iteration are
generated on a second thread while the update trains, and written to memory when the update is done.

The tips must come from the policy that played the episodes, as on the blocking path, but the update changes the
weights under the thread. So the thread generates with weights that stay put:

- a separate rollout backend (vLLM) keeps its own weights until the trainer syncs them, after :meth:`finish`;
- otherwise a *snapshot* of the model: a copy that shares the frozen weights and owns a copy of the trainable ones
  (with LoRA a few MB; with full fine-tuning a whole second model), refreshed before every reflection.

Memory is written on the main thread, in the blocking path's order, so both paths end an iteration with the same
memory (tests/test_overlap.py). Whether it pays depends on the hardware: on a CPU with few cores both halves want the
same cores, on a GPU the reflection's small decoding steps fill the update's gaps.
"""

from __future__ import annotations

import copy
from concurrent.futures import Future, ThreadPoolExecutor
from contextlib import nullcontext
from dataclasses import dataclass
from functools import partial

import torch

from empo2.episodes.episode import Episode
from empo2.episodes.reflection import land_memory_ops, memory_ops, memory_plan, reflection_job
from empo2.episodes.rollout import RolloutContext
from empo2.policy.generate import generate_batch


def overlap_wanted(setting: bool | None, model: torch.nn.Module, backend) -> bool:
    """``memory.overlap_reflection``; ``None`` (auto) = on where generation has its own weights, or on a GPU with a
    LoRA adapter (a full fine-tune's snapshot would be a second copy of every weight, beside the update's peak)."""
    if setting is not None:
        return setting
    lora = hasattr(model, "peft_config")
    return backend is not None or (lora and next(model.parameters()).device.type == "cuda")


@dataclass
class PendingReflection:
    uses: list
    writers: list[Episode]
    tips: Future


class BackgroundReflection:
    """Starts an iteration's reflections on a worker thread (:meth:`start`) and writes them (:meth:`finish`)."""

    def __init__(self, model: torch.nn.Module, backend=None, autocast=nullcontext):
        # an engine computes in its own dtype, outside the trainer's autocast
        self.model, self.backend, self.autocast = model, backend, nullcontext if backend is not None else autocast
        self.snapshot, self._pairs = (None, []) if backend is not None else _snapshot(model)
        self._worker = ThreadPoolExecutor(max_workers=1, thread_name_prefix="empo2-reflect")

    def start(self, ctx: RolloutContext, episodes: list[Episode], writers: list[Episode],
              seed: int | None = None) -> PendingReflection:
        """Call before the update: takes the weights that played ``episodes`` and starts generating the tips of
        ``writers`` (as :func:`~empo2.episodes.reflection.reflect`)."""
        uses, writers = memory_plan(episodes, writers)
        job = reflection_job(ctx, writers, seed)  # prompts and seeds are read here, on the caller's thread
        with torch.no_grad():
            for mine, theirs in self._pairs:
                mine.copy_(theirs)
        generate = self.backend.generate if self.backend is not None else partial(generate_batch, self.snapshot,
                                                                                  ctx.tokenizer, options=ctx.compute)
        return PendingReflection(uses, writers, self._worker.submit(self._run, job, generate))

    def _run(self, job, generate) -> list[str]:
        with self.autocast():  # autocast is per thread: the blocking path reflects inside the rollout's
            return job(generate)

    def finish(self, ctx: RolloutContext, episodes: list[Episode], pending: PendingReflection) -> list[Episode]:
        """Wait for the tips and write them (and the tip uses) to memory; a failed reflection raises here. Returns
        ``episodes`` as new values noting their tips, as :func:`~empo2.episodes.reflection.reflect` does."""
        tips = pending.tips.result()
        return land_memory_ops(ctx, episodes, memory_ops(ctx, pending.uses, pending.writers, tips))

    def close(self) -> None:
        self._worker.shutdown(wait=True)


def _snapshot(model: torch.nn.Module) -> tuple[torch.nn.Module, list[tuple[torch.Tensor, torch.Tensor]]]:
    """A copy of ``model`` that shares its frozen parameters, and (snapshot tensor, model parameter) pairs of the
    trainable ones to refresh it with."""
    trainable = [p for p in model.parameters() if p.requires_grad]
    shared = {id(p): p for p in model.parameters() if not p.requires_grad}
    snapshot = copy.deepcopy(model, memo=shared)
    own = [p for p in snapshot.parameters() if p.requires_grad]
    assert len(own) == len(trainable), "the snapshot's trainable parameters do not match the model's"
    snapshot.requires_grad_(False)
    return snapshot, [(mine.data, theirs) for mine, theirs in zip(own, trainable)]
