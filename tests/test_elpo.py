"""ELPO's equations (empo2.algo.elpo, empo2.algo.elpo_tree) against float64 references computed here with plain
Python, and against the worked rollout tree the paper prints in App. B (Figure 4, N = 16 leaves, rewards 1.0 / −1.1)."""

from __future__ import annotations

import math
import statistics

import numpy as np
import pytest
import torch

from empo2.algo import elpo, elpo_tree
from empo2.algo.advantages import AdvantageInput, compute_advantages
from empo2.config.sections import algo_config

W, L = 1.0, -1.1  # the worked example's rewards: right answer, wrong answer


def figure4_tree():
    """The App. B tree as node paths. Node names: the leaves below each node, as Figure 4 prints them (``FW_leaves``);
    a suffix after step m shares the first m nodes. The text copy of the figure cuts the lone chains of leaves 6, 7,
    13, 14 and 15 short; their lengths change no value (every node of a lone chain carries the same numbers)."""
    names: dict[str, int] = {}

    def node(name):
        return names.setdefault(name, len(names))

    spec = {  # leaf -> step names, step 1 first
        0: ["1:0,3,4", "2:0", "3:0"], 3: ["1:0,3,4", "2:3", "3:3"], 4: ["1:0,3,4", "2:4", "3:4"],
        1: ["1:1", "2:1"], 2: ["1:2"],
        5: ["1:5..12", "2:5,10,11,12", "3:5"], 10: ["1:5..12", "2:5,10,11,12", "3:10"],
        11: ["1:5..12", "2:5,10,11,12", "3:11"], 12: ["1:5..12", "2:5,10,11,12", "3:12"],
        8: ["1:5..12", "2:8"], 9: ["1:5..12", "2:9", "3:9"],
        6: ["1:6", "2:6", "3:6"], 7: ["1:7", "2:7", "3:7"], 13: ["1:13"], 14: ["1:14"], 15: ["1:15", "2:15", "3:15"],
    }
    paths = [[node(n) for n in spec[leaf]] for leaf in range(16)]
    rewards = [W if leaf in (8, 9) else L for leaf in range(16)]
    return paths, rewards, names


# What Figure 4 prints for each node: r ("R="), A_b ("branch"), A_t ("traj"), A_hier ("A"), to 3 decimals.
LONE = (L, -0.354, -0.378, -0.366)
FIGURE4 = {
    "1:0,3,4": LONE, "2:0": (L, 0.0, -0.378, -0.189), "2:3": (L, 0.0, -0.378, -0.189),
    "2:4": (L, 0.0, -0.378, -0.189), "3:0": (L, 0.0, -0.378, -0.189), "3:3": (L, 0.0, -0.378, -0.189),
    "3:4": (L, 0.0, -0.378, -0.189),
    "1:1": LONE, "2:1": LONE, "1:2": LONE,
    "1:5..12": (0.3, 2.828, 0.630, 1.729), "2:5,10,11,12": (L, -1.414, -0.378, -0.896),
    "3:5": (L, 0.0, -0.378, -0.189), "3:10": (L, 0.0, -0.378, -0.189), "3:11": (L, 0.0, -0.378, -0.189),
    "3:12": (L, 0.0, -0.378, -0.189),
    "2:8": (W, 0.707, 2.646, 1.676), "2:9": (W, 0.707, 2.646, 1.676), "3:9": (W, 0.707, 2.646, 1.676),
    "1:6": LONE, "2:6": LONE, "3:6": LONE, "1:7": LONE, "2:7": LONE, "3:7": LONE, "1:13": LONE, "1:14": LONE,
    "1:15": LONE, "2:15": LONE, "3:15": LONE,
}


