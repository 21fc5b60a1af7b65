"""LUFFY (algo/luffy.py, episodes/expert.py): float64 references written out independently of the code under test,
the expert member on real ScienceWorld (the gold path reaches the goal; the bare "0" trap), and a 1-iteration run on
the WebShop fixture that logs its expert rows."""

from __future__ import annotations

import math

import numpy as np
import pytest
import torch

from empo2.algo.advantages import AdvantageInput, compute_advantages
from empo2.algo.losses import get_policy_loss
from empo2.algo.luffy import LuffyOptions
from empo2.config.sections import algo_config
from empo2.envs.actions import replayable_gold
from empo2.episodes.expert import ExpertPlayer, expert_generation

AUTO_ANSWER = "0"  # how ScienceWorld's gold paths answer an ambiguity prompt

GAMMA = 0.1


def luffy(logp_new, logp_old, adv, mask, off_policy, name="luffy", shaping=True, clip=False, **knobs):
    """The loss ``name`` with LUFFY's γ = :data:`GAMMA`, its ``shaping`` and ``clip`` and the shared ``knobs``."""
    algo = algo_config(luffy=LuffyOptions(gamma=GAMMA, shaping=shaping, clip=clip), **knobs)
    return get_policy_loss(name)(logp_new, logp_old, adv, mask, algo, modes=["on"] * logp_new.shape[0],
                                 off_policy=off_policy)


# ------------------------------------------------------------------------------------------------ Eq. 4 advantage


def reference_advantage(returns, groups, std):
    """Loop-by-loop: each member's return minus its group's mean (expert included), optionally / sample std."""
    out = []
    for i, r in enumerate(returns):
        members = [returns[j] for j in range(len(returns)) if groups[j] == groups[i]]
        mean = sum(members) / len(members)
        a = r - mean
        if std:
            sd = math.sqrt(sum((m - mean) ** 2 for m in members) / (len(members) - 1))
            a = a / (sd + 1e-6)
        out.append(a)
    return out


@pytest.mark.parametrize("std", [False, True])
def test_mixed_policy_advantage_puts_the_expert_in_the_group(std):
    # two groups of 4: three sampled members, then the expert (last); the expert's success moves the mean
    returns = [0.0, 0.0, 30.0, 100.0, 0.0, 0.0, 0.0, 100.0]
    groups = [0, 0, 0, 0, 1, 1, 1, 1]
    inp = AdvantageInput.from_returns(returns, groups, algo_config(luffy=LuffyOptions(std=std)),
                                      lengths=[2, 1, 3, 5, 1, 1, 2, 4])
    adv, metrics = compute_advantages("luffy", inp)
    want = reference_advantage(returns, groups, std)
    for a, w in zip(adv, want):
        np.testing.assert_allclose(a, w, rtol=1e-12, atol=1e-12)  # every step of an episode gets its value
    if not std:  # mean-only (Dr.GRPO): a failed sampled member of group 1 gets −25, not −(0 − 0) = 0 without expert
        assert adv[4][0] == pytest.approx(-25.0)
    assert metrics["zero_adv_groups"] == 0.0
    # an all-success group (expert included) carries no signal
    adv, metrics = compute_advantages("luffy", AdvantageInput.from_returns([100.0] * 4, [0] * 4, algo_config()))
    assert [float(a[0]) for a in adv] == [0.0] * 4 and metrics["zero_adv_groups"] == 1.0


# ------------------------------------------------------------------------------------------------ Eq. 6 gradient


