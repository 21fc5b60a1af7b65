"""LUFFY: Learning to Reason under Off-Policy Guidance (Yan et al., NeurIPS 2025, arXiv 2504.14945), written as its
equations. One member of each group plays the environment's gold path instead of sampling (the expert π_φ;
:mod:`empo2.episodes.expert`), and the group learns from it and from its own samples at once (docs/fidelity.md, *LUFFY*).

Eq. 4, the mixed-policy advantage, with the expert INSIDE the group before normalisation::

    Â_i = (R_i − mean(G_on ∪ G_off)) / std(G_on ∪ G_off)       (``algo.luffy.std=true``)
    Â_i =  R_i − mean(G_on ∪ G_off)                            (default: the official script, Dr.GRPO)

Eq. 6, policy shaping, per valid response token t of row i (to be minimised)::

    expert row (π_φ = 1):  loss_t = −Â_i · f(π_θ(a_t)),   f(x) = x / (x + γ)   (Eq. 20; γ = ``algo.luffy.gamma``)
                                                         f(x) = x            (``algo.luffy.shaping=false``: Eq. 5)
    on-policy row:         loss_t = −Â_i · ρ_t,          ρ_t = π_θ(a_t) / π_old(a_t)   (no clip, App. E.1)
                           loss_t = −min(ρ_t·Â_i, clip(ρ_t, 1−ε_low, 1+ε_high)·Â_i)  (``algo.luffy.clip=true``)

An expert row has no ratio to π_old, no clip, no low-probability mask and no truncated importance weight: its
``logp_old`` is never read (the rollout stores log 1 = 0 there, π_φ = 1). The gradient of an expert token (Eq. 7)
is −Â·f′(π_θ)·π_θ·∇log π_θ with f′(x) = γ/(x + γ)², which raises the weight of the expert's low-probability tokens.

Aggregation (``algo.loss_type``): ``dr_grpo`` is the script's Σ_{i,t} loss_t / (rows × ``algo.dr_grpo_length``)
(a constant per row, no length normalisation); ``token_mean`` is Eq. 5/6's 1/Z with Z = all response tokens.
The ``empo2_luffy`` loss keeps EMPO²'s own loss (clip, low-probability mask, off-policy ratio) on the sampled rows
and shapes the expert rows as above. Both read LUFFY's settings, :class:`LuffyOptions` (``algo.luffy.*``).
"""

from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass
from typing import Any, ClassVar

import numpy as np
import torch

from empo2.algo.advantages import AdvantageInput, group_normalise, register_advantage
from empo2.algo.empo2 import empo2_modes
from empo2.algo.losses import (
    aggregate_token_loss,
    clipped_surrogate_settings,
    k3_kl,
    policy_loss,
    register_policy_loss,
)
from empo2.algo.registry import AlgorithmSpec, register_algorithm
from empo2.bounds import bounded

OFFICIAL = ("LUFFY's exp_scripts/train.sh (the paper: entropy 0.01)",
            {"beta": 0.0, "loss_type": "dr_grpo", "luffy.clip": False, "luffy.std": False, "luffy.shaping": True,
             "luffy.gamma": 0.1, "entropy_coeff": 0.001})
"""The settings of the official script: no KL, Dr.GRPO aggregation, no on-policy clip, mean-only advantage, shaping
with γ = 0.1, and an entropy bonus of 0.001 (the paper says 0.01), which empo2's losses do not have."""


@dataclass(frozen=True)
class LuffyOptions:
    """LUFFY's settings, ``algo.luffy.*`` (the ``luffy`` and ``empo2_luffy`` algorithms)."""

    key: ClassVar[str] = "luffy"

    gamma: float = bounded(0.1, 1e-6, 1)
    """γ of the policy-shaping function f(x) = x/(x + γ) on expert tokens (paper: 0.1)."""
    shaping: bool = True
    """Shape the expert tokens' probability with f (Eq. 6); ``false``: f(x) = x (the mixed-policy objective, Eq. 5
    with π_φ = 1)."""
    clip: bool = False
    """Clip the on-policy rows' ratio as GRPO does; ``false`` (paper App. E.1, official script): no clip."""
    std: bool = False
    """Divide the mixed group's centred returns by their sample std (Eq. 4 as printed); ``false`` (official script,
    Dr.GRPO): mean-only."""


