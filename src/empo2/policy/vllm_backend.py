"""vLLM rollout backend (``policy.backend: vllm``; ``pip install 'empo2[vllm]'``; one CUDA GPU per rank).

The engine lives in the trainer's process next to the training model (colocated, as TRL's ``vllm_mode=colocate``):
``memory_fraction`` of the GPU is vLLM's (weights + KV cache), the rest the trainer's. Prefix caching is on, so the
shared system prompt, demonstrations and history of a group's G rollouts are computed once.

Weight sync after every update: a LoRA run saves the adapter to a fresh folder and switches to a new
``LoRARequest`` id (vLLM loads it on the next request); a full fine-tuning run copies every weight into the engine's
model (``load_weights``) and clears the prefix cache, whose keys would otherwise hold the old policy's KV.

Not exercised on this project's CPU CI: tests/test_backend.py and scripts/gpu_check.sh run it where a GPU exists.
"""

from __future__ import annotations

import os
import shutil
import tempfile

from empo2.policy.errors import BackendError
from empo2.policy.generate import Generation


def _import_vllm():
    try:
        import vllm
    except ImportError as exc:
        raise BackendError(f"policy.backend=vllm needs vLLM and a CUDA GPU: pip install 'empo2[vllm]' ({exc})") \
            from None
    return vllm


class VLLMBackend:
    """Batched sampling with vLLM; same contract as :class:`empo2.policy.backend.HFBackend`."""

    def __init__(self, model_path: str, tokenizer, lora_rank: int = 0, memory_fraction: float = 0.4, seed: int = 0):
        os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")  # engine in this process: weights reachable
        vllm = _import_vllm()
        self.tokenizer, self._vllm = tokenizer, vllm
        extra = dict(enable_lora=True, max_lora_rank=lora_rank) if lora_rank else {}
        try:  # processed: the log-probs of the distribution sampled (after temperature), the backend contract's
            self.llm = vllm.LLM(model=model_path, enable_prefix_caching=True, gpu_memory_utilization=memory_fraction,
                                seed=seed, dtype="bfloat16", logprobs_mode="processed_logprobs", **extra)
        except TypeError:  # a vLLM without logprobs_mode returns untempered log-probs: wrong at temperature != 1
            raise BackendError("policy.backend=vllm needs a vLLM with LLM(logprobs_mode=...) for the log-probs of "
                               "the sampled distribution: pip install -U vllm") from None
        self._lora, self._lora_id, self._lora_dir = None, 0, None

    def generate(self, prompts: list[list[int]], max_new_tokens: int, *, temperature: float = 1.0, top_p: float = 1.0,
                 top_k: int = 0, greedy: bool = False, row_seeds: list[int] | None = None) -> list[Generation]:
        if not prompts:
            return []
        sp = self._vllm.SamplingParams
        params = [sp(max_tokens=max_new_tokens, temperature=0.0 if greedy else temperature,
                     top_p=1.0 if greedy else top_p, top_k=-1 if greedy or top_k <= 0 else top_k, logprobs=0,
                     seed=None if row_seeds is None else row_seeds[i] % 2**31,
                     stop_token_ids=[self.tokenizer.eos_token_id]) for i in range(len(prompts))]
        inputs = [{"prompt_token_ids": list(p)} for p in prompts]
        outs = self.llm.generate(inputs, params, lora_request=self._lora, use_tqdm=False)
        results = []
        for out in outs:
            comp = out.outputs[0]
            ids = list(comp.token_ids)
            logps = [float(step[t].logprob) for step, t in zip(comp.logprobs or [], ids)]
            results.append(Generation(ids=ids, logprobs=logps,
                                      text=self.tokenizer.decode(ids, skip_special_tokens=True)))
        return results

    def sync_weights(self, model) -> None:
        """Make the engine sample from ``model``'s current weights (LoRA adapter or full weights)."""
        if hasattr(model, "peft_config"):
            self._sync_lora(model)
            return
        engine_model = self.llm.llm_engine.model_executor.driver_worker.worker.model_runner.model
        engine_model.load_weights((name, p.detach()) for name, p in model.state_dict().items())
        self.llm.reset_prefix_cache()

    def _sync_lora(self, model) -> None:
        from vllm.lora.request import LoRARequest

        folder = tempfile.mkdtemp(prefix="empo2-vllm-lora-")
        model.save_pretrained(folder)
        if self._lora_dir:
            shutil.rmtree(self._lora_dir, ignore_errors=True)
        self._lora_id += 1  # a new id: vLLM loads the adapter afresh instead of serving its cached copy
        self._lora, self._lora_dir = LoRARequest(f"policy-{self._lora_id}", self._lora_id, folder), folder
        self.llm.reset_prefix_cache()
