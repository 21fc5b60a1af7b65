"""Per-token log-probs of responses given prompts, for any Hugging Face causal LM, batched with padding.

Layout of one batch (P = longest prompt, R = longest response, L = P + R)::

    [pad … pad  p_1 … p_k | r_1 … r_m  pad … pad]      prompts LEFT-padded to P, responses RIGHT-padded to R

so every response starts at column P, and the logits that predict the responses are the last R + 1 positions minus the
final one. Only those are computed (``logits_to_keep``, when the model supports it; otherwise the full logits are
sliced), and log-probs are ``logit[token] − logsumexp(logits)`` in float32, without materialising a full log-softmax.
``position_ids`` count real tokens only, so a padded row sees exactly the positions it would see alone.

Works with grad enabled (training) and under ``torch.no_grad()`` (behaviour / reference log-probs).
"""

from __future__ import annotations

from typing import Iterator, Sequence

import torch


def _model_device(model: torch.nn.Module) -> torch.device:
    try:
        return next(model.parameters()).device
    except StopIteration:
        return torch.device("cpu")


def response_logprobs(
    model: torch.nn.Module,
    prompt_ids: Sequence[Sequence[int]],
    response_ids: Sequence[Sequence[int]],
    pad_token_id: int,
    *,
    temperature: float = 1.0,
) -> tuple[torch.Tensor, torch.Tensor]:
    """log π(r_t | prompt, r_<t) for every response token.

    prompt_ids: B lists of token ids (each non-empty); response_ids: B lists (may be empty).
    ``temperature`` divides the logits (use the sampling temperature so the log-probs match the behaviour policy).
    Returns ``(logp [B, R] float32, mask [B, R] bool)`` on the model's device, R = longest response; padded
    positions have ``logp = 0`` and ``mask = False``.
    """
    if len(prompt_ids) != len(response_ids):
        raise ValueError(f"{len(prompt_ids)} prompts but {len(response_ids)} responses")
    if any(len(p) == 0 for p in prompt_ids):
        raise ValueError("every prompt needs at least one token")
    device = _model_device(model)
    b = len(prompt_ids)
    p_len = max((len(p) for p in prompt_ids), default=0)
    r_len = max((len(r) for r in response_ids), default=0)
    if b == 0 or r_len == 0:
        return torch.zeros(b, r_len, device=device), torch.zeros(b, r_len, dtype=torch.bool, device=device)

    ids = torch.full((b, p_len + r_len), pad_token_id, dtype=torch.long)  # [B, L]
    attn = torch.zeros((b, p_len + r_len), dtype=torch.long)  # [B, L]
    resp = torch.full((b, r_len), pad_token_id, dtype=torch.long)  # [B, R]
    mask = torch.zeros((b, r_len), dtype=torch.bool)  # [B, R]
    for i, (p, r) in enumerate(zip(prompt_ids, response_ids)):
        ids[i, p_len - len(p) : p_len] = torch.as_tensor(p, dtype=torch.long)
        ids[i, p_len : p_len + len(r)] = torch.as_tensor(r, dtype=torch.long)
        attn[i, p_len - len(p) : p_len + len(r)] = 1
        resp[i, : len(r)] = torch.as_tensor(r, dtype=torch.long)
        mask[i, : len(r)] = True
    ids, attn, resp, mask = ids.to(device), attn.to(device), resp.to(device), mask.to(device)
    position_ids = (attn.cumsum(dim=1) - 1).clamp(min=0)  # [B, L]

    kwargs = dict(input_ids=ids, attention_mask=attn, position_ids=position_ids, use_cache=False)
    try:
        logits = model(**kwargs, logits_to_keep=r_len + 1).logits  # [B, R + 1, V]
    except TypeError:  # a model without logits_to_keep: compute all positions, then slice
        logits = model(**kwargs).logits  # [B, L, V]
    logits = logits[:, -(r_len + 1) : -1, :].float()  # [B, R, V]; position P-1+t predicts r_t
    if temperature != 1.0:
        logits = logits / temperature
    token_logit = logits.gather(-1, resp.unsqueeze(-1)).squeeze(-1)  # [B, R]
    logp = token_logit - torch.logsumexp(logits, dim=-1)  # [B, R]
    return torch.where(mask, logp, 0.0), mask


def micro_batches(
    prompt_ids: Sequence[Sequence[int]],
    response_ids: Sequence[Sequence[int]],
    max_tokens: int,
    *,
    sort: bool = True,
) -> Iterator[list[int]]:
    """Split rows into micro-batches whose PADDED size fits ``max_tokens``; yields lists of row indices.

    A micro-batch of rows S costs ``|S| · (max_{i∈S} len(prompt_i) + max_{i∈S} len(response_i))`` tokens (the layout
    of :func:`response_logprobs`). A single row over the budget gets a micro-batch of its own. With ``sort=True`` rows
    are grouped by total length (longest first) to cut padding; every index appears exactly once either way.
    """
    if max_tokens < 1:
        raise ValueError("max_tokens must be >= 1")
    order = list(range(len(prompt_ids)))
    if sort:
        order.sort(key=lambda i: -(len(prompt_ids[i]) + len(response_ids[i])))
    batch: list[int] = []
    max_p = max_r = 0
    for i in order:
        p, r = max(max_p, len(prompt_ids[i])), max(max_r, len(response_ids[i]))
        if batch and (len(batch) + 1) * (p + r) > max_tokens:
            yield batch
            batch, p, r = [], len(prompt_ids[i]), len(response_ids[i])
        batch.append(i)
        max_p, max_r = p, r
    if batch:
        yield batch
