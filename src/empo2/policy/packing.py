"""Chain packing: a row whose prompt + response is where another row's prompt starts needs no forward of its own.

In the ``append`` prompt layout step t+1's prompt is step t's prompt, its response and a new turn, token for token, so
one forward over an episode's last row holds the logits of every earlier step's response: a causal model's logit at
a position depends on the tokens up to it only. :func:`plan_packing` finds such chains on the token ids themselves
(whatever layout made them) and gathers each batch's rows into *packed sequences*: a carrier row (covered by no
other row), forwarded once, and the rows it covers, whose log-probs are read off its forward. A packed sequence's
``prompt`` is the carrier's tokens up to its earliest member's response; its ``continuation`` is the rest (later
turns and responses, then the carrier's own response), laid out where a response goes. Rows that chain with
nothing are packed sequences of one: prompt and continuation are the row's own.
"""

from __future__ import annotations

import bisect
from collections.abc import Sequence
from dataclasses import dataclass

import torch


@dataclass(frozen=True)
class Packing:
    members: list[list[int]]
    """Rows read from each packed sequence, ascending; the carrier (the row forwarded) is the last."""
    prompts: list[list[int]]
    """Each packed sequence's prompt (its carrier's tokens before the earliest member's response)."""
    continuations: list[list[int]]
    """Each packed sequence's tokens after its prompt (the carrier's prompt rest, then the carrier's response)."""
    sequence_of: list[int]
    """Per row: the packed sequence it is read from."""
    offsets: list[int]
    """Per row: where its response starts in its packed sequence's continuation."""

    @property
    def forwarded_tokens(self) -> int:
        """Tokens the packed sequences forward: each one's prompt and continuation (the rows' own where nothing
        packs)."""
        return sum(map(len, self.prompts)) + sum(map(len, self.continuations))

    @property
    def packs(self) -> bool:
        """Whether any row is read from another row's forward."""
        return len(self.members) < len(self.sequence_of)

    def scored(self, lengths: Sequence[int], device) -> torch.Tensor:
        """[S, C] bool: the continuation positions some member's response occupies (C = longest continuation);
        ``lengths``: each row's response length."""
        out = torch.zeros((len(self.members), max(map(len, self.continuations), default=0)), dtype=torch.bool)
        for row, n in enumerate(lengths):
            out[self.sequence_of[row], self.offsets[row]: self.offsets[row] + n] = True
        return out.to(device)

    def unpack(self, logp: torch.Tensor, lengths: Sequence[int]) -> tuple[torch.Tensor, torch.Tensor]:
        """Per-row ``(logp [B, R], mask [B, R])`` from the packed sequences' ``logp`` [S, C] (gradients flow back)."""
        r_len = max(lengths, default=0)
        steps = torch.arange(r_len, device=logp.device)  # [R]
        mask = steps[None] < torch.tensor(list(lengths), device=logp.device)[:, None]  # [B, R]
        cols = torch.tensor(self.offsets, device=logp.device)[:, None] + steps[None]  # [B, R]
        cols = torch.where(mask, cols, 0)
        rows = torch.tensor(self.sequence_of, device=logp.device)[:, None].expand_as(cols)  # [B, R]
        return torch.where(mask, logp[rows, cols], 0.0), mask


def plan_packing(prompts: Sequence[Sequence[int]], responses: Sequence[Sequence[int]]) -> Packing:
    """Packed sequences of a batch's rows. Row A is *covered* by row B when B's prompt starts with A's prompt +
    response (A's response non-empty); then B's forward holds A's log-probs, and so does the forward of any row that
    covers B. Each covered row is read from the longest-prompt row covering it, which no row covers (a row covering
    it would cover A too, with a longer prompt), so every packed sequence has one carrier that nothing covers."""
    prompts = [list(p) for p in prompts]
    order = sorted(range(len(prompts)), key=lambda i: prompts[i])
    keys = [prompts[i] for i in order]
    carrier = list(range(len(prompts)))
    for a, response in enumerate(responses):
        if not response:
            continue
        seq = prompts[a] + list(response)
        j, best = bisect.bisect_left(keys, seq), None
        while j < len(keys) and keys[j][: len(seq)] == seq:  # the rows whose prompt starts with A's tokens
            b = order[j]
            if best is None or (len(prompts[b]), -b) > (len(prompts[best]), -best):
                best = b
            j += 1
        if best is not None:
            carrier[a] = best
    groups: dict[int, list[int]] = {}
    for row, c in enumerate(carrier):
        groups.setdefault(c, []).append(row)
    members = [[r for r in rows if r != c] + [c] for c, rows in sorted(groups.items())]
    sequence_of, offsets = [0] * len(prompts), [0] * len(prompts)
    packed_prompts, continuations = [], []
    for s, rows in enumerate(members):
        full = prompts[rows[-1]] + list(responses[rows[-1]])
        cut = min(len(prompts[r]) for r in rows)
        packed_prompts.append(full[:cut])
        continuations.append(full[cut:])
        for r in rows:
            sequence_of[r], offsets[r] = s, len(prompts[r]) - cut
    return Packing(members, packed_prompts, continuations, sequence_of, offsets)


def packed_batches(packing: Packing, plan) -> list[list[int]]:
    """Micro-batches (lists of row indices) that keep each packed sequence's rows together: ``plan(prompts,
    continuations)`` cuts ``packing``'s packed sequences (e.g. :func:`empo2.policy.logprobs.shared_micro_batches`),
    costed as they run, and each is replaced by its rows. The caller plans the packing once and passes it on (its
    step's shared heads are the packed prompts too)."""
    return [[row for s in batch for row in packing.members[s]] for batch in plan(packing.prompts,
                                                                                packing.continuations)]


def chain_batches(chains: Sequence[Sequence[int]], size: int) -> list[list[int]]:
    """``chains`` (lists of row indices, in the order given) cut every ``size`` rows, each chain going whole to the
    batch its first row falls in (a cut inside a chain moves to the chain's end), so a batch holds up to a chain's
    rows more than ``size``. Chains of one row each are the rows cut every ``size``."""
    batches: list[list[int]] = []
    start = 0
    for chain in chains:
        if start // size >= len(batches):
            batches.append([])
        batches[-1].extend(chain)
        start += len(chain)
    return batches
