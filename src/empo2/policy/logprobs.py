"""Per-token log-probs of responses given prompts, for any Hugging Face causal LM, batched with padding.

Layout of one batch (P = longest prompt, R = longest response, L = P + R)::

    [pad … pad  p_1 … p_k | r_1 … r_m  pad … pad]      prompts LEFT-padded to P, responses RIGHT-padded to R

so every response starts at column P, and the logits that predict the responses are the last R + 1 positions minus the
final one. Only those are computed (``logits_to_keep``, when the model supports it; otherwise the full logits are
sliced), and log-probs are ``logit[token] − logsumexp(logits)`` in float32, without materialising a full log-softmax.
``position_ids`` count real tokens only, so a padded row sees exactly the positions it would see alone.

With prefix sharing (the default; :mod:`empo2.policy.prefix`) rows with a common token head run that head once, with
gradient, and their tails + responses run on top of its KV cache; the response columns are laid out the same way.
Where the model exposes its decoder and output layer, logits are computed only at real response tokens and
``logprob_chunk_tokens`` at a time (each chunk recomputed in backward rather than stored), so no [B, R, V] tensor
is ever held. A row whose prompt + response starts another row's prompt (the ``append`` prompt layout) is read off
that row's forward (:mod:`empo2.policy.packing`), with the same log-probs and gradients.

Works with grad enabled (training) and under ``torch.no_grad()`` (behaviour / reference log-probs).
"""

from __future__ import annotations

from collections.abc import Iterator, Sequence

import torch
from torch.distributed.fsdp import FSDPModule
from torch.utils.checkpoint import checkpoint

from empo2.policy import kv_cache
from empo2.policy import packing as pk
from empo2.policy import prefix as px


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
    options: px.ComputeOptions = px.DEFAULT_OPTIONS,
    step_heads: px.StepHeads | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """log π(r_t | prompt, r_<t) for every response token.

    prompt_ids: B lists of token ids (each non-empty); response_ids: B lists (may be empty).
    ``temperature`` divides the logits (use the sampling temperature so the log-probs match the behaviour policy).
    ``options``: prefix sharing, compute dtype, log-prob chunk size, the shortest head worth sharing.
    ``step_heads``: the optimizer step's heads (:func:`empo2.policy.prefix.heads_once_per_step`), used with grad on.
    Returns ``(logp [B, R] float32, mask [B, R] bool)`` on the model's device, R = longest response; padded
    positions have ``logp = 0`` and ``mask = False``.
    """
    if len(prompt_ids) != len(response_ids):
        raise ValueError(f"{len(prompt_ids)} prompts but {len(response_ids)} responses")
    if any(len(p) == 0 for p in prompt_ids):
        raise ValueError("every prompt needs at least one token")
    packing = pk.plan_packing(prompt_ids, response_ids) if packs_chains(model, options) else None
    if packing is None or not packing.packs:
        return _logprobs(model, prompt_ids, response_ids, pad_token_id, temperature, options, step_heads)
    lengths = [len(r) for r in response_ids]
    scored = packing.scored(lengths, _model_device(model))  # [S, C]
    logp, _ = _logprobs(model, packing.prompts, packing.continuations, pad_token_id, temperature, options,
                        step_heads, scored)  # [S, C]
    return packing.unpack(logp, lengths)


def packs_chains(model, options: px.ComputeOptions) -> bool:
    """Whether :func:`response_logprobs` packs chained rows (:mod:`empo2.policy.packing`): where ``options`` ask
    for it and logits can be computed at the packed responses' positions only (a model whose output layer runs
    inside its own forward would compute them at every position of the packed sequences)."""
    return options.pack_chains and _split_head(model) is not None