def reference(paths, rewards, lam=0.5, eps=1e-6):
    """Eq. 6–10 written independently in plain Python floats: nodes as dicts, statistics.pstdev."""
    children: dict[int, list[int]] = {}
    leaf_reward, through = {}, {}
    for i, path in enumerate(paths):
        for depth, n in enumerate(path):
            through.setdefault(n, []).append(i)
            parent = path[depth - 1] if depth else "root"
            if n not in children.setdefault(parent, []):
                children[parent].append(n)
        leaf_reward[path[-1]] = rewards[i]

    def r(n):  # Eq. 6
        kids = children.get(n, [])
        return leaf_reward[n] if not kids else sum(r(c) for c in kids) / len(kids)

    def norm(xs):
        mu, sd = statistics.fmean(xs), statistics.pstdev(xs)
        return [0.0 if sd == 0 else (x - mu) / (sd + eps) for x in xs]

    a_b = {}

    def walk(n, inherited):  # Eq. 7; a lone child keeps its parent's value
        kids = children.get(n, [])
        values = norm([r(c) for c in kids]) if len(kids) > 1 else [inherited] * len(kids)
        for c, v in zip(kids, values):
            a_b[c] = v
            walk(c, v)

    walk("root", 0.0)
    a_traj = norm(list(rewards))  # Eq. 8
    out = {}
    for n in through:
        a_t = statistics.fmean(a_traj[i] for i in through[n])  # Eq. 9
        out[n] = (r(n), a_b[n], a_t, lam * a_b[n] + (1 - lam) * a_t)  # Eq. 10
    return out


def test_figure4_worked_tree():
    paths, rewards, names = figure4_tree()
    got = elpo_tree.tree_advantages(paths, rewards)
    ref = reference(paths, rewards)
    for name, n in names.items():
        ours = (got.reward[n], got.branch[n], got.node[n], got.hier[n])
        assert ours == pytest.approx(ref[n], abs=1e-12), name
        assert ours == pytest.approx(FIGURE4[name], abs=6e-4), name  # printed to 3 decimals
    # Eq. 8 on the leaves: 14 × −1.1 and 2 × 1.0 with the population std.
    assert got.trajectory[[8, 9]] == pytest.approx([2.646, 2.646], abs=6e-4)
    assert got.trajectory[0] == pytest.approx(-0.378, abs=6e-4)


def test_tree_rejects_bad_paths():
    with pytest.raises(ValueError, match="two parents"):
        elpo_tree.tree_parents([[0, 1], [2, 1]])
    with pytest.raises(ValueError, match="leaf"):
        elpo_tree.tree_parents([[0, 1], [0]])
    with pytest.raises(ValueError, match="0..S-1"):
        elpo_tree.tree_parents([[0, 5]])


def test_random_trees_match_reference():
    rng = np.random.default_rng(0)
    for _ in range(30):
        paths, next_id = [], 0
        for _traj in range(int(rng.integers(2, 9))):
            if paths and rng.random() < 0.6:  # a suffix after step m of an earlier trajectory
                base = paths[int(rng.integers(len(paths)))]
                m = int(rng.integers(1, len(base))) if len(base) > 1 else 0
                prefix = base[:m]
            else:
                prefix = []
            new = list(range(next_id, next_id + int(rng.integers(1, 4))))
            next_id += len(new)
            paths.append(prefix + new)
        rewards = [float(x) for x in rng.choice([0.0, 1.0, 0.5], size=len(paths))]
        got = elpo_tree.tree_advantages(paths, rewards, lam=0.3)
        ref = reference(paths, rewards, lam=0.3)
        for n, values in ref.items():
            assert (got.reward[n], got.branch[n], got.node[n], got.hier[n]) == pytest.approx(values, abs=1e-12)


def grpo_objective_reference(ratio, adv, eps_low=0.2, eps_high=0.315):
    """GRPO's clipped surrogate (Eq. 2) in float64, elementwise on nested lists."""
    return [[min(r * a, min(max(r, 1 - eps_low), 1 + eps_high) * a) for r, a in zip(rr, aa)]
            for rr, aa in zip(ratio, adv)]


