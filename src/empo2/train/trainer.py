"""The EMPO² / GRPO / GiGPO training loop, with evaluation, atomic checkpoints, resume and metrics.

One :meth:`Trainer.iteration` is one iteration of the paper's loop (EMPO², Liu et al., ICLR 2026, arXiv 2602.23008:
the Method section and its figure of the three learning modes), one call per step:

1. sample (``_sample``): a batch of tasks u ~ p(U), each rolled out G times (the GRPO group), and a learning mode per
   batch or group, ``on`` / ``on_tips`` / ``off_tips`` (the three modes; ``TaskSampler``, ``ModeSampler``).
2. roll out (``_roll_out``): a ~ π_θ(·|s_t, u), or a ~ π_θ(·|s_t, u, tips_t) with tips_t = Retr(s_t; M) in the
   memory modes (the memory-augmented prompt; :func:`empo2.episodes.rollout.run_episodes`).
3. reflect (``_reflect``): at an episode's end the policy writes a tip into the memory M, the non-parametric update
   (:func:`empo2.episodes.reflection.reflect`; beside the update with :mod:`empo2.train.overlap`).
4. novelty (``_novelty``): the intrinsic reward r_int = 1/n of each state reached, n the number of similar states
   seen (the state-novelty reward; :func:`empo2.train.intrinsic.novelty_rewards`).
5. returns and advantages (``_advantages``): R = R_ext + w·R_int and GRPO's group-normalised advantage
   A_i = (R_i − mean_G R) / (std_G R + ε), or GiGPO's or ProxMO's (:func:`empo2.algo.advantages.compute_advantages`).
6. update (``_update``): the modified GRPO loss, a clipped ratio ρ (for ``off_tips`` π_θ(a|s,u) / π_θold(a|s,u,tips)),
   the low-probability mask 1[π_θ(a|s,u) ≥ δ] and β·D_KL (:class:`empo2.train.update.PolicyUpdate`, ``algo.losses``).
7. sync (``_sync``): tips generated beside the update are written, a separate rollout backend takes the new weights.
8. record (``_record``): samples, warnings, one line of ``metrics.jsonl`` (:func:`empo2.train.batch.iteration_record`).

:meth:`Trainer.train` evaluates without memory on held-out variations (:mod:`empo2.episodes.evaluate`);
``docs/fidelity.md`` says where each step follows the paper, where the released code, and where neither.
"""

from __future__ import annotations

import json
import time
import zlib
from functools import partial
from pathlib import Path
from typing import Any

