"""ProxMO advantages against float64 references written here with plain Python (dicts, ``math``), and properties.

The reference: PSC weights w⁺ = 1 + β(σ((1 − p)^α) − ½) for an episode that reached the goal, w⁻ = 1 + β(σ(−p^α) − ½)
for one that did not, β = range / (σ(1) − ½), p = the group's fraction of successful episodes; A^E = w·(R − mean R).
PSA: TF-IDF over every step of the batch (lowercase words of ≥ 2 word characters, raw counts, smooth idf
ln((1 + n) / (1 + df)) + 1, L2 rows), w_ij = softmax_j(cos_ij / τ) over the steps of i's episode group (i included),
A^S_i = G_i − Σ_j w_ij G_j with G_t = Σ_{k≥t} γ^{k−t} r_k. A = A^E + ω·A^S.
"""

from __future__ import annotations

import math
import os
import re
import subprocess
import sys
from collections import Counter
from pathlib import Path

import numpy as np
import pytest

from empo2.algo.advantages import AdvantageInput, compute_advantages
from empo2.algo.proxmo import (
    ProxmoOptions,
    episode_psc_advantage,
    idf_weights,
    step_psa_advantage,
    term_counts,
    tfidf_vectors,
)
from empo2.config import Config, ConfigError, algo_config

ROOMS = ["You are in the kitchen. A fridge is here.", "You are in the hallway. A door leads north.",
         "A garden with an open gate.", "You are in the kitchen. A fridge is here, and an oven.",
         "Search results: red shoes, blue shoes; page 1"]


# ---------------------------------------------------------------------------------------------- references
def _sigmoid(x):
    return 1.0 / (1.0 + math.exp(-x))


def ref_psc_weight(success, p, alpha=4.0, target=0.05):
    beta = target / (_sigmoid(1.0) - 0.5)
    return 1.0 + beta * (_sigmoid((1.0 - p) ** alpha) - 0.5) if success else 1.0 + beta * (_sigmoid(-p ** alpha) - 0.5)


def ref_episode(returns, groups, success, psc=True, alpha=4.0, target=0.05):
    out = [0.0] * len(returns)
    for g in set(groups):
        members = [i for i in range(len(returns)) if groups[i] == g]
        vals = [returns[i] for i in members]
        if max(vals) == min(vals):
            continue
        mean = math.fsum(vals) / len(vals)
        p = sum(success[i] for i in members) / len(members)
        for i in members:
            out[i] = (ref_psc_weight(success[i], p, alpha, target) if psc else 1.0) * (returns[i] - mean)
    return out


def ref_tfidf(texts, max_features=0):
    """Each text as a {term: weight} dict, L2-normalised."""
    docs = [Counter(re.findall(r"\b\w\w+\b", t.lower())) for t in texts]
    df, tf = Counter(), Counter()
    for d in docs:
        df.update(d.keys())
        tf.update(d)
    keep = sorted(tf, key=lambda t: (-tf[t], t))[:max_features or None]
    idf = {t: math.log((1 + len(texts)) / (1 + df[t])) + 1 for t in keep}
    out = []
    for d in docs:
        v = {t: c * idf[t] for t, c in d.items() if t in idf}
        norm = math.sqrt(math.fsum(x * x for x in v.values()))
        out.append({t: x / norm for t, x in v.items()} if norm else {})
    return out


def ref_cos(a, b):
    return math.fsum(x * b.get(t, 0.0) for t, x in a.items())


def ref_step(groups, rewards, keys, gamma=0.95, tau=0.1, max_features=1024):
    flat = [(i, t) for i in range(len(rewards)) for t in range(len(rewards[i]))]
    vec = dict(zip(flat, ref_tfidf([keys[i][t] for i, t in flat], max_features)))
    G = {(i, t): math.fsum(gamma ** (k - t) * rewards[i][k] for k in range(t, len(rewards[i]))) for i, t in flat}
    out = [[0.0] * len(r) for r in rewards]
    for i, t in flat:
        mates = [(j, s) for j, s in flat if groups[j] == groups[i]]
        if max(G[m] for m in mates) == min(G[m] for m in mates):
            continue
        logits = [ref_cos(vec[(i, t)], vec[m]) / tau for m in mates]
        top = max(logits)
        e = [math.exp(x - top) for x in logits]
        out[i][t] = G[(i, t)] - math.fsum(w * G[m] for w, m in zip(e, mates)) / math.fsum(e)
    return out