def test_clip_differs_from_grpo_only_on_the_critical_suffix():
    # A tree of 3 trajectories: the searched one (index 0, 6 steps, t_crit = 4) and two suffixes after its step 2.
    paths = [[0, 1, 2, 3, 4, 5], [0, 1, 6, 7], [0, 1, 8]]
    clip_low = elpo.node_clip_low(paths, {0: 4})
    assert clip_low.tolist() == pytest.approx([0.2, 0.2, 0.2, 0.315, 0.315, 0.315, 0.2, 0.2, 0.2])
    assert elpo.critical_clip_low(6, None).tolist() == [0.2] * 6
    ratios = [0.5, 0.69, 0.75, 0.79, 0.81, 1.0, 1.2, 1.4]
    grid = [(r, a) for r in ratios for a in (-1.5, 1.5)]
    n_rows = len(clip_low)
    ratio = torch.tensor([[r for r, _ in grid]] * n_rows, dtype=torch.float64, requires_grad=True)
    adv = torch.tensor([[a for _, a in grid]] * n_rows, dtype=torch.float64)
    obj = elpo.elc_surrogate(ratio, adv, torch.tensor(clip_low)[:, None])
    grpo = grpo_objective_reference(ratio.tolist(), adv.tolist())
    obj.sum().backward()
    for row in range(n_rows):
        critical = row in (3, 4, 5)
        for col, (r, a) in enumerate(grid):
            lower_bound_moved = critical and a < 0 and r < 0.8  # the clipped value −(1 − ε_low)·|A| moves
            same = obj[row, col].item() == pytest.approx(grpo[row][col], abs=1e-15)
            assert same != lower_bound_moved, (row, r, a)
            # GRPO's clip cuts the gradient for ρ < 0.8; ELC keeps it down to 0.685: d(ρA)/dρ = A there.
            unclipped = not (a < 0 and r < (1 - 0.315 if critical else 0.8)) and not (a > 0 and r > 1.315)
            assert ratio.grad[row, col].item() == (pytest.approx(a) if unclipped else 0.0), (row, r, a)
    # A positive advantage is never touched: the upper bound is the same.
    assert torch.equal(elpo.elc_surrogate(ratio, adv.abs(), 0.315), elpo.elc_surrogate(ratio, adv.abs(), 0.2))


def test_token_entropy_matches_numpy():
    torch.manual_seed(0)
    logits = torch.randn(3, 5, 11, dtype=torch.float64)
    x = logits.numpy()
    p = np.exp(x - x.max(-1, keepdims=True))
    p /= p.sum(-1, keepdims=True)
    want = -(p * np.log(p)).sum(-1)
    assert elpo.token_entropy(logits).numpy() == pytest.approx(want, abs=1e-6)


def test_sampled_entropy_is_the_mean_surprisal_whose_mean_is_eq3():
    """Tokens drawn in the proportions of p (a, a, b, c for p = ½, ¼, ¼): their mean surprisal is exactly H(p)."""
    p = [0.5, 0.25, 0.25]
    want = -math.fsum(q * math.log(q) for q in p)
    assert elpo.sampled_entropy([math.log(p[k]) for k in (0, 0, 1, 2)]) == pytest.approx(want, rel=1e-12)
    assert elpo.token_entropy(torch.tensor(p, dtype=torch.float64).log()).item() == pytest.approx(want, rel=1e-6)
    assert elpo.sampled_entropy([]) == 0.0


def test_critical_steps_are_t_crit_to_the_end():
    for n in range(6):
        for t_crit in (None, 1, 2, 4, 7):
            want = [t_crit is not None and t >= t_crit for t in range(1, n + 1)]
            assert elpo.critical_steps(n, t_crit).tolist() == want, (n, t_crit)
            assert elpo.critical_clip_low(n, t_crit, 0.2, 0.115).tolist() == pytest.approx(
                [0.315 if c else 0.2 for c in want], abs=1e-15)


