"""ELPO's rollout (Algorithm 1 of Liang et al., 2026) beside :func:`empo2.episodes.rollout.run_episodes`: per group, full
trajectories until B_max failures are buffered, then a binary search for the first irrecoverable step of the failure
with the largest entropy gap (Eq. 4), probing each anchor with X_m suffixes (Eq. 5) that branch off the failure by
replaying its prefix (:mod:`empo2.episodes.branching`). Full trajectories and suffixes count against the group's budget
N, the same number of rollouts the other methods play. Groups advance together, wave by wave, so that every wave is
one batched generation loop; a wave holds at most B_max episodes per group, which fits the pool (G per group).

A step's entropy is estimated by the mean surprisal −log π_old(a_t) of its sampled tokens, whose expectation is the
token entropy of Eq. 3 at the sampling temperature (the generation returns log-probs of the sampled tokens only).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field

from empo2.agent.prompts import PromptParts, hints_text
from empo2.algo import elpo
from empo2.episodes.branching import Branch, restore_branches
from empo2.episodes.episode import Episode, Step
from empo2.episodes.rollout import ActionSource, RolloutContext, _play, _reset, model_actions
from empo2.policy.sampling import Sampling


def step_entropy(step: Step) -> float:
    """The step's entropy (Eq. 3) estimated from its sampled tokens (:func:`empo2.algo.elpo.sampled_entropy`)."""
    return elpo.sampled_entropy(step.logp_old)


@dataclass
class _Group:
    """Algorithm 1's state for one group (one task and variation)."""

    task: str
    variation: int
    group: int
    mode: str
    budget: int
    """Rollouts left (N minus full trajectories and suffixes already sampled)."""
    buffer: list[int] = field(default_factory=list)
    """Indices (into the driver's episode list) of the failures waiting for the choice of Eq. 4."""
    source: int | None = None
    search: elpo.CriticalStepSearch | None = None
    members: int = 0


def drive(ctx, specs, sampling, cfg, progress, seed=None):
    """ELPO's rollout driver (its ``AlgorithmSpec.rollout``): :func:`run_elpo` with Algorithm 1's knobs from
    ``algo.elpo``."""
    return run_elpo(ctx, specs, sampling, progress=progress, options=cfg.algo.elpo, seed=seed)


def run_elpo(ctx: RolloutContext, specs: list[tuple[str, int, int, str]], sampling: Sampling | None = None,
             progress=None, actions: ActionSource | None = None, options: elpo.ElpoOptions | None = None,
             on_step: Callable[[Episode], None] | None = None,
             seed: int | None = None) -> tuple[list[Episode], dict[str, float]]:
    """Algorithm 1 for every group of ``specs`` ([(task, variation, group, mode)], N entries per group = its budget).

    Returns the episodes (full trajectories, then branches, in the order they were played; a branch has
    ``parent = (member, m)``, a searched failure ``critical_step = t_crit``) and the stats of ``run_episodes``
    plus ``elpo_searches``, ``elpo_localised_after_first`` (searches whose t_crit > 1), ``elpo_probes``,
    ``elpo_waves`` and the replay metrics of :func:`restore_branches`. A branch whose replay ended its episode
    (``replay_ended_branches``) has no step to play: it is left out of the episodes, and its rollout still counts
    against the budget.
    """
    o = options or elpo.ElpoOptions()
    actions = actions or model_actions(sampling or Sampling.rollout(ctx.policy_cfg), seed)
    groups: dict[int, _Group] = {}
    for task, variation, g, mode in specs:
        groups.setdefault(g, _Group(task, variation, g, mode, 0)).budget += 1
    stats = {"gen_time": 0.0, "env_time": 0.0, "memory_time": 0.0, "gen_tokens": 0, "prompt_tokens": 0,
             "long_prompts": 0, "step_waves": 0, "elpo_searches": 0.0, "elpo_localised_after_first": 0.0,
             "elpo_probes": 0.0, "elpo_waves": 0.0, "replay_branches": 0.0, "replay_mismatch_branches": 0.0,
             "replay_ended_branches": 0.0, "replay_time": 0.0}
    episodes: list[Episode] = []
    while True:
        fulls, branches = _plan_wave(groups, episodes, o)
        if not fulls and not branches:
            break
        start = len(episodes)
        episodes += _wave(ctx, fulls, branches, actions, stats, progress, on_step)
        stats["elpo_waves"] += 1
        _advance(groups, episodes, start, o, stats)
    return episodes, stats


