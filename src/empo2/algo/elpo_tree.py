"""ELPO's rollout tree and its hierarchical advantages (Liang et al., 2026, arXiv 2602.09598 v1, §4.2), written as
the paper's equations; the loss, the search and the method's registration are :mod:`empo2.algo.elpo`.

The rollout tree of one task (the paper's G_x): each sampled trajectory is a path of step nodes from the implicit
root; a suffix sampled after step m of a trajectory shares that trajectory's first m nodes. Here a tree is given as
``paths`` (trajectory i = its node ids, step 1 first) with ``rewards`` [N] (the terminal reward of each trajectory).
Nodes are numbered 0..S−1; a node shared by several paths is one update row. :func:`tree_paths` builds the paths
from episodes that branched off each other.

- :func:`tree_rewards` (Eq. 6) — r(s) = R(s) at a leaf, else the mean of r over the DIRECT children.
- :func:`branch_advantages` (Eq. 7) — A_b(c) = (r(c) − μ_b)/(σ_b + ϵ) over the children of a branching node.
- :func:`trajectory_advantages` (Eq. 8) — A_t(τ_i) = (R_i − μ_t)/(σ_t + ϵ) over all N leaves of the tree.
- :func:`node_credit` (Eq. 9) — A_t(s) = mean of A_t over the trajectories through s.
- :func:`hierarchical_advantages` (Eq. 10) — A_hier = λ·A_b + (1 − λ)·A_t.
- :func:`tree_advantages` — Eq. 6–10 in order for one tree.

Where the text is silent, the worked tree of App. B (Figure 4) decides: σ is the POPULATION std (ddof 0) at both
levels; a child whose siblings all have the same r gets A_b = 0; a node with a single child passes its own A_b on to
that child (Eq. 7 defines A_b only where M > 1; Figure 4 prints the parent's value on every lone child).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np

LAMBDA_TREE = 0.5
"""λ_tree of Eq. 10 (Table 2, App. C)."""

EQUAL_RTOL = 1e-9
"""Values of one normalisation group that differ by at most this × max(1, |v|) count as equal: advantage exactly 0."""

ROOT = -1
"""The parent of a first step: the implicit root (the task prompt), which is not a row."""


def tree_parents(paths: Sequence[Sequence[int]]) -> np.ndarray:
    """parent [S] int64 of every node (``ROOT`` for a first step), from the trajectories' node paths.

    Raises ``ValueError`` when the paths do not form a tree: node ids not 0..S−1, a node with two parents, or a
    trajectory that ends inside another's path (every trajectory must end at its own leaf).
    """
    parent: dict[int, int] = {}
    for path in paths:
        if not len(path):
            raise ValueError("every trajectory needs at least one step")
        prev = ROOT
        for node in path:
            node = int(node)
            if parent.setdefault(node, prev) != prev:
                raise ValueError(f"node {node} has two parents ({parent[node]} and {prev})")
            prev = node
    if sorted(parent) != list(range(len(parent))):
        raise ValueError("node ids must be 0..S-1")
    out = np.array([parent[s] for s in range(len(parent))], dtype=np.int64)  # [S]
    inner = set(out.tolist())
    ends = [int(p[-1]) for p in paths]
    if any(e in inner for e in ends) or len(set(ends)) != len(ends):
        raise ValueError("every trajectory must end at a leaf of its own")
    return out


def _children(parent: np.ndarray) -> list[list[int]]:
    kids: list[list[int]] = [[] for _ in range(len(parent))]
    for s, p in enumerate(parent.tolist()):
        if p != ROOT:
            kids[p].append(s)
    return kids


def _depth_order(parent: np.ndarray) -> list[int]:
    """Nodes ordered so that every parent comes before its children."""
    depth = np.zeros(len(parent), dtype=np.int64)
    for s in range(len(parent)):
        d, p = 0, s
        while parent[p] != ROOT:
            p, d = int(parent[p]), d + 1
        depth[s] = d
    return np.argsort(depth, kind="stable").tolist()


def _normalise(values: np.ndarray, eps: float) -> np.ndarray:
    """(v − mean)/(population std + ϵ); exactly 0 when all values agree up to :data:`EQUAL_RTOL`."""
    v = np.asarray(values, dtype=np.float64)
    spread = float(v.max() - v.min()) if v.size else 0.0
    if spread <= EQUAL_RTOL * max(1.0, float(np.abs(v).max(initial=0.0))):
        return np.zeros_like(v)
    return (v - v.mean()) / (v.std(ddof=0) + eps)


def tree_rewards(paths: Sequence[Sequence[int]], rewards: Sequence[float]) -> np.ndarray:
    """Eq. 6: r [S] float64; r(s) = R(s) at a leaf, else the mean of r over the direct children of s (not over the
    leaves below s: children −1.1, 1, 1 give 0.3, where the six leaves below would give −0.4)."""
    parent = tree_parents(paths)
    kids = _children(parent)
    r = np.full(len(parent), np.nan)
    for path, reward in zip(paths, rewards):
        r[int(path[-1])] = float(reward)
    for s in reversed(_depth_order(parent)):  # children before parents
        if kids[s]:
            r[s] = float(np.mean(r[kids[s]]))
    return r


def branch_advantages(paths: Sequence[Sequence[int]], r: np.ndarray, eps: float = 1e-6) -> np.ndarray:
    """Eq. 7: A_b [S] float64. The children of a branching node (the root included) are normalised among themselves
    (population std); the single child of a non-branching node carries its parent's A_b (App. B)."""
    parent = tree_parents(paths)
    kids = _children(parent)
    first = [s for s in range(len(parent)) if parent[s] == ROOT]
    a_b = np.zeros(len(parent))
    if len(first) > 1:  # the root branches: its children are the first steps
        a_b[first] = _normalise(r[first], eps)
    for s in _depth_order(parent):  # parents first, so a lone child finds its parent's value set
        if len(kids[s]) > 1:
            a_b[kids[s]] = _normalise(r[kids[s]], eps)
        elif kids[s]:
            a_b[kids[s][0]] = a_b[s]
    return a_b