def _batch(rng, n_groups=3, size=4, texts=ROOMS):
    """Groups of ``size`` episodes with ScienceWorld-like returns (partial scores are not successes)."""
    groups, rewards, keys, success = [], [], [], []
    for g in range(n_groups):
        for _ in range(size):
            length = int(rng.integers(1, 6))
            r = rng.choice([0.0, 0.0, 8.0, 25.0], size=length)
            won = bool(rng.random() < 0.4)
            if won:
                r[-1] = 100.0 - r[:-1].sum()
            groups.append(g)
            rewards.append(r)
            keys.append([texts[int(k)] for k in rng.integers(len(texts), size=length)])
            success.append(won)
    returns = np.array([r.sum() for r in rewards])
    return returns, np.array(groups), rewards, keys, np.array(success)


def proxmo_algo(**proxmo):
    """An ``algo`` section with ProxMO's options ``algo.proxmo`` (``tau=0.1`` …)."""
    return algo_config(proxmo=ProxmoOptions(**proxmo))


def _run(returns, groups, rewards, keys, success, gather=None, **options):
    inp = AdvantageInput(returns, groups, rewards, keys, proxmo_algo(**options), success)
    if gather is not None:
        inp.gather = gather
    return compute_advantages("proxmo", inp)


def _close(adv, ref, tol=1e-10):
    assert [len(a) for a in adv] == [len(r) for r in ref]
    for a, r in zip(adv, ref):
        np.testing.assert_allclose(a, r, rtol=tol, atol=tol)


# ---------------------------------------------------------------------------------------------- PSC
@pytest.mark.parametrize("k", [0, 1, 4, 7, 8])
def test_psc_weights_at_success_rates(k):
    """Eight episodes, k of them successes (p = k/8): A^E = w·(R − mean R). Failures carry partial scores, so p is
    the success fraction, not a clamped mean of returns (which would be 1 here)."""
    success = [i < k for i in range(8)]
    returns = [100.0 if s else 10.0 * i for i, s in enumerate(success)]
    groups = [0] * 8
    rewards = [np.array([r]) for r in returns]
    keys = [["same state"]] * 8
    adv, metrics = _run(np.array(returns), np.array(groups), rewards, keys, np.array(success), psa=False)
    _close(adv, [[a] for a in ref_episode(returns, groups, success)], tol=1e-12)
    p = k / 8
    if 0 < k < 8:  # worked values at the range's ends and middle
        beta = 0.05 / (_sigmoid(1.0) - 0.5)
        assert ref_psc_weight(True, p) == pytest.approx(1 + beta * (_sigmoid((1 - p) ** 4) - 0.5), rel=1e-15)
    assert ref_psc_weight(True, 0.0) == pytest.approx(1.05, rel=1e-15)  # the rarest success: +5 %
    assert ref_psc_weight(False, 1.0) == pytest.approx(0.95, rel=1e-15)  # the rarest failure: −5 %
    assert ref_psc_weight(True, 1.0) == ref_psc_weight(False, 0.0) == 1.0
    assert metrics["psc_success_rate_mean"] == p


def test_psc_off_is_mean_centring_and_equal_groups_give_zero():
    returns, groups, rewards, keys, success = _batch(np.random.default_rng(1))
    adv, _ = _run(returns, groups, rewards, keys, success, psc=False, psa=False)
    ref = ref_episode(returns.tolist(), groups.tolist(), success.tolist(), psc=False)
    _close(adv, [[a] * len(r) for a, r in zip(ref, rewards)])
    same = [np.array([0.0, 0.0, 5.0]), np.array([5.0]), np.array([0.0, 5.0])]  # also every G_t = 5 (γ = 1)
    adv, m = _run(np.array([5.0] * 3), np.zeros(3, int), same, [["kitchen", "garden", "hall"], ["hall"],
                  ["garden", "kitchen"]], np.array([1, 0, 0], bool), gamma=1.0)
    assert all(np.all(a == 0.0) for a in adv) and m["zero_adv_groups"] == 1.0


