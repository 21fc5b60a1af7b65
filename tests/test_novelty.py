"""Novelty reward: every visit of a batch counted with the counts before it (1/(n_before + n_batch)), order-free within a
batch (clustering of new states included), decaying across batches and checkpoints, namespaces, a float64 reference."""

from __future__ import annotations

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from empo2.algo.empo2 import novelty_reward
from empo2.memory.novelty import NoveltyReward


def reward(nov, embs, namespaces=None):
    """The reward the trainer gives each visit: r_int = 1/n of the store's visit counts."""
    return novelty_reward(nov.visits(embs, namespaces))


def unit(v):
    v = np.asarray(v, dtype=np.float64)
    return v / np.linalg.norm(v)


def reference(embs_calls, threshold):
    """Brute force in float64 loops: assign each visit to its most similar stored state, or else cluster the unmatched
    visits greedily in lexicographic order of their values; every visit then earns 1/(count after the whole call)."""
    store, counts, out = [], [], []
    for embs in embs_calls:
        xs = [unit(x) for x in embs]
        state = []
        for x in xs:
            sims = [float(np.dot(x, s)) for s in store]
            state.append(int(np.argmax(sims)) if sims and max(sims) >= threshold else None)
        first_new = len(store)
        for i in sorted((i for i, j in enumerate(state) if j is None), key=lambda i: tuple(xs[i])):
            sims = [float(np.dot(xs[i], s)) for s in store[first_new:]]
            if sims and max(sims) >= threshold:
                state[i] = first_new + int(np.argmax(sims))
            else:
                state[i] = len(store)
                store.append(xs[i])
                counts.append(0)
        for j in state:
            counts[j] += 1
        out.append([1.0 / counts[j] for j in state])
    return out, counts


def clustered_calls(seed, sizes, dim=16):
    rng = np.random.default_rng(seed)
    centres = rng.normal(size=(5, dim))
    return [(centres[rng.integers(0, 5, n)] + rng.normal(scale=0.3, size=(n, dim))).astype(np.float32) for n in sizes]


def test_repeats_decay_within_a_batch_and_across_batches():
    nov = NoveltyReward(threshold=0.9)
    e = np.eye(8, dtype=np.float32)
    assert reward(nov, np.stack([e[0]] * 4)).tolist() == [0.25] * 4  # four visits of one new state: 1/4 each
    assert reward(nov, e[[0]]).tolist() == pytest.approx([1 / 5])
    assert reward(nov, e[1:5]).tolist() == [1.0] * 4  # new distinct states, visited once
    assert reward(nov, e[[3, 0, 3]] * 7.0).tolist() == pytest.approx([1 / 3, 1 / 6, 1 / 3])  # scale is irrelevant
    # new states are stored in lexicographic order of their embeddings: e4, e3, e2, e1
    assert len(nov) == 5 and nov.counts().tolist() == [6, 1, 3, 1, 1]


def test_a_state_repeated_in_the_batch_earns_less_than_one_visited_once():
    """An episode looping in one new state against one that visits four new states, in the same batch."""
    e = np.eye(8, dtype=np.float32)
    loop, explore = e[[0, 0, 0, 0]], e[[1, 2, 3, 4]]
    r = reward(NoveltyReward(0.9), np.concatenate([loop, explore]))
    assert r[:4].tolist() == [0.25] * 4 and r[4:].tolist() == [1.0] * 4
    assert r[:4].mean() < r[4:].mean()


def test_threshold():
    nov = NoveltyReward(threshold=0.9)
    base = unit([1, 0, 0])
    near = unit([1, 0.3, 0])  # cos(base, near) ≈ 0.958
    far = unit([1, 1.0, 0])  # cos(base, far) ≈ 0.707, cos(near, far) ≈ 0.88
    assert reward(nov, np.stack([base, near, far])).tolist() == [0.5, 0.5, 1.0]  # base and near are one state
    assert len(nov) == 2 and sorted(nov.counts().tolist()) == [1, 2]
    assert reward(nov, np.stack([near])).tolist() == pytest.approx([1 / 3])


def test_new_state_clustering_does_not_depend_on_the_batch_order():
    """a ~ b and b ~ c but a !~ c: greedy clustering in arrival order makes {a, b}, {c} or {b, a, c} depending on who
    comes first. Here every order gives the same states, the same rewards and the same next batch."""
    a, b, c = unit([1, 0, 0]), unit([np.cos(0.4), np.sin(0.4), 0]), unit([np.cos(0.8), np.sin(0.8), 0])
    assert np.dot(a, b) >= 0.9 and np.dot(b, c) >= 0.9 and np.dot(a, c) < 0.9
    batch = np.stack([a, b, c]).astype(np.float32)
    results = []
    for perm in ([0, 1, 2], [1, 0, 2], [2, 1, 0], [1, 2, 0]):
        nov = NoveltyReward(0.9)
        r = np.empty(3)
        r[perm] = reward(nov, batch[perm])
        results.append((r.tolist(), reward(nov, batch).tolist(), nov.counts().tolist()))
    assert all(res == results[0] for res in results), results


@settings(max_examples=40)
@given(st.integers(0, 2**31 - 1), st.lists(st.integers(1, 30), min_size=1, max_size=3),
       st.sampled_from([0.5, 0.8, 0.9]), st.randoms(use_true_random=False))
def test_permuting_a_batch_changes_nothing(seed, sizes, threshold, rnd):
    """Rewards of the batch (per visit), the store it leaves and the rewards of the next batch are all the same when
    the batch's visits arrive in another order."""
    *history, batch, follow = clustered_calls(seed, sizes + [20, 20])
    perm = np.array(rnd.sample(range(len(batch)), len(batch)))
    runs = []
    for order in (np.arange(len(batch)), perm):
        nov = NoveltyReward(threshold)
        for call in history:
            reward(nov, call)
        r = np.empty(len(batch))
        r[order] = reward(nov, batch[order])
        runs.append((r, nov.counts(), reward(nov, follow)))
    for got, want in zip(runs[1], runs[0]):
        np.testing.assert_array_equal(got, want)


