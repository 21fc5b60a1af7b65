"""Advantage estimators (a registry, verl-style) and the return that feeds them (docs/fidelity.md, *Advantages*).

Every estimator gets step-level data in one :class:`AdvantageInput` and gives one advantage per STEP::

    fn(inp: AdvantageInput) -> (advantages: list of [T_i] float64 numpy arrays, metrics dict[str, float])

``inp.returns`` [N] and ``inp.group_ids`` [N] are per episode; ``inp.step_rewards[i]`` [T_i] and
``inp.state_keys[i]`` (T_i strings: the state each step's action answered, :func:`empo2.envs.base.state_of`) are
per step of episode i. The
trainer gives every generated token of step t of episode i the advantage ``advantages[i][t]``. ``inp.success`` [N]
says which episodes reached the goal; ``inp.gather`` collects an object from every data-parallel rank, for statistics
over the whole global batch (ProxMO's TF-IDF term counts). ``inp.algo`` is the config's ``algo`` section: each
estimator reads its knobs there, the shared ones (``scale_rewards``, ``adv_eps``) and its method's own options
(``algo.gigpo``, ``algo.proxmo`` …, declared in the method's file and registered with its algorithm).
Register a new estimator with ``@register_advantage("name")`` and call any of them through
:func:`compute_advantages`, which checks the input.

GRPO broadcasts one group-normalised value per episode to all of its steps::

    A_i = (R_i - mean_G R) / (std_G R + eps)        std_G = SAMPLE std of the group (ddof = 1, as torch.std)
    A_i =  R_i - mean_G R                           when algo.scale_rewards=False      (eps = algo.adv_eps)

A group of one rollout, or a group whose returns are all equal (up to :data:`EQUAL_RTOL`), gets exactly 0 (no
learning signal); such groups are counted in ``metrics["zero_adv_groups"]`` because their rollouts cost compute and
teach nothing. GiGPO (episode + anchor-state step groups) lives in :mod:`empo2.algo.gigpo`, ProxMO (success-rate
weights + proximity-weighted step baselines) in :mod:`empo2.algo.proxmo`; the built-in estimators
are registered by :mod:`empo2.algo.registry`, which importing any module of ``empo2.algo`` loads.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch

from empo2.algo.returns import step_rewards_with_novelty

EQUAL_RTOL = 1e-9
"""Returns of a group that differ by at most this × max(1, |R|) count as equal (advantage exactly 0)."""


def _one_rank(obj: Any) -> list[Any]:
    return [obj]


@dataclass
class AdvantageInput:
    """Step-level data of N episodes (see the module docstring)."""

    returns: np.ndarray
    """[N] float64: each episode's return (extrinsic + weighted intrinsic, R_ext + w·R_int;
    = the sum of the step rewards on its path from the root, :func:`path_rewards`: a branch's prefix included)."""
    group_ids: np.ndarray
    """[N] int64: the GRPO group (same task and variation, same rollout batch)."""
    step_rewards: list[np.ndarray]
    """N arrays [T_i] float64: each step's reward (step index = position)."""
    state_keys: list[list[str]]
    """N lists of T_i strings: the state each step's action answered, as the environment defines it (GiGPO's anchor
    key; anchor groups never span two episode groups, and one episode group is one task and variation)."""
    algo: Any
    """The ``algo`` config section (:class:`empo2.config.sections.AlgoConfig`): the shared knobs and every registered
    method's options (``algo.gigpo`` …), each estimator reading its own."""
    success: np.ndarray | None = None
    """[N] bool: whether each episode reached the goal (ProxMO's success rate); ``None`` where unknown."""
    gather: Callable[[Any], list[Any]] = _one_rank
    """``obj -> [obj of rank 0, obj of rank 1, …]`` over the data-parallel ranks (every rank calls it together): for
    estimators whose statistics run over the whole global batch, while ``returns``… hold this rank's groups only."""
    tree: list[tuple[int, tuple[int, int] | None]] | None = None
    """Per episode (member, parent): ELPO's tree links, parent = (member it branched from, m) or ``None``."""

    @classmethod
    def from_rewards(cls, episodes, rewards: list[np.ndarray], algo: Any,
                     gather: Callable[[Any], list[Any]] | None = None, returns=None) -> AdvantageInput:
        """From rollout episodes (:class:`~empo2.episodes.episode.Episode`: ``group``, ``member``, ``parent``,
        ``steps``, ``success``) and their step rewards (:func:`step_rewards`, computed once per batch): the return is
        the sum of the step rewards on the episode's path (:func:`path_rewards`, :func:`returns_of`) unless
        ``returns`` is given; state key = the state the step answered (:func:`empo2.envs.base.state_of`)."""
        keys = [[s.state_text for s in ep.steps] for ep in episodes]
        groups = np.array([ep.group for ep in episodes], dtype=np.int64)
        success = np.array([bool(ep.success) for ep in episodes], dtype=bool)
        tree = [(ep.member, ep.parent) for ep in episodes]
        returns = returns_of(path_rewards(episodes, rewards)) if returns is None else _as_numpy(returns, np.float64)
        return cls(returns, groups, list(rewards), keys, algo, success, gather or _one_rank, tree)

    @classmethod
    def from_episodes(cls, episodes, returns, intrinsic_weight: float, algo: Any,
                      intrinsic_aggregation: str = "mean",
                      gather: Callable[[Any], list[Any]] | None = None) -> AdvantageInput:
        """:meth:`from_rewards` with the step rewards of :func:`step_rewards` and the ``returns`` given."""
        rewards = step_rewards(episodes, intrinsic_weight, intrinsic_aggregation)
        return cls.from_rewards(episodes, rewards, algo, gather, returns)

    @classmethod
    def from_returns(cls, returns, group_ids, algo: Any, lengths: Sequence[int] | None = None) -> AdvantageInput:
        """Episode-level data only: step rewards are 0 except the return on the last step; keys are unique."""
        r = _as_numpy(returns, np.float64)
        lengths = [1] * len(r) if lengths is None else list(lengths)
        rewards = [np.zeros(n) for n in lengths]
        for i, n in enumerate(lengths):
            if n:
                rewards[i][-1] = r[i]
        keys = [[f"episode {i} step {t}" for t in range(n)] for i, n in enumerate(lengths)]
        return cls(r, _as_numpy(group_ids, np.int64), rewards, keys, algo)


