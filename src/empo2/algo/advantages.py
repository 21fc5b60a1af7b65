"""Advantage estimators (a registry, verl-style) and the return that feeds them (SPEC §1.5, §4).

An estimator maps per-trajectory returns and group ids to per-trajectory advantages::

    fn(returns [N] float64 numpy, group_ids [N] int64 numpy, *, scale_rewards: bool, eps: float)
        -> (advantages [N] float64 numpy, metrics dict[str, float])

Register a new one with ``@register_advantage("name")``; call any of them through :func:`compute_advantages`,
which converts inputs and returns a ``torch.float32`` tensor. The trainer broadcasts a trajectory's advantage to
every generated token of every step of that trajectory.

GRPO (the only entry for now; GiGPO will be a second entry)::

    A_i = (R_i - mean_G R) / (std_G R + eps)        std_G = POPULATION std of the group (ddof = 0)
    A_i =  R_i - mean_G R                           when scale_rewards=False

A group of one rollout, or a group whose returns are all equal (up to :data:`EQUAL_RTOL`), gets exactly 0 (no learning signal); such groups are
counted in ``metrics["zero_adv_groups"]`` because their rollouts cost compute and teach nothing.
"""

from __future__ import annotations

from typing import Callable

import numpy as np
import torch

EQUAL_RTOL = 1e-9
"""Returns of a group that differ by at most this × max(1, |R|) count as equal (advantage exactly 0)."""

AdvantageFn = Callable[..., tuple[np.ndarray, dict[str, float]]]

ADVANTAGE_ESTIMATORS: dict[str, AdvantageFn] = {}
"""Registry: estimator name -> function (see the module docstring for the signature)."""


def register_advantage(name: str) -> Callable[[AdvantageFn], AdvantageFn]:
    """Decorator that adds an estimator to :data:`ADVANTAGE_ESTIMATORS` under ``name``."""

    def wrap(fn: AdvantageFn) -> AdvantageFn:
        if name in ADVANTAGE_ESTIMATORS:
            raise ValueError(f"advantage estimator {name!r} is already registered")
        ADVANTAGE_ESTIMATORS[name] = fn
        return fn

    return wrap


def _as_numpy(x, dtype) -> np.ndarray:
    if isinstance(x, torch.Tensor):
        x = x.detach().cpu().numpy()
    return np.asarray(x, dtype=dtype).reshape(-1)


@register_advantage("grpo")
def grpo_advantages(
    returns: np.ndarray, group_ids: np.ndarray, *, scale_rewards: bool = True, eps: float = 1e-6
) -> tuple[np.ndarray, dict[str, float]]:
    """GRPO group-normalised advantages. returns [N] float64, group_ids [N] int -> ([N] float64, metrics).

    Groups need not be contiguous. Population std (ddof=0): for returns (0, 1) the std is 0.5, so A ≈ (-1, +1)
    (ddof=1 would give ±0.707).
    """
    _, inv = np.unique(group_ids, return_inverse=True)  # inv: [N] group index 0..G-1
    inv = inv.reshape(-1)
    num_groups = int(inv.max()) + 1 if inv.size else 0
    size = np.bincount(inv, minlength=num_groups).astype(np.float64)  # [G]
    gmax = np.full(num_groups, -np.inf)
    gmin = np.full(num_groups, np.inf)
    np.maximum.at(gmax, inv, returns)
    np.minimum.at(gmin, inv, returns)
    # A group whose returns agree up to EQUAL_RTOL (relative to max(1, |R|)) carries no signal: exactly 0. Without
    # this, (0, 2e-209) divides by an underflowed std (±inf) and (0, 9e-20) gives ±1 while (1, 1 + 9e-20) gives 0.
    magnitude = np.maximum(1.0, np.maximum(np.abs(gmax), np.abs(gmin)))  # [G]
    degenerate = (gmax - gmin) <= EQUAL_RTOL * magnitude  # [G]; a group of size 1 is always degenerate
    mean = np.bincount(inv, weights=returns, minlength=num_groups) / np.maximum(size, 1)  # [G]
    centred = returns - mean[inv]  # [N]
    # std computed on returns divided by the group's spread, so neither huge nor tiny returns overflow/underflow.
    spread = np.where(degenerate, 1.0, gmax - gmin)  # [G]
    unit = centred / spread[inv]  # [N], |unit| <= 1
    std = spread * np.sqrt(np.bincount(inv, weights=unit**2, minlength=num_groups) / np.maximum(size, 1))  # [G]
    safe_std = np.where(degenerate, 1.0, std)  # [G]; > 0 wherever a group is not degenerate
    adv = centred / (safe_std[inv] + eps) if scale_rewards else centred  # [N]
    adv = np.where(degenerate[inv], 0.0, adv)
    metrics = {
        "groups": float(num_groups),
        "zero_adv_groups": float(degenerate.sum()),
        "singleton_groups": float((size == 1).sum()),
        "adv_abs_mean": float(np.abs(adv).mean()) if adv.size else 0.0,
        "return_std_mean": float(std.mean()) if num_groups else 0.0,
    }
    return adv, metrics


