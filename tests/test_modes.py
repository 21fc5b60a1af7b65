"""Mode sampler: frequencies, granularity, seeding and resumable state."""

from __future__ import annotations

import json
from collections import Counter

import pytest

from empo2.algo.empo2 import MODES
from empo2.algo.modes import ModeSampler
from empo2.config import Config

DEFAULT = {"on": 0.75, "on_tips": 0.08, "off_tips": 0.17}


def test_group_frequencies_match_probabilities():
    s = ModeSampler(DEFAULT, seed=1, granularity="group")
    draws = s.sample(40000)
    c = Counter(draws)
    for m in MODES:
        assert c[m] / 40000 == pytest.approx(DEFAULT[m], abs=0.01)


def test_batch_granularity_repeats_one_mode_per_batch():
    s = ModeSampler(DEFAULT, seed=2)
    batches = [s.sample(8) for _ in range(3000)]
    assert all(len(b) == 8 and len(set(b)) == 1 for b in batches)
    c = Counter(b[0] for b in batches)
    assert c["on"] / 3000 == pytest.approx(0.75, abs=0.03) and c["off_tips"] / 3000 == pytest.approx(0.17, abs=0.03)
    assert s.sample(0) == []


def test_group_granularity_mixes_modes_within_a_batch():
    s = ModeSampler({"on": 0.5, "off_tips": 0.5}, seed=3, granularity="group")
    assert any(len(set(s.sample(8))) > 1 for _ in range(10))


def test_zero_probability_never_drawn():
    s = ModeSampler({"on": 1.0, "on_tips": 0.0, "off_tips": 0.0}, seed=0, granularity="group")
    assert set(s.sample(5000)) == {"on"}
    s = ModeSampler({"off_tips": 1.0}, seed=0, granularity="group")
    assert set(s.sample(5000)) == {"off_tips"}


def test_seeded_and_resumable():
    a, b = ModeSampler(DEFAULT, seed=7, granularity="group"), ModeSampler(DEFAULT, seed=7, granularity="group")
    assert a.sample(50) == b.sample(50)
    assert ModeSampler(DEFAULT, seed=8, granularity="group").sample(50) != ModeSampler(DEFAULT, seed=7,
                                                                                      granularity="group").sample(50)
    run = ModeSampler(DEFAULT, seed=11)
    first = [run.sample(4) for _ in range(5)]
    state = json.loads(json.dumps(run.state_dict()))  # survives a JSON checkpoint
    rest = [run.sample(4) for _ in range(20)]
    resumed = ModeSampler(DEFAULT, seed=11)
    resumed.load_state_dict(state)
    assert [resumed.sample(4) for _ in range(20)] == rest
    fresh = ModeSampler(DEFAULT, seed=11)
    assert [fresh.sample(4) for _ in range(5)] == first


def test_algorithm_spec_modes_feed_the_sampler():
    cfg = Config()
    s = ModeSampler(cfg.algorithm.modes(cfg.algo), seed=cfg.train.seed)
    assert s.probs == pytest.approx(DEFAULT) and s.granularity == "batch" and s.seed == cfg.train.seed
    cfg = Config.load(None, ["algo.name=grpo"])
    assert set(ModeSampler(cfg.algorithm.modes(cfg.algo), seed=3).sample(100)) == {"on"}


def test_rejects_bad_input():
    with pytest.raises(ValueError):
        ModeSampler({"on": 0.5, "off_tips": 0.4}, seed=0)
    with pytest.raises(ValueError):
        ModeSampler({"on": 1.2, "off_tips": -0.2}, seed=0)
    with pytest.raises(ValueError):
        ModeSampler({"on": 1.0, "offline": 0.0}, seed=0)
    with pytest.raises(ValueError, match="algo.mode_granularity must be one of batch, group, got 'episode'"):
        Config.load(None, ["algo.mode_granularity=episode"])  # the granularity is checked once, at load
