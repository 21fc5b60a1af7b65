"""Policy losses (a registry, verl-style): the clipped surrogate GRPO, EMPO² and the other methods share (the paper's
masked GRPO objective, Liu et al. 2026; docs/fidelity.md, *The loss*), registered by each method's file (EMPO²'s as
``empo2``, :mod:`empo2.algo.empo2`). The low-probability mask is one of its shared knobs (``low_prob_threshold``, which
GRPO, LUFFY and ELPO switch off); the rows the KL term covers and the ratio's denominator follow the row's mode
(:mod:`empo2.algo.modes`); this module adds the clip, dual clip, k3, aggregation and guards.

Per valid response token t of row i (objective, to be maximised)::

    ρ      = exp(logp_new − logp_old)                                 token ratio
    obj    = min(ρ·A, clip(ρ, 1−ε_low, 1+ε_high)·A)                   clipped surrogate
    obj    = max(obj, c·A)            if A < 0 and c > 0             dual clip
    keep   = π_θ(a_t) ≥ δ             π_θ = exp(logp_new), detached   low-probability mask (δ = 0: off)
    loss_t = −obj·keep + β·k3·on,     k3 = exp(ref − new) − (ref − new) − 1

where ``keep`` is :func:`low_probability_mask` and ``on`` is 0 on ``off_tips`` rows
(:func:`empo2.algo.modes.trains_on_rollout_prompt`).

``token_mean``:    loss = Σ_{i,t} loss_t / Σ_{i,t} response_mask      (the paper's 1/(N·T); masked tokens count in T)
``sequence_mean``: loss = mean_i [ Σ_t loss_t / Σ_t response_mask ]   (rows with no valid token are left out)
``dr_grpo``:       loss = Σ_{i,t} loss_t / (B · L)                     (Dr.GRPO: a constant L = ``dr_grpo_length``)

A registered loss is called as ``loss_fn(logp_new, logp_old, advantages, response_mask, algo, *, logp_ref, modes)``
and reads its knobs from ``algo``, the run's ``algo`` config section (ε_low = ``epsilon``, ε_high =
``epsilon_high``, c = ``dual_clip``, δ = ``low_prob_threshold``, ``mask_granularity``, β = ``beta``,
``loss_type``), so a new loss with a new knob reads it there and the update that calls it does not change. The
section is checked when the config loads, so a loss does not check its knobs again.

Which log-probs go where (the trainer's job; see :func:`empo2.algo.modes.behaviour_logp_for_ratio`):

- ``logp_new``: current policy on the TRAINING prompt: with tips for ``on_tips``, WITHOUT tips for ``on`` and
  ``off_tips``. So for ``off_tips`` rows the mask tests π_θ(a | tip-free prompt), as in the paper.
- ``logp_old``: π_old's log-probs on the ROLLOUT prompt: the engine's, recorded while sampling, or the trainer's
  recomputation before the first optimizer step (``algo.old_logprobs``). For ``off_tips`` rows this
  is π_old(a | s, u, tips) (paper), or the old policy on the tip-free prompt with ``off_policy_ratio="tip_free"``.

Sequence granularity (released code): a whole row is dropped when ANY of its valid tokens has
``logp_old < log δ``; the threshold is ``log δ`` of the same ``low_prob_threshold`` field.

Numerics: the log-ratio is clamped to [−20, 20] before ``exp`` (no effect on ordinary ratios); padded and masked
positions are replaced by 0 BEFORE any arithmetic, so junk (±inf, NaN) there can never leak into the loss or the
gradient (the KL log-ratio is clamped the same way). If a VALID position holds a non-finite input, or the loss is
non-finite, :func:`policy_loss` returns a zero loss whose gradient is exactly zero and sets
``metrics["skipped"] = 1.0``; the trainer must then skip the optimizer step (and also check grad norms).
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Callable, Sequence
from typing import Any

import torch

from empo2.algo.modes import MODES, check_mode, trains_on_rollout_prompt

LOG_RATIO_CLAMP = 20.0

PolicyLossFn = Callable[..., tuple[torch.Tensor, dict[str, float]]]
POLICY_LOSSES: dict[str, PolicyLossFn] = {}
"""Registry: loss name -> function with the signature of :func:`policy_loss` (it reads its knobs from ``algo``)."""
LossSettingsFn = Callable[[Any], dict[str, str]]
LOSS_SETTINGS: dict[str, LossSettingsFn] = {}
"""Registry: loss name -> ``algo -> {setting: value as text}``, the settings the loss really applies (what ``compare``
lists for each arm); a loss registered without one is described by :func:`clipped_surrogate_settings`."""


def register_policy_loss(name: str, settings: LossSettingsFn | None = None) -> Callable[[PolicyLossFn], PolicyLossFn]:
    """Decorator that adds a loss to :data:`POLICY_LOSSES` under ``name`` (same form as ``@register_advantage``),
    with the function that says which of the ``algo`` knobs it applies (``settings``)."""

    def wrap(fn: PolicyLossFn) -> PolicyLossFn:
        if name in POLICY_LOSSES:
            raise ValueError(f"policy loss {name!r} is already registered")
        POLICY_LOSSES[name] = fn
        if settings is not None:
            LOSS_SETTINGS[name] = settings
        return fn

    return wrap


NO_ENTROPY = "none"


def aggregation_text(algo: Any) -> str:
    """``algo.loss_type`` in words (``dr_grpo`` with its constant length; 0 = ``policy.max_completion_length``)."""
    if algo.loss_type != "dr_grpo":
        return algo.loss_type
    return f"dr_grpo (L = {algo.dr_grpo_length or 'policy.max_completion_length'})"


def clipped_surrogate_settings(algo: Any, mask: bool = True) -> dict[str, str]:
    """The settings :func:`policy_loss` applies: clip, dual clip, the low-probability mask (``mask=False``: a loss
    that turns it off), the KL term, the aggregation; no entropy bonus."""
    delta = algo.low_prob_threshold
    return {"clip": f"{algo.epsilon:g} / {algo.epsilon_high:g}",
            "dual_clip": f"{algo.dual_clip:g}" if algo.dual_clip > 0 else "off",
            "mask": f"δ = {delta:g} per {algo.mask_granularity}" if mask and delta > 0 else "off",
            "kl": f"β {algo.beta:g} (k3)", "aggregation": aggregation_text(algo), "entropy bonus": NO_ENTROPY}


def settings_of(loss: str, algo: Any) -> dict[str, str]:
    """What loss ``loss`` applies under ``algo`` (:data:`LOSS_SETTINGS`)."""
    return {"loss": loss, **LOSS_SETTINGS.get(loss, clipped_surrogate_settings)(algo)}


def get_policy_loss(name: str) -> PolicyLossFn:
    if name not in POLICY_LOSSES:
        raise ValueError(f"unknown policy loss {name!r}; registered: {', '.join(sorted(POLICY_LOSSES))}")
    return POLICY_LOSSES[name]


def low_probability_mask(logp_new: torch.Tensor, logp_old: torch.Tensor, valid: torch.Tensor, delta: float,
                         granularity: str = "token") -> torch.Tensor:
    """The paper's mask 1[π_θ(a_t | s_t, u) ≥ δ]: keep [B, T] bool, the valid tokens whose surrogate counts.

    logp_new, logp_old [B, T]; valid [B, T] bool; δ = ``algo.low_prob_threshold`` (0: no mask).

    - ``token`` (the paper): a token is kept when π_θ(a_t) ≥ δ on the row's training prompt (tip-free for ``on`` and
      ``off_tips``); π_θ is detached, the mask carries no gradient.
    - ``sequence`` (the released code's variant, shipped off there): a whole row is dropped when ANY valid token has
      an old log-prob below log δ (the released code's fixed −5.0 ≈ log 0.0067).
    """
    if delta <= 0:
        return valid
    if granularity == "token":
        return valid & (logp_new.detach() >= math.log(delta))  # π_θ(a_t) ≥ δ
    bad_row = (valid & ~(logp_old >= math.log(delta))).any(dim=1, keepdim=True)  # [B, 1]
    return valid & ~bad_row


def policy_loss(logp_new: torch.Tensor, logp_old: torch.Tensor, advantages: torch.Tensor, response_mask: torch.Tensor,
                algo: Any, *, logp_ref: torch.Tensor | None = None, modes: Sequence[str] | None = None,
                surrogate: Callable[[torch.Tensor, torch.Tensor], torch.Tensor] | None = None,
                ) -> tuple[torch.Tensor, dict[str, float]]:
    """EMPO² loss. logp_new/logp_old/logp_ref/response_mask [B, T]; advantages [B] or [B, T]; modes: B strings;
    ``algo``: the ``algo`` config section (:class:`empo2.config.sections.AlgoConfig`), which holds the knobs.

    Returns ``(loss scalar, metrics)``; see the module docstring for the formula. Gradient flows through ``logp_new``
    only. Metrics (python floats): ratio_mean, ratio_max, clip_frac, dual_clip_frac, masked_frac, approx_kl, kl_ref,
    valid_tokens, kept_tokens, skipped, and loss_<mode> for each mode present in ``modes``. ``surrogate``:
    ``(ratio, advantage) -> objective`` [B, T], a method's clipped surrogate min(ρ·A, clip(ρ)·A) in place of the
    shared clip(ρ, 1 − ε, 1 + ε_high) (ELPO's error-localised clip, :func:`empo2.algo.elpo.elpo_loss`).
    """
    _check_args(logp_new, logp_old, advantages, response_mask, logp_ref, modes)
    epsilon, epsilon_high, dual_clip = algo.epsilon, algo.epsilon_high, algo.dual_clip
    delta, beta, granularity, aggregation = algo.low_prob_threshold, algo.beta, algo.mask_granularity, algo.loss_type
    valid = response_mask.bool()  # [B, T]
    adv = advantages if advantages.dim() == 2 else advantages[:, None].expand_as(logp_new)  # [B, T]
    adv = torch.where(valid, adv.to(logp_new.dtype), 0.0)  # [B, T]

    keep = low_probability_mask(logp_new, logp_old, valid, delta, granularity)  # [B, T]

    log_ratio = torch.where(keep, logp_new - logp_old, 0.0).clamp(-LOG_RATIO_CLAMP, LOG_RATIO_CLAMP)  # [B, T]
    ratio = torch.exp(log_ratio)  # [B, T]
    obj_unclipped = ratio * adv  # [B, T]
    if surrogate is None:
        obj = torch.minimum(obj_unclipped, torch.clamp(ratio, 1.0 - epsilon, 1.0 + epsilon_high) * adv)  # [B, T]
    else:
        obj = surrogate(ratio, adv)  # [B, T]
    surrogate_obj = obj  # before the dual clip: the clip branch is active where it is below ρ·A
    if dual_clip > 0:
        obj = torch.where(adv < 0, torch.maximum(obj, dual_clip * adv), obj)  # [B, T]
    token_loss = torch.where(keep, -obj, 0.0)  # [B, T]

    k3 = torch.zeros_like(logp_new)  # [B, T]
    if logp_ref is not None:
        k3 = k3_kl(logp_ref, logp_new, valid)  # [B, T], ≥ 0
        if beta > 0:
            token_loss = token_loss + beta * torch.where(_kl_rows(valid, modes), k3, 0.0)

    loss = aggregate_token_loss(token_loss, valid, aggregation, algo.dr_grpo_length)  # []

    with torch.no_grad():
        metrics = _metrics(ratio, log_ratio, obj_unclipped, surrogate_obj, adv, valid, keep, k3, dual_clip)
        metrics.update(_mode_losses(token_loss, valid, modes, aggregation))
    return _skip_if_not_finite(loss, metrics, logp_new, [logp_old, adv, logp_ref], valid)


def k3_kl(logp_ref: torch.Tensor, logp_new: torch.Tensor, valid: torch.Tensor) -> torch.Tensor:
    """The low-variance k3 estimate of KL(π_θ ‖ π_ref) per sampled token: exp(ref − new) − (ref − new) − 1 [B, T],
    ≥ 0; 0 where not ``valid`` (the log-ratio is zeroed there and clamped to ±``LOG_RATIO_CLAMP``)."""
    ref_log_ratio = torch.where(valid, logp_ref - logp_new, 0.0).clamp(-LOG_RATIO_CLAMP, LOG_RATIO_CLAMP)
    return torch.exp(ref_log_ratio) - ref_log_ratio - 1.0


def _kl_rows(valid: torch.Tensor, modes: Sequence[str] | None) -> torch.Tensor:
    """[B, T]: the valid tokens of the rows whose KL term is an estimate of the KL on their training prompt (every
    row but ``off_tips``)."""
    if modes is None:
        return valid
    on_prompt = torch.tensor([trains_on_rollout_prompt(m) for m in modes], device=valid.device)  # [B]
    return valid & on_prompt[:, None]


def _mode_losses(token_loss: torch.Tensor, valid: torch.Tensor, modes: Sequence[str] | None,
                 aggregation: str) -> dict[str, float]:
    """``loss_<mode>``: the loss of each mode's rows alone, for the logs."""
    out = {}
    for mode in MODES if modes is not None else ():
        rows = torch.tensor([m == mode for m in modes], device=valid.device)  # [B]
        if rows.any():
            out[f"loss_{mode}"] = float(aggregate_token_loss(token_loss[rows], valid[rows], aggregation))
    return out


def _skip_if_not_finite(loss: torch.Tensor, metrics: dict[str, float], logp_new: torch.Tensor,
                        others: list[torch.Tensor | None], valid: torch.Tensor) -> tuple[torch.Tensor, dict[str, float]]:
    """A non-finite input on a valid token, or a non-finite loss, skips the micro-batch (``skipped`` = 1): the loss
    becomes 0 with its graph kept, so its gradient is exactly 0."""
    inputs = [logp_new.detach()] + [x for x in others if x is not None]
    bad = any(bool((~torch.isfinite(x) & valid).any()) for x in inputs) or not bool(torch.isfinite(loss))
    metrics["skipped"] = float(bad)
    if bad:
        loss = torch.where(torch.zeros_like(valid), logp_new, 0.0).sum()
    return loss, metrics


def aggregate_token_loss(token_loss: torch.Tensor, valid: torch.Tensor, aggregation: str,
                         length: int = 0) -> torch.Tensor:
    """token_loss [B, T], valid [B, T] -> scalar; normaliser = valid tokens (masked-out tokens still count), or
    rows × ``length`` for ``dr_grpo`` (``length`` 0: the padded width T)."""
    counts = valid.sum(dim=1)  # [B]
    if aggregation == "dr_grpo":
        return token_loss.sum() / max(token_loss.shape[0] * (length or token_loss.shape[1]), 1)
    if aggregation == "token_mean":
        return token_loss.sum() / counts.sum().clamp(min=1)
    per_row = token_loss.sum(dim=1) / counts.clamp(min=1)  # [B]
    has_tokens = counts > 0  # [B]
    return (per_row * has_tokens).sum() / has_tokens.sum().clamp(min=1)


def _metrics(ratio, log_ratio, obj_unclipped, obj, adv, valid, keep, k3, dual_clip) -> dict[str, float]:
    """``obj``: the clipped surrogate min(ρ·A, clip(ρ)·A) [B, T], before the dual clip."""
    n_valid = int(valid.sum())
    n_keep = int(keep.sum())
    kf = keep.to(ratio.dtype)

    def mean_kept(x: torch.Tensor) -> float:
        return float((x * kf).sum() / max(n_keep, 1))

    clipped = (obj < obj_unclipped) & keep  # the clip branch is the active one (zero gradient)
    dual = torch.zeros_like(keep)
    if dual_clip > 0:  # the dual-clip floor c·A is the active branch
        dual = (adv < 0) & (dual_clip * adv > obj) & keep
    return {
        "ratio_mean": mean_kept(ratio),
        "ratio_max": float(ratio[keep].max()) if n_keep else 0.0,
        "clip_frac": mean_kept(clipped.to(ratio.dtype)),
        "dual_clip_frac": mean_kept(dual.to(ratio.dtype)),
        "masked_frac": float(n_valid - n_keep) / max(n_valid, 1),
        "approx_kl": mean_kept((ratio - 1.0) - log_ratio),  # k3 of KL(old ‖ new) on kept tokens
        "kl_ref": float((k3 * valid).sum() / max(n_valid, 1)),
        "valid_tokens": float(n_valid),
        "kept_tokens": float(n_keep),
    }


def _check_args(logp_new, logp_old, advantages, response_mask, logp_ref, modes):
    if logp_new.dim() != 2:
        raise ValueError(f"logp_new must be [B, T], got {tuple(logp_new.shape)}")
    for name, t in (("logp_old", logp_old), ("response_mask", response_mask), ("logp_ref", logp_ref)):
        if t is not None and t.shape != logp_new.shape:
            raise ValueError(f"{name} {tuple(t.shape)} must match logp_new {tuple(logp_new.shape)}")
    if advantages.shape not in (logp_new.shape[:1], logp_new.shape):
        raise ValueError(f"advantages {tuple(advantages.shape)} must be [B] or [B, T] "
                         f"for logp_new {tuple(logp_new.shape)}")
    if modes is not None:
        if len(modes) != logp_new.shape[0]:
            raise ValueError(f"modes has {len(modes)} entries for {logp_new.shape[0]} rows")
        for m in modes:
            check_mode(m)


def micro_batch_share(algo: Any, valid_tokens: int, rows: int, mini_tokens: float, mini_rows: float) -> float:
    """The weight of a micro-batch's loss (a mean inside the micro-batch) so that the micro-batches of a mini-batch add
    up to its mean over the whole mini-batch: its share of the tokens (``token_mean``) or of the rows
    (``sequence_mean``)."""
    return valid_tokens / max(mini_tokens, 1) if algo.loss_type == "token_mean" else rows / mini_rows


@register_policy_loss("grpo", settings=lambda algo: clipped_surrogate_settings(algo, mask=False))
def grpo_loss(logp_new, logp_old, advantages, response_mask, algo, **kwargs) -> tuple[torch.Tensor, dict[str, float]]:
    """``grpo``: :func:`policy_loss` without the low-probability mask (``algo.low_prob_threshold`` is taken as 0)."""
    no_mask = dataclasses.replace(algo, low_prob_threshold=0.0)
    return policy_loss(logp_new, logp_old, advantages, response_mask, no_mask, **kwargs)