@pytest.mark.parametrize("shaped", [True, False])
@pytest.mark.parametrize("a_hat", [1.7, -0.6])
def test_expert_token_gradient_matches_the_closed_form(shaped, a_hat):
    """d/dz of −Â·f(softmax(z)_a) = −Â·f′(π_a)·π_a·(1[k=a] − π_k), f′(x) = γ/(x+γ)² (f(x) = x: f′ = 1)."""
    rng = np.random.default_rng(3)
    for _ in range(5):
        z_np = rng.normal(size=7) * 2.0
        a = int(rng.integers(7))
        z = torch.tensor(z_np, dtype=torch.float64, requires_grad=True)
        logp = torch.log_softmax(z, dim=0)[a].reshape(1, 1)
        old = torch.full((1, 1), float("nan"), dtype=torch.float64)  # an expert row never reads π_old
        loss, metrics = luffy(logp, old, torch.tensor([a_hat], dtype=torch.float64), torch.ones(1, 1),
                              [True], shaping=shaped, loss_type="token_mean")
        loss.backward()
        p = np.exp(z_np - z_np.max())
        p /= p.sum()
        f = p[a] / (p[a] + GAMMA) if shaped else p[a]
        fprime = GAMMA / (p[a] + GAMMA) ** 2 if shaped else 1.0
        want_grad = -a_hat * fprime * p[a] * ((np.arange(7) == a) - p)
        assert float(loss.detach()) == pytest.approx(-a_hat * f, rel=1e-12)
        np.testing.assert_allclose(z.grad.numpy(), want_grad, rtol=1e-10, atol=1e-14)
        assert metrics["skipped"] == 0.0


def test_shaping_raises_low_probability_tokens_against_plain_mixed_policy():
    """Eq. 8: the per-logit weight f′(π)·π(1−π) is larger for shaped rare tokens than π(1−π)."""
    for p in (0.01, 0.05, 0.2):
        logp = torch.tensor([[math.log(p)]], dtype=torch.float64, requires_grad=True)
        luffy(logp, torch.zeros(1, 1), torch.ones(1), torch.ones(1, 1), [True], loss_type="token_mean")[0].backward()
        shaped = -float(logp.grad)
        assert shaped == pytest.approx(GAMMA * p / (p + GAMMA) ** 2, rel=1e-12)  # −∂loss/∂log π = f′(π)·π
        assert shaped > p  # f(x)=x gives π


# ------------------------------------------------------------------------------------------------ on-policy rows


@pytest.mark.parametrize("a_hat", [2.0, -1.5])
def test_on_policy_rows_lose_their_clip_and_the_switch_restores_it(a_hat):
    # ratio 3 (far outside [0.8, 1.3]) and a second token with ratio 0.5
    new = torch.tensor([[math.log(0.3), math.log(0.1)]], dtype=torch.float64, requires_grad=True)
    old = torch.tensor([[math.log(0.1), math.log(0.2)]], dtype=torch.float64)
    ratio = np.array([3.0, 0.5])
    loss, metrics = luffy(new, old, torch.tensor([a_hat], dtype=torch.float64), torch.ones(1, 2), [False],
                          loss_type="token_mean")
    loss.backward()
    assert float(loss.detach()) == pytest.approx(-a_hat * ratio.mean(), rel=1e-12)
    np.testing.assert_allclose(new.grad.numpy()[0], -a_hat * ratio / 2, rtol=1e-12)  # d(−Â·ρ)/d log π = −Â·ρ
    assert metrics["clip_frac"] == 0.0 and metrics["dual_clip_frac"] == 0.0

    new.grad = None
    luffy(new, old, torch.tensor([a_hat], dtype=torch.float64), torch.ones(1, 2), [False], loss_type="token_mean",
          clip=True)[0].backward()
    clipped = np.where((ratio > 1.3) & (a_hat > 0) | (ratio < 0.8) & (a_hat < 0), 0.0, -a_hat * ratio / 2)
    np.testing.assert_allclose(new.grad.numpy()[0], clipped, rtol=1e-12)  # GRPO's clip (dual clip 10 not reached)


def test_luffy_drops_the_low_probability_mask_and_empo2_luffy_keeps_it():
    new = torch.tensor([[math.log(0.001)]], dtype=torch.float64, requires_grad=True)  # π < δ = 0.01
    old = new.detach().clone()
    for name, masked in (("luffy", False), ("empo2_luffy", True)):
        new.grad = None
        luffy(new, old, torch.ones(1, dtype=torch.float64), torch.ones(1, 1), [False], name=name,
              low_prob_threshold=0.01)[0].backward()
        assert (float(new.grad) == 0.0) == masked


