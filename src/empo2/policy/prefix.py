"""Shared-prefix computation: rows that start with the same tokens pay for that head once.

The G rollouts of a group share the system prompt, the task and the demonstration (and at step 0 the whole
observation), which is most of a ~600-token prompt. :func:`plan_groups` groups rows by a common token head;
:func:`head_cache` runs each group's head once (batch 1, with gradient when grad is enabled) and lays the heads' keys
and values out as one batched KV cache; the rows' own tails then run on top of it. Batch layout (H = longest head)::

    cache columns:  [0 … 0  h_1 … h_P]            each row's group head, LEFT-padded to H (mask 0 on the pads)
    input columns:  [pad … pad  t_1 … t_k | …]     each row's tail (prompt after its head), LEFT-padded

``position_ids`` are explicit (a tail token at index j of its prompt gets position j), so every real token sees
exactly the keys and positions it would see in an unpadded single-row forward.

Across the steps of a rollout the heads repeat too: inside :func:`reuse_heads` (weights fixed), each generation
call keeps the heads it computed, and the next call runs only what follows the longest cached prefix of a new head.

The compute options (prefix sharing on/off, bfloat16 autocast, log-prob chunk size) live here too, as a
:class:`ComputeOptions` that generation and log-prob calls take as an argument, next to the caches they may use: a
rollout's :class:`HeadMemo` and an optimizer step's :class:`StepHeads`.
"""

from __future__ import annotations

import contextlib
from collections.abc import Sequence
from dataclasses import dataclass

import torch

from empo2.policy.kv_cache import cache_kwargs, layer_kv, make_cache, output_cache
from empo2.policy.precision import resolve_autocast


@dataclass(frozen=True)
class ComputeOptions:
    prefix_sharing: bool = True
    """Compute a shared token head once per group of rows (generation and training log-probs)."""
    compute_dtype: str = "float32"
    """``float32``, ``bfloat16`` or ``float16`` (autocast around forward passes; weights and optimizer state keep
    their own dtype). Set from ``policy.autocast``."""
    logprob_chunk_tokens: int = 1024
    """Response positions whose vocabulary logits are materialised at once when computing log-probs."""
    min_shared_tokens: int = 16
    """A head shorter than this is not worth a separate forward; such rows run unshared."""
    reuse_heads: bool = True
    """Rollouts keep the previous generation call's head KV (:meth:`HeadMemo.reuse`); from ``policy.reuse_heads``."""
    pack_chains: bool = True
    """A row whose tokens start another row's prompt takes its log-probs from that row's forward
    (:mod:`empo2.policy.packing`; exact, so always on but in tests that compare against rows run one by one)."""

    def __post_init__(self):
        if self.compute_dtype not in ("float32", "bfloat16", "float16"):
            raise ValueError(f"compute_dtype must be float32, bfloat16 or float16, not {self.compute_dtype!r}")


DEFAULT_OPTIONS = ComputeOptions()


def compute_options(policy_cfg, train_cfg) -> ComputeOptions:
    """The compute options of a run's config (``policy.prefix_sharing``, ``policy.autocast``, ``policy.reuse_heads``,
    ``train.logprob_chunk_tokens``)."""
    autocast = resolve_autocast(policy_cfg.autocast, policy_cfg.device)
    compute = {"none": "float32"}.get(autocast, autocast)
    return ComputeOptions(prefix_sharing=policy_cfg.prefix_sharing, compute_dtype=compute,
                          logprob_chunk_tokens=train_cfg.logprob_chunk_tokens, reuse_heads=policy_cfg.reuse_heads)


