"""The novelty (intrinsic) reward of a batch of episodes, computed over the whole batch even when it is split over
data-parallel ranks."""

from __future__ import annotations

import dataclasses

import numpy as np

from empo2.algo.returns import novelty_reward
from empo2.episodes.episode import Episode
from empo2.parallel.distributed import Dist, gather_in_order


def novelty_rewards(novelty, embedder, episodes: list[Episode], dist: Dist | None = None) -> list[Episode]:
    """``episodes`` again, as new episodes whose steps carry in ``Step.intrinsic`` the novelty reward of the state each
    step reached (the given episodes and steps are left as they were), within its task's namespace: 1/n
    (:func:`empo2.algo.empo2.novelty_reward`) with n = n_before + n_batch for a state visited n_before times before
    this batch and n_batch times in it, all of this batch's visits counted together (:mod:`empo2.memory.novelty`). A
    state an episode loops in earns less at every
    visit than one it sees once, and the rewards do not depend on the order of ``episodes``.

    An episode lost to a crashed environment worker (``failed``) is left as it is: the update leaves it out, and the
    states it reached before the crash (the last one unknown) are not counted.

    With a data-parallel ``dist`` the counts are taken over every rank's episodes in global order
    (:func:`~empo2.parallel.distributed.gather_in_order`), so they see the whole batch and stay identical on every rank.

    An expert member (LUFFY's gold path) is no visitor: the policy did not explore its states, so they are not
    counted and its steps earn no novelty reward.
    """
    # A crashed episode counts nothing; an expert member's states were not visited by the policy.
    reached = [[] if ep.failed or ep.expert else ep.reached_states() for ep in episodes]
    texts = [state for states in reached for state in states]
    # Each distinct text is embedded once, in sorted order: the same text then has bit-identical embeddings (a
    # sentence encoder's padding makes them differ in the last bits across batches) whatever the episodes' order.
    unique = sorted(set(texts))
    row_of = {text: i for i, text in enumerate(unique)}
    embs = (np.asarray(embedder.encode(unique))[[row_of[t] for t in texts]] if texts
            else np.zeros((0, embedder.dim), dtype=np.float32))  # [total steps, dim]
    bounds = np.cumsum([0] + [len(states) for states in reached])
    per_episode = [(ep.task, embs[a:b]) for ep, a, b in zip(episodes, bounds[:-1], bounds[1:])]  # [steps_i, dim]
    fn = _novelty_fn(novelty)
    rewards_per_episode = gather_in_order(dist, episodes, per_episode, fn) if dist is not None else fn(per_episode)
    rewards_per_episode = [np.zeros(len(ep.steps)) if ep.expert else r for ep, r in zip(episodes, rewards_per_episode)]
    return [ep if ep.failed else
            dataclasses.replace(ep, steps=[dataclasses.replace(s, intrinsic=float(r)) for s, r in zip(ep.steps, rewards)])
            for ep, rewards in zip(episodes, rewards_per_episode)]


def _novelty_fn(novelty):
    def fn(per_episode: list[tuple[str, np.ndarray]]) -> list[np.ndarray]:
        sizes = [len(e) for _, e in per_episode]
        if not sum(sizes):
            return [np.zeros(0) for _ in per_episode]
        tasks = [task for task, e in per_episode for _ in range(len(e))]
        visits = novelty.visits(np.concatenate([e for _, e in per_episode if len(e)]), tasks)
        flat = np.asarray(novelty_reward(visits), np.float64)
        bounds = np.cumsum([0] + sizes)
        return [flat[a:b] for a, b in zip(bounds[:-1], bounds[1:])]
    return fn