def _logprobs(model, prompt_ids, response_ids, pad_token_id: int, temperature: float, options: px.ComputeOptions,
              step_heads: px.StepHeads | None, scored: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """:func:`response_logprobs` of rows as given; ``scored`` [B, R]: the response positions whose log-probs are
    wanted (default: all), the others left 0."""
    device = _model_device(model)
    b = len(prompt_ids)
    p_len = max((len(p) for p in prompt_ids), default=0)
    r_len = max((len(r) for r in response_ids), default=0)
    if b == 0 or r_len == 0:
        return torch.zeros(b, r_len, device=device), torch.zeros(b, r_len, dtype=torch.bool, device=device)

    step = step_heads if torch.is_grad_enabled() else None  # a no-grad pass (reference log-probs) runs its own heads
    groups = None if not options.prefix_sharing else step.layout(prompt_ids, options.min_shared_tokens) \
        if step is not None else px.plan_layout(prompt_ids, options.min_shared_tokens)
    resp = torch.full((b, r_len), pad_token_id, dtype=torch.long)  # [B, R]
    mask = torch.zeros((b, r_len), dtype=torch.bool)  # [B, R]
    for i, r in enumerate(response_ids):
        resp[i, : len(r)] = torch.as_tensor(r, dtype=torch.long)
        mask[i, : len(r)] = True
    resp, mask = resp.to(device), mask.to(device)
    scored = mask if scored is None else scored
    with px.autocast(model, options):
        if groups:
            kwargs = _shared_inputs(model, prompt_ids, groups, resp, mask, pad_token_id, step)
        else:
            kwargs = _padded_inputs(prompt_ids, resp, mask, p_len, pad_token_id, device)
        logp = _response_logp(model, kwargs, resp, scored, temperature, options.logprob_chunk_tokens)
    return torch.where(scored, logp, 0.0), mask


def _padded_inputs(prompt_ids, resp, mask, p_len: int, pad_token_id: int, device) -> dict:
    """Today's layout: prompts LEFT-padded to P, responses RIGHT-padded to R (module docstring)."""
    b, r_len = resp.shape
    ids = torch.full((b, p_len), pad_token_id, dtype=torch.long)  # [B, P]
    attn = torch.zeros((b, p_len), dtype=torch.long)  # [B, P]
    for i, p in enumerate(prompt_ids):
        ids[i, p_len - len(p):] = torch.as_tensor(p, dtype=torch.long)
        attn[i, p_len - len(p):] = 1
    ids = torch.cat([ids.to(device), resp], dim=1)  # [B, L]
    attn = torch.cat([attn.to(device), mask.long()], dim=1)  # [B, L]
    position_ids = (attn.cumsum(dim=1) - 1).clamp(min=0)  # [B, L]
    return dict(input_ids=ids, attention_mask=attn, position_ids=position_ids, use_cache=False)


def _shared_inputs(model, prompt_ids, groups, resp, mask, pad_token_id: int, step=None) -> dict:
    """Heads once (with grad; from the step's heads ``step`` if given) as a KV cache; tails LEFT-padded, then
    responses RIGHT-padded, on top of it."""
    cache, head_mask = px.head_cache(model, prompt_ids, groups, step=step)  # head_mask [B, H]
    ids, tail_mask, pos = px.tail_batch(prompt_ids, groups, pad_token_id, resp.device)  # [B, S] each
    lengths = torch.tensor([len(p) for p in prompt_ids], device=resp.device)  # [B]
    resp_pos = lengths[:, None] + torch.arange(resp.shape[1], device=resp.device)  # [B, R]
    return dict(input_ids=torch.cat([ids, resp], dim=1), position_ids=torch.cat([pos, resp_pos], dim=1),
                attention_mask=torch.cat([head_mask, tail_mask, mask.long()], dim=1), use_cache=True,
                **kv_cache.cache_kwargs(model, cache))


def _split_head(model):
    """(decoder, output layer) when logits are a plain linear map of the decoder's last hidden state, else None."""
    if isinstance(model, FSDPModule):  # FSDP gathers the root's weights (embeddings, output layer) in its forward only
        return None
    base = model.get_base_model() if hasattr(model, "get_base_model") else model
    config = getattr(base, "config", None)
    if config is None or getattr(config, "final_logit_softcapping", None) or hasattr(config, "logit_scale"):
        return None
    try:
        decoder, head = base.get_decoder(), base.get_output_embeddings()
    except (AttributeError, NotImplementedError):
        return None
    if decoder is None or not isinstance(head, torch.nn.Linear):
        return None
    return decoder, head


def _response_logp(model, kwargs: dict, resp, scored, temperature: float, chunk: int) -> torch.Tensor:
    """log π(r_t | …) [B, R] float32 from one forward over ``kwargs`` whose last R columns are the responses; where
    the model allows, computed at the ``scored`` [B, R] positions only."""
    r_len = resp.shape[1]
    split = _split_head(model)
    if split is None:
        try:
            logits = model(**kwargs, logits_to_keep=r_len + 1).logits  # [B, R + 1, V]
        except TypeError:  # a model without logits_to_keep: compute all positions, then slice
            logits = model(**kwargs).logits  # [B, L, V]
        logits = logits[:, -(r_len + 1): -1, :].float() / temperature  # [B, R, V]; column P-1+t predicts r_t
        token_logit = logits.gather(-1, resp.unsqueeze(-1)).squeeze(-1)  # [B, R]
        return token_logit - torch.logsumexp(logits, dim=-1)  # [B, R]
    decoder, head = split
    hidden = decoder(**kwargs).last_hidden_state[:, -(r_len + 1): -1, :]  # [B, R, D]
    rows, cols = scored.nonzero(as_tuple=True)  # the N response tokens wanted
    picked, targets = hidden[rows, cols], resp[rows, cols]  # [N, D], [N]
    parts = []
    for start in range(0, picked.shape[0], max(1, chunk)):
        h, t = picked[start: start + chunk], targets[start: start + chunk]
        if torch.is_grad_enabled() and h.requires_grad:
            parts.append(checkpoint(_chunk_logp, head, h, t, temperature, use_reentrant=False))
        else:
            parts.append(_chunk_logp(head, h, t, temperature))
    logp = torch.zeros(resp.shape, dtype=torch.float32, device=resp.device)
    if parts:
        logp = logp.index_put((rows, cols), torch.cat(parts))
    return logp


def _chunk_logp(head: torch.nn.Linear, hidden: torch.Tensor, targets: torch.Tensor, temperature: float):
    """log-softmax at ``targets`` [n] of ``head(hidden)`` [n, V] in float32, without a full log-softmax tensor."""
    logits = head(hidden).float() / temperature  # [n, V]
    return logits.gather(-1, targets[:, None]).squeeze(-1) - torch.logsumexp(logits, dim=-1)  # [n]


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


def shared_micro_batches(
    prompt_ids: Sequence[Sequence[int]],
    response_ids: Sequence[Sequence[int]],
    max_tokens: int,
    min_shared: int = 16,
    step_heads: bool = False,
) -> list[list[int]]:
    """Micro-batches (lists of row indices) for prefix-shared log-probs, each costing at most ``max_tokens``.

    Rows are grouped by common token head (:func:`empo2.policy.prefix.plan_groups`) and filled group by group. The
    cost of a micro-batch is what it computes: each group head once (a row left alone runs its own head),
    plus rows × the longest tail + response. A single row over the budget gets a micro-batch of its own.
    ``step_heads``: the rows are one optimizer step's, run inside :func:`empo2.policy.prefix.heads_once_per_step`.
    The group heads are then computed once and held for the whole step, so they count once against every
    micro-batch's budget: the activations held at any time stay within ``max_tokens``, or within the heads plus one
    row when those alone exceed it.
    """
    if max_tokens < 1:
        raise ValueError("max_tokens must be >= 1")
    heads = {}
    order = []
    groups = px.plan_groups(prompt_ids, min_shared)
    for gid, (rows, head) in enumerate(groups):
        for r in rows:
            heads[r] = (gid, head)
            order.append(r)
    held = sum(head for _, head in groups) if step_heads else 0

    def cost(batch: list[int]) -> int:
        members: dict[int, int] = {}
        for r in batch:
            members[heads[r][0]] = members.get(heads[r][0], 0) + 1
        shared = lambda r: heads[r][1] > 0 and (step_heads or members[heads[r][0]] > 1)
        if not any(shared(r) for r in batch):  # nothing shared: the padded layout
            return held + len(batch) * max(len(prompt_ids[r]) + len(response_ids[r]) for r in batch)
        # Shared layout (plan_layout): each group's head once; a lone row's own head is its prompt but one token.
        own = {r: heads[r][1] if shared(r) else len(prompt_ids[r]) - 1 for r in batch}
        computed = {heads[r][0]: own[r] for r in batch if not (step_heads and shared(r))}
        width = max(len(prompt_ids[r]) - own[r] + len(response_ids[r]) for r in batch)
        return held + sum(computed.values()) + len(batch) * width

    batches: list[list[int]] = []
    for r in order:
        if batches and cost(batches[-1] + [r]) <= max_tokens:
            batches[-1].append(r)
        else:
            batches.append([r])
    return batches