# ------------------------------------------------------------------------------------------------ expert rows


def test_expert_rows_ignore_pi_old_the_mask_and_the_clip():
    """The expert row's loss and gradient are the same whatever its logp_old holds (NaN included), its rare
    tokens are not masked, and mixed with an on-policy row the batch is aggregated as one (both aggregations)."""
    lp_expert = np.log([0.002, 0.4, 0.9])  # the first token is below δ
    lp_on = np.log([0.5, 0.25, 0.1])
    lp_old_on = np.log([0.25, 0.25, 0.2])
    mask = torch.tensor([[1, 1, 1], [1, 1, 0]])
    adv = torch.tensor([0.75, -0.25], dtype=torch.float64)
    grads = {}
    for agg in ("token_mean", "dr_grpo"):
        for old_expert in (np.full(3, np.nan), np.log([0.9, 0.9, 0.9]), np.zeros(3)):
            new = torch.tensor(np.stack([lp_expert, lp_on]), dtype=torch.float64, requires_grad=True)
            old = torch.tensor(np.stack([old_expert, lp_old_on]), dtype=torch.float64)
            loss, metrics = luffy(new, old, adv, mask, [True, False], loss_type=agg, dr_grpo_length=8,
                                  low_prob_threshold=0.01, tis_cap=2.0)
            loss.backward()
            assert metrics["skipped"] == 0.0
            grads.setdefault(agg, []).append((float(loss.detach()), new.grad.numpy().copy()))
        # float64 reference, token by token
        p = np.exp(lp_expert)
        expert_terms = -0.75 * p / (p + GAMMA)
        expert_grad = -0.75 * GAMMA * p / (p + GAMMA) ** 2
        ratio = np.exp(lp_on[:2] - lp_old_on[:2])
        on_terms = 0.25 * ratio
        on_grad = 0.25 * ratio
        norm = 5 if agg == "token_mean" else 2 * 8
        want_loss = (expert_terms.sum() + on_terms.sum()) / norm
        want_grad = np.stack([expert_grad, np.append(on_grad, 0.0)]) / norm
        for got_loss, got_grad in grads[agg]:
            assert got_loss == pytest.approx(want_loss, rel=1e-12)
            np.testing.assert_allclose(got_grad, want_grad, rtol=1e-10, atol=1e-15)


def test_expert_generation_and_gold_cleaning(smollm):
    _, tok = smollm
    gen = expert_generation(tok, "open door to kitchen")
    assert gen.ids == tok.encode("open door to kitchen", add_special_tokens=False) + [tok.eos_token_id]
    assert gen.logprobs == [0.0] * len(gen.ids) and gen.text == "open door to kitchen"
    assert tok.decode(gen.ids, skip_special_tokens=True) == "open door to kitchen"
    assert replayable_gold(["look around", AUTO_ANSWER, " 0 ", "move 0 seed", "1"]) == ["look around", "move 0 seed",
                                                                                       "1"]


def test_update_rows_mark_the_expert_off_policy():
    from empo2.episodes.episode import Episode, Step
    from empo2.train.rows import update_rows

    def ep(expert):
        e = Episode("t", 0, 0, "on", expert=expert)
        e.steps.append(Step([1], [1], [2, 3], [0.0, 0.0], "a", "a", "o", 0.0, "s"))
        return e

    rows = update_rows([ep(False), ep(True)], [[0.5], [0.5]])
    assert [r.off_policy for r in rows] == [False, True]


# ------------------------------------------------------------------------------------------------ real environments