class HeadMemo:
    """The token sequences one generation call computed, with their KV, for the next call of the same rollout
    (:meth:`reuse`); a rollout's generation calls pass it to :func:`empo2.policy.generate.generate_batch`. After a
    call it holds each row's prompt and sampled response, so a next prompt that extends one of them (the ``append``
    prompt layout) prefills only its new tokens; a next prompt that shares less reuses its longest known prefix."""

    def __init__(self):
        self.heads: list | None = None
        """``[(token ids, per-layer KV [1, kv_heads, len(ids), head_dim])]`` of the last call; ``None`` outside
        :meth:`reuse`."""

    @property
    def active(self) -> bool:
        return self.heads is not None

    @contextlib.contextmanager
    def reuse(self, options: ComputeOptions):
        """Within this block, generation reuses the KV of the sequences computed by the previous generation call
        (the weights must not change inside it: one rollout). Memory: the KV of one call's rows, which that call held
        anyway. A no-op when ``options`` turn prefix sharing or head reuse off, or inside another such block."""
        if not (options.prefix_sharing and options.reuse_heads) or self.active:
            yield
            return
        self.heads = []
        try:
            yield
        finally:
            self.heads = None


    def known(self, ids: Sequence[int]) -> int:
        """How many leading tokens of ``ids`` the memo holds KV for."""
        return max((common_prefix_len(old, ids) for old, _ in self.heads or []), default=0)

    def layout(self, prompts: Sequence[Sequence[int]], min_shared: int) -> list[tuple[list[int], int]] | None:
        """:func:`plan_layout` inside :meth:`reuse`: a row whose kept tokens reach past its group's head leaves the
        group for a head of its own (its prompt but the last token), which then prefills only what the memo lacks."""
        groups = plan_layout(prompts, min_shared, own_heads=self.active)
        if not groups or not self.heads:
            return groups
        known = [self.known(p) for p in prompts]
        out = []
        for rows, head in groups:
            stay = [r for r in rows if known[r] <= head] if len(rows) > 1 else []
            out += [([r], len(prompts[r]) - 1) for r in rows if r not in stay or len(stay) == 1]
            if len(stay) > 1:
                out.append((stay, head))
        return out

    def keep_rows(self, cache, prompt_mask: torch.Tensor, prompts: Sequence[Sequence[int]],
                  responses: Sequence[Sequence[int]]) -> None:
        """Keep each row's prompt and the part of its response whose KV ``cache`` holds, in place of the heads.

        ``cache``: the decoding cache, columns = the ``prompt_mask`` [B, W] columns (each row's head and tail, padded)
        then one column per fed response token; ``responses``: each row's sampled ids."""
        layers = layer_kv(cache)
        width = prompt_mask.shape[1]
        fed = layers[0][0].shape[2] - width  # the last sampled token of a call is never fed
        kept = []
        for r, (prompt, response) in enumerate(zip(prompts, responses)):
            n = min(len(response), fed)
            cols = torch.cat([prompt_mask[r].nonzero().squeeze(1),
                              torch.arange(width, width + n, device=prompt_mask.device)])  # [len(prompt) + n]
            kept.append((list(prompt) + list(response[:n]),
                         [(k[r:r + 1].index_select(2, cols), v[r:r + 1].index_select(2, cols)) for k, v in layers]))
        self.heads[:] = kept


class StepHeads:
    """The shared heads of one optimizer step's rows (:func:`heads_once_per_step`): token ids, and once run, their
    KV twice: as computed (with the graph back to the weights) and as leaf copies the micro-batches attend to."""

    def __init__(self, heads: list[list[int]]):
        self.heads = heads
        self._kv: dict[int, tuple[list, list]] = {}

    def head_of(self, prompt: Sequence[int]) -> int | None:
        """Index of the longest stored head that starts ``prompt`` and leaves it a tail, or None."""
        found = None
        for i, head in enumerate(self.heads):
            if len(head) < len(prompt) and list(prompt[: len(head)]) == head and (
                    found is None or len(head) > len(self.heads[found])):
                found = i
        return found

    def layout(self, prompts: Sequence[Sequence[int]], min_shared: int) -> list[tuple[list[int], int]] | None:
        """:func:`plan_layout` for a micro-batch, with rows grouped by the step's heads."""
        index = [self.head_of(p) for p in prompts]
        if all(i is None for i in index):
            return plan_layout(prompts, min_shared)
        groups: dict = {}
        for r, i in enumerate(index):
            groups.setdefault(("step", i) if i is not None else ("own", r), []).append(r)
        return [(rows, len(self.heads[key[1]]) if key[0] == "step" else len(prompts[rows[0]]) - 1)
                for key, rows in groups.items()]

    def kv(self, model, ids: list[int], device) -> list[tuple[torch.Tensor, torch.Tensor]] | None:
        """Leaf copies of head ``ids``'s KV (computed on first use), or None if ``ids`` is not a step head."""
        if ids not in self.heads:
            return None
        i = self.heads.index(ids)
        if i not in self._kv:
            computed = head_kv(model, ids, None, device)
            self._kv[i] = (computed, [(k.detach().requires_grad_(), v.detach().requires_grad_()) for k, v in computed])
        return self._kv[i][1]

    def backward(self) -> None:
        """Run each used head's backward once, with the gradient the micro-batches left on its leaf copies."""
        outputs, grads = [], []
        for computed, leaves in self._kv.values():
            for pair, leaf_pair in zip(computed, leaves):
                for out, leaf in zip(pair, leaf_pair):
                    if leaf.grad is not None and out.requires_grad:  # e.g. keys of frozen layers below LoRA
                        outputs.append(out)
                        grads.append(leaf.grad)
        self._kv.clear()
        if outputs:
            torch.autograd.backward(outputs, grads)