def compute_advantages(
    name: str, returns, group_ids, *, scale_rewards: bool = True, eps: float = 1e-6
) -> tuple[torch.Tensor, dict[str, float]]:
    """Run registered estimator ``name``. returns [N] float (numpy/torch/list), group_ids [N] int.

    Returns ``(advantages torch.float32 [N], metrics)``; metrics include ``groups`` and ``zero_adv_groups``.
    Computation is in float64 and cast at the end.
    """
    if name not in ADVANTAGE_ESTIMATORS:
        raise ValueError(f"unknown advantage estimator {name!r}; registered: {', '.join(sorted(ADVANTAGE_ESTIMATORS))}")
    r = _as_numpy(returns, np.float64)  # [N]
    g = _as_numpy(group_ids, np.int64)  # [N]
    if r.shape != g.shape:
        raise ValueError(f"returns {r.shape} and group_ids {g.shape} must have the same length")
    if not np.all(np.isfinite(r)):
        raise ValueError("returns contain non-finite values")
    adv, metrics = ADVANTAGE_ESTIMATORS[name](r, g, scale_rewards=scale_rewards, eps=eps)
    return torch.as_tensor(adv, dtype=torch.float32), metrics


def combine_returns(extrinsic, intrinsic_sums, weight: float) -> np.ndarray:
    """R = R_ext + w · Σ_t r_int.

    extrinsic [N], intrinsic_sums [N] (per-trajectory sum of novelty rewards), weight w -> R [N] float64.
    """
    ext = _as_numpy(extrinsic, np.float64)  # [N]
    intr = _as_numpy(intrinsic_sums, np.float64)  # [N]
    if ext.shape != intr.shape:
        raise ValueError(f"extrinsic {ext.shape} and intrinsic_sums {intr.shape} must have the same length")
    return ext + float(weight) * intr


def intrinsic_weight(
    iteration: int,
    total_iterations: int,
    schedule: str = "constant",
    weight: float = 0.0,
    start: float = 0.8,
    end: float = 0.2,
) -> float:
    """Weight w of the intrinsic reward at ``iteration`` (0-based) of ``total_iterations``.

    - ``constant``: ``weight`` (0 = intrinsic reward off).
    - ``linear``: ``start`` at iteration 0, ``end`` at iteration ``total_iterations - 1`` and after, linear in between
      (``weight`` is ignored; the config fields are ``intrinsic_weight_start`` / ``intrinsic_weight_end``).
    """
    if schedule == "constant":
        return float(weight)
    if schedule == "linear":
        span = max(int(total_iterations) - 1, 1)
        frac = min(max(iteration / span, 0.0), 1.0)
        return float(start + (end - start) * frac)
    raise ValueError(f"unknown intrinsic schedule {schedule!r}; use 'constant' or 'linear'")