@pytest.mark.slow
def test_expert_plays_a_real_scienceworld_gold_path_to_the_goal(smollm):
    from empo2.config.sections import MemoryConfig, PolicyConfig
    from empo2.envs.pool import EnvPool
    from empo2.episodes.rollout import RolloutContext

    _, tok = smollm

    def never(*args):
        raise AssertionError("a group of experts only asks the policy nothing")

    with EnvPool("scienceworld", {"max_steps": 30, "valid_actions_in_info": False}, 1) as pool:
        ctx = RolloutContext(None, tok, pool, None, None, "scienceworld",
                             PolicyConfig(history_window=2, max_prompt_length=1024, few_shot=0), MemoryConfig())
        player = ExpertPlayer(group_size=1)
        actions = player.actions(never)
        from empo2.episodes.rollout import run_episodes

        episodes, _ = run_episodes(ctx, [("find-animal", 0, 0, "on")], actions=actions)
        gold = replayable_gold(pool.call(0, "gold_actions"))
    ep = episodes[0]
    assert ep.expert and ep.success and ep.score == 100 and len(ep.steps) <= 30
    assert [s.raw_action for s in ep.steps] == gold[: len(ep.steps)]
    for s in ep.steps:  # the tokens the policy would have written; rendered prompts as a policy row gets them
        assert s.response_ids == tok.encode(s.raw_action, add_special_tokens=False) + [tok.eos_token_id]
        assert tok.decode(s.prompt_ids).rstrip().endswith("assistant") and s.logp_old == [0.0] * len(s.response_ids)
    assert "Your next action:" in tok.decode(ep.steps[-1].prompt_ids)


@pytest.mark.slow
def test_bare_zero_in_a_real_gold_path_is_answered_by_the_env_not_replayed():
    """grow-plant variation 0: gold action 10 is a bare "0" answering an "Ambiguous request" that our env already
    answers; sent as an action it becomes some corrected command the gold path never had. Without it, every
    command the simulator runs is the gold's."""
    from empo2.envs.actions import clean_action
    from empo2.envs.scienceworld import ScienceWorldEnv

    env = ScienceWorldEnv(max_steps=1000, valid_actions_in_info=False)
    try:
        env.reset("grow-plant", 0)
        gold = env.gold_actions()  # the episode is still at its start
        zero = gold.index(AUTO_ANSWER)
        prefix = gold[: zero + 2]
        ran = [env.step(a).info["action"] for a in prefix]
        assert ran[zero] != AUTO_ANSWER and ran[zero] not in prefix  # the trap: an arbitrary corrected action
        env.reset("grow-plant", 0)
        clean = replayable_gold(prefix)
        ran = [env.step(a).info["action"] for a in clean]
        assert AUTO_ANSWER not in clean and ran == [clean_action(a) for a in clean]
    finally:
        env.close()


@pytest.mark.slow
def test_one_luffy_iteration_on_the_webshop_fixture_logs_its_expert_rows(tiny_model):
    """One iteration through the Python API in this process (the fixture's WebShop workers are real processes)."""
    from empo2 import Config, Trainer

    cfg = Config.load("configs/webshop_cpu.yaml", ["algo.name=luffy", "train.iterations=1",
                                                   f"policy.model={tiny_model}", "env.max_steps=5",
                                                   "env.eval_variations=1", "algo.num_generations=2",
                                                   "policy.max_completion_length=20", "train.progress=false",
                                                   "algo.loss_type=dr_grpo"])  # 20: the fixture's gold actions fit
    with Trainer(cfg) as trainer:
        rec = trainer.iteration()
    assert rec["expert"]["slots"] == 1 and rec["expert"]["kept"] == 1 and rec["expert"]["fallback"] == 0
    assert rec["expert"]["cut_actions"] == 0 and rec["expert"]["success_rate"] == 1.0
    gold = rec["expert_env_steps"]  # search → item → options → buy: 4 or 5 steps on the fixture
    assert 4 <= gold <= 5 and rec["expert"]["rows"] == rec["expert"]["env_steps"] == rec["loss"]["expert_rows"] == gold
    assert rec["loss"]["rows"] == gold + rec["env_steps"]  # the policy's steps are counted apart
    assert rec["env_steps"] == rec["train"]["env_steps"] >= 1


def test_expert_algorithms_need_a_sampled_member(tmp_path, capsys):
    from empo2.cli import main

    assert main(["train", "--config", "configs/webshop_cpu.yaml", "--algo", "luffy", "algo.num_generations=1",
                 f"train.output_dir={tmp_path / 'x'}"]) == 2
    assert "algo.num_generations must be more than that" in capsys.readouterr().err
    assert not (tmp_path / "x").exists()