def test_entropy_gap_choice_and_suffix_count():
    assert elpo.entropy_gap([1.0, 2.0, 4.0]) == pytest.approx(2.0)  # H_tool = mean(2, 4), H_root = 1
    assert elpo.entropy_gap([1.0]) == 0.0
    assert elpo.choose_search([[1.0, 1.5], [2.0, 1.0, 4.0], [0.5, 1.0]]) == 0  # gaps 0.5, 0.5, 0.5: the first
    assert elpo.choose_search([[1.0, 1.5], [2.0, 1.0, 6.0], [0.5, 0.6]]) == 1  # gaps 0.5, 1.5, 0.1
    # Eq. 5 with Table 2: X_m = 1 + 2·σ(5Δ).
    for gap in (-2.0, -0.3, 0.0, 0.1, 0.7, 5.0, -800.0, 800.0):
        want = 1 + 2 / (1 + math.exp(-5 * gap)) if gap > -100 else 1.0
        assert elpo.suffix_count(gap, 0.0) == pytest.approx(want, abs=1e-12)
    assert elpo.suffix_samples(0.0, 0.0) == 2
    assert elpo.suffix_samples(1.0, 0.0) == 3 and elpo.suffix_samples(-1.0, 0.0) == 1


def test_binary_search_finds_the_critical_step_in_log2_probes():
    for k in range(1, 41):
        for t_star in range(1, k + 1):
            # Scripted oracle: a prefix of m steps is recoverable iff it stops before the critical step.
            search, spent = elpo.localise(k, lambda m, _s, t=t_star: m < t, budget=10**6)
            assert search.done and search.t_crit == t_star, (k, t_star)
            assert len(search.probes) <= math.ceil(math.log2(k)) if k > 1 else not search.probes
            assert spent == len(search.probes)


def test_binary_search_counts_suffixes_and_stops_at_the_budget():
    # Only the last of an anchor's suffixes succeeds: "any suffix reaches R = 1" must still move L.
    for k, t_star in ((30, 17), (30, 1), (30, 30), (7, 5)):
        n = 3
        search, spent = elpo.localise(k, lambda m, s, t=t_star: m < t and s == n - 1, budget=10**6,
                                      samples=lambda m: n)
        assert search.t_crit == t_star and spent == n * len(search.probes)
    # Table 2: N_total = 16, B_max = 3 full trajectories first, so 13 rollouts are left for suffixes; at 3 a probe a
    # 30-step search needs 5 probes = 15 rollouts and must stop at 13.
    for budget in range(0, 16):
        search, spent = elpo.localise(30, lambda m, s: m < 20, budget=budget, samples=lambda m: 3)
        assert spent <= budget
        assert spent == min(budget, 3 * len(search.probes))
    # Sparse successes: nothing ever succeeds, so the search ends at step 1 (the paper's stated limit).
    search, _ = elpo.localise(30, lambda m, s: False, budget=100)
    assert search.t_crit == 1 and all(not ok for _, ok in search.probes)


def test_registered_elpo_loss_widens_only_the_critical_rows():
    from empo2.algo.losses import get_policy_loss
    from empo2.algo.registry import get_algorithm
    from empo2.episodes.episode import Episode, Step
    from empo2.train.rows import update_rows

    algo = algo_config(epsilon_high=0.315, dual_clip=0.0)
    # Rows from episodes: a searched failure with t_crit = 2 of 3 steps, and a branch of it (never widened).
    def ep(n, t_crit=None):
        e = Episode("t", 0, 0, "on", critical_step=t_crit)
        e.steps = [Step([1], [1], [2, 3], [-1.0, -1.0], "a", "a", "o", 0.0, "s") for _ in range(n)]
        return e
    rows = update_rows([ep(3, 2), ep(2)], [[-1.0] * 3, [-1.0] * 2], get_algorithm("elpo").row_extras)
    assert [r.extras["critical"] for r in rows] == [False, True, True, False, False]
    critical = torch.tensor([r.extras["critical"] for r in rows])
    ratios = torch.tensor([0.75, 0.75, 0.9, 0.75, 0.75], dtype=torch.float64)
    logp_old = torch.full((5, 2), -1.0, dtype=torch.float64)
    logp_new = (logp_old + ratios.log()[:, None]).requires_grad_(True)
    adv = torch.tensor([r.advantage for r in rows], dtype=torch.float64)
    mask = torch.ones(5, 2)
    loss, metrics = get_policy_loss("elpo")(logp_new, logp_old, adv, mask, algo, critical=critical)
    loss.backward()
    grad_elpo = logp_new.grad.clone()
    logp_new.grad = None
    get_policy_loss("grpo")(logp_new, logp_old, adv, mask, algo)[0].backward()
    # ρ = 0.75 < 1 − 0.2 with A < 0: GRPO clips (no gradient); ELPO's bound 0.685 keeps row 1's gradient.
    # Token-mean over 10 tokens: d(−ρA)/dlogp = −ρA/10 = 0.075 per token.
    assert grad_elpo[1].tolist() == pytest.approx([0.075, 0.075])
    assert logp_new.grad[1].tolist() == [0.0, 0.0]
    for row in (0, 2, 3, 4):
        assert grad_elpo[row].tolist() == pytest.approx(logp_new.grad[row].tolist(), abs=1e-15)
    assert metrics["critical_rows"] == 2


