"""The EMPO² / GRPO training loop (SPEC §1): sample tasks and a mode, roll out groups, reflect into memory,
compute group advantages (with the novelty reward), and take clipped policy-gradient steps — with evaluation,
atomic checkpoints, resume, metrics, TensorBoard and plots.
"""

from __future__ import annotations

import json
import logging
import random
import shutil
import time
import zlib
from collections import Counter
from pathlib import Path
from typing import Any

import numpy as np
import torch

from empo2.algo.advantages import (AdvantageInput, AdvantageOptions, combine_returns, compute_advantages,
                                   intrinsic_weight)
from empo2.algo.losses import behaviour_logp_for_ratio, get_policy_loss
from empo2.algo.modes import ModeSampler
from empo2.config import Config, ConfigError
from empo2.envs.factory import env_label, make_env_kwargs, resolve_tasks
from empo2.envs.pool import FailureStreak, make_pool
from empo2.memory.embedder import get_embedder
from empo2.memory.novelty import NoveltyReward
from empo2.memory.store import TipMemory
from empo2.policy.backend import check_backend, make_backend
from empo2.policy.loader import autocast_context, check_precision, load_model, resolve_model_path
from empo2.policy.logprobs import response_logprobs, shared_micro_batches
from empo2.policy.prefix import configure_model
from empo2.policy.seeded import row_seed
from empo2.train import checkpoint as ckpt
from empo2.train import distributed as dp
from empo2.train.evaluate import evaluate, write_eval_tables
from empo2.train.intrinsic import novelty_rewards
from empo2.train.metrics import MetricsLog, iteration_line, peak_rss_gb, plot_run, reset_peak_rss
from empo2.train.rollout import Episode, RolloutContext, episode_record, run_episodes
from empo2.train.rows import UpdateRow, update_rows
from empo2.train.sampling import TaskSampler

log = logging.getLogger("empo2.train")