def test_psc_needs_success():
    with pytest.raises(ValueError, match="success"):
        _run(np.array([1.0, 0.0]), np.zeros(2, int), [np.ones(1), np.zeros(1)], [["a"], ["b"]], None)


# ---------------------------------------------------------------------------------------------- PSA
def test_tfidf_and_psa_by_hand():
    """Three one-step episodes. Tokens: "A red door" → red, door ("a" is one character); "the BLUE door" → the, blue,
    door; "red red key!" → red ×2, key. n = 3, df(red) = df(door) = 2, others 1, so idf a = ln(4/3) + 1 for red and
    door, b = ln 2 + 1 for the, blue, key. Cosines: c01 = a² / (a√2 · √(2b² + a²)), c02 = 2a² / (a√2 · √(4a² + b²)),
    c12 = 0."""
    texts = ["A red door", "the BLUE door", "red red key!"]
    a, b = math.log(4 / 3) + 1, math.log(2) + 1
    c01 = a / (math.sqrt(2) * math.sqrt(2 * b * b + a * a))
    c02 = 2 * a / (math.sqrt(2) * math.sqrt(4 * a * a + b * b))
    cos = [[1.0, c01, c02], [c01, 1.0, 0.0], [c02, 0.0, 1.0]]
    terms, idf = idf_weights(term_counts(texts), 1024)
    assert terms == ["blue", "door", "key", "red", "the"]
    np.testing.assert_allclose(idf, [b, a, b, a, b], rtol=1e-15)
    v = tfidf_vectors(texts, terms, idf)
    np.testing.assert_allclose(v @ v.T, cos, rtol=1e-14, atol=1e-15)

    G, tau = [1.0, 0.0, 0.5], 0.1
    step = []
    for i in range(3):
        e = [math.exp(cos[i][j] / tau) for j in range(3)]
        step.append(G[i] - sum(ej * gj for ej, gj in zip(e, G)) / sum(e))
    inp = AdvantageInput(np.array(G), np.zeros(3, int), [np.array([g]) for g in G], [[t] for t in texts],
                         proxmo_algo(tau=tau), np.array([True, False, False]))
    got, _ = step_psa_advantage(inp)
    np.testing.assert_allclose(np.concatenate(got), step, rtol=1e-13)
    _close(got, ref_step([0] * 3, [[g] for g in G], [[t] for t in texts]), tol=1e-13)


@pytest.mark.parametrize("seed", range(4))
def test_proxmo_matches_reference(seed):
    """Multi-step episodes, several groups, γ = 0.95, τ = 0.1, ω = 0.7: A = A^E + ω·A^S against the reference."""
    returns, groups, rewards, keys, success = _batch(np.random.default_rng(seed))
    adv, _ = _run(returns, groups, rewards, keys, success, step_advantage_weight=0.7)
    ep = ref_episode(returns.tolist(), groups.tolist(), success.tolist())
    st = ref_step(groups.tolist(), [r.tolist() for r in rewards], keys)
    _close(adv, [[ep[i] + 0.7 * s for s in st[i]] for i in range(len(ep))])
    a_ep, _ = episode_psc_advantage(AdvantageInput(returns, groups, rewards, keys, algo_config(), success))
    a_st, _ = step_psa_advantage(AdvantageInput(returns, groups, rewards, keys, algo_config(), success))
    _close(adv, [a_ep[i] + 0.7 * a_st[i] for i in range(len(a_ep))], tol=1e-14)  # A = A^E + ω·A^S
    only_ep, _ = _run(returns, groups, rewards, keys, success, psa=False)
    _close(only_ep, [[e] * len(r) for e, r in zip(ep, rewards)])


def test_max_features_keeps_the_most_frequent_terms():
    texts = ["alpha alpha alpha beta", "beta gamma", "delta delta alpha", "gamma"]  # counts 4, 2, 2, 2: no tie at 1
    terms, _ = idf_weights(term_counts(texts), 1)
    assert terms == ["alpha"]
    terms, _ = idf_weights(term_counts(texts), 3)  # a tie at the cut goes to the alphabetically first
    assert terms == ["alpha", "beta", "delta"]
    groups, rewards = [0, 0, 0, 0], [[1.0], [0.0], [0.5], [0.25]]
    adv, _ = _run(np.array([1.0, 0.0, 0.5, 0.25]), np.array(groups), [np.array(r) for r in rewards],
                  [[t] for t in texts], np.zeros(4, bool), psc=False, max_features=2)
    ep = ref_episode([1.0, 0.0, 0.5, 0.25], groups, [False] * 4, psc=False)
    st = ref_step(groups, rewards, [[t] for t in texts], max_features=2)
    _close(adv, [[e + s[0]] for e, s in zip(ep, st)], tol=1e-13)


