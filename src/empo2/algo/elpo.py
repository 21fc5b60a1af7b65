"""ELPO (Liang et al., 2026, "Learning from the Irrecoverable: Error-Localized Policy Optimization for
Tool-Integrated LLM Reasoning", arXiv 2602.09598 v1), written as its equations.

The rollout tree's advantages (§4.2, Eq. 6–10: the tree, its rewards, branch, trajectory and hierarchical
advantages) are :mod:`empo2.algo.elpo_tree`; :func:`elpo_advantages`, the registered advantage, applies them to each
group's tree.

Binary error localisation (BEL, §4.1, Algorithm 1):

- :func:`token_entropy` (Eq. 3) — H = −Σ_j p_j log p_j per generated token; :func:`sampled_entropy`, its estimate
  from the sampled tokens' log-probs, which is what the rollout has.
- :func:`entropy_gap`, :func:`choose_search` (Eq. 4) — τ*_search = argmax_τ∈B (H^tool(τ) − H^root(τ)).
- :func:`suffix_count` (Eq. 5) — X_m = X_min + (X_max − X_min)·σ(β(H^tool_m − H^root)) suffixes at anchor m.
- :class:`CriticalStepSearch` (Algorithm 1, lines 22–46) — the binary search for the first irrecoverable step t_crit;
  :func:`localise` runs it against any probe under a rollout budget.

Error-localised clipping (§4.3):

- :func:`critical_steps`, :func:`elc_clip_low`, :func:`critical_clip_low` (Eq. 11) — ε^t_low = ε_low + ε_elc on the
  searched trajectory's steps t ≥ t_crit, ε_low elsewhere.
- :func:`elc_surrogate` (Eq. 12) — min(ρ·A_hier, clip(ρ, 1 − ε^t_low, 1 + ε_high)·A_hier); :func:`elpo_loss`, the
  registered loss, hands it, with the per-row lower bound of Eq. 11, to the shared policy loss
  (:func:`empo2.algo.losses.policy_loss`: masks, KL, aggregation) in place of the shared clip.

Table 2's defaults are the module constants below; a run's settings are :class:`ElpoOptions`, ``algo.elpo.*`` of the
config.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from functools import partial
from typing import ClassVar

import numpy as np
import torch

from empo2.algo.advantages import AdvantageInput, register_advantage
from empo2.algo.elpo_tree import LAMBDA_TREE, tree_advantages, tree_parents, tree_paths
from empo2.algo.losses import clipped_surrogate_settings, policy_loss, register_policy_loss
from empo2.algo.registry import AlgorithmSpec, register_algorithm
from empo2.bounds import bounded

# Table 2 (App. C); its λ_tree, LAMBDA_TREE, sits with Eq. 10 in elpo_tree. Its budget N_total (16) is the group
# size here, ``algo.num_generations``.
B_MAX = 3
X_MIN = 1.0
X_MAX = 3.0
BETA = 5.0
EPS_LOW = 0.2
EPS_HIGH = 0.315
EPS_ELC = 0.115

OFFICIAL = ("the paper's Table 2 (no code was released)",
            {"epsilon": EPS_LOW, "epsilon_high": EPS_HIGH, "elpo.eps_elc": EPS_ELC, "elpo.lambda_tree": LAMBDA_TREE,
             "beta": 0.0})


@dataclass(frozen=True)
class ElpoOptions:
    """ELPO's settings, ``algo.elpo.*``: the advantage's λ, the clip's ε_elc and Algorithm 1's rollout knobs (Table 2
    by default)."""

    key: ClassVar[str] = "elpo"

    lambda_tree: float = bounded(LAMBDA_TREE, 0, 1)
    """λ_tree in A_hier = λ·A_branch + (1 − λ)·A_trajectory (Eq. 10; Table 2: 0.5)."""
    eps_elc: float = bounded(EPS_ELC, 0, 1)
    """ε_elc added to ε_low (``algo.epsilon``) on a searched failure's critical step and its suffix (Eq. 11)."""
    b_max: int = bounded(B_MAX, 1, 4096)
    """Failures buffered before each binary search (Algorithm 1's B_max; Table 2: 3)."""
    x_min: float = bounded(X_MIN, 1, 4096)
    """Fewest suffixes per probe, X_min of Eq. 5."""
    x_max: float = bounded(X_MAX, 1, 4096)
    """Most suffixes per probe, X_max of Eq. 5."""
    beta: float = bounded(BETA, 0, 1e6)
    """Entropy-gap scale β of Eq. 5."""