@contextlib.contextmanager
def heads_once_per_step(prompts: Sequence[Sequence[int]], min_shared: int = 16):
    """Within this block (the micro-batches of one optimizer step, each passing the yielded store to
    :func:`empo2.policy.logprobs.response_logprobs`), each head that rows of ``prompts`` share runs forward once, at
    its first use. The micro-batches' backward passes stop at leaf copies of its KV and add up their
    gradients there; leaving the block runs the head's backward once with the sum. The gradient is the same as
    running the head in every micro-batch (the gradient of a sum is the sum of the gradients), for one head forward
    and backward per step instead of one per micro-batch. Yields the :class:`StepHeads` (None when nothing is shared)."""
    heads = [list(prompts[rows[0]][:head]) for rows, head in plan_groups(prompts, min_shared) if head > 0]
    if not heads:
        yield None
        return
    store = StepHeads(heads)
    yield store
    store.backward()  # not reached when a micro-batch raised


def autocast(model: torch.nn.Module, options: ComputeOptions):
    """Low-precision autocast for forward passes when asked for (a no-op context otherwise)."""
    if options.compute_dtype == "float32":
        return contextlib.nullcontext()
    device = next(model.parameters()).device.type
    return torch.autocast(device, dtype=getattr(torch, options.compute_dtype))


# ----------------------------------------------------------------------------------------------- grouping
def common_prefix_len(a: Sequence[int], b: Sequence[int]) -> int:
    n = min(len(a), len(b))
    i = 0
    while i < n and a[i] == b[i]:
        i += 1
    return i


def plan_groups(prompts: Sequence[Sequence[int]], min_shared: int = 16) -> list[tuple[list[int], int]]:
    """Group rows by a shared token head: a list of ``(row indices, head length)`` covering every row once.

    Rows are visited in lexicographic order (rows with long common heads become neighbours); a row joins the current
    group when that lowers the total token count: a group of k rows with head P that shrinks to P' by the join costs
    k·(P − P') more tail tokens and saves P' head tokens of the new row. A head never covers a row's last token (its
    logits must come from the tail forward). Single rows get head length 0 (nothing shared).
    """
    order = sorted(range(len(prompts)), key=lambda i: list(prompts[i]))
    groups: list[tuple[list[int], int]] = []
    for i in order:
        if groups:
            rows, head = groups[-1]
            first = prompts[rows[0]]
            cap = min(len(prompts[i]), len(first)) - 1 if len(rows) == 1 else min(head, len(prompts[i]) - 1)
            new = min(common_prefix_len(first, prompts[i]), cap)
            cost = 0 if len(rows) == 1 else len(rows) * (head - new)  # extra tail tokens of the current members
            if new >= min_shared and cost < new:
                groups[-1] = (rows + [i], new)
                continue
        groups.append(([i], 0))
    return [(sorted(rows), head if len(rows) > 1 else 0) for rows, head in groups]


def worth_sharing(groups: list[tuple[list[int], int]]) -> bool:
    return any(head > 0 for _, head in groups)


def plan_layout(prompts: Sequence[Sequence[int]], min_shared: int = 16,
                own_heads: bool = False) -> list[tuple[list[int], int]] | None:
    """Groups ready for :func:`head_cache`, or ``None`` when no head is shared (then the plain path is as good) and
    ``own_heads`` is off.

    A row that shares nothing gets its own head (its prompt but the last token, run alone): its tail is then one
    token, so a single long unshared prompt does not pad every row's tail to its length. ``own_heads`` lays rows out
    so even when nothing is shared (inside :func:`reuse_heads`, a row's own head may be known from the last step).
    """
    groups = plan_groups(prompts, min_shared)
    if not worth_sharing(groups) and not (own_heads and all(len(p) > 1 for p in prompts)):
        return None
    return [(rows, head if len(rows) > 1 else len(prompts[rows[0]]) - 1) for rows, head in groups]