def test_tfidf_as_scikit_learn():
    """An independent check of the conventions where scikit-learn happens to be installed (not a dependency)."""
    text = pytest.importorskip("sklearn.feature_extraction.text")
    rng = np.random.default_rng(5)
    words = ["Kitchen", "door", "a", "fridge", "open", "closed", "red", "shoes", "size_9", "über", "1", "42"]
    texts = [" ".join(rng.choice(words, size=int(rng.integers(0, 9)))) + "." for _ in range(40)]
    texts[3] = "a 1 ."  # no token of two characters: a zero row
    want = text.TfidfVectorizer().fit_transform(texts).toarray()
    terms, idf = idf_weights(term_counts(texts), 0)
    got = tfidf_vectors(texts, terms, idf)
    np.testing.assert_allclose(got @ got.T, want @ want.T, rtol=1e-12, atol=1e-14)


def test_tau_to_zero_is_gigpo_mean_norm_on_exact_duplicates():
    """τ → 0: the softmax keeps only the steps with cosine 1 (the same text), i.e. GiGPO's exact anchor groups with
    ``mean_norm`` (self included) at both levels (PSC off)."""
    for seed in range(3):
        returns, groups, rewards, keys, success = _batch(np.random.default_rng(10 + seed), texts=ROOMS[:3])
        adv, _ = _run(returns, groups, rewards, keys, success, psc=False, tau=1e-4)
        gigpo, _ = compute_advantages("gigpo", AdvantageInput(returns, groups, rewards, keys,
                                                              algo_config()))  # GiGPO's default: mean_norm
        _close(adv, gigpo, tol=1e-9)


@pytest.mark.parametrize("seed", range(3))
def test_order_of_a_group_does_not_matter(seed):
    """Permuting the episodes (within and across groups) permutes the advantages, nothing else."""
    rng = np.random.default_rng(seed)
    returns, groups, rewards, keys, success = _batch(rng, n_groups=2, size=6)
    adv, _ = _run(returns, groups, rewards, keys, success, max_features=8)
    for _ in range(4):
        perm = rng.permutation(len(returns))
        adv_p, _ = _run(returns[perm], groups[perm], [rewards[i] for i in perm], [keys[i] for i in perm],
                        success[perm], max_features=8)
        _close(adv_p, [adv[i] for i in perm], tol=1e-12)


def test_groups_do_not_see_each_other_and_self_is_included():
    """A state alone in its group (no similar step) gets b ≈ G (self weight e^{1/τ} dominates): A^S ≈ 0. A step of
    another group with the very same text does not enter the baseline."""
    keys = [["kitchen fridge"], ["garden gate"], ["kitchen fridge"]]
    inp = AdvantageInput(np.array([1.0, 0.0, 7.0]), np.array([0, 0, 1]), [np.array([1.0]), np.array([0.0]),
                         np.array([7.0])], keys, algo_config(), np.array([True, False, False]))
    a_st, _ = step_psa_advantage(inp)
    e = math.exp(-1 / 0.1)  # cosine 0 against cosine 1, over τ
    np.testing.assert_allclose(np.concatenate(a_st), [1.0 - 1.0 / (1 + e), 0.0 - 1.0 * e / (1 + e), 0.0],
                               rtol=1e-13, atol=1e-15)