@register_advantage("luffy")
def mixed_policy_advantages(inp: AdvantageInput) -> tuple[list[np.ndarray], dict[str, float]]:
    """Eq. 4: the expert's return is one of the group's, so it moves the group's mean (and std) like any member.
    Mean-only unless ``algo.luffy.std`` (GRPO's ``scale_rewards`` does not apply)."""
    adv, metrics = group_normalise(inp.returns, inp.group_ids, scale_rewards=inp.algo.luffy.std,
                                   eps=inp.algo.adv_eps)  # [N]
    return [np.full(len(r), a) for a, r in zip(adv, inp.step_rewards)], metrics


def shaping(prob: torch.Tensor, gamma: float, shaped: bool = True) -> torch.Tensor:
    """Eq. 20: f(x) = x / (x + γ); the identity when ``shaped`` is off (the mixed-policy objective, Eq. 5)."""
    return prob / (prob + gamma) if shaped else prob


def _unclipped(algo: Any) -> Any:
    """The on-policy rows' knobs without any clip (App. E.1 and the script's ``loss_remove_clip``)."""
    return dataclasses.replace(algo, epsilon=math.inf, epsilon_high=math.inf, dual_clip=0.0)


def expert_token_loss(logp_new: torch.Tensor, advantages: torch.Tensor, valid: torch.Tensor,
                      algo: Any) -> torch.Tensor:
    """Eq. 6, expert rows: −Â·f(π_θ) per valid token. logp_new [B, T], advantages [B, T], valid [B, T] → [B, T]."""
    prob = torch.exp(torch.where(valid, logp_new, 0.0))  # [B, T] π_θ(a_t), exp(0) on padding
    return torch.where(valid, -advantages * shaping(prob, algo.luffy.gamma, algo.luffy.shaping), 0.0)


def _loss(logp_new, logp_old, advantages, response_mask, algo, on_policy_algo, *, logp_ref=None, modes=None,
          off_policy=None) -> tuple[torch.Tensor, dict[str, float]]:
    """Expert rows shaped (Eq. 6), the other rows through :func:`empo2.algo.losses.policy_loss` with
    ``on_policy_algo``; both parts aggregated as one batch (``algo.loss_type``)."""
    rows = logp_new.shape[0]
    expert = torch.zeros(rows, dtype=torch.bool, device=logp_new.device) if off_policy is None else \
        torch.as_tensor(list(off_policy), dtype=torch.bool, device=logp_new.device)  # [B]
    if expert.shape != (rows,):
        raise ValueError(f"off_policy has {expert.numel()} entries for {rows} rows")
    valid = response_mask.bool()  # [B, T]
    on = ~expert
    parts, metrics = [], {}
    if on.any():
        idx = on.nonzero().squeeze(1)
        on_loss, metrics = policy_loss(
            logp_new[idx], logp_old[idx], advantages[idx], response_mask[idx], on_policy_algo,
            logp_ref=None if logp_ref is None else logp_ref[idx],
            modes=None if modes is None else [modes[i] for i in idx.tolist()])
        parts.append((on_loss, idx))
        metrics["loss_on_policy"] = float(on_loss.detach())
    if expert.any():
        idx = expert.nonzero().squeeze(1)
        e_valid = valid[idx]  # [E, T]
        e_logp = logp_new[idx]  # [E, T]
        adv = advantages[idx]
        adv = adv if adv.dim() == 2 else adv[:, None].expand_as(e_logp)  # [E, T]
        adv = torch.where(e_valid, adv.to(e_logp.dtype), 0.0)
        token_loss = expert_token_loss(e_logp, adv, e_valid, algo)  # [E, T]
        if logp_ref is not None and algo.beta > 0:
            token_loss = token_loss + algo.beta * k3_kl(logp_ref[idx], e_logp, e_valid)
        e_loss = aggregate_token_loss(token_loss, e_valid, algo.loss_type, algo.dr_grpo_length)
        bad = not bool(torch.isfinite(torch.where(e_valid, e_logp.detach(), 0.0)).all()) or \
            not bool(torch.isfinite(e_loss))
        parts.append((e_loss, idx))
        with torch.no_grad():
            prob = torch.exp(torch.where(e_valid, e_logp, 0.0))
            n = int(e_valid.sum())
            metrics.update(loss_expert=float(e_loss.detach()), expert_prob_mean=float((prob * e_valid).sum() / max(n, 1)),
                           expert_tokens=float(n))
        metrics["skipped"] = max(metrics.get("skipped", 0.0), float(bad))
    # both parts as one batch: each part's mean weighted by its share of the normaliser
    share = _shares(valid, [idx for _, idx in parts], algo.loss_type)
    loss = sum(s * part for s, (part, _) in zip(share, parts))
    if metrics.get("skipped", 0.0):
        loss = torch.where(torch.zeros_like(valid), logp_new, 0.0).sum()  # a zero loss with an exactly-zero gradient
    metrics["expert_row_frac"] = float(expert.float().mean()) if rows else 0.0
    return loss, metrics