AdvantageFn = Callable[[AdvantageInput], tuple[list[np.ndarray], dict[str, float]]]

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


def group_normalise(values: np.ndarray, group_ids: np.ndarray, *, scale_rewards: bool = True,
                    eps: float = 1e-6) -> tuple[np.ndarray, dict[str, float]]:
    """Group-normalised values. values [N] float64, group_ids [N] int -> ([N] float64, metrics).

    Groups need not be contiguous. Sample std (ddof=1, as ``torch.std``, TRL, verl and the released code): for values
    (0, 1) the std is 0.707, so A ≈ (-0.707, +0.707). A degenerate group (one member, or all equal up to EQUAL_RTOL)
    gets exactly 0, so a group of one never divides by n − 1 = 0.
    """
    _, inv = np.unique(group_ids, return_inverse=True)  # inv: [N] group index 0..G-1
    inv = inv.reshape(-1)
    num_groups = int(inv.max()) + 1 if inv.size else 0
    size = np.bincount(inv, minlength=num_groups).astype(np.float64)  # [G]
    gmax = np.full(num_groups, -np.inf)
    gmin = np.full(num_groups, np.inf)
    np.maximum.at(gmax, inv, values)
    np.minimum.at(gmin, inv, values)
    # A group whose values agree up to EQUAL_RTOL (relative to max(1, |R|)) carries no signal: exactly 0. Without
    # this, (0, 2e-209) divides by an underflowed std (±inf) and (0, 9e-20) gives ±1 while (1, 1 + 9e-20) gives 0.
    magnitude = np.maximum(1.0, np.maximum(np.abs(gmax), np.abs(gmin)))  # [G]
    degenerate = (gmax - gmin) <= EQUAL_RTOL * magnitude  # [G]; a group of size 1 is always degenerate
    mean = np.bincount(inv, weights=values, minlength=num_groups) / np.maximum(size, 1)  # [G]
    centred = values - mean[inv]  # [N]
    # std computed on values divided by the group's spread, so neither huge nor tiny values overflow/underflow.
    spread = np.where(degenerate, 1.0, gmax - gmin)  # [G]
    unit = centred / spread[inv]  # [N], |unit| <= 1
    std = spread * np.sqrt(np.bincount(inv, weights=unit**2, minlength=num_groups) / np.maximum(size - 1, 1))  # [G]
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


@register_advantage("grpo")
def grpo_advantages(inp: AdvantageInput) -> tuple[list[np.ndarray], dict[str, float]]:
    """GRPO: the episode's group-normalised return, broadcast to every step of the episode."""
    adv, metrics = group_normalise(inp.returns, inp.group_ids, scale_rewards=inp.algo.scale_rewards,
                                   eps=inp.algo.adv_eps)  # [N]
    return [np.full(len(r), a) for a, r in zip(adv, inp.step_rewards)], metrics


