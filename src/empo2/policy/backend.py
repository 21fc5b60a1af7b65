"""Rollout backends: what turns a batch of prompt-id lists into sampled token ids and behaviour log-probs.

``policy.backend: hf`` (default, the reference) generates with the training model itself, so it never holds stale
weights. ``policy.backend: vllm`` (``pip install 'empo2[vllm]'``, a CUDA GPU) keeps a separate vLLM engine with
prefix caching; the trainer calls :meth:`RolloutBackend.sync_weights` after every update so rollouts always come
from the current policy.

The contract (tests/test_backend.py runs it against every available backend, and drives a rollout and a reflection
through a backend with exactly the protocol's signature):

- ``generate(prompts, sampling, row_seeds=None)`` (``sampling``: a :class:`~empo2.policy.sampling.Sampling`; every
  backend's signature equals :class:`RolloutBackend`'s) returns one :class:`~empo2.policy.generate.Generation` per
  prompt, in order: ids up to and including the first EOS (at most ``sampling.max_new_tokens``), one behaviour
  log-prob per id, the decoded text. ``top_k=0`` and ``top_p=1`` are off.
- behaviour log-probs are of the distribution that was sampled, TRL's convention: log-softmax(logits /
  temperature), where the update scores ``logp_new`` at the same temperature. Greedy decoding (``greedy`` or
  temperature 0) gives the untempered log-softmax. Top-p / top-k filtering is outside this promise (HF leaves it
  out, vLLM's processed log-probs renormalise over what is kept); training refuses both.
- equal ``row_seeds`` give equal samples; greedy is deterministic.
- after ``sync_weights(model)`` samples come from ``model``'s current weights.
"""

from __future__ import annotations

from typing import Protocol

from empo2.policy.backend_error import BackendError
from empo2.policy.generate import Generation, generate_batch
from empo2.policy.prefix import DEFAULT_OPTIONS, ComputeOptions
from empo2.policy.sampling import Sampling

BACKENDS = ("hf", "merged", "vllm", "auto")
"""``merged``: the HF decoding on a copy of the policy with its LoRA folded in (:mod:`empo2.policy.merged_backend`);
``auto``: the engine measured faster on this kind of machine (:mod:`empo2.policy.engine_choice`)."""


class RolloutBackend(Protocol):
    def generate(self, prompts: list[list[int]], sampling: Sampling,
                 row_seeds: list[int] | None = None) -> list[Generation]: ...

    def sync_weights(self, model) -> None: ...


class HFBackend:
    """Generation with the training model (Hugging Face ``generate``); weights are shared, so syncing is free."""

    def __init__(self, model, tokenizer, options: ComputeOptions = DEFAULT_OPTIONS):
        self.model, self.tokenizer, self.options = model, tokenizer, options

    def generate(self, prompts: list[list[int]], sampling: Sampling,
                 row_seeds: list[int] | None = None) -> list[Generation]:
        return generate_batch(self.model, self.tokenizer, prompts, sampling, row_seeds, options=self.options)

    def sync_weights(self, model) -> None:
        self.model = model


VLLM_LORA_RANKS = (1, 8, 16, 32, 64, 128, 256, 320, 512)
"""The adapter ranks vLLM's ``max_lora_rank`` accepts (vLLM ``config/lora.py``)."""


def check_lora_rank(lora_rank: int) -> None:
    """A LoRA rank (0: no adapter) the vLLM engine can serve, or one line saying which ones it can."""
    if lora_rank and lora_rank not in VLLM_LORA_RANKS:
        raise BackendError(f"policy.lora_r={lora_rank}: vLLM serves adapters of rank "
                           f"{', '.join(map(str, VLLM_LORA_RANKS))} only; pick one of them")


def check_backend(name: str, lora_rank: int = 0) -> None:
    """Fail early (before a run writes anything) when backend ``name`` cannot run here (``lora_rank``: the
    adapter's rank, 0 for full fine-tuning)."""
    if name == "vllm":
        from empo2.policy.vllm_backend import _import_vllm

        check_lora_rank(lora_rank)
        _import_vllm()
    elif name not in ("hf", "merged"):
        raise BackendError(f"unknown policy.backend {name!r}; use {' or '.join(BACKENDS)}")


def make_backend(name: str, model, tokenizer, model_path: str | None = None, lora_rank: int = 16,
                 memory_fraction: float = 0.4, seed: int = 0, dtype: str | None = None) -> RolloutBackend:
    """Build backend ``name`` (``hf`` or ``vllm``) for ``model``; vLLM is imported only here, and only if asked.
    ``dtype``: the engine's (``None``: its device's default)."""
    if name == "hf":
        return HFBackend(model, tokenizer)
    if name == "merged":
        from empo2.policy.merged_backend import MergedBackend

        return MergedBackend(model, tokenizer, dtype or "float32")
    if name == "vllm":
        from empo2.policy.vllm_backend import VLLMBackend

        check_lora_rank(lora_rank)  # before the engine starts: vLLM refuses other ranks deep in its start-up
        return VLLMBackend(model_path, tokenizer, lora_rank=lora_rank, memory_fraction=memory_fraction, seed=seed,
                           dtype=dtype)
    raise BackendError(f"unknown policy.backend {name!r}; use {' or '.join(BACKENDS)}")