# ---------------------------------------------------------------------------------------------- the global batch
def test_two_ranks_fit_tfidf_on_the_whole_batch():
    """Rank r holds groups r, r + 2, …; each gathers the other's term counts, so its advantages equal the one-rank
    run's for its groups. Without the gather (each rank fitting its own steps) they differ."""
    returns, groups, rewards, keys, success = _batch(np.random.default_rng(7), n_groups=4)
    whole, _ = _run(returns, groups, rewards, keys, success)
    ranks = [np.flatnonzero(groups % 2 == r) for r in (0, 1)]
    counts = [term_counts([k for i in idx for k in keys[i]]) for idx in ranks]
    for r, idx in enumerate(ranks):
        part = (returns[idx], groups[idx], [rewards[i] for i in idx], [keys[i] for i in idx], success[idx])

        def gather(mine, r=r):
            assert mine == counts[r]
            return [mine if q == r else counts[q] for q in (0, 1)]

        got, _ = _run(*part, gather=gather)
        _close(got, [whole[i] for i in idx], tol=1e-13)
        alone, _ = _run(*part)
        assert not np.allclose(np.concatenate(alone), np.concatenate([whole[i] for i in idx]))


@pytest.mark.slow
def test_two_gloo_ranks_match_one_rank(tmp_path):
    """The same through real gloo collectives (``Dist.all_gather``) under torchrun with 2 ranks."""
    worker = Path(__file__).parent / "helpers" / "proxmo_rank_worker.py"
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": str(Path("src").resolve())}
    subprocess.run([sys.executable, str(worker), str(tmp_path / "one.json")], env=env, check=True, timeout=300)
    subprocess.run([sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node=2", str(worker),
                    str(tmp_path / "two.json")], env=env, check=True, timeout=300, capture_output=True)
    import json

    one = json.loads((tmp_path / "one.json").read_text())
    two = {**json.loads((tmp_path / "two.json.0").read_text()), **json.loads((tmp_path / "two.json.1").read_text())}
    assert sorted(two) == sorted(one) and all(np.allclose(two[k], one[k], rtol=0, atol=1e-13) for k in one)


# ---------------------------------------------------------------------------------------------- config and arms
def test_config_defaults_bounds_and_one_line_errors(tmp_path, capsys):
    a = Config.load(None, ["algo.name=proxmo"]).algo
    o = a.proxmo
    assert (o.psc, o.psa, o.alpha, o.range, o.tau, o.max_features, o.gamma, o.step_advantage_weight) == \
        (True, True, 4.0, 0.05, 0.1, 1024, 0.95, 1.0)
    for bad in ("algo.proxmo.tau=0", "algo.proxmo.range=1", "algo.proxmo.alpha=-1", "algo.proxmo.max_features=-1"):
        with pytest.raises(ConfigError, match=bad.split("=")[0]):
            Config.load(None, ["algo.name=proxmo", bad])
    from empo2.cli import main

    out = tmp_path / "run"
    assert main(["train", "--config", "configs/webshop_cpu.yaml", "--output-dir", str(out), "algo.name=proxmo",
                 "algo.proxmo.tau=0"]) == 2
    err = capsys.readouterr().err.strip()
    assert "algo.proxmo.tau" in err and len(err.splitlines()) == 1 and not out.exists()


def test_arms_run_their_settings_and_report_labels_them(tmp_path):
    from empo2.experiments.compare_plan import plan_runs
    from empo2.experiments.report import method_label

    names = ["proxmo", "proxmo-no-psc", "proxmo-no-psa", "empo2+proxmo", "gigpo"]
    off = tmp_path / "off.yaml"  # a config file's switches do not reach a plain name's run
    Config.load("configs/webshop_cpu.yaml", ["algo.proxmo.psc=false", "algo.proxmo.psa=false"]).save(off)
    plans = plan_runs(str(off), names, [1], tmp_path, [])
    got = [(p.cfg.algo.name, p.cfg.algorithm.estimator(p.cfg.algo), p.cfg.algo.proxmo.psc, p.cfg.algo.proxmo.psa)
           for p in plans]
    assert got == [("proxmo", "proxmo", True, True), ("proxmo", "proxmo", False, True),
                   ("proxmo", "proxmo", True, False), ("empo2", "proxmo", True, True), ("gigpo", "gigpo", True, True)]
    assert [method_label(p.cfg.to_dict()) for p in plans] == names
    assert method_label(Config.load(None, ["algo.name=proxmo", "algo.proxmo.psa=false"])) == "proxmo-no-psa"
    for switch in ("algo.proxmo.psc=false", "algo.proxmo_psc=false"):  # its old name is the same setting
        with pytest.raises(ConfigError, match="set by compare"):
            plan_runs(str(off), ["proxmo"], [1], tmp_path, [switch])