# ----------------------------------------------------------------------------------------------- head cache
def head_cache(model, prompts: Sequence[Sequence[int]], groups: list[tuple[list[int], int]], room: int = 0,
               memo: HeadMemo | None = None, step: StepHeads | None = None):
    """Run each group's head once and lay it out for all rows: returns ``(cache, head_mask [B, H])``.

    Autograd flows through the copies, so with grad enabled the head's parameters get the sum of every row's
    gradient, as if each row had run it. ``room``: tokens the cache will grow by without copying (:func:`empo2.policy.kv_cache.make_cache`).
    Without grad, heads start from a rollout's ``memo`` (inside :meth:`HeadMemo.reuse`); with grad, from the
    optimizer step's ``step`` heads: a training forward never reads a rollout's memo, nor generation a step's heads.
    """
    device = next(model.parameters()).device
    b, width = len(prompts), max(head for _, head in groups)
    head_mask = torch.zeros((b, width), dtype=torch.long, device=device)  # [B, H]
    grad = torch.is_grad_enabled()
    memo = memo.heads if memo is not None and not grad else None
    step = step if grad else None
    computed = []
    per_group = []
    for rows, head in groups:
        if head == 0:
            continue
        ids = list(prompts[rows[0]][:head])
        kv = (step.kv(model, ids, device) if step is not None else None) or head_kv(model, ids, memo, device)
        computed.append((ids, kv))
        per_group.append((rows, head, kv))
        head_mask[rows, width - head:] = 1
    if memo is not None:
        memo[:] = computed
    layers = []
    for layer in range(len(per_group[0][2])):
        k0, v0 = per_group[0][2][layer]  # [1, kv_heads, P, head_dim]
        zero_k = k0.new_zeros((1, k0.shape[1], width, k0.shape[3]))
        zero_v = v0.new_zeros((1, v0.shape[1], width, v0.shape[3]))
        row_k, row_v = [zero_k] * b, [zero_v] * b
        for rows, _, kv in per_group:
            k, v = _padded(kv[layer][0], width), _padded(kv[layer][1], width)  # [1, kv_heads, H, head_dim]
            for r in rows:
                row_k[r], row_v[r] = k, v
        layers.append((torch.cat(row_k), torch.cat(row_v)))  # [B, kv_heads, H, head_dim]
    return make_cache(model, layers, room), head_mask


def head_kv(model, ids: list[int], memo: list | None, device) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """Per-layer (keys, values) [1, kv_heads, P, head_dim] of one head; with a memo, only the part after the longest
    cached prefix runs (on top of that prefix's KV)."""
    known, cached = 0, None
    for old_ids, old_kv in memo or []:
        n = common_prefix_len(old_ids, ids)
        if n > known:
            known, cached = n, old_kv
    if known == len(ids):
        return [(k[:, :, :known], v[:, :, :known]) for k, v in cached]
    past = {}
    if known:
        past = cache_kwargs(model, make_cache(model, [(k[:, :, :known], v[:, :, :known]) for k, v in cached]))
    new = torch.tensor([ids[known:]], dtype=torch.long, device=device)  # [1, P - known]
    out = model(input_ids=new, attention_mask=torch.ones((1, len(ids)), dtype=torch.long, device=device),
                position_ids=torch.arange(known, len(ids), device=device)[None], use_cache=True, logits_to_keep=1,
                **past)
    return layer_kv(output_cache(out))


def _padded(kv: torch.Tensor, width: int) -> torch.Tensor:
    """[1, h, P, d] → [1, h, width, d], zeros on the left."""
    return torch.nn.functional.pad(kv, (0, 0, width - kv.shape[2], 0))


def tail_batch(prompts: Sequence[Sequence[int]], groups, pad_id: int, device) -> tuple[torch.Tensor, ...]:
    """Each row's tokens after its head, LEFT-padded: ``(ids [B, S], mask [B, S], positions [B, S])``."""
    heads = [0] * len(prompts)
    for rows, head in groups:
        for r in rows:
            heads[r] = head
    width = max(len(p) - h for p, h in zip(prompts, heads))
    ids = torch.full((len(prompts), width), pad_id, dtype=torch.long)
    mask = torch.zeros((len(prompts), width), dtype=torch.long)
    pos = torch.zeros((len(prompts), width), dtype=torch.long)
    for r, (p, h) in enumerate(zip(prompts, heads)):
        n = len(p) - h
        ids[r, width - n:] = torch.as_tensor(list(p[h:]), dtype=torch.long)
        mask[r, width - n:] = 1
        pos[r, width - n:] = torch.arange(h, len(p))
    return ids.to(device), mask.to(device), pos.to(device)
