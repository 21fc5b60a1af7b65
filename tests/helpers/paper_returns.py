"""The paper's return R = R_ext + w·R_int per episode, the equation the tests hold the training's return against.

Training computes each return as the sum of its step rewards r_t + w_t·r_int_t (:mod:`empo2.algo.returns`), so that
step-level estimators and ELPO's path returns read the same terms; these tests check that the sum equals this
equation."""

from __future__ import annotations

import numpy as np
import torch


def combine_returns(extrinsic, intrinsic_returns, weight: float) -> np.ndarray:
    """R = R_ext + w · R_int: extrinsic [N], intrinsic_returns [N] (each episode's R_int), weight w -> R [N] float64
    (the paper adds the intrinsic reward to the extrinsic one; the released code computes one and never adds it)."""
    ext, intr = _as_numpy(extrinsic), _as_numpy(intrinsic_returns)  # [N], [N]
    if ext.shape != intr.shape:
        raise ValueError(f"extrinsic {ext.shape} and intrinsic_returns {intr.shape} must have the same length")
    return ext + float(weight) * intr


def _as_numpy(x) -> np.ndarray:
    if isinstance(x, torch.Tensor):
        x = x.detach().cpu().numpy()
    return np.asarray(x, dtype=np.float64).reshape(-1)
