"""ProxMO advantages ("Proximity-Based Multi-Turn Optimization", arXiv 2602.19225; official code GithubX-F/ProxMO-RL,
``proxmo/core_proxmo.py``).

GiGPO's two levels (:mod:`empo2.algo.gigpo`) with two changes, in named stages. The paper's body could not be read
(only its abstract and the official code), so each stage is tagged with its formula and the official function it
matches rather than an equation number:

1. :func:`psc_weights` — polarized signal controller (PSC, ``compute_psc_weights``): from the group's success rate p,
   a successful episode gets w⁺ = 1 + β(σ((1 − p)^α) − ½) and a failed one w⁻ = 1 + β(σ(−p^α) − ½), with
   β = range / (σ(1) − ½), so w ∈ [1 − range, 1 + range]: a rare success is pushed up, a rare failure damped.
2. :func:`episode_psc_advantage` — A^E(τ_i) = w_i · (R(τ_i) − mean_j R(τ_j)) over the episode group (mean only).
3. :func:`discounted_step_returns` (GiGPO's) — G_t = r_t + γ·G_{t+1}.
4. :func:`term_counts`, :func:`merge_term_counts`, :func:`idf_weights`, :func:`tfidf_vectors` — TF-IDF of each step's
   state text (scikit-learn's ``TfidfVectorizer`` conventions: lowercase, tokens ``\\b\\w\\w+\\b``, raw counts,
   idf_t = ln((1 + n) / (1 + df_t)) + 1, rows L2-normalised, the ``max_features`` most frequent terms of the batch),
   fitted over the whole global batch: one document per step, every rank's steps counted.
5. :func:`soft_step_baseline` — proximity-based soft aggregation (PSA, ``step_soft_reward``): sim_ij = cos(v_i, v_j),
   w_ij = softmax_j(sim_ij / τ) over every step j of i's episode group (all episodes, all turns, i itself included),
   b_i = Σ_j w_ij G_j and A^S_i = G_i − b_i.
6. :func:`proxmo_advantages` — A = A^E + ω·A^S.

p is the fraction of the group's episodes that reached the goal (``Episode.success``), as the paper defines it; the
official code instead clamps a step-weighted mean of its 10/0 rewards into [0, 1] (docs/fidelity.md, *ProxMO*). Its
settings are :class:`ProxmoOptions`, ``algo.proxmo.*`` of the config.
"""

from __future__ import annotations

import math
import re
from collections import Counter
from dataclasses import dataclass
from typing import ClassVar

import numpy as np

from empo2.algo.advantages import EQUAL_RTOL, AdvantageInput, group_normalise, register_advantage
from empo2.algo.gigpo import discounted_step_returns
from empo2.algo.registry import AlgorithmSpec, register_algorithm
from empo2.bounds import bounded

OFFICIAL = ("ProxMO-RL's scripts (KL loss 0.01, low_var_kl) and ppo_trainer.yaml",
            {"beta": 0.01, "epsilon": 0.2, "epsilon_high": 0.2, "dual_clip": 3.0, "entropy_coeff": 0.001})
"""The loss settings of the official runs (``examples/proxmo_trainer/run_*.sh``: ``kl_loss_coef=0.01``;
``ppo_trainer.yaml``: ``clip_ratio_low/high`` 0.2, ``clip_ratio_c`` 3.0, ``entropy_coeff`` 0.001)."""


@dataclass(frozen=True)
class ProxmoOptions:
    """ProxMO's settings, ``algo.proxmo.*``: read wherever its estimator runs (``algo.name=proxmo``, or
    ``algo.advantage=proxmo`` under EMPO²)."""

    key: ClassVar[str] = "proxmo"

    psc: bool = True
    """Weight the episode advantage by the polarized signal controller, from the group's success rate (off: the
    ``proxmo-no-psc`` arm)."""
    psa: bool = True
    """Add the proximity-weighted step advantage ω·A^S (off: the ``proxmo-no-psa`` arm)."""
    alpha: float = bounded(4.0, 0, 100)
    """PSC: steepness α of σ((1 − p)^α) and σ(−p^α) (the official scripts: 4.0)."""
    range: float = bounded(0.05, 0, 0.99)
    """PSC: the episode weights lie in [1 − range, 1 + range] (the official scripts: 0.05)."""
    tau: float = bounded(0.1, 1e-6, 1e6)
    """PSA: softmax temperature τ over the TF-IDF cosine similarities of a group's steps (paper: 0.1)."""
    max_features: int = bounded(1024, 0, 10 ** 9)
    """PSA: TF-IDF keeps the global batch's this many most frequent terms (official code: 1024; 0 = all)."""
    gamma: float = bounded(0.95, 0, 1)
    """Discount of the step return G_t = r_t + γ·G_{t+1} (the paper: 0.95, as GiGPO's)."""
    step_advantage_weight: float = bounded(1.0, 0, 1e6)
    """ω in A = A^E + ω·A^S (the paper: 1.0, as GiGPO's)."""


