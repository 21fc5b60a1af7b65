"""The EMPO² / GRPO / GiGPO training loop, with evaluation, atomic checkpoints, resume and metrics.

One :meth:`Trainer.iteration` is one iteration of the paper's loop (EMPO², Liu et al., ICLR 2026, arXiv 2602.23008:
the Method section and its figure of the three learning modes), one call per step, each handing its values to the
next (episodes → returns → advantages → rows → losses); :func:`stage` names and times the rollout, update and sync:

1. sample (``_sample``): a batch of tasks u ~ p(U), each rolled out G times (the GRPO group), and a learning mode per
   batch or group, ``on`` / ``on_tips`` / ``off_tips`` (the three modes; ``TaskSampler``, ``ModeSampler``).
2. roll out (``_roll_out``): a ~ π_θ(·|s_t, u), or a ~ π_θ(·|s_t, u, tips_t) with tips_t = Retr(s_t; M) in the
   memory modes (the memory-augmented prompt; :func:`empo2.episodes.rollout.run_episodes`).
3. reflect (``_reflect``): at an episode's end the policy writes a tip into the memory M, the non-parametric update
   (:func:`empo2.episodes.reflection.reflect`; beside the update with :mod:`empo2.train.overlap`).
4. novelty (``_novelty``): the intrinsic reward r_int = 1/n of each state reached, n the number of similar states
   seen (the state-novelty reward; :func:`empo2.train.intrinsic.novelty_rewards`).
5. returns and advantages (``_advantages``): R = R_ext + w·R_int (computed once, carried to the record) and GRPO's
   group-normalised advantage A_i = (R_i − mean_G R) / (std_G R + ε), or GiGPO's or ProxMO's
   (:func:`empo2.algo.advantages.compute_advantages`).
6. update (``_update``): the modified GRPO loss, a clipped ratio ρ (for ``off_tips`` π_θ(a|s,u) / π_θold(a|s,u,tips)),
   the low-probability mask 1[π_θ(a|s,u) ≥ δ] and β·D_KL (:class:`empo2.train.update.PolicyUpdate`, ``algo.losses``).
7. sync (``_sync``): tips generated beside the update are written, a separate rollout backend takes the new weights.
8. record (``_env_steps``, ``_record``): the run's environment steps, samples, warnings, one line of ``metrics.jsonl``
   (:func:`empo2.train.batch.iteration_record`).

:meth:`Trainer.train` evaluates without memory on held-out variations (:mod:`empo2.episodes.evaluate`);
``docs/fidelity.md`` says where each step follows the paper, where the released code, and where neither.
"""

from __future__ import annotations

import json
import time
import zlib
from contextlib import contextmanager
from functools import partial
from pathlib import Path
from typing import Any

from empo2 import signals
from empo2.algo.advantages import AdvantageInput, compute_advantages, step_rewards
from empo2.algo.returns import intrinsic_weight
from empo2.envs.factory import env_label
from empo2.episodes.drivers import has_state, share_state
from empo2.episodes.episode import Episode
from empo2.episodes.evaluate import EvalPlan, evaluate, write_eval_tables
from empo2.episodes.reflection import reflect, tip_writers
from empo2.episodes.rollout import timed
from empo2.parallel import sharding
from empo2.policy.seeded import row_seed
from empo2.rundir import checkpoint as ckpt
from empo2.rundir.metrics import iteration_line, plot_run, reset_peak_rss
from empo2.rundir.resume import settings_digest
from empo2.train.batch import (
    Batch,
    append_samples,
    batch_env_steps,
    batch_expert_steps,
    iteration_record,
    no_signal_warnings,
    ran_episodes,
)
from empo2.train.build import TrainerParts
from empo2.train.intrinsic import novelty_rewards
from empo2.train.overlap import PendingReflection
from empo2.train.rows import update_rows