def trajectory_advantages(rewards: Sequence[float], eps: float = 1e-6) -> np.ndarray:
    """Eq. 8: A_t [N] float64, each trajectory's reward normalised over all N leaves (population std)."""
    return _normalise(np.asarray(rewards, dtype=np.float64), eps)


def node_credit(paths: Sequence[Sequence[int]], a_traj: np.ndarray) -> np.ndarray:
    """Eq. 9: A_t [S] float64 per node, the mean of A_t(τ) over the trajectories τ whose path holds the node."""
    n_nodes = len(tree_parents(paths))
    total, count = np.zeros(n_nodes), np.zeros(n_nodes)
    for path, a in zip(paths, a_traj):
        total[list(path)] += float(a)
        count[list(path)] += 1
    return total / count


def hierarchical_advantages(a_branch: np.ndarray, a_node: np.ndarray, lam: float = LAMBDA_TREE) -> np.ndarray:
    """Eq. 10: A_hier = λ·A_b + (1 − λ)·A_t, per node."""
    return lam * np.asarray(a_branch, dtype=np.float64) + (1.0 - lam) * np.asarray(a_node, dtype=np.float64)


@dataclass
class TreeAdvantages:
    """Every per-node quantity of §4.2 for one tree (arrays [S] float64; ``trajectory`` is [N])."""

    reward: np.ndarray
    branch: np.ndarray
    trajectory: np.ndarray
    node: np.ndarray
    hier: np.ndarray


def tree_advantages(paths: Sequence[Sequence[int]], rewards: Sequence[float], lam: float = LAMBDA_TREE,
                    eps: float = 1e-6) -> TreeAdvantages:
    """Eq. 6–10 in order for one tree."""
    r = tree_rewards(paths, rewards)
    a_b = branch_advantages(paths, r, eps)
    a_t = trajectory_advantages(rewards, eps)
    a_node = node_credit(paths, a_t)
    return TreeAdvantages(r, a_b, a_t, a_node, hierarchical_advantages(a_b, a_node, lam))


def tree_paths(parents: Sequence[tuple[int, int] | None], lengths: Sequence[int]) -> list[list[int]]:
    """Node paths of one tree from its episodes: ``parents[i]`` = (j, m) when episode i branched after step m of
    episode j (j < i; it holds only its own ``lengths[i]`` steps), ``None`` for a full trajectory."""
    paths: list[list[int]] = []
    next_node = 0
    for parent, n in zip(parents, lengths):
        prefix = [] if parent is None else paths[parent[0]][: parent[1]]
        paths.append(prefix + list(range(next_node, next_node + n)))
        next_node += n
    return paths
