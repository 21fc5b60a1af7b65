"""Batched generation for many environments at once: KV cache, temperature/top-p, shared prompt heads.

Every call serves all still-active episodes in one batch; the behaviour log-prob of each sampled token comes back
with it, so no second forward pass is needed for the rollout policy's log-probs. They are TRL's convention:
log-softmax(logits / temperature), the distribution that was sampled (top-p / top-k filtering is not in them, which
is why training refuses those: :meth:`empo2.config.Config.check_training`). Greedy decoding samples no distribution;
its log-probs are those of the untempered logits (:func:`scoring_temperature`).

With prefix sharing (the default, see :mod:`empo2.policy.prefix`) rows that start with the same tokens (the G
rollouts of a task share system prompt, task and demonstration) compute that head once, and a short decoding loop
here samples on top of the shared cache. Without it, one left-padded ``model.generate`` call does the work.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from empo2.policy import kv_cache
from empo2.policy import prefix as px
from empo2.policy.sampling import Sampling, scoring_temperature  # noqa: F401  (scoring_temperature: public here)
from empo2.policy.seeded import SeededSampler


@dataclass
class Generation:
    ids: list[int]
    """Sampled token ids, up to and including the first EOS (or ``max_new_tokens``)."""
    logprobs: list[float]
    """Behaviour log-prob of each sampled token, ``len == len(ids)``."""
    text: str


def token_logprobs(logits: torch.Tensor, tokens: torch.Tensor, temperature: float) -> torch.Tensor:
    """log-softmax(logits / temperature) at ``tokens``: logits [..., V] (raw), tokens [...]; float32."""
    scaled = logits.float() / temperature
    return torch.log_softmax(scaled, dim=-1).gather(-1, tokens.unsqueeze(-1)).squeeze(-1)


@torch.no_grad()
def generate_batch(
    model,
    tokenizer,
    prompts: list[list[int]],
    sampling: Sampling,
    row_seeds: list[int] | None = None,
    *,
    generator_seed: int | None = None,
    options: px.ComputeOptions = px.DEFAULT_OPTIONS,
    heads: px.HeadMemo | None = None,
) -> list[Generation]:
    """Generate one completion per prompt (token-id lists), all in one batched call.

    Only ``sampling``'s settings apply: the model's own generation defaults (a repetition penalty, top-k,
    n-gram blocking — Qwen2.5-Instruct ships some) are overridden, so the sampled distribution is the tempered
    policy whose log-probs the update uses. ``row_seeds`` (one per prompt) samples each row from its own random
    stream (:mod:`empo2.policy.seeded`), so a row's tokens do not depend on the rest of the batch.
    ``options``: prefix sharing, compute dtype and the shortest head worth sharing. ``heads``: a rollout's memo of the
    previous call's heads (used inside :meth:`empo2.policy.prefix.HeadMemo.reuse`).
    """
    if not prompts:
        return []
    if generator_seed is not None:
        torch.manual_seed(generator_seed)
    do_sample, scoring = sampling.sampled, sampling.scoring_temperature
    max_new_tokens, temperature, top_p, top_k = (sampling.max_new_tokens, sampling.temperature, sampling.top_p,
                                                 sampling.top_k)
    with px.autocast(model, options):
        reusing = heads is not None and heads.active
        groups = None if not options.prefix_sharing else heads.layout(prompts, options.min_shared_tokens) \
            if reusing else px.plan_layout(prompts, options.min_shared_tokens)
        if groups:
            new_tokens, token_logp = _decode_shared(model, tokenizer, prompts, groups, max_new_tokens,
                                                    temperature if do_sample else 0.0, top_p, top_k, row_seeds, heads)
        else:
            new_tokens, logits = _generate_padded(model, tokenizer, prompts, max_new_tokens, do_sample,
                                                  temperature, top_p, top_k, row_seeds)
            token_logp = token_logprobs(logits, new_tokens, scoring)  # [B, N]
    results = []
    eos = tokenizer.eos_token_id
    for row in range(len(prompts)):
        ids = new_tokens[row].tolist()
        if eos in ids:
            ids = ids[: ids.index(eos) + 1]
        logp = token_logp[row, : len(ids)].tolist()
        results.append(Generation(ids=ids, logprobs=logp, text=tokenizer.decode(ids, skip_special_tokens=True)))
    return results


def _generate_padded(model, tokenizer, prompts, max_new_tokens, do_sample, temperature, top_p, top_k, row_seeds=None):
    """One left-padded ``model.generate``. Returns ``(tokens [B, N], raw logits [B, N, V])``."""
    device = next(model.parameters()).device
    pad_id = tokenizer.pad_token_id
    width = max(len(p) for p in prompts)
    input_ids = torch.full((len(prompts), width), pad_id, dtype=torch.long)  # [B, P] left-padded
    attention = torch.zeros((len(prompts), width), dtype=torch.long)
    for row, ids in enumerate(prompts):
        input_ids[row, width - len(ids):] = torch.tensor(ids, dtype=torch.long)
        attention[row, width - len(ids):] = 1
    sampling = dict(do_sample=True, temperature=temperature, top_p=top_p, top_k=top_k) if do_sample \
        else dict(do_sample=False)
    neutral = dict(repetition_penalty=1.0, no_repeat_ngram_size=0, min_new_tokens=0)
    if do_sample and row_seeds is not None:
        from transformers import LogitsProcessorList

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
        synced_gpus=False,  # transformers syncs FSDP ranks' steps; the sharded trainer gathers the whole model first
        **sampling,
        **neutral,
    )
    new_tokens = out.sequences[:, width:]  # [B, N]
    return new_tokens, torch.stack(out.logits, dim=1)  # [B, N, V] raw: before temperature and the seeded noise


def _decode_shared(model, tokenizer, prompts, groups, max_new_tokens, temperature, top_p, top_k, row_seeds=None,
                   heads=None):
    """Decode on top of the groups' shared heads (starting from ``heads``, a rollout's :class:`HeadMemo`, if given);
    ``temperature == 0`` means greedy; ``row_seeds`` samples each row from its own stream
    (:class:`empo2.policy.seeded.SeededSampler`, the same draws as the padded path).

    Returns ``(tokens [B, N], logp [B, N])``, log-probs at :func:`scoring_temperature`; rows that finished keep
    receiving the pad token (as in ``generate``).
    """
    device = next(model.parameters()).device
    ids, mask, pos = px.tail_batch(prompts, groups, tokenizer.pad_token_id, device)  # [B, S] each
    cache, head_mask = px.head_cache(model, prompts, groups, room=ids.shape[1] + max_new_tokens,  # head_mask [B, H]
                                     memo=heads)
    mask = prompt_mask = torch.cat([head_mask, mask], dim=1)  # [B, H + S]
    next_pos = torch.tensor([len(p) for p in prompts], device=device)  # [B]
    done = torch.zeros(len(prompts), dtype=torch.bool, device=device)
    seeded = SeededSampler(row_seeds, temperature, top_p, top_k) if row_seeds is not None and temperature > 0 else None
    scoring = scoring_temperature(temperature)
    tokens, logps = [], []
    for _ in range(max_new_tokens):
        out = model(input_ids=ids, attention_mask=mask, position_ids=pos, use_cache=True, logits_to_keep=1,
                    **kv_cache.cache_kwargs(model, cache))
        cache = kv_cache.output_cache(out)
        logits = out.logits[:, -1, :].float()  # [B, V] raw logits
        tok = seeded(ids, logits).argmax(dim=-1) if seeded else _pick(logits, temperature, top_p, top_k)  # [B]
        tok = torch.where(done, torch.full_like(tok, tokenizer.pad_token_id), tok)
        tokens.append(tok)
        logps.append(token_logprobs(logits, tok, scoring))
        done |= tok == tokenizer.eos_token_id
        if bool(done.all()):
            break
        ids, pos = tok[:, None], next_pos[:, None]  # [B, 1]
        mask = torch.cat([mask, torch.ones_like(mask[:, :1])], dim=1)
        next_pos = next_pos + 1
    if not tokens:
        return torch.zeros((len(prompts), 0), dtype=torch.long), torch.zeros((len(prompts), 0))
    tokens = torch.stack(tokens, dim=1)  # [B, N]
    if heads is not None and heads.active:  # the next call of the rollout may extend these rows
        eos = tokenizer.eos_token_id
        responses = [row[: row.index(eos) + 1] if eos in row else row for row in tokens.tolist()]
        heads.keep_rows(cache, prompt_mask, prompts, responses)
    return tokens, torch.stack(logps, dim=1)  # [B, N]


def _pick(logits: torch.Tensor, temperature: float, top_p: float, top_k: int = 0) -> torch.Tensor:
    """Greedy (``temperature == 0``) or temperature + top-k + nucleus sampling from raw logits [B, V]; returns [B]."""
    if temperature <= 0:
        return logits.argmax(dim=-1)
    scaled = logits / temperature  # [B, V]
    if 0 < top_k < scaled.shape[-1]:
        kth = scaled.topk(top_k, dim=-1).values[:, -1:]  # [B, 1]
        scaled = scaled.masked_fill(scaled < kth, float("-inf"))
    probs = torch.softmax(scaled, dim=-1)  # [B, V]
    if top_p < 1.0:
        sorted_p, order = probs.sort(dim=-1, descending=True)
        keep = sorted_p.cumsum(dim=-1) - sorted_p < top_p  # the smallest set whose mass reaches top_p (>= 1 token)
        probs = torch.zeros_like(probs).scatter(-1, order, sorted_p * keep)
    return torch.multinomial(probs, 1).squeeze(-1)