class Trainer(TrainerParts):
    """Train an LLM agent with the config's algorithm (EMPO², GRPO, GiGPO, LUFFY, ProxMO, ELPO …).

    Built from a :class:`~empo2.config.Config` and, where given, its parts; whatever is not given is made from the
    config (``policy.model`` loaded, ``env.name``'s worker processes started, the run folder's memory opened):

    - ``model`` / ``tokenizer``: a Hugging Face causal LM and its tokenizer. LoRA is put on it per ``policy.lora``
      unless it already carries adapters (a PEFT model is trained as it is).
    - ``env``: an environment factory (``factory()`` returns one environment on the TextEnv protocol; the trainer
      builds as many as it plays episodes at once, in this process), or a ready pool of environment workers
      (:class:`~empo2.envs.pool.EnvPool`). ``env.name`` must still be registered: it names the tasks and the prompt's
      guide.
    - ``memory``: a :class:`~empo2.memory.store.TipMemory` to retrieve tips from and write them to.
    - ``embedder``: the sentence embedder of retrieval and novelty (default: ``memory.embedder``, loaded).
    - ``output_dir``: the run folder (metrics, checkpoints, evaluations, ``memory.sqlite``). Without one the trainer
      writes to a temporary folder that :meth:`close` deletes, so nothing is kept but what :meth:`train` and
      :meth:`iteration` return. ``resume=True`` continues the run in ``output_dir`` from its last checkpoint.

    The trainer works on a copy of ``config``: ``trainer.cfg`` holds what it settled (``auto`` precision and engine,
    :mod:`empo2.train.compute`), the caller's config reads as before. Parts given to the trainer stay the caller's:
    :meth:`close` closes only what the trainer made (:mod:`empo2.train.build` makes the parts). :meth:`train` runs
    the whole loop (iterations, evaluations, checkpoints, a final evaluation); :meth:`iteration` runs one iteration and
    returns its metrics record. The command ``empo2 train`` builds this class and calls :meth:`train`; the run
    folder's lock and its ``config.yaml`` are the command's.

    Example (ScienceWorld's workers are spawned processes, which import the script again: keep the work under
    ``if __name__ == "__main__":``; an environment factory plays in this process and needs no guard)::

        from empo2 import Config, Trainer

        if __name__ == "__main__":
            cfg = Config.load("configs/scienceworld_cpu.yaml", ["train.iterations=2", "algo.num_generations=2"])
            with Trainer(cfg, output_dir="runs/demo") as trainer:
                record = trainer.iteration()  # iteration 0: rollouts, reflection, advantages, update
                print(record["train"]["score_mean"], record["loss"].get("optimizer_steps"))
                final = trainer.train()  # iteration 1 (logged, checkpointed) and the final evaluation
    """

    # ----------------------------------------------------------------------------------------------- loop
    def train(self, progress=None) -> dict[str, Any]:
        cfg = self.cfg
        last_eval = None
        start_done = self.dist.broadcast_object((self.run_dir / "eval" / "start.json").is_file())  # rank 0's view
        if cfg.train.eval_at_start and self.next_iteration == 0 and not start_done:
            signals.set_phase("the start evaluation")
            # the untrained policy: a learning curve's point at 0 env steps
            start = self.evaluate(tag="start", progress=progress)
            self._say(f"start eval (no memory, {cfg.env.eval_split}): score {start['summary']['score_mean']:.1f}")
            signals.set_phase("the step from the start evaluation to iteration 0")
        if self.dist.is_main and self.next_iteration < cfg.train.iterations:  # training is left to do, so
            for stale in ("final.json", "final.md"):  # a final eval already here (a resume that added iterations) is old
                (self.run_dir / "eval" / stale).unlink(missing_ok=True)
        for it in range(self.next_iteration, cfg.train.iterations):
            t_iter = time.perf_counter()
            with signals.grace(cfg.train.preempt_save):  # a SIGTERM waits for this iteration's checkpoint
                record = self.iteration(it, progress)
                stopping = bool(self.dist.all_reduce([float(signals.stop_requested())], op="max")[0])  # ranks agree
                if cfg.train.eval_every and (it + 1) % cfg.train.eval_every == 0 and it + 1 < cfg.train.iterations \
                        and not stopping:
                    signals.set_phase(f"the evaluation after iteration {it}")
                    last_eval = self.evaluate(tag=f"iter_{it:06d}", progress=progress)
                    record["eval"] = last_eval["summary"]
                record["time"]["iteration"] = time.perf_counter() - t_iter
                if self.metrics is not None:
                    self.metrics.log(record)
                if (it + 1) % cfg.train.save_every == 0 or it + 1 == cfg.train.iterations or signals.stop_requested():
                    signals.set_phase(f"the checkpoint write of iteration {it}")
                    self.save(it)
                self._say(iteration_line(record))
                signals.raise_pending()
        signals.set_phase("the final evaluation")
        final = self.evaluate(tag="final", progress=progress)
        score = final["summary"]["score_mean"]
        start_file = self.run_dir / "eval" / "start.json"
        versus = ""
        if start_file.is_file():  # the learning this run shows, said in the last line a user reads
            before = json.loads(start_file.read_text())["summary"]["score_mean"]
            versus = f" ({score - before:+.1f} over the start eval's {before:.1f})"
        self._say(f"final eval (no memory, {cfg.env.eval_split}): score {score:.1f}{versus}, "
                  f"success {final['summary']['success_rate']:.2f}")
        if self.dist.is_main:
            plot_run(self.run_dir)
        return final

    def iteration(self, it: int | None = None, progress=None) -> dict[str, Any]:
        """One iteration of the paper's loop, one call per step (the module docstring maps them to the paper); each
        step takes the values it needs and returns the ones it makes.

        ``it`` (default: the one after the last played) seeds the iteration and sets the intrinsic schedule; the
        returned record is what :meth:`train` logs to ``metrics.jsonl`` (this call logs and saves nothing)."""
        it = self.next_iteration if it is None else it
        self.next_iteration = it + 1
        seconds = {"rollout": 0.0, "update": 0.0, "sync": 0.0}
        modes, specs, seed = self._sample(it)
        with stage("rollout", it, seconds):
            episodes, stats = self._roll_out(it, specs, seed, progress)
            self.ctx.step_counter += stats["step_waves"]  # the memory clock; a reflection sets it (data parallel)
            episodes, stats, pending = self._reflect(episodes, stats, seed)
        weight, episodes = self._novelty(it, episodes)
        returns, advantages, advantage_metrics = self._advantages(episodes, weight)
        with stage("update", it, seconds):
            losses = self._update(episodes, advantages, progress)
        episodes, stats = self._sync(it, episodes, stats, pending, losses, seconds)
        batch = Batch(it, modes, specs, episodes, stats, weight, returns, advantage_metrics, losses, seconds)
        whole = self.dist.whole_batch(batch)  # rank 0 reports every rank's episodes, stats and losses
        self.env_steps, self.expert_env_steps = self._env_steps(whole)
        return self._record(batch, whole)

    def _sample(self, it: int) -> tuple[list[str], list[tuple[str, int, int, str]], int | None]:
        """Tasks and a mode per group: the same global batch on every rank. Returns the mode of each group, this
        rank's rollouts (task, variation, group, mode), G per group, and the iteration's sampling seed
        (``policy.seeded_sampling``: each row samples from its own stream seeded by (this, group, member, turn);
        ``None``: unseeded)."""
        cfg = self.cfg
        self.dist.seed_iteration(cfg.train.seed, it)
        picks = self.task_sampler.sample(cfg.train.tasks_per_batch)
        modes = self.mode_sampler.sample(len(picks))
        specs = [(task, var, g, modes[g]) for g, (task, var) in enumerate(picks) if self.dist.owns(g)
                 for _ in range(cfg.algo.num_generations)]
        return modes, specs, row_seed(cfg.train.seed, it) if cfg.policy.seeded_sampling else None

    def _roll_out(self, it: int, specs, seed: int | None, progress) -> tuple[list[Episode], dict[str, float]]:
        """Play every rollout to the end (with tips retrieved in the memory modes); returns the episodes and the
        rollout's times and token counts."""
        cfg = self.cfg
        reset_peak_rss()
        with sharding.generating(self.model, cfg.policy.autocast, self.ctx.backend):
            progress_fn = partial(_rollout_progress, progress, it)
            episodes, stats = self.rollout(self.ctx, specs, self.sampling, cfg, progress_fn, seed)
        share_state(self.rollout, self.dist.all_gather)
        return episodes, stats

    def _reflect(self, episodes: list[Episode], stats: dict[str, float], seed: int | None):
        """Each finished episode writes its tip into memory (memory algorithms only). Returns the episodes noting
        their tips, the stats with the reflection's time added to the memory time, and ``None``; or, with
        ``overlap_reflection``, the episodes and stats as they were and the reflection started on another thread
        while the update trains (:meth:`_sync` writes its tips)."""
        if self.memory is None:
            return episodes, stats, None
        writers = tip_writers(episodes, self.cfg.memory)
        if self.reflection is not None:
            return episodes, stats, self.reflection.start(self.ctx, episodes, writers, seed)
        stats = dict(stats)
        with timed(stats, "memory_time"), sharding.generating(self.model, self.cfg.policy.autocast, self.ctx.backend):
            episodes = reflect(self.ctx, episodes, writers, seed)
        return episodes, stats, None

    def _novelty(self, it: int, episodes: list[Episode]) -> tuple[float, list[Episode]]:
        """The intrinsic weight w of this iteration and the episodes with every step's novelty reward where w > 0."""
        weight = intrinsic_weight(self.cfg.algo, it, self.cfg.train.iterations)
        if weight > 0:  # counted over the whole batch, over every rank's episodes
            episodes = novelty_rewards(self.novelty, self.embedder, episodes, self.dist)
        return weight, episodes

    def _advantages(self, episodes: list[Episode], weight: float):
        """The returns R [N] and per-step advantages of the episodes that ran, and the advantage metrics (a streak of
        lost episodes stops the run)."""
        if self.env_failures.update([ep.error if ep.failed else None for ep in episodes], self.run_dir):
            self._say(f"[warning] {sum(ep.failed for ep in episodes)} episode(s) lost to a crashed environment "
                      "worker (restarted); they are left out of this update")
        algo, ran = self.cfg.algo, ran_episodes(episodes)
        rewards = step_rewards(ran, weight, algo.intrinsic_aggregation)
        # the returns: the sums of the step rewards
        inputs = AdvantageInput.from_rewards(ran, rewards, algo, gather=self.dist.all_gather)
        advantages, metrics = compute_advantages(self.algorithm.estimator(algo), inputs)
        return inputs.returns, advantages, metrics

    def _update(self, episodes: list[Episode], advantages, progress) -> dict[str, float]:
        """The algorithm's policy-gradient steps on every generated action of the episodes that ran; returns the
        loss metrics (none where the algorithm trains no weights)."""
        rows = update_rows(ran_episodes(episodes), advantages, self.algorithm.row_extras)
        return self.update(rows, progress) if self.algorithm.updates_weights else {}

    def _sync(self, it: int, episodes: list[Episode], stats: dict[str, float], pending: PendingReflection | None,
              losses: dict[str, float], seconds: dict[str, float]) -> tuple[list[Episode], dict[str, float]]:
        """Memory and the rollout backend catch up with the update: tips generated beside it are written (returns
        the episodes noting them, and the stats with their time), and a separate backend (vLLM) takes the new
        weights, so the next rollouts sample from the updated policy."""
        if pending is not None:
            stats = dict(stats)
            with timed(stats, "memory_time"):
                episodes = self.reflection.finish(self.ctx, episodes, pending)
        if self.ctx.backend is not None and losses.get("optimizer_steps"):
            with stage("sync", it, seconds, mark=False):  # part of the update's phase
                self.ctx.backend.sync_weights(self.model)
        return episodes, stats

    def _env_steps(self, whole: Batch) -> tuple[int, int]:
        """The run's environment steps, the policy's and the expert members', with the whole batch's added."""
        return self.env_steps + batch_env_steps(whole), self.expert_env_steps + batch_expert_steps(whole)

    def _record(self, batch: Batch, whole: Batch) -> dict[str, Any]:
        """Samples of this rank's episodes, the warnings, and the metrics record of the whole batch."""
        if self.dist.is_main:  # rank 0 writes samples of its own (full) episodes
            append_samples(self.run_dir / "trajectories.jsonl", batch, self.cfg.train.sample_trajectories, self.tokenizer)
        self.zero_adv_streak, warnings = no_signal_warnings(whole, self.zero_adv_streak, self.cfg.train)
        for text in warnings:
            self._say(text)
        memory_size = self.memory.stats()["tips"] if self.memory is not None else 0
        return iteration_record(whole, self.cfg.algo.intrinsic_aggregation, memory_size, self.env_steps,
                                self.expert_env_steps, self.method_metrics)

    # ----------------------------------------------------------------------------------------------- eval/save
    def evaluate(self, tag: str, with_memory: bool = False, progress=None) -> dict[str, Any]:
        """Play the held-out episodes (``env.eval_split``) and write ``eval/<tag>.json`` and ``.md``.

        An evaluation leaves the training as it was: it draws from streams of its own, seeded by (``train.seed``,
        ``tag``, rank), and its environment steps are not the run's (the step counter that dates tips is put back).
        Its result is therefore a function of the weights, the seed and the tag: the start evaluation is the same for
        every algorithm with the same untrained model and evaluation settings, whatever the process did before."""
        cfg = self.cfg
        stream = row_seed(cfg.train.seed, zlib.crc32(tag.encode()), self.dist.rank)
        seed = row_seed(cfg.train.seed, zlib.crc32(tag.encode())) if cfg.policy.seeded_sampling else None
        counter = self.ctx.step_counter
        with ckpt.separate_stream(stream), sharding.generating(self.model, self.cfg.policy.autocast, self.ctx.backend):
            result = evaluate(self.ctx, self.task_names, EvalPlan.from_config(cfg, self.pool_size, with_memory),
                              dist=self.dist, progress=None if progress is None else partial(progress, f"eval {tag}"),
                              seed=seed)
        self.ctx.step_counter = counter
        if self.dist.is_main:
            write_eval_tables(result, self.run_dir / "eval", tag, label=env_label(cfg.env))
        return result

    def save(self, it: int) -> Path | None:
        if not self.dist.is_main and not self.dist.sharded:  # sharded: every rank writes its shards
            return None
        state = {"task_sampler": self.task_sampler.state_dict(), "mode_sampler": self.mode_sampler.state_dict(),
                 "novelty": self.novelty.state_dict(), "zero_adv_streak": self.zero_adv_streak,
                 "step_counter": self.ctx.step_counter,
                 "env_steps": self.env_steps, "expert_env_steps": self.expert_env_steps,
                 **({self.rollout.state_key: self.rollout.state_dict()} if has_state(self.rollout) else {}),
                 "config": self.cfg.to_dict(), "settings_digest": settings_digest(self.cfg)}
        copy = self.memory.copy_to if self.memory is not None else None
        if self.dist.sharded:
            return ckpt.save_sharded(self.run_dir, it, self.model, self.optimizer, state, copy,
                                     self.cfg.train.keep_checkpoints, self.dist)
        return ckpt.save_checkpoint(self.run_dir, it, self.model, self.optimizer, state, copy,
                                    self.cfg.train.keep_checkpoints)

    def __enter__(self) -> Trainer:
        return self

    def __exit__(self, *exc: Any) -> None:
        self.close()


@contextmanager
def stage(name: str, it: int, seconds: dict[str, float], mark: bool = True):
    """One stage of iteration ``it``: names it the process's phase (``the rollout of iteration 3``, for the stop
    message and the ``-v`` log; a safe point) unless ``mark`` is off, and adds its wall time to ``seconds[name]``."""
    if mark:
        signals.set_phase(f"the {name}", where=f"iteration {it}")
    with timed(seconds, name):
        yield


def _rollout_progress(progress, it: int, done: int, total: int) -> None:
    if progress is not None:
        progress(f"iter {it}: rollouts", done, total)
    if done == total:  # every episode has ended: the end-of-episode reflection follows
        signals.set_phase("the reflection", keep_where=True)