def test_groups_without_signal_are_counted_as_grpo_counts_them():
    # group 0: every trajectory failed alike (A_hier 0 everywhere); group 1: one success among failures
    inp = AdvantageInput.from_returns([0.0, 0.0, 0.0, 0.0, 1.0], [0, 0, 0, 1, 1], algo_config(), [3, 2, 4, 2, 3])
    adv, metrics = compute_advantages("elpo", inp)
    assert all(not a.any() for a in adv[:3]) and all(a.any() for a in adv[3:])
    assert metrics["zero_adv_groups"] == 1.0
    assert metrics["zero_adv_groups"] == compute_advantages("grpo", inp)[1]["zero_adv_groups"]


def _episode(group, member, rewards, parent=None):
    """An episode as the rollout records it (plain data; only the step rewards and the tree link matter here)."""
    from empo2.episodes.episode import Episode, Step

    steps = [Step([], [], [], [], "", f"action {t}", "", float(r), f"state {member}/{t}") for t, r in enumerate(rewards)]
    return Episode("find-non-living-thing", 0, group, "on", member=member, steps=steps, parent=parent,
                   final_state="end")


def test_a_branch_is_scored_with_its_prefix():
    """Eq. 6–8 take the terminal reward of the completed trajectory, prefix included. A ScienceWorld failure that
    reached score 67 (+17 for the answer box's room at step 2, +50 for the focus at step 3) is searched; its branches
    after steps 2 and 3 replay the prefix and end where it ended (the rewards after the replay are score changes from
    the replayed score). Every leaf of that path has R = 67, so each gets the same A_hier, which a float64 reference
    computes from the leaves' full returns."""
    from empo2.algo.advantages import step_rewards

    source = [0.0, 17.0, 50.0, 0.0, 0.0]
    episodes = [_episode(0, 0, source), _episode(0, 1, [0.0, 8.0, 0.0]), _episode(0, 2, [0.0, 0.0, 0.0, 0.0]),
                _episode(0, 3, [50.0, 0.0, 0.0], parent=(0, 2)), _episode(0, 4, [0.0, 0.0], parent=(0, 3))]
    rewards = step_rewards(episodes, 0.0)
    inp = AdvantageInput.from_rewards(episodes, rewards, algo_config())  # as the trainer builds it
    adv, _ = compute_advantages("elpo", inp)
    leaves = [float(adv[i][-1]) for i in (0, 3, 4)]
    full = [67.0, 8.0, 0.0, 67.0, 67.0]  # the leaves' R; below m the siblings all have r = 67, so A_b = 0 there
    a_t = (full[0] - statistics.fmean(full)) / (statistics.pstdev(full) + 1e-6)
    assert leaves == pytest.approx([0.5 * 0.0 + 0.5 * a_t] * 3, rel=1e-12), leaves
    assert leaves[0] > 0  # the best trajectory of the tree, branches included
    assert inp.returns.tolist() == full  # the return a branch reports is its path's too