from empo2 import signals
from empo2.algo.advantages import (
    AdvantageInput,
    AdvantageOptions,
    compute_advantages,
    step_rewards,
)
from empo2.algo.empo2 import intrinsic_weight
from empo2.envs.factory import env_label
from empo2.episodes.drivers import rollout_driver
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
)
from empo2.train.build import TrainerParts
from empo2.train.intrinsic import novelty_rewards
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
        """One iteration of the paper's loop, one call per step (the module docstring maps them to the paper).

        ``it`` (default: the one after the last played) seeds the iteration and sets the intrinsic schedule; the
        returned record is what :meth:`train` logs to ``metrics.jsonl`` (this call logs and saves nothing)."""
        it = self.next_iteration if it is None else it
        self.next_iteration = it + 1
        batch = self._sample(it)
        self._roll_out(batch, progress)
        self._reflect(batch)
        self._novelty(batch)
        self._advantages(batch)
        self._update(batch, progress)
        self._sync(batch)
        return self._record(batch)

    def _sample(self, it: int) -> Batch:
        """Tasks and a mode per group: the same global batch on every rank; this rank's groups, G rollouts each."""
        cfg = self.cfg
        self.dist.seed_iteration(cfg.train.seed, it)
        picks = self.task_sampler.sample(cfg.train.tasks_per_batch)
        modes = self.mode_sampler.sample(len(picks))
        specs = [(task, var, g, modes[g]) for g, (task, var) in enumerate(picks) if self.dist.owns(g)
                 for _ in range(cfg.algo.num_generations)]
        seed = row_seed(cfg.train.seed, it) if cfg.policy.seeded_sampling else None
        return Batch(it, modes, specs, sampling_seed=seed)

    def _roll_out(self, batch: Batch, progress) -> None:
        """Play every rollout to the end (with tips retrieved in the memory modes)."""
        cfg, it = self.cfg, batch.iteration
        seed = batch.sampling_seed
        reset_peak_rss()
        signals.set_phase("the rollout", where=f"iteration {it}")
        with timed(batch.seconds, "rollout"), sharding.generating(self.model, cfg.policy.autocast, self.ctx.backend):
            progress_fn = partial(_rollout_progress, progress, it)
            if self.expert is not None:  # LUFFY: gold-path members
                batch.episodes, batch.stats = self.expert.play(self.ctx, batch.specs, self.sampling,
                                                               progress=progress_fn, seed=seed)
                # every rank knows every unreachable expert, as one process would (and rank 0 checkpoints them)
                found = self.dist.all_gather(self.expert.state_dict())
                self.expert.load_state_dict([pair for part in found for pair in part])
            else:  # G independent episodes, or ELPO's tree
                drive = rollout_driver(self.algorithm.rollout)
                batch.episodes, batch.stats = drive(self.ctx, batch.specs, self.sampling, cfg, progress_fn, seed)

    def _reflect(self, batch: Batch) -> None:
        """Each finished episode writes its tip into memory (memory algorithms only); with ``overlap_reflection``
        the tips are generated on another thread while the update trains, and written by :meth:`_sync`."""
        if self.memory is None:
            return
        writers = tip_writers(batch.episodes, self.cfg.memory)
        with timed(batch.seconds, "rollout"):
            if self.reflection is not None:
                batch.pending = self.reflection.start(self.ctx, batch.episodes, writers, batch.sampling_seed)
                return
            with timed(batch.stats, "memory_time"), sharding.generating(self.model, self.cfg.policy.autocast,
                                                                        self.ctx.backend):
                batch.episodes = reflect(self.ctx, batch.episodes, writers, batch.sampling_seed)

    def _novelty(self, batch: Batch) -> None:
        """The intrinsic weight of this iteration and, where it is on, every step's novelty reward."""
        batch.intrinsic_weight = intrinsic_weight(self.cfg.algo, batch.iteration, self.cfg.train.iterations)
        if batch.intrinsic_weight > 0:  # counted over the whole batch, over every rank's episodes
            batch.episodes = novelty_rewards(self.novelty, self.embedder, batch.episodes, self.dist)

    def _advantages(self, batch: Batch) -> None:
        """Returns and per-step advantages of the episodes that ran (a streak of lost episodes stops the run)."""
        episodes = batch.episodes
        if self.env_failures.update([ep.error if ep.failed else None for ep in episodes], self.run_dir):
            self._say(f"[warning] {sum(ep.failed for ep in episodes)} episode(s) lost to a crashed environment "
                      "worker (restarted); they are left out of this update")
        algo = self.cfg.algo
        batch.rewards = step_rewards(batch.ran, batch.intrinsic_weight, algo.intrinsic_aggregation)
        inputs = AdvantageInput.from_rewards(batch.ran, batch.rewards, AdvantageOptions.from_config(algo),
                                             gather=self.dist.all_gather)  # returns: the sums of the step rewards
        batch.advantages, batch.advantage_metrics = compute_advantages(self.algorithm.estimator(algo), inputs)

    def _update(self, batch: Batch, progress) -> None:
        """The algorithm's policy-gradient steps on every generated action of the episodes that ran."""
        signals.set_phase("the update", where=f"iteration {batch.iteration}")
        with timed(batch.seconds, "update"):
            rows = update_rows(batch.ran, batch.advantages)
            batch.losses = self.update(rows, progress) if self.algorithm.updates_weights else {}

    def _sync(self, batch: Batch) -> None:
        """Memory and the rollout backend catch up with the update: tips generated beside it are written, and a
        separate backend (vLLM) takes the new weights, so the next rollouts sample from the updated policy."""
        if batch.pending is not None:
            with timed(batch.stats, "memory_time"):
                batch.episodes = self.reflection.finish(self.ctx, batch.episodes, batch.pending)
        if self.ctx.backend is not None and batch.losses.get("optimizer_steps"):
            with timed(batch.seconds, "sync"):
                self.ctx.backend.sync_weights(self.model)

    def _record(self, batch: Batch) -> dict[str, Any]:
        """Samples of this rank's episodes, the warnings, and the metrics record of the whole batch."""
        if self.dist.is_main:  # rank 0 writes samples of its own (full) episodes
            append_samples(self.run_dir / "trajectories.jsonl", batch, self.cfg.train.sample_trajectories, self.tokenizer)
        whole = self.dist.whole_batch(batch)  # rank 0 reports every rank's episodes, stats and losses
        self.zero_adv_streak, warnings = no_signal_warnings(whole, self.zero_adv_streak, self.cfg.train)
        for text in warnings:
            self._say(text)
        self.env_steps += batch_env_steps(whole)
        self.expert_env_steps += batch_expert_steps(whole)
        memory_size = self.memory.stats()["tips"] if self.memory is not None else 0
        return iteration_record(whole, self.cfg.algo.intrinsic_aggregation, memory_size, self.env_steps,
                                self.expert_env_steps)

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
                 "expert_unreachable": self.expert.state_dict() if self.expert is not None else [],
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


def _rollout_progress(progress, it: int, done: int, total: int) -> None:
    if progress is not None:
        progress(f"iter {it}: rollouts", done, total)
    if done == total:  # every episode has ended: the end-of-episode reflection follows
        signals.set_phase("the reflection", keep_where=True)