def compute_advantages(name: str, inp: AdvantageInput) -> tuple[list[np.ndarray], dict[str, float]]:
    """Run registered estimator ``name`` on ``inp``; returns per-step advantages (N arrays [T_i] float64) + metrics.

    Metrics include ``groups`` and ``zero_adv_groups`` (episode groups without a learning signal).
    """
    if name not in ADVANTAGE_ESTIMATORS:
        raise ValueError(f"unknown advantage estimator {name!r}; registered: {', '.join(sorted(ADVANTAGE_ESTIMATORS))}")
    inp = _checked(inp)
    adv, metrics = ADVANTAGE_ESTIMATORS[name](inp)
    if len(adv) != len(inp.step_rewards) or any(len(a) != len(r) for a, r in zip(adv, inp.step_rewards)):
        raise RuntimeError(f"advantage estimator {name!r} returned the wrong shape")
    return [np.asarray(a, dtype=np.float64) for a in adv], metrics


def _checked(inp: AdvantageInput) -> AdvantageInput:
    r = _as_numpy(inp.returns, np.float64)  # [N]
    g = _as_numpy(inp.group_ids, np.int64)  # [N]
    rewards = [_as_numpy(x, np.float64) for x in inp.step_rewards]
    if r.shape != g.shape:
        raise ValueError(f"returns {r.shape} and group_ids {g.shape} must have the same length")
    if len(rewards) != len(r) or len(inp.state_keys) != len(r):
        raise ValueError(f"{len(r)} returns but {len(rewards)} step-reward and {len(inp.state_keys)} state-key lists")
    if any(len(k) != len(x) for k, x in zip(inp.state_keys, rewards)):
        raise ValueError("every episode needs one state key per step reward")
    if not np.all(np.isfinite(r)) or not all(np.all(np.isfinite(x)) for x in rewards):
        raise ValueError("returns or step rewards contain non-finite values")
    success = None if inp.success is None else np.asarray(inp.success, dtype=bool).reshape(-1)
    if success is not None and success.shape != r.shape:
        raise ValueError(f"returns {r.shape} and success {success.shape} must have the same length")
    return AdvantageInput(r, g, rewards, [list(k) for k in inp.state_keys], inp.algo, success, inp.gather,
                          inp.tree)


def step_rewards(episodes, intrinsic_weight: float, aggregation: str = "mean") -> list[np.ndarray]:
    """Each step's reward r_t + w·r_int_t (EMPO²'s return, :func:`empo2.algo.empo2.step_rewards_with_novelty`), the
    one source of every estimator's input and of the return.

    episodes: plain data, ``steps`` with ``reward`` (extrinsic) and ``intrinsic`` (novelty) -> N arrays [T_i] float64.
    """
    return [step_rewards_with_novelty([s.reward for s in ep.steps], [s.intrinsic for s in ep.steps],
                                      intrinsic_weight, aggregation) for ep in episodes]


def path_rewards(episodes, rewards: Sequence[np.ndarray]) -> list[np.ndarray]:
    """Each episode's step rewards from the root of its rollout tree [T_path] float64. An ELPO branch
    (``parent = (member j, m)``) holds only the steps after its prefix, so its path starts with the first m rewards
    of episode j's path (same group, earlier in ``episodes``); any other episode's path is its own steps. A branch
    whose source is not among ``episodes`` keeps its own steps only.

    A branch's first reward is the score change from the state its replay reached, so the path's sum is the return
    of the whole trajectory the branch completed (ELPO's R, Eq. 6–8)."""
    index = {(ep.group, ep.member): i for i, ep in enumerate(episodes)}
    out: list[np.ndarray] = []
    for i, (ep, own) in enumerate(zip(episodes, rewards)):
        own = np.asarray(own, dtype=np.float64)
        j = index.get((ep.group, ep.parent[0])) if ep.parent is not None else None
        out.append(np.concatenate([out[j][: ep.parent[1]], own]) if j is not None and j < i else own)
    return out


def returns_of(rewards: Sequence[np.ndarray]) -> np.ndarray:
    """R_i = Σ_t r_t of each episode's step rewards [N] float64. ``math.fsum`` rounds once, so two episodes whose
    steps earn the same rewards in another order get the same return (and a group of them no advantage)."""
    return np.array([math.fsum(r) for r in rewards], dtype=np.float64)