def test_compare_summary_counts_expert_steps_apart():
    from empo2.experiments.compare_summary import expert_steps_text

    runs = [{"name": "grpo-s0", "algo": "grpo", "expert_env_steps": 0},
            {"name": "luffy-s0", "algo": "luffy", "expert_env_steps": 37}]
    [text] = expert_steps_text(runs)
    assert "luffy-s0 37" in text and "grpo" not in text and "counted apart" in text
    assert expert_steps_text(runs[:1]) == []


def test_train_algo_names_what_compare_algos_names(tmp_path, capsys):
    """``train --algo luffy`` runs the ``luffy`` arm (LUFFY as its script runs it), as ``compare --algos luffy`` does;
    an override that contradicts the arm is refused at load; ``--algo NAME+ESTIMATOR`` sets the estimator."""
    from empo2.cli import main, parse_cli
    from empo2.cli.training import train_config
    from empo2.experiments.arm_runs import arm_overrides

    args = parse_cli(["train", "--config", "configs/scienceworld_evidence_cpu.yaml", "--algo", "luffy",
                      "--output-dir", str(tmp_path / "a")])
    cfg, _ = train_config(args)
    a = cfg.algo
    assert (a.name, a.arm, a.loss_type, a.intrinsic_weight, a.luffy.shaping, a.luffy.clip) == \
        ("luffy", "luffy", "dr_grpo", 0.0, True, False)
    assert arm_overrides("luffy")[0] == "algo.name=luffy"
    cfg, _ = train_config(parse_cli(["train", "--config", "configs/scienceworld_evidence_cpu.yaml", "--algo",
                                      "empo2+gigpo", "--output-dir", str(tmp_path / "b")]))
    assert (cfg.algo.name, cfg.algo.advantage, cfg.algo.arm) == ("empo2", "gigpo", None)
    assert main(["train", "--config", "configs/webshop_cpu.yaml", "--algo", "luffy", "algo.loss_type=token_mean",
                 f"train.output_dir={tmp_path / 'c'}"]) == 2
    assert "luffy" in capsys.readouterr().err and not (tmp_path / "c").exists()


def test_expert_actions_are_cut_where_the_policy_s_would_be(smollm):
    _, tok = smollm
    action = "search[men's running shoes with arch support, non slip, navy blue, size 9, under 60 dollars]"
    whole = expert_generation(tok, action, max_tokens=64)
    assert whole.text == action and whole.ids[-1] == tok.eos_token_id
    cut = expert_generation(tok, action, max_tokens=8)
    assert cut.ids == whole.ids[:8] and tok.eos_token_id not in cut.ids and cut.logprobs == [0.0] * 8
    assert cut.text == tok.decode(whole.ids[:8], skip_special_tokens=True) and action.startswith(cut.text)


def _episode(member, states, tips=(), expert=False):
    """Steps answering ``states[:-1]``, the last state reached ``states[-1]``."""
    from empo2.episodes.episode import Episode, Step

    steps = [Step([], [], [], [], "", f"act {t}", "", 0.0, s, tip_ids=list(tips)) for t, s in enumerate(states[:-1])]
    return Episode("find-animal", 0, 0, "on_tips", member=member, steps=steps, expert=expert,
                   final_state=states[-1], score=100.0 if expert else 8.0)