# ----------------------------------------------------------------------------------------------- clipping
def critical_steps(n_steps: int, t_crit: int | None) -> np.ndarray:
    """Eq. 11's scope on one trajectory of ``n_steps`` steps: [T] bool, True on steps t_crit..T (1-based, the
    critical step and its suffix); ``t_crit=None`` (not searched) = none."""
    out = np.zeros(n_steps, dtype=bool)
    if t_crit is not None:
        out[max(int(t_crit) - 1, 0):] = True
    return out


def elc_clip_low(critical, eps_low: float = EPS_LOW, eps_elc: float = EPS_ELC):
    """Eq. 11: ε^t_low = ε_low + ε_elc where ``critical`` (a float64 array or tensor of 0/1), else ε_low."""
    return float(eps_low) + float(eps_elc) * critical


def critical_clip_low(n_steps: int, t_crit: int | None, eps_low: float = EPS_LOW,
                      eps_elc: float = EPS_ELC) -> np.ndarray:
    """Eq. 11 for one trajectory of ``n_steps`` steps: ε^t_low [T] float64, ε_low + ε_elc on steps t_crit..T
    (:func:`critical_steps`), ε_low elsewhere; ``t_crit=None`` (not searched) = ε_low throughout."""
    return elc_clip_low(critical_steps(n_steps, t_crit).astype(np.float64), eps_low, eps_elc)


def node_clip_low(paths: Sequence[Sequence[int]], critical: dict[int, int], eps_low: float = EPS_LOW,
                  eps_elc: float = EPS_ELC) -> np.ndarray:
    """Eq. 11 on the tree's rows: ε_low [S] per node; ``critical`` maps a searched trajectory's index to its t_crit.
    Only the searched trajectory's own nodes from step t_crit on are widened (not its failed sibling suffixes)."""
    out = np.full(len(tree_parents(paths)), float(eps_low))
    for i, t_crit in critical.items():
        path = list(paths[i])
        out[path] = np.maximum(out[path], critical_clip_low(len(path), t_crit, eps_low, eps_elc))
    return out


def elc_surrogate(ratio: torch.Tensor, adv: torch.Tensor, clip_low: torch.Tensor | float,
                  eps_high: float = EPS_HIGH) -> torch.Tensor:
    """Eq. 12 (to be maximised): min(ρ·A, clip(ρ, 1 − ε^t_low, 1 + ε_high)·A) per token. ratio, adv [B, T];
    clip_low a float, [B, 1] (per row) or [B, T]."""
    low = 1.0 - torch.as_tensor(clip_low, dtype=ratio.dtype, device=ratio.device)
    clipped = torch.minimum(torch.maximum(ratio, low), torch.full_like(ratio, 1.0 + eps_high))
    return torch.minimum(ratio * adv, clipped * adv)


def elpo_loss_settings(algo) -> dict[str, str]:
    """What the ``elpo`` loss applies: Eq. 11–12's clip, no dual clip, no low-probability mask."""
    return {**clipped_surrogate_settings(dataclasses.replace(algo, dual_clip=0.0), mask=False),
            "clip": f"{algo.epsilon:g} / {algo.epsilon_high:g}, ε_low + {algo.elpo.eps_elc:g} on the critical suffix"}


@register_policy_loss("elpo", settings=elpo_loss_settings)
def elpo_loss(logp_new, logp_old, advantages, response_mask, algo, *, critical: torch.Tensor | None = None,
              **kwargs) -> tuple[torch.Tensor, dict[str, float]]:
    """Eq. 12 as the ``elpo`` loss: GRPO's clipped surrogate, without the low-probability mask or the dual clip,
    whose lower bound is 1 − ε^t_low of Eq. 11 per row: ε_low + ε_elc on rows in a searched failure's critical
    suffix (``critical`` [B] bool, :func:`critical_steps`) and ε_low elsewhere; ε_low = ``algo.epsilon``,
    ε_elc = ``algo.elpo.eps_elc``, ε_high = ``algo.epsilon_high``. Metric ``critical_rows``: the rows with the wider
    bound."""
    surrogate = None
    if critical is not None:
        clip_low = elc_clip_low(critical.to(logp_new.device, torch.float64), algo.epsilon, algo.elpo.eps_elc)  # [B]
        surrogate = partial(elc_surrogate, clip_low=clip_low[:, None], eps_high=algo.epsilon_high)
    loss, metrics = policy_loss(logp_new, logp_old, advantages, response_mask,
                                dataclasses.replace(algo, low_prob_threshold=0.0, dual_clip=0.0), surrogate=surrogate,
                                **kwargs)
    metrics["critical_rows"] = float(critical.sum()) if critical is not None else 0.0
    return loss, metrics