@settings(max_examples=40)
@given(st.integers(0, 2**31 - 1), st.lists(st.integers(1, 30), min_size=1, max_size=4),
       st.sampled_from([0.5, 0.8, 0.9]))
def test_matches_float64_reference(seed, sizes, threshold):
    calls = clustered_calls(seed, sizes)
    nov = NoveltyReward(threshold)
    got = [reward(nov, c).tolist() for c in calls]
    want, counts = reference([c.astype(np.float64) for c in calls], threshold)
    for g, w in zip(got, want):
        assert g == pytest.approx(w, rel=1e-12)
    assert nov.counts().tolist() == counts


def test_namespaces_are_separate():
    nov = NoveltyReward()
    e = np.eye(3, dtype=np.float32)
    reward(nov, e[[0, 0]], ["find-animal", "find-animal"])
    assert reward(nov, e[[0, 0]], ["find-animal", "find-plant"]).tolist() == pytest.approx([1 / 3, 1.0])
    assert nov.counts("find-animal").tolist() == [3] and nov.counts("find-plant").tolist() == [1]
    with pytest.raises(ValueError):
        reward(nov, e[[0]], ["a", "b"])


def test_decay_continues_across_batches_through_the_state_dict():
    e = np.eye(4, dtype=np.float32)
    a = NoveltyReward(0.9)
    assert reward(a, e[[0, 0, 1]]).tolist() == [0.5, 0.5, 1.0]
    b = NoveltyReward(0.5)
    b.load_state_dict({k: (v.copy() if isinstance(v, np.ndarray) else v) for k, v in a.state_dict().items()})
    assert b.threshold == 0.9
    assert reward(b, e[[0, 0, 1, 2]]).tolist() == [0.25, 0.25, 0.5, 1.0]
    assert reward(a, e[[0, 0, 1, 2]]).tolist() == [0.25, 0.25, 0.5, 1.0]


def test_state_dict_round_trip_continues_identically():
    rng = np.random.default_rng(0)
    x = rng.normal(size=(50, 8)).astype(np.float32)
    x[25:] = x[:25]  # the second half repeats the first
    a = NoveltyReward(0.9)
    reward(a, x[:30])
    b = NoveltyReward(0.5)
    b.load_state_dict({k: (v.copy() if isinstance(v, np.ndarray) else v) for k, v in a.state_dict().items()})
    np.testing.assert_array_equal(reward(a, x[30:]), reward(b, x[30:]))
    sd = b.state_dict()["namespaces"][""]
    assert sd["embeddings"].dtype == np.float32 and sd["counts"].dtype == np.int64
    np.testing.assert_allclose(np.linalg.norm(sd["embeddings"], axis=1), 1.0, rtol=1e-6)


def test_episodes_through_the_trainer_hook(embedder):
    """The trainer's path (real embedder, real Episode objects): identical trajectories of a group earn identical
    intrinsic returns, a looping one earns less than an exploring one, the values are the float64 reference's on the
    embedder's vectors, and shuffling the episodes changes nothing."""
    from empo2.episodes.episode import Episode, Step
    from empo2.train.intrinsic import novelty_rewards

    rooms = ["This room is called the kitchen. In it, you see: a fridge, a sink, a stove.",
             "This room is called the greenhouse. In it, you see: a flower pot, a bee hive, a shovel.",
             "This room is called the foundry. In it, you see: a blast furnace, a sink.",
             "This room is called the art studio. In it, you see: a large cupboard, a table, a wood cup."]
    trajectories = {"explore": rooms, "loop": [rooms[1]] * 4, "twin_a": rooms[:2], "twin_b": rooms[:2]}

    def episodes(names):
        # each step answers the state the previous one reached; the novelty reward is for the state reached
        return [Episode("find-plant", 0, 0, "on", member=i, final_state=trajectories[name][-1],
                        steps=[Step([1], [1], [2], [-0.5], "look around", "look around", obs, 0.0, before)
                               for before, obs in zip(["start", *trajectories[name]], trajectories[name])])
                for i, name in enumerate(names)]

    names = list(trajectories)
    returns = []
    for order in (names, names[::-1], [names[2], names[0], names[3], names[1]]):
        eps = episodes(order)
        given = [[s.intrinsic for s in ep.steps] for ep in eps]
        eps, old = novelty_rewards(NoveltyReward(0.9), embedder, eps), eps
        assert [[s.intrinsic for s in ep.steps] for ep in old] == given  # the given episodes are left as they were
        returns.append({name: [s.intrinsic for s in ep.steps] for name, ep in zip(order, eps)})
    assert returns[1] == returns[0] and returns[2] == returns[0]
    r = returns[0]
    assert r["twin_a"] == r["twin_b"]
    assert np.mean(r["loop"]) < np.mean(r["explore"])
    visits = [obs for name in names for obs in trajectories[name]]
    want, _ = reference([embedder.encode(visits).astype(np.float64)], 0.9)
    assert [x for name in names for x in r[name]] == pytest.approx(want[0], rel=1e-12)


def test_bad_input():
    nov = NoveltyReward()
    assert reward(nov, np.zeros((0, 4))).shape == (0,)
    reward(nov, np.eye(4))
    with pytest.raises(ValueError):
        reward(nov, np.eye(3))
    with pytest.raises(ValueError):
        reward(nov, np.zeros((1, 4)))
    with pytest.raises(ValueError):
        reward(nov, np.ones(4))