def test_the_expert_credits_no_tip_and_visits_no_state(embedder):
    """Under EMPO² + expert the gold-path member sees tips in its prompt and reaches states, but its actions are the
    gold path's: it neither credits the tips (their utility would take its score of 100) nor counts as a visitor
    of the states the policy explores (nor earns a novelty reward)."""
    from empo2.episodes.reflection import memory_plan
    from empo2.memory.novelty import NoveltyReward
    from empo2.train.intrinsic import novelty_rewards

    rooms = ["You are in the hallway, by a picture.", "A fridge, a stove and a sink: the kitchen.",
             "Rows of tomato plants grow in the greenhouse soil.", "A red box stands on the bathroom floor."]
    sampled, expert = _episode(0, rooms[:3], tips=[7]), _episode(1, rooms, tips=[7, 9], expert=True)
    uses, writers = memory_plan([sampled, expert], [sampled, expert])
    assert uses == [((0, 0), ([7], 8.0))] and writers == [sampled, expert]
    alone = novelty_rewards(NoveltyReward(0.9), embedder, [sampled])
    both = novelty_rewards(NoveltyReward(0.9), embedder, [sampled, expert])
    assert [s.intrinsic for s in both[0].steps] == [s.intrinsic for s in alone[0].steps] == [1.0, 1.0]
    assert [s.intrinsic for s in both[1].steps] == [0.0, 0.0, 0.0]


@pytest.mark.slow
def test_a_resumed_luffy_run_remembers_its_unreachable_experts(tiny_model, tmp_path):
    """A 2-step cap makes the fixture's gold path (4–5 steps) miss the goal: the first iteration replays it, fails and
    remembers the goal, so the second samples that slot from the start. A run resumed from the first iteration's
    checkpoint must do the same (the set is in the checkpoint), and the metrics keep the policy's episodes apart
    from the expert's."""
    from empo2 import Config, Trainer

    cfg = Config.load("configs/webshop_cpu.yaml", ["algo.name=luffy", "train.iterations=2", f"policy.model={tiny_model}",
                                                   "env.max_steps=2", "env.train_variations=1",
                                                   "env.eval_variations=1", "algo.num_generations=2",
                                                   "policy.max_completion_length=8", "train.progress=false",
                                                   "algo.loss_type=dr_grpo", "train.eval_at_start=false"])
    with Trainer(cfg, output_dir=tmp_path / "whole") as trainer:
        first = trainer.iteration()
        unreachable = set(trainer.rollout.unreachable)
        second = trainer.iteration()
    assert first["expert"]["discarded_env_steps"] == 2 and first["expert"]["fallback"] == 1
    assert second["expert"]["discarded_env_steps"] == 0 and second["expert"]["fallback"] == 1

    with Trainer(cfg, output_dir=tmp_path / "resumed") as trainer:
        trainer.iteration()
        trainer.save(0)
    with Trainer(cfg, output_dir=tmp_path / "resumed", resume=True) as trainer:
        assert len(unreachable) == 1 and trainer.rollout.unreachable == unreachable
        again = trainer.iteration()
    assert again["expert"] == second["expert"]
    assert first["expert"]["cut_actions"] >= 1  # the search text is longer than 8 tokens
    # the expert's replay was discarded: the train block holds the sampled members only (its slot's refill included)
    assert first["train"]["env_steps"] == first["env_steps"] and first["train"]["score_mean"] <= 100


def test_training_metrics_keep_the_expert_apart():
    from empo2.episodes.expert import expert_metrics
    from empo2.train.batch import Batch, iteration_record

    sampled, expert = _episode(0, ["a", "b", "c"]), _episode(1, ["a", "b", "c", "d"], expert=True)
    sampled.steps[1].reward, expert.steps[2].reward = 8.0, 100.0
    expert.success = True
    stats = {"memory_time": 0.0, "gen_time": 1.0, "env_time": 0.0, "gen_tokens": 0, "long_prompts": 0,
             "expert_slots": 1, "expert_kept": 1, "expert_fallback": 0, "expert_steps": 3,
             "expert_discarded_steps": 0}
    batch = Batch(0, ["on"], [], episodes=[sampled, expert], stats=stats, returns=np.array([8.0, 100.0]),
                  advantage_metrics={"groups": 1.0})
    rec = iteration_record(batch, "mean", 0, 2, 3, expert_metrics)
    train = rec["train"]
    assert (train["score_mean"], train["success_rate"], train["return_mean"], train["steps_mean"]) == (8.0, 0.0, 8.0,
                                                                                                       2.0)
    assert (rec["expert"]["score_mean"], rec["expert"]["success_rate"]) == (100.0, 1.0)