# ----------------------------------------------------------------------------------------------- BEL
def token_entropy(logits: torch.Tensor) -> torch.Tensor:
    """Eq. 3: logits [..., V] -> H [...] = −Σ_j p_j log p_j (nats), with p = softmax(logits)."""
    logp = torch.log_softmax(logits.float(), dim=-1)
    return -(logp.exp() * logp).sum(dim=-1)


def sampled_entropy(logp: Sequence[float]) -> float:
    """Eq. 3 estimated from one response's sampled tokens: the mean surprisal −mean_t log π(a_t), whose expectation
    is the mean token entropy (the generation keeps only the sampled tokens' log-probs); 0 for no tokens."""
    return float(-np.mean(logp)) if len(logp) else 0.0


def entropy_gap(step_entropy: Sequence[float]) -> float:
    """Eq. 4's score of one failed trajectory: H^tool − H^root, with ``step_entropy`` [T] the mean token entropy of
    each step's response. H^root = step 1 (the response to the task prompt); H^tool = the mean over steps 2..T (each
    a response to an environment observation, the agent's "tool feedback"). A one-step trajectory scores 0."""
    h = np.asarray(step_entropy, dtype=np.float64)
    return float(h[1:].mean() - h[0]) if h.size > 1 else 0.0


def choose_search(step_entropies: Sequence[Sequence[float]]) -> int:
    """Eq. 4: the index of the buffered failure with the largest entropy gap (the first one on ties)."""
    if not len(step_entropies):
        raise ValueError("the failure buffer is empty")
    return int(np.argmax([entropy_gap(h) for h in step_entropies]))


def suffix_count(h_tool_m: float, h_root: float, x_min: float = X_MIN, x_max: float = X_MAX,
                 beta: float = BETA) -> float:
    """Eq. 5: X_m = X_min + (X_max − X_min)·σ(β(H^tool_m − H^root)), a real number (2.0 at a zero gap)."""
    z = beta * (h_tool_m - h_root)
    sigmoid = 1.0 / (1.0 + math.exp(-z)) if z >= 0 else math.exp(z) / (1.0 + math.exp(z))
    return x_min + (x_max - x_min) * sigmoid


def suffix_samples(h_tool_m: float, h_root: float, x_min: float = X_MIN, x_max: float = X_MAX,
                   beta: float = BETA) -> int:
    """Eq. 5 as Algorithm 1 uses it, a loop count: X_m rounded half up (the paper does not say how it rounds)."""
    return int(math.floor(suffix_count(h_tool_m, h_root, x_min, x_max, beta) + 0.5))


@dataclass
class CriticalStepSearch:
    """Algorithm 1, lines 22–46: the binary search over the K steps of a failed trajectory.

    An anchor m fixes steps 1..m as a prefix; suffixes are sampled from step m + 1 on. If any succeeds the error
    lies after m (L = m + 1), else at or before m (R = m). t_crit = L when the range has collapsed (or when the
    budget ran out first: Algorithm 1 still reports L). When no suffix ever succeeds the search ends at step 1.
    """

    steps: int
    low: int = 1
    high: int = 0
    probes: list[tuple[int, bool]] = field(default_factory=list)
    """(anchor m, recoverable) of every probe, in order."""

    def __post_init__(self):
        if self.steps < 1:
            raise ValueError("a searched trajectory needs at least one step")
        self.high = self.high or self.steps

    @property
    def done(self) -> bool:
        return self.low >= self.high

    def anchor(self) -> int:
        """m = ⌊(L + R)/2⌋, the next prefix length to probe (1 ≤ m < K)."""
        if self.done:
            raise RuntimeError("the search is over")
        return (self.low + self.high) // 2

    def record(self, recoverable: bool) -> None:
        """The outcome of the probe at :meth:`anchor`: whether any of its suffixes succeeded."""
        m = self.anchor()
        self.probes.append((m, bool(recoverable)))
        if recoverable:
            self.low = m + 1
        else:
            self.high = m

    @property
    def t_crit(self) -> int:
        return self.low


