"""Batched generation for many environments at once: left padding, attention mask, KV cache, temperature/top-p.

Every call serves all still-active episodes in one ``model.generate``; the behaviour log-prob of each sampled token
(log-softmax of the raw, untempered logits, i.e. π_old at temperature 1) comes back with it, so no second forward
pass is needed for the rollout policy's log-probs.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch


@dataclass
class Generation:
    ids: list[int]
    """Sampled token ids, up to and including the first EOS (or ``max_new_tokens``)."""
    logprobs: list[float]
    """Behaviour log-prob of each sampled token, ``len == len(ids)``."""
    text: str


@torch.no_grad()
def generate_batch(
    model,
    tokenizer,
    prompts: list[list[int]],
    max_new_tokens: int,
    temperature: float = 1.0,
    top_p: float = 1.0,
    greedy: bool = False,
    generator_seed: int | None = None,
    top_k: int = 0,
    row_seeds: list[int] | None = None,
) -> list[Generation]:
    """Generate one completion per prompt (token-id lists), all in one batched call.

    Only the sampling settings given here apply: the model's own generation defaults (a repetition penalty, top-k,
    n-gram blocking — Qwen2.5-Instruct ships some) are overridden, so the sampled distribution is the tempered
    policy whose log-probs the update uses. ``row_seeds`` (one per prompt) samples each row from its own random
    stream (:mod:`empo2.policy.seeded`), so a row's tokens do not depend on the rest of the batch."""
    if not prompts:
        return []
    device = next(model.parameters()).device
    pad_id = tokenizer.pad_token_id
    width = max(len(p) for p in prompts)
    input_ids = torch.full((len(prompts), width), pad_id, dtype=torch.long)  # [B, P] left-padded
    attention = torch.zeros((len(prompts), width), dtype=torch.long)
    for row, ids in enumerate(prompts):
        input_ids[row, width - len(ids):] = torch.tensor(ids, dtype=torch.long)
        attention[row, width - len(ids):] = 1
    if generator_seed is not None:
        torch.manual_seed(generator_seed)
    do_sample = not greedy and temperature > 0
    sampling = dict(do_sample=True, temperature=temperature, top_p=top_p, top_k=top_k) if do_sample \
        else dict(do_sample=False)
    neutral = dict(repetition_penalty=1.0, no_repeat_ngram_size=0, min_new_tokens=0)
    if do_sample and row_seeds is not None:
        from transformers import LogitsProcessorList

        from empo2.policy.seeded import SeededSampler

        sampler = SeededSampler(row_seeds, temperature, top_p, top_k)
        sampling = dict(do_sample=False, logits_processor=LogitsProcessorList([sampler]))
    out = model.generate(
        input_ids=input_ids.to(device),
        attention_mask=attention.to(device),
        max_new_tokens=max_new_tokens,
        pad_token_id=pad_id,
        eos_token_id=tokenizer.eos_token_id,
        return_dict_in_generate=True,
        output_logits=True,
        use_cache=True,
        **sampling,
        **neutral,
    )
    new_tokens = out.sequences[:, width:]  # [B, N]
    logits = torch.stack(out.logits, dim=1).float()  # [B, N, V] raw logits
    token_logp = torch.log_softmax(logits, dim=-1).gather(-1, new_tokens.unsqueeze(-1)).squeeze(-1)  # [B, N]
    results = []
    eos = tokenizer.eos_token_id
    for row in range(len(prompts)):
        ids = new_tokens[row].tolist()
        if eos in ids:
            ids = ids[: ids.index(eos) + 1]
        logp = token_logp[row, : len(ids)].tolist()
        results.append(Generation(ids=ids, logprobs=logp, text=tokenizer.decode(ids, skip_special_tokens=True)))
    return results
