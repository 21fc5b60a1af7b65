"""``policy.backend: merged``: rollouts on a copy of the policy whose LoRA update is folded into its weights.

A rollout decodes one token per row per forward, and at G = 8 rows on a CPU such a forward is bound by reading the
weights and by the number of operations, not by arithmetic: the unmerged LoRA adds two small matrix products per
adapted layer. The copy runs the plain model, and in ``dtype`` (bfloat16 halves the bytes read per forward). It is a
separate engine as vLLM is: :meth:`MergedBackend.sync_weights` rebuilds it after every update, and the trainer
recomputes π_old (``algo.old_logprobs: auto``), since the copy's rounding differs from the trained model's.

Between two syncs the copy's weights are fixed, so every generation call may extend the KV the previous call computed
(the rollout's :class:`~empo2.policy.prefix.HeadMemo`, kept here rather than per rollout).
"""

from __future__ import annotations

import copy
import dataclasses

import torch

from empo2.policy.generate import Generation, generate_batch
from empo2.policy.prefix import DEFAULT_OPTIONS, ComputeOptions, HeadMemo
from empo2.policy.sampling import Sampling


class MergedBackend:
    """Generation with a merged copy of the policy; the :class:`~empo2.policy.backend.RolloutBackend` contract."""

    def __init__(self, model, tokenizer, dtype: str = "float32", options: ComputeOptions = DEFAULT_OPTIONS):
        self.tokenizer, self.dtype = tokenizer, getattr(torch, dtype)
        # the copy's weights are in its dtype already: no autocast around its forwards
        self.options = dataclasses.replace(options, compute_dtype="float32")
        self.engine, self.heads = None, HeadMemo()
        self.sync_weights(model)

    def generate(self, prompts: list[list[int]], sampling: Sampling,
                 row_seeds: list[int] | None = None) -> list[Generation]:
        return generate_batch(self.engine, self.tokenizer, prompts, sampling, row_seeds, options=self.options,
                              heads=self.heads if self.options.prefix_sharing and self.options.reuse_heads else None)

    def sync_weights(self, model) -> None:
        """Rebuild the copy from ``model``'s current weights (LoRA folded in), in the engine's dtype."""
        self.engine = None  # the old copy is freed before the new one is made
        twin = copy.deepcopy(model)
        if hasattr(twin, "merge_and_unload"):
            twin = twin.merge_and_unload()
        self.engine = twin.to(self.dtype).eval().requires_grad_(False)
        self.heads.heads = []  # KV of the old weights is stale

    def close(self) -> None:
        self.engine, self.heads.heads = None, None
