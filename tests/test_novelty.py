"""Novelty reward: 1, 1/2, 1/3 … across batches, order-independent within a batch, namespaces, a naive reference."""

from __future__ import annotations

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from empo2.memory.novelty import NoveltyReward


def unit(v):
    v = np.asarray(v, dtype=np.float64)
    return v / np.linalg.norm(v)


def naive(embs_calls, threshold):
    """Reference: each call scored against the store before the call (float64 loops), then the store updated."""
    store, counts, out = [], [], []
    for embs in embs_calls:
        xs = [unit(x) for x in embs]
        matches = []
        for x in xs:
            sims = [float(np.dot(x, s)) for s in store]
            matches.append(int(np.argmax(sims)) if sims and max(sims) >= threshold else -1)
        out.append([1.0 / (counts[j] + 1) if j >= 0 else 1.0 for j in matches])
        first_new = len(store)
        for x, j in zip(xs, matches):
            if j >= 0:
                counts[j] += 1
                continue
            sims = [float(np.dot(x, s)) for s in store[first_new:]]
            if sims and max(sims) >= threshold:
                counts[first_new + int(np.argmax(sims))] += 1
            else:
                store.append(x)
                counts.append(1)
    return out, counts


def test_repeats_decay_as_one_over_n_across_batches_and_not_within():
    nov = NoveltyReward(threshold=0.9)
    e = np.eye(8, dtype=np.float32)
    assert nov.reward(np.stack([e[0]] * 4)).tolist() == [1.0] * 4  # all four scored against the empty store
    assert nov.reward(e[[0]]).tolist() == pytest.approx([1 / 5])
    assert nov.reward(e[1:5]).tolist() == [1.0] * 4  # new distinct states
    assert nov.reward(e[[3, 0, 3]] * 7.0).tolist() == pytest.approx([1 / 2, 1 / 6, 1 / 2])  # scale is irrelevant
    assert len(nov) == 5 and nov.counts().tolist() == [6, 1, 1, 3, 1]


def test_threshold():
    nov = NoveltyReward(threshold=0.9)
    base = unit([1, 0, 0])
    near = unit([1, 0.3, 0])  # cos ≈ 0.958
    far = unit([1, 1.0, 0])  # cos ≈ 0.707
    assert nov.reward(np.stack([base, near, far])).tolist() == [1.0, 1.0, 1.0]
    assert len(nov) == 2 and nov.counts().tolist() == [2, 1]  # base and near share one new state
    assert nov.reward(np.stack([near])).tolist() == pytest.approx([1 / 3])


def test_order_of_a_batch_does_not_matter():
    """Regression: counting episode after episode gave identical trajectories 1, 1/2, 1/3, 1/4."""
    e = np.eye(4, dtype=np.float32)
    a, b = NoveltyReward(), NoveltyReward()
    a.reward(e[[0, 0, 1]])
    b.reward(e[[1, 0, 0]])
    batch = e[[0, 1, 0, 1, 1, 2]]
    perm = np.array([5, 3, 0, 4, 2, 1])
    ra, rb = a.reward(batch), b.reward(batch[perm])
    np.testing.assert_array_equal(ra[perm], rb)
    assert ra.tolist() == pytest.approx([1 / 3, 1 / 2, 1 / 3, 1 / 2, 1 / 2, 1.0])


def test_namespaces_are_separate():
    nov = NoveltyReward()
    e = np.eye(3, dtype=np.float32)
    nov.reward(e[[0, 0]], ["find-animal", "find-animal"])
    assert nov.reward(e[[0, 0]], ["find-animal", "find-plant"]).tolist() == pytest.approx([1 / 3, 1.0])
    assert nov.counts("find-animal").tolist() == [3] and nov.counts("find-plant").tolist() == [1]
    with pytest.raises(ValueError):
        nov.reward(e[[0]], ["a", "b"])


@settings(max_examples=40, deadline=None)
@given(st.integers(0, 2**31 - 1), st.lists(st.integers(1, 30), min_size=1, max_size=4),
       st.sampled_from([0.5, 0.8, 0.9]))
def test_matches_naive_reference(seed, sizes, threshold):
    rng = np.random.default_rng(seed)
    centres = rng.normal(size=(5, 16))
    calls = [centres[rng.integers(0, 5, n)] + rng.normal(scale=0.3, size=(n, 16)) for n in sizes]
    nov = NoveltyReward(threshold)
    got = [nov.reward(c.astype(np.float32)).tolist() for c in calls]
    want, counts = naive(calls, threshold)
    for g, w in zip(got, want):
        assert g == pytest.approx(w)
    assert nov.counts().tolist() == counts


def test_state_dict_round_trip_continues_identically():
    rng = np.random.default_rng(0)
    x = rng.normal(size=(50, 8)).astype(np.float32)
    x[25:] = x[:25]  # the second half repeats the first
    a = NoveltyReward(0.9)
    a.reward(x[:30])
    b = NoveltyReward(0.5)
    b.load_state_dict({k: (v.copy() if isinstance(v, np.ndarray) else v) for k, v in a.state_dict().items()})
    assert b.threshold == 0.9
    np.testing.assert_array_equal(a.reward(x[30:]), b.reward(x[30:]))
    sd = b.state_dict()["namespaces"][""]
    assert sd["embeddings"].dtype == np.float32 and sd["counts"].dtype == np.int64
    np.testing.assert_allclose(np.linalg.norm(sd["embeddings"], axis=1), 1.0, rtol=1e-6)


def test_bad_input():
    nov = NoveltyReward()
    assert nov.reward(np.zeros((0, 4))).shape == (0,)
    nov.reward(np.eye(4))
    with pytest.raises(ValueError):
        nov.reward(np.eye(3))
    with pytest.raises(ValueError):
        nov.reward(np.zeros((1, 4)))
    with pytest.raises(ValueError):
        nov.reward(np.ones(4))