TOKEN = re.compile(r"(?u)\b\w\w+\b")
"""scikit-learn's default ``token_pattern``: words of two or more word characters."""


# ---------------------------------------------------------------------------------------------- episode level (PSC)
def psc_weights(success: np.ndarray, p: float, alpha: float, target_range: float) -> np.ndarray:
    """PSC: success [n] bool, the group's success rate p ∈ [0, 1] -> w [n] float64.

    w⁺ = 1 + β(σ((1 − p)^α) − ½) for a success, w⁻ = 1 + β(σ(−p^α) − ½) for a failure, β = range / (σ(1) − ½).
    """
    beta = target_range / (_sigmoid(1.0) - 0.5)
    w_success = 1.0 + beta * (_sigmoid((1.0 - p) ** alpha) - 0.5)
    w_failure = 1.0 + beta * (_sigmoid(-(p ** alpha)) - 0.5)
    return np.where(np.asarray(success, dtype=bool), w_success, w_failure)


def _sigmoid(x: float) -> float:
    return 1.0 / (1.0 + math.exp(-x))


def episode_psc_advantage(inp: AdvantageInput) -> tuple[np.ndarray, dict[str, float]]:
    """A^E_i = w_i · (R_i − mean_group R) [N] float64 (w = 1 with ``algo.proxmo.psc`` off), and the episode metrics.

    The centring is GiGPO's ``mean_norm`` (:func:`group_normalise`): a group of one, or of equal returns, gets 0.
    """
    o = inp.algo.proxmo
    centred, metrics = group_normalise(inp.returns, inp.group_ids, scale_rewards=False, eps=inp.algo.adv_eps)  # [N]
    if not o.psc:
        return centred, metrics
    if inp.success is None:
        raise ValueError("ProxMO's signal controller needs each episode's success (AdvantageInput.success)")
    weights = np.ones(len(centred))  # [N]
    rates = []
    for g in np.unique(inp.group_ids):
        members = inp.group_ids == g
        p = float(np.mean(inp.success[members]))
        weights[members] = psc_weights(inp.success[members], p, o.alpha, o.range)
        rates.append(p)
    metrics["psc_success_rate_mean"] = float(np.mean(rates)) if rates else 0.0
    metrics["psc_weight_mean"] = float(weights.mean()) if weights.size else 1.0
    return weights * centred, metrics


# ---------------------------------------------------------------------------------------------- TF-IDF
@dataclass(frozen=True)
class TermCounts:
    """What the TF-IDF fit needs from a set of documents; counts from several ranks add up (:func:`merge_term_counts`)."""

    documents: int
    document_frequency: dict[str, int]
    """term -> number of documents holding it (df)."""
    term_frequency: dict[str, int]
    """term -> occurrences over all documents (ranks terms for ``max_features``)."""


def tokens(text: str) -> list[str]:
    return TOKEN.findall(text.lower())


def term_counts(texts: list[str]) -> TermCounts:
    df: Counter[str] = Counter()
    tf: Counter[str] = Counter()
    for text in texts:
        words = tokens(text)
        tf.update(words)
        df.update(set(words))
    return TermCounts(len(texts), dict(df), dict(tf))


def merge_term_counts(parts: list[TermCounts]) -> TermCounts:
    """The counts of the union of the parts' documents (integer sums: the same whatever the split)."""
    df: Counter[str] = Counter()
    tf: Counter[str] = Counter()
    for part in parts:
        df.update(part.document_frequency)
        tf.update(part.term_frequency)
    return TermCounts(sum(p.documents for p in parts), dict(df), dict(tf))


def idf_weights(counts: TermCounts, max_features: int) -> tuple[list[str], np.ndarray]:
    """The vocabulary (sorted) and idf_t = ln((1 + n) / (1 + df_t)) + 1 [V] float64 (smooth idf).

    ``max_features`` > 0 keeps the terms with the most occurrences in the batch; ties go to the alphabetically first
    (scikit-learn breaks them by an unstable argsort, so with ties its pick may differ).
    """
    terms = sorted(counts.term_frequency, key=lambda t: (-counts.term_frequency[t], t))
    if max_features > 0:
        terms = terms[:max_features]
    terms.sort()
    df = np.array([counts.document_frequency[t] for t in terms], dtype=np.float64)  # [V]
    return terms, np.log((1.0 + counts.documents) / (1.0 + df)) + 1.0