def localise(steps: int, probe: Callable[[int, int], bool], budget: int,
             samples: Callable[[int], int] | None = None) -> tuple[CriticalStepSearch, int]:
    """Run :class:`CriticalStepSearch` on a trajectory of ``steps`` steps against ``probe(m, k)`` (does suffix k
    after prefix m succeed?), sampling ``samples(m)`` suffixes per anchor (Eq. 5; default 1) while the rollout
    ``budget`` lasts (each suffix costs one rollout, Algorithm 1 lines 23 and 29). Returns the search and the
    rollouts spent. Suffixes of one anchor are all sampled (they go out as one wave), as Algorithm 1 does."""
    search, spent = CriticalStepSearch(steps), 0
    while not search.done and spent < budget:
        m = search.anchor()
        n = max(1, samples(m) if samples else 1)
        outcomes = [probe(m, k) for k in range(min(n, budget - spent))]
        spent += len(outcomes)
        search.record(any(outcomes))
    return search, spent


@register_advantage("elpo")
def elpo_advantages(inp: AdvantageInput) -> tuple[list[np.ndarray], dict[str, float]]:
    """Eq. 6–10 on each group's tree: every step an episode holds gets its node's A_hier (a branch holds only the
    steps after its prefix, so a shared prefix step is one row). A leaf's R is the terminal reward of the whole
    trajectory: the sum of the step rewards on its path from the root, the prefix a branch shares with its source
    included (``inp.returns`` is not read, so a return that left the prefix out cannot reach the tree). A branch whose
    source is missing from the batch (a crashed worker) counts as a tree of its own. Raw rewards feed Eq. 6–8 (App.
    B's rewards are −1.1 / 1.0)."""
    tree = inp.tree or [(i, None) for i in range(len(inp.returns))]
    out: list[np.ndarray] = [np.zeros(len(r)) for r in inp.step_rewards]
    silent = 0  # groups whose every node gets A_hier = 0: no learning signal, as GRPO's zero_adv_groups
    for g in np.unique(inp.group_ids):
        rows = [int(i) for i in np.flatnonzero(inp.group_ids == g)]
        local = {tree[i][0]: k for k, i in enumerate(rows)}
        parents = []
        for i in rows:
            p = tree[i][1]
            parents.append((local[p[0]], p[1]) if p is not None and local.get(p[0], len(rows)) < local[tree[i][0]]
                           else None)
        paths = tree_paths(parents, [len(inp.step_rewards[i]) for i in rows])
        node_reward = np.concatenate([np.asarray(inp.step_rewards[i], dtype=np.float64) for i in rows])  # [S]
        leaf_returns = [math.fsum(node_reward[path]) for path in paths]  # R of each completed trajectory
        hier = tree_advantages(paths, leaf_returns, inp.algo.elpo.lambda_tree, inp.algo.adv_eps).hier
        for i, path in zip(rows, paths):
            own = len(inp.step_rewards[i])
            out[i] = hier[path[len(path) - own:]] if own else np.zeros(0)
        silent += not np.any(hier)
    flat = np.concatenate(out) if out else np.zeros(0)
    return out, {"groups": float(len(np.unique(inp.group_ids))), "adv_abs_mean": float(np.abs(flat).mean())
                 if flat.size else 0.0, "zero_adv_groups": float(silent)}


def row_extras(episode) -> dict[str, np.ndarray]:
    """What an ELPO update row carries: ``critical``, whether its step lies in Eq. 11's scope (:func:`critical_steps`
    of the episode's ``critical_step``), which :func:`elpo_loss` widens."""
    return {"critical": critical_steps(len(episode.steps), episode.critical_step)}


register_algorithm(AlgorithmSpec(
    "elpo", uses_memory=False, loss="elpo", advantage="elpo", rollout="empo2.episodes.elpo_rollout:drive",
    metrics="empo2.episodes.elpo_rollout:tree_metrics", row_extras=row_extras, reward_note="a tree leaf's R is its whole path's (the replayed prefix included)",
    official=OFFICIAL, options=ElpoOptions))  # Liang et al. 2026