class Trainer:
    def __init__(self, cfg: Config, run_dir: Path, resume: bool = False, console=None):
        self.cfg, self.run_dir, self.console = cfg, Path(run_dir), console
        self.algorithm = cfg.algorithm  # the registry entry: memory use, modes, loss, estimator
        self.use_memory = self.algorithm.uses_memory
        seed = cfg.train.seed
        random.seed(seed), np.random.seed(seed), torch.manual_seed(seed)
        check_precision(cfg.policy.dtype, cfg.policy.device, cfg.policy.lora, cfg.policy.autocast)
        check_backend(cfg.policy.backend)
        self.dist = dp.init_from_env()
        if cfg.train.tasks_per_batch < self.dist.world_size:
            raise ConfigError(f"train.tasks_per_batch ({cfg.train.tasks_per_batch}) must be at least the number of "
                              f"ranks ({self.dist.world_size}): each rank plays whole groups")

        self.model, self.tokenizer = load_model(cfg.policy.model, cfg.policy.device, cfg.policy.dtype)
        self.model = self._adapt(self.model)
        configure_model(self.model, cfg)  # prefix sharing, compute dtype, log-prob chunks
        self.optimizer = torch.optim.AdamW(
            [p for p in self.model.parameters() if p.requires_grad],
            lr=cfg.train.learning_rate, weight_decay=cfg.train.weight_decay,
        )
        self.embedder = get_embedder(cfg.memory.embedder)
        self.loss_fn = get_policy_loss(self.algorithm.loss)

        names = resolve_tasks(cfg.env)
        env_kwargs = make_env_kwargs(cfg.env)
        self.pool_size = self.dist.max_local(cfg.train.tasks_per_batch) * cfg.algo.num_generations
        self.pool = make_pool(cfg.env.pool, cfg.env.name, env_kwargs, self.pool_size)
        train_vars = {}
        for name in names:
            variations = self.pool.call(0, "variations", name, "train", retries=1)
            train_vars[name] = list(variations[: cfg.env.train_variations]) or list(variations[:1])
        self.task_names = names
        self.task_sampler = TaskSampler(train_vars, seed)
        self.mode_sampler = ModeSampler(self.algorithm.modes(cfg.algo), seed=seed,
                                        granularity=cfg.algo.mode_granularity)
        self.novelty = NoveltyReward(cfg.algo.novelty_threshold)
        if self.dist.is_main:  # rank 0 owns the run folder
            self.run_dir.mkdir(parents=True, exist_ok=True)  # only now: a bad task/model/Java error writes nothing
        self.memory = self._open_memory(resume) if self.use_memory else None
        self.metrics = MetricsLog(self.run_dir, cfg.train.tensorboard) if self.dist.is_main else None
        self.start_iteration = 0
        self.zero_adv_streak = 0
        self.resumed_step_counter = 0
        self.env_steps = 0  # environment steps of all training episodes so far (the run's budget spent)
        self.env_failures = FailureStreak(cfg.train.max_consecutive_env_failures)
        if resume:
            self._restore()
        self.dist.broadcast_params([p for p in self.model.parameters() if p.requires_grad])
        self.ctx = RolloutContext(self.model, self.tokenizer, self.pool, self.embedder, self.memory, cfg.env.name,
                                  cfg.policy, cfg.memory, step_counter=self.resumed_step_counter)
        if self.dist.enabled and self.memory is not None:
            self.ctx.memory_sync = dp.memory_sync(self.dist)
        if cfg.policy.backend != "hf":  # HF generates with self.model itself: nothing to build or sync
            self.ctx.backend = make_backend(cfg.policy.backend, self.model, self.tokenizer,
                                            resolve_model_path(cfg.policy.model),
                                            cfg.policy.lora_r if cfg.policy.lora else 0, cfg.policy.vllm_memory, seed)
            self.ctx.backend.sync_weights(self.model)

    # ----------------------------------------------------------------------------------------------- setup
    def _adapt(self, model):
        if not self.cfg.policy.lora:
            for p in model.parameters():
                p.requires_grad_(True)
            return model
        from peft import LoraConfig, get_peft_model

        pc = self.cfg.policy
        lora = LoraConfig(r=pc.lora_r, lora_alpha=pc.lora_alpha, lora_dropout=pc.lora_dropout,
                          target_modules=list(pc.lora_target_modules), task_type="CAUSAL_LM")
        return get_peft_model(model, lora)

    def _open_memory(self, resume: bool) -> TipMemory:
        path = self.run_dir / "memory.sqlite"
        mc = self.cfg.memory
        if not self.dist.is_main:  # a private replica of rank 0's memory, kept equal by memory_sync
            path = dp.write_replica(self.dist.broadcast_object(None), self.dist.rank)
        elif not resume and mc.seed_from and not path.exists():
            shutil.copyfile(mc.seed_from, path)
        elif resume and not path.exists():  # the live database is gone: fall back to the checkpoint's copy
            last = ckpt.latest_checkpoint(self.run_dir)
            if last is not None and (last / "memory.sqlite").is_file():
                shutil.copyfile(last / "memory.sqlite", path)
        memory = TipMemory(path, dim=self.embedder.dim, capacity=mc.capacity, eviction=mc.eviction,
                           dedup_threshold=mc.dedup_threshold, max_tip_words=mc.max_tip_words)
        if self.dist.enabled and self.dist.is_main:  # the other ranks start their replicas from these bytes
            self.dist.broadcast_object(dp.database_bytes(memory))
        return memory

    def _restore(self) -> None:
        last = self.dist.broadcast_object(ckpt.latest_checkpoint(self.run_dir))  # rank 0 decides which one
        if last is None:
            log.warning("no checkpoint in %s: starting from iteration 0", self.run_dir)
            if self.metrics is not None:
                self.metrics.truncate_after(-1)
            return
        state = ckpt.load_state(last)
        self._load_weights(last / "model")
        self.optimizer.load_state_dict(torch.load(last / "optimizer.pt", weights_only=False))
        self.task_sampler.load_state_dict(state["task_sampler"])
        self.mode_sampler.load_state_dict(state["mode_sampler"])
        self.novelty.load_state_dict(state["novelty"])
        self.zero_adv_streak = state.get("zero_adv_streak", 0)
        self.resumed_step_counter = state.get("step_counter", 0)
        self.env_steps = state.get("env_steps", 0)
        ckpt.set_rng_state(state["rng"])
        self.start_iteration = state["iteration"] + 1
        if self.metrics is not None:
            self.metrics.truncate_after(state["iteration"])
        log.info("resumed from %s: next iteration %d", last, self.start_iteration)

    def _load_weights(self, folder: Path) -> None:
        from safetensors.torch import load_file

        files = sorted(folder.glob("*.safetensors"))
        if self.cfg.policy.lora:
            from peft import set_peft_model_state_dict

            set_peft_model_state_dict(self.model, load_file(str(folder / "adapter_model.safetensors")))
        else:
            state = {}
            for f in files:
                state.update(load_file(str(f)))
            self.model.load_state_dict(state, strict=False)

    # ----------------------------------------------------------------------------------------------- loop
    def train(self, progress=None) -> dict[str, Any]:
        cfg = self.cfg
        last_eval = None
        start_done = self.dist.broadcast_object((self.run_dir / "eval" / "start.json").is_file())  # rank 0's view
        if cfg.train.eval_at_start and self.start_iteration == 0 and not start_done:
            rng, counter = ckpt.rng_state(), self.ctx.step_counter  # training then runs as without this evaluation
            start = self.evaluate(tag="start")  # the untrained policy: a learning curve's point at 0 env steps
            ckpt.set_rng_state(rng)
            self.ctx.step_counter = counter
            self._say(f"start eval (no memory, {cfg.env.eval_split}): score {start['summary']['score_mean']:.1f}")
        for it in range(self.start_iteration, cfg.train.iterations):
            t_iter = time.perf_counter()
            record = self.iteration(it, progress)
            if cfg.train.eval_every and (it + 1) % cfg.train.eval_every == 0 and it + 1 < cfg.train.iterations:
                last_eval = self.evaluate(tag=f"iter_{it:06d}")
                record["eval"] = last_eval["summary"]
            record["time"]["iteration"] = time.perf_counter() - t_iter
            if self.metrics is not None:
                self.metrics.log(record)
            if (it + 1) % cfg.train.save_every == 0 or it + 1 == cfg.train.iterations:
                self.save(it)
            self._say(iteration_line(record))
        final = self.evaluate(tag="final")
        self._say(f"final eval (no memory, {cfg.env.eval_split}): score {final['summary']['score_mean']:.1f}, "
                  f"success {final['summary']['success_rate']:.2f}")
        if self.dist.is_main:
            plot_run(self.run_dir)
        return final

    def iteration(self, it: int, progress=None) -> dict[str, Any]:
        cfg = self.cfg
        G = cfg.algo.num_generations
        self.dist.seed_iteration(cfg.train.seed, it)
        picks = self.task_sampler.sample(cfg.train.tasks_per_batch)  # the same global batch on every rank
        modes = self.mode_sampler.sample(len(picks))
        specs = [(task, var, g, modes[g]) for g, (task, var) in enumerate(picks) if self.dist.owns(g)
                 for _ in range(G)]
        self.ctx.sampling_seed = row_seed(cfg.train.seed, it) if cfg.policy.seeded_sampling else None
        reset_peak_rss()
        t0 = time.perf_counter()
        cb = (lambda done, total: progress(f"iter {it}: rollouts", done, total)) if progress else None
        with self._autocast():
            episodes, rstats = run_episodes(self.ctx, specs, temperature=cfg.policy.temperature, reflect=None
                                            if self.use_memory else False, progress=cb)
        t_rollout = time.perf_counter() - t0
        if self.env_failures.update([ep.error if ep.failed else None for ep in episodes], self.run_dir):
            self._say(f"[warning] {sum(ep.failed for ep in episodes)} episode(s) lost to a crashed environment "
                      "worker (restarted); they are left out of this update")

        w = intrinsic_weight(it, cfg.train.iterations, cfg.algo.intrinsic_schedule, cfg.algo.intrinsic_weight,
                             cfg.algo.intrinsic_weight_start, cfg.algo.intrinsic_weight_end)
        if w > 0:
            novelty_rewards(self.novelty, self.embedder, episodes,
                            gather=(lambda values, fn: dp.gather_in_order(self.dist, episodes, values, fn)))
        ok = [ep for ep in episodes if not ep.failed]
        intrinsic = [ep.intrinsic_return(cfg.algo.intrinsic_aggregation) for ep in ok]
        returns = combine_returns([ep.extrinsic_return for ep in ok], intrinsic, w)
        inputs = AdvantageInput.from_episodes(ok, returns, w, AdvantageOptions.from_config(cfg.algo),
                                              cfg.algo.intrinsic_aggregation)
        adv, adv_metrics = compute_advantages(self.algorithm.estimator(cfg.algo), inputs)  # one value per step
        t0 = time.perf_counter()
        rows = update_rows(ok, adv)
        loss_metrics = self.update(rows, progress) if self.algorithm.updates_weights else {}
        if self.ctx.backend is not None and loss_metrics.get("optimizer_steps"):
            self.ctx.backend.sync_weights(self.model)  # the next rollouts sample from the updated policy
        t_update = time.perf_counter() - t0
        self._write_samples(it, episodes)
        if self.dist.enabled:  # rank 0 reports the whole batch: every rank's episodes, stats and losses
            episodes = dp.gather_episodes(self.dist, episodes)
            ok = [ep for ep in episodes if not ep.failed]
            intrinsic = [ep.intrinsic_return(cfg.algo.intrinsic_aggregation) for ep in ok]
            returns = combine_returns([ep.extrinsic_return for ep in ok], intrinsic, w)
            rstats, adv_metrics, loss_metrics = dp.merge_stats(self.dist, rstats, adv_metrics, loss_metrics)

        self.zero_adv_streak = self.zero_adv_streak + 1 if adv_metrics["zero_adv_groups"] == adv_metrics["groups"] \
            else 0
        if self.zero_adv_streak >= cfg.train.zero_adv_warn_iters:
            self._say(f"[warning] {self.zero_adv_streak} iterations in a row with zero advantage in every group: "
                      "no learning signal (all rollouts of each task scored the same). Consider more generations, "
                      "easier tasks, memory rollouts or the intrinsic reward.")
        accepted = _mean([s.accepted for ep in episodes for s in ep.steps])
        if accepted < 0.5:
            self._say(f"[warning] only {accepted:.0%} of this iteration's actions were accepted by the environment: "
                      "the agent hardly acts, so returns carry little signal (see env.action_cutoff).")
        mem_size = self.memory.stats()["tips"] if self.memory is not None else 0
        scores = [ep.score for ep in episodes]
        tokens = rstats["gen_tokens"]
        steps = sum(len(ep.steps) for ep in episodes)
        self.env_steps += steps
        return {
            "iteration": it,
            "env_steps": self.env_steps,
            "modes": modes,
            "mode_counts": dict(Counter(modes)),
            "train": {"score_mean": float(np.mean(scores)), "score_max": float(np.max(scores)),
                      "success_rate": float(np.mean([ep.success for ep in episodes])),
                      "return_mean": float(np.mean(returns)) if len(ok) else 0.0,
                      "intrinsic_mean": _mean(intrinsic), "accepted_rate": accepted,
                      "intrinsic_weight": w, "failed_episodes": len(episodes) - len(ok),
                      "steps_mean": float(np.mean([len(ep.steps) for ep in episodes])), "env_steps": steps},
            "advantage": adv_metrics,
            "loss": loss_metrics,
            "memory": {"size": mem_size, "added": sum(1 for ep in episodes if ep.tip_written),
                       "rejected": sum(1 for ep in episodes if ep.tip_rejected),
                       "rejected_reasons": dict(Counter(ep.tip_rejected for ep in episodes if ep.tip_rejected)),
                       "tips_used_per_step": _mean([len(s.tip_ids) for ep in episodes for s in ep.steps])},
            "time": {"rollout": t_rollout, "update": t_update, "memory": rstats["memory_time"],
                     "generate": rstats["gen_time"], "env": rstats["env_time"]},
            "tokens_per_s": {"generate": tokens / max(rstats["gen_time"], 1e-9),
                             "update": loss_metrics.get("tokens", 0) / max(t_update, 1e-9)},
            "long_prompts": rstats["long_prompts"], "memory_peak_rss_gb": peak_rss_gb(),
        }

    # ----------------------------------------------------------------------------------------------- update
    def update(self, rows: list[UpdateRow], progress=None) -> dict[str, float]:
        """``num_iterations`` passes over the rows; each pass is shuffled and cut into mini-batches of
        ``mini_batch_size`` rows (0 = all), one optimizer step per mini-batch, each normalised by its own tokens.
        A mini-batch is processed in token-budgeted micro-batches whose gradients add up to the mini-batch's."""
        cfg, model = self.cfg, self.model
        rows = [r for r in rows if r.advantage != 0.0 or cfg.algo.beta > 0]  # else loss and gradient are exactly 0
        if not self.dist.all_reduce([len(rows)])[0]:  # data parallel: no rank has rows, so no rank steps
            return {"rows": 0, "response_tokens": 0, "tokens": 0, "optimizer_steps": 0, "skipped_steps": 0}
        if cfg.algo.off_policy_ratio == "tip_free":
            self._tip_free_old_logp(rows)
        model.train()
        sums: Counter = Counter()
        n_mb = steps = skipped = 0
        size = dp.local_mini_size(self.dist, cfg.train.mini_batch_size, len(rows))
        for _ in range(cfg.train.num_iterations):
            order = list(range(len(rows)))
            random.shuffle(order)
            minis = [[rows[i] for i in order[k:k + size]] for k in range(0, len(order), size)]
            for m in range(dp.step_count(self.dist, len(minis))):  # every rank takes as many steps
                mini = minis[m] if m < len(minis) else []  # a rank out of rows adds zero gradient
                # the loss is normalised over the global mini-batch (all ranks' m-th mini-batches)
                tokens, count = self.dist.all_reduce([sum(len(r.response) for r in mini), len(mini)])
                ok = True
                for batch in _token_batches(mini, cfg.train.micro_batch_tokens, cfg.policy.prefix_sharing):
                    metrics, batch_ok = self._backward(batch, tokens, count)
                    ok &= batch_ok
                    sums.update(metrics)
                    n_mb += 1
                if self._step(inputs_ok=ok):
                    steps += 1
                else:
                    skipped += 1
                if progress:
                    progress("update", m + 1, len(minis))
        model.eval()
        out = {k: v / max(n_mb, 1) for k, v in sums.items()}
        processed = sum(len(r.train_prompt) + len(r.response) for r in rows) * cfg.train.num_iterations
        out.update(rows=len(rows), response_tokens=sum(len(r.response) for r in rows), tokens=processed,
                   optimizer_steps=steps, skipped_steps=skipped)
        return out

    def _autocast(self):
        return autocast_context(next(self.model.parameters()).device, self.cfg.policy.autocast)

    def _backward(self, batch: list[UpdateRow], mini_tokens: float, mini_rows: float) -> tuple[dict[str, float], bool]:
        """Loss and backward of one micro-batch, weighted by its share of the mini-batch (its response tokens and
        rows over all ranks)."""
        cfg = self.cfg
        prompts = [r.train_prompt for r in batch]
        responses = [r.response for r in batch]
        with self._autocast():
            logp_new, mask = response_logprobs(self.model, prompts, responses, self.tokenizer.pad_token_id)
        logp_old = _pad([r.logp_old for r in batch], logp_new.shape[1]).to(logp_new.device)
        adv = torch.tensor([r.advantage for r in batch], dtype=torch.float32, device=logp_new.device)
        logp_ref = None
        if cfg.algo.beta > 0:
            with torch.no_grad(), self._reference(), self._autocast():
                logp_ref, _ = response_logprobs(self.model, prompts, responses, self.tokenizer.pad_token_id)
        loss, metrics = self.loss_fn(
            logp_new, logp_old, adv, mask, logp_ref=logp_ref, modes=[r.mode for r in batch],
            epsilon=cfg.algo.epsilon, epsilon_high=cfg.algo.epsilon_high, dual_clip=cfg.algo.dual_clip,
            delta=cfg.algo.delta, mask_granularity=cfg.algo.mask_granularity, beta=cfg.algo.beta,
            aggregation=cfg.algo.loss_type,
        )
        # The loss is a mean inside the micro-batch; weight it by its share so the micro-batches of a mini-batch add
        # up to the mean over the mini-batch (token_mean: share of tokens; sequence_mean: share of rows).
        share = mask.sum().item() / max(mini_tokens, 1) if cfg.algo.loss_type == "token_mean" \
            else len(batch) / mini_rows
        ok = metrics.get("skipped", 0.0) == 0.0
        if ok:
            (loss * share).backward()
        return metrics, ok

    def _step(self, inputs_ok: bool) -> bool:
        params = [p for p in self.model.parameters() if p.requires_grad]
        inputs_ok = self.dist.all_reduce_grads(params, inputs_ok)  # data parallel: sum over ranks; else a no-op
        norm = torch.nn.utils.clip_grad_norm_(params, self.cfg.train.max_grad_norm)
        if not inputs_ok or not torch.isfinite(norm):
            why = "non-finite loss inputs" if not inputs_ok else f"non-finite gradient norm ({float(norm)})"
            log.warning("%s: optimizer step skipped, weights unchanged", why)
            self.optimizer.zero_grad(set_to_none=True)
            return False
        self.optimizer.step()
        self.optimizer.zero_grad(set_to_none=True)
        return True

    def _reference(self):
        """The reference policy is the model with its LoRA adapter disabled (no second copy of the weights)."""
        if self.cfg.policy.lora:
            return self.model.disable_adapter()
        raise RuntimeError("algo.beta > 0 with full fine-tuning needs a reference copy; use policy.lora=true")

    @torch.no_grad()
    def _tip_free_old_logp(self, rows: list[UpdateRow]) -> None:
        """Pre-release variant: recompute off_tips rows' old log-probs on the tip-free prompt before the update."""
        for r in rows:
            if r.mode == "off_tips":
                with self._autocast():
                    lp, _ = response_logprobs(self.model, [r.train_prompt], [r.response], self.tokenizer.pad_token_id)
                r.logp_old = behaviour_logp_for_ratio("off_tips", torch.tensor(r.logp_old), lp[0],
                                                      variant="tip_free").tolist()

    # ----------------------------------------------------------------------------------------------- eval/save
    def evaluate(self, tag: str, with_memory: bool = False) -> dict[str, Any]:
        cfg = self.cfg
        self.ctx.sampling_seed = row_seed(cfg.train.seed, zlib.crc32(tag.encode())) if cfg.policy.seeded_sampling \
            else None
        with self._autocast():
            result = evaluate(self.ctx, self.task_names, cfg.env.eval_split, cfg.env.eval_variations,
                              cfg.train.eval_episodes_per_task, cfg.policy.eval_temperature, self.pool_size,
                              with_memory=with_memory, dist=self.dist)
        if self.dist.is_main:
            write_eval_tables(result, self.run_dir / "eval", tag, label=env_label(cfg))
        return result

    def save(self, it: int) -> Path | None:
        if not self.dist.is_main:
            return None
        state = {"task_sampler": self.task_sampler.state_dict(), "mode_sampler": self.mode_sampler.state_dict(),
                 "novelty": self.novelty.state_dict(), "zero_adv_streak": self.zero_adv_streak,
                 "step_counter": self.ctx.step_counter,
                 "env_steps": self.env_steps,
                 "config": self.cfg.to_dict()}
        copy = self.memory.copy_to if self.memory is not None else None
        return ckpt.save_checkpoint(self.run_dir, it, self.model, self.optimizer, state, copy,
                                    self.cfg.train.keep_checkpoints)

    def _write_samples(self, it: int, episodes: list[Episode]) -> None:
        n = self.cfg.train.sample_trajectories
        if n <= 0 or not self.dist.is_main:  # rank 0 writes samples of its own (full) episodes
            return
        with open(self.run_dir / "trajectories.jsonl", "a") as fh:
            for ep in episodes[:n]:
                fh.write(json.dumps({"iteration": it, **episode_record(ep, self.tokenizer)}) + "\n")

    def _say(self, text: str) -> None:
        if not self.dist.is_main:
            return
        if self.console is not None:
            self.console.print(text, soft_wrap=True)  # one line per message, also in logs and CI (no 80-col wrap)
        else:
            print(text)

    def close(self) -> None:
        self.pool.close()
        if self.metrics is not None:
            self.metrics.close()
        if self.memory is not None:
            self.memory.close()
        self.dist.close()


def _mean(values: list[float]) -> float:
    return float(np.mean(values)) if values else 0.0


def _pad(rows: list[list[float]], width: int) -> torch.Tensor:
    out = torch.zeros((len(rows), width), dtype=torch.float32)
    for i, r in enumerate(rows):
        out[i, : len(r)] = torch.tensor(r, dtype=torch.float32)
    return out


def _token_batches(rows: list[UpdateRow], budget: int, shared: bool = False) -> list[list[UpdateRow]]:
    """Split rows into micro-batches whose padded size (rows × longest prompt+response) stays within ``budget``."""
    if shared:  # rows sharing a prompt head go together, costed as computed (order in a mini-batch is free)
        idx = shared_micro_batches([r.train_prompt for r in rows], [r.response for r in rows], budget)
        return [[rows[i] for i in b] for b in idx]
    batches, current, longest = [], [], 0
    for r in rows:
        length = len(r.train_prompt) + len(r.response)
        if current and max(longest, length) * (len(current) + 1) > budget:
            batches.append(current)
            current, longest = [], 0
        current.append(r)
        longest = max(longest, length)
    if current:
        batches.append(current)
    return batches