def _shares(valid: torch.Tensor, parts: list[torch.Tensor], aggregation: str) -> list[float]:
    """Weights that make Σ share·mean(part) the mean over all rows: tokens (``token_mean``), rows with a token
    (``sequence_mean``) or rows (``dr_grpo``)."""
    counts = valid.sum(dim=1)  # [B]
    if aggregation == "token_mean":
        sizes = [float(counts[idx].sum()) for idx in parts]
    elif aggregation == "sequence_mean":
        sizes = [float((counts[idx] > 0).sum()) for idx in parts]
    else:
        sizes = [float(len(idx)) for idx in parts]
    total = sum(sizes)
    return [s / total if total else 0.0 for s in sizes]


def _expert_rows(algo: Any) -> str:
    return f"−Â·f(π_θ), f(x) = x/(x + {algo.luffy.gamma:g})" if algo.luffy.shaping else "−Â·π_θ (no shaping)"


def luffy_loss_settings(algo: Any) -> dict[str, str]:
    """What the ``luffy`` loss applies: shaped expert rows; on-policy rows without the mask, unclipped unless
    ``algo.luffy.clip``."""
    on = clipped_surrogate_settings(algo if algo.luffy.clip else _unclipped(algo), mask=False)
    if not algo.luffy.clip:
        on.update(clip="none on on-policy rows (App. E.1)", dual_clip="off")
    return {**on, "expert_rows": _expert_rows(algo)}


def empo2_luffy_loss_settings(algo: Any) -> dict[str, str]:
    """What the ``empo2_luffy`` loss applies: EMPO²'s loss on the sampled rows, shaped expert rows."""
    return {**clipped_surrogate_settings(algo), "expert_rows": _expert_rows(algo)}


@register_policy_loss("luffy", settings=luffy_loss_settings)
def luffy_loss(logp_new, logp_old, advantages, response_mask, algo, **kwargs) -> tuple[torch.Tensor, dict[str, float]]:
    """LUFFY (Eq. 6): shaped expert rows; on-policy rows without the low-probability mask and, unless
    ``algo.luffy.clip``, without the clip."""
    on_policy = dataclasses.replace(algo, low_prob_threshold=0.0)
    return _loss(logp_new, logp_old, advantages, response_mask, algo,
                 on_policy if algo.luffy.clip else _unclipped(on_policy), **kwargs)


@register_policy_loss("empo2_luffy", settings=empo2_luffy_loss_settings)
def empo2_luffy_loss(logp_new, logp_old, advantages, response_mask, algo,
                     **kwargs) -> tuple[torch.Tensor, dict[str, float]]:
    """EMPO² with an expert member: EMPO²'s loss on the sampled rows, LUFFY's shaping (Eq. 6) on the expert rows."""
    return _loss(logp_new, logp_old, advantages, response_mask, algo, algo, **kwargs)


EXPERT_ROLLOUT = "empo2.episodes.expert:ExpertPlayer"
"""The rollout driver that plays the expert members (:mod:`empo2.episodes.expert`), and its part of the record."""
EXPERT_METRICS = "empo2.episodes.expert:expert_metrics"

register_algorithm(AlgorithmSpec("luffy", uses_memory=False, loss="luffy", advantage="luffy", expert_members=1,
                                 rollout=EXPERT_ROLLOUT, metrics=EXPERT_METRICS, official=OFFICIAL,
                                 options=LuffyOptions))  # Yan et al. 2025
# EMPO² with an expert member: no published method
register_algorithm(AlgorithmSpec("empo2_luffy", uses_memory=True, loss="empo2_luffy", mode_probs=empo2_modes,
                                 expert_members=1, rollout=EXPERT_ROLLOUT, metrics=EXPERT_METRICS, novelty=True,
                                 options=LuffyOptions))