def tfidf_vectors(texts: list[str], terms: list[str], idf: np.ndarray) -> np.ndarray:
    """texts [M] -> [M, V] float64: raw term counts × idf, each row L2-normalised (a text with no known term: 0)."""
    column = {t: k for k, t in enumerate(terms)}
    out = np.zeros((len(texts), len(terms)), dtype=np.float64)  # [M, V]
    for i, text in enumerate(texts):
        for word in tokens(text):
            k = column.get(word)
            if k is not None:
                out[i, k] += 1.0
    out *= idf[None, :]
    norm = np.linalg.norm(out, axis=1, keepdims=True)  # [M, 1]
    return np.divide(out, norm, out=np.zeros_like(out), where=norm > 0)


# ---------------------------------------------------------------------------------------------- step level (PSA)
def soft_step_baseline(step_returns: np.ndarray, vectors: np.ndarray, step_group: np.ndarray,
                       tau: float) -> np.ndarray:
    """PSA: A^S_i = G_i − Σ_j w_ij G_j, w_ij = softmax_j(cos(v_i, v_j) / τ) over the steps j with i's episode group.

    step_returns [M] G, vectors [M, V] L2-normalised (cosine = dot product), step_group [M] episode group -> [M].
    Written as Σ_j w_ij (G_i − G_j) (the weights sum to 1), so a group of equal returns gets exactly 0; returns that
    agree up to :data:`EQUAL_RTOL` count as equal, as in GiGPO.
    """
    out = np.zeros(len(step_returns), dtype=np.float64)  # [M]
    for g in np.unique(step_group):
        idx = np.flatnonzero(step_group == g)  # [m]
        G = step_returns[idx]  # [m]
        if G.max() - G.min() <= EQUAL_RTOL * max(1.0, float(np.abs(G).max())):
            continue
        logits = vectors[idx] @ vectors[idx].T / tau  # [m, m]
        logits -= logits.max(axis=1, keepdims=True)  # exp stays finite for any τ > 0
        w = np.exp(logits)
        w /= w.sum(axis=1, keepdims=True)  # [m, m], rows sum to 1
        out[idx] = (w * (G[:, None] - G[None, :])).sum(axis=1)
    return out


def step_psa_advantage(inp: AdvantageInput) -> tuple[list[np.ndarray], dict[str, float]]:
    """A^S per step (N arrays [T_i] float64), with TF-IDF fitted over every rank's steps (``inp.gather``)."""
    o = inp.algo.proxmo
    lengths = [len(r) for r in inp.step_rewards]
    texts = [key for keys in inp.state_keys for key in keys]  # [M], one document per step
    counts = merge_term_counts(inp.gather(term_counts(texts)))  # every rank calls this, holding steps or not
    terms, idf = idf_weights(counts, o.max_features)
    step_returns = np.concatenate([discounted_step_returns(r, o.gamma) for r in inp.step_rewards] or [np.zeros(0)])
    step_group = np.repeat(inp.group_ids, lengths)  # [M]
    flat = soft_step_baseline(step_returns, tfidf_vectors(texts, terms, idf), step_group, o.tau)
    metrics = {"psa_vocabulary": float(len(terms)),
               "step_adv_abs_mean": float(np.abs(flat).mean()) if flat.size else 0.0}
    return np.split(flat, np.cumsum(lengths)[:-1]) if lengths else [], metrics


@register_advantage("proxmo")
def proxmo_advantages(inp: AdvantageInput) -> tuple[list[np.ndarray], dict[str, float]]:
    """A = A^E + ω·A^S per step (A^S left out with ``algo.proxmo.psa`` off). ``zero_adv_groups`` counts episode groups
    whose every step gets 0."""
    a_ep, metrics = episode_psc_advantage(inp)  # [N]
    lengths = [len(r) for r in inp.step_rewards]
    if inp.algo.proxmo.psa:
        a_step, step_metrics = step_psa_advantage(inp)
        metrics.update(step_metrics)
    else:
        a_step = [np.zeros(n) for n in lengths]
    w = inp.algo.proxmo.step_advantage_weight
    adv = [a_ep[i] + w * a_step[i] for i in range(len(a_ep))]
    silent: dict[int, bool] = {}
    for g, a in zip(inp.group_ids.tolist(), adv):
        silent[g] = silent.get(g, True) and not np.any(a != 0.0)
    metrics["zero_adv_groups"] = float(sum(silent.values()))
    metrics["adv_abs_mean"] = float(np.abs(np.concatenate(adv)).mean()) if adv and sum(lengths) else 0.0
    return adv, metrics


register_algorithm(AlgorithmSpec("proxmo", uses_memory=False, loss="grpo", advantage="proxmo",
                                 official=OFFICIAL, options=ProxmoOptions))  # arXiv 2602.19225