def _plan_wave(groups: dict[int, _Group], episodes: list[Episode], o: elpo.ElpoOptions):
    """This wave's new full trajectories and its branches [(branch, episode it branches from)]."""
    fulls, branches = [], []
    for grp in groups.values():
        if grp.budget <= 0:
            continue
        if grp.search is None:  # Algorithm 1, lines 5-13: collect failures
            n = min(o.b_max - len(grp.buffer), grp.budget)
            fulls += [Episode(grp.task, grp.variation, grp.group, grp.mode, member=grp.members + k) for k in range(n)]
        else:  # lines 24-39: probe the anchor with X_m suffixes
            source = episodes[grp.source]
            m = grp.search.anchor()
            h = [step_entropy(s) for s in source.steps]
            n = min(elpo.suffix_samples(h[m], h[0], o.x_min, o.x_max, o.beta), grp.budget)
            branches += [(Episode(source.task, source.variation, grp.group, grp.mode, member=grp.members + k,
                                  parent=(source.member, m)), source) for k in range(n)]
        grp.members += n
        grp.budget -= n
    return fulls, branches


def _wave(ctx, fulls: list[Episode], branches: list[tuple[Episode, Episode]], actions, stats, progress,
          on_step) -> list[Episode]:
    """Play one wave: full trajectories reset on workers 0..F−1, branches restored on the next workers, then all
    step together until done. Returns the wave's episodes without the branches whose replay ended their episode."""
    wave = fulls + [b for b, _ in branches]
    parts = _reset(ctx, fulls)  # worker i = position i of the wave
    restored, metrics = restore_branches(ctx.pool, [(len(fulls) + k, src, b.parent[1])
                                                    for k, (b, src) in enumerate(branches)])
    for key in ("replay_branches", "replay_mismatch_branches", "replay_ended_branches", "replay_time"):
        stats[key] += metrics[key]
    ended = set()
    for k, (b, src) in enumerate(branches):
        i, m = len(fulls) + k, b.parent[1]
        r = restored[i]
        b.task_description = src.task_description
        if not isinstance(r, Branch):
            b.failed, b.done, b.error = True, True, str(getattr(r, "error", r))
            continue
        if r.ended:  # a leaf without a step of its own: no node of the tree, no row, no probe outcome
            b.done = True
            ended.add(i)
            continue
        demo = ctx.demonstrations.get((src.task, src.variation, ctx.policy_cfg.few_shot), "")
        parts[i] = PromptParts(env=ctx.env_name, task=src.task_description, observation=r.observation,
                               history=[(s.action, s.observation) for s in src.steps[:m]],
                               initial_observation=src.initial_observation, demonstration=demo,
                               hints=hints_text(r.info))
        b.initial_observation, b.final_state = src.initial_observation, r.state
    with ctx.heads.reuse(ctx.compute):
        _play(ctx, wave, parts, actions, stats, progress, on_step)
    return [ep for i, ep in enumerate(wave) if i not in ended]


def _advance(groups: dict[int, _Group], episodes: list[Episode], start: int, o: elpo.ElpoOptions,
             stats: dict[str, float]) -> None:
    """After a wave: searches take their probe's outcome (lines 40-46), collectors buffer their failures and start a
    search when the buffer is full or the budget is spent (lines 14-22)."""
    new = range(start, len(episodes))
    for grp in groups.values():
        mine = [i for i in new if episodes[i].group == grp.group]
        if grp.search is not None:
            if mine:
                grp.search.record(any(episodes[i].success for i in mine))
                stats["elpo_probes"] += 1
            if grp.search.done or grp.budget <= 0:
                _finish(grp, episodes, stats)
            continue
        grp.buffer += [i for i in mine if not episodes[i].success and not episodes[i].failed and episodes[i].steps]
        if grp.buffer and (len(grp.buffer) >= o.b_max or grp.budget <= 0):
            if grp.budget > 0:  # no rollout left to probe with: Algorithm 1 would report t_crit = 1 unsearched
                gaps = [[step_entropy(s) for s in episodes[i].steps] for i in grp.buffer]
                grp.source = grp.buffer[elpo.choose_search(gaps)]
                grp.search = elpo.CriticalStepSearch(len(episodes[grp.source].steps))
                if grp.search.done:  # a one-step failure: its only step is the critical one
                    _finish(grp, episodes, stats)
            grp.buffer = []


def _finish(grp: _Group, episodes: list[Episode], stats: dict[str, float]) -> None:
    t_crit = grp.search.t_crit
    episodes[grp.source].critical_step = t_crit
    stats["elpo_searches"] += 1
    stats["elpo_localised_after_first"] += t_crit > 1
    grp.search, grp.source = None, None


def tree_metrics(batch) -> dict:
    """ELPO's part of the iteration record (``AlgorithmSpec.metrics``): the whole batch's searches and replays, when
    the rollout grew trees. ``localised_share`` is the share of searches whose first irrecoverable step came after
    step 1 (with no success anywhere a search ends at step 1)."""
    stats = batch.stats
    if "elpo_searches" not in stats:
        return {}
    out = {k.removeprefix("elpo_"): float(v) for k, v in stats.items() if k.startswith(("elpo_", "replay_"))}
    out["localised_share"] = out["localised_after_first"] / out["searches"] if out["searches"] else 0.0
    return {"elpo": out}
