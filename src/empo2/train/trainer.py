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
from collections import Counter
from pathlib import Path
from typing import Any

import numpy as np
import torch

from empo2.algo.advantages import combine_returns, compute_advantages, intrinsic_weight
from empo2.algo.losses import behaviour_logp_for_ratio, get_policy_loss
from empo2.algo.modes import ModeSampler
from empo2.config import Config
from empo2.envs.factory import env_label, make_env_kwargs, resolve_tasks
from empo2.envs.pool import EnvPool
from empo2.memory.embedder import get_embedder
from empo2.memory.novelty import NoveltyReward
from empo2.memory.store import TipMemory
from empo2.policy.loader import load_model
from empo2.policy.logprobs import response_logprobs
from empo2.train import checkpoint as ckpt
from empo2.train.evaluate import evaluate, write_eval_tables
from empo2.train.metrics import MetricsLog, plot_run
from empo2.train.rollout import Episode, RolloutContext, episode_record, novelty_rewards, run_episodes

log = logging.getLogger("empo2.train")


class TaskSampler:
    """Seeded choice of (task, train variation) pairs; its RNG state goes into checkpoints."""

    def __init__(self, tasks: dict[str, list[int]], seed: int):
        self.tasks = tasks
        self.rng = np.random.default_rng(seed)

    def sample(self, n: int) -> list[tuple[str, int]]:
        names = sorted(self.tasks)
        picks = self.rng.choice(len(names), size=n, replace=n > len(names))
        return [(names[i], int(self.rng.choice(self.tasks[names[i]]))) for i in picks]

    def state_dict(self) -> dict[str, Any]:
        return {"bit_generator": self.rng.bit_generator.state}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.rng.bit_generator.state = state["bit_generator"]


class Trainer:
    def __init__(self, cfg: Config, run_dir: Path, resume: bool = False, console=None):
        self.cfg, self.run_dir, self.console = cfg, Path(run_dir), console
        self.use_memory = cfg.algo.name == "empo2"
        seed = cfg.train.seed
        random.seed(seed), np.random.seed(seed), torch.manual_seed(seed)

        self.model, self.tokenizer = load_model(cfg.policy.model, cfg.policy.device, cfg.policy.dtype)
        self.model = self._adapt(self.model)
        self.optimizer = torch.optim.AdamW(
            [p for p in self.model.parameters() if p.requires_grad],
            lr=cfg.train.learning_rate, weight_decay=cfg.train.weight_decay,
        )
        self.embedder = get_embedder(cfg.memory.embedder)
        self.loss_fn = get_policy_loss(cfg.algo.name)

        names = resolve_tasks(cfg.env)
        env_kwargs = make_env_kwargs(cfg.env)
        self.pool_size = cfg.train.tasks_per_batch * cfg.algo.num_generations
        self.pool = EnvPool(cfg.env.name, env_kwargs, self.pool_size)
        train_vars = {}
        for name in names:
            variations = self.pool.call(0, "variations", name, "train")
            train_vars[name] = list(variations[: cfg.env.train_variations]) or list(variations[:1])
        self.task_names = names
        self.task_sampler = TaskSampler(train_vars, seed)
        self.mode_sampler = ModeSampler(cfg.mode_probs, seed=seed, granularity=cfg.algo.mode_granularity)
        self.novelty = NoveltyReward(cfg.algo.novelty_threshold)
        self.run_dir.mkdir(parents=True, exist_ok=True)  # only now: a bad task/model/Java error writes nothing
        self.memory = self._open_memory(resume) if self.use_memory else None
        self.metrics = MetricsLog(self.run_dir, cfg.train.tensorboard)
        self.start_iteration = 0
        self.zero_adv_streak = 0
        if resume:
            self._restore()
        self.ctx = RolloutContext(self.model, self.tokenizer, self.pool, self.embedder, self.memory, cfg.env.name,
                                  cfg.policy, cfg.memory)

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
        if not resume and mc.seed_from and not path.exists():
            shutil.copyfile(mc.seed_from, path)
        if resume and not path.exists():  # the live database is gone: fall back to the checkpoint's copy
            last = ckpt.latest_checkpoint(self.run_dir)
            if last is not None and (last / "memory.sqlite").is_file():
                shutil.copyfile(last / "memory.sqlite", path)
        return TipMemory(path, dim=self.embedder.dim, capacity=mc.capacity, eviction=mc.eviction,
                         dedup_threshold=mc.dedup_threshold, max_tip_words=mc.max_tip_words)

    def _restore(self) -> None:
        last = ckpt.latest_checkpoint(self.run_dir)
        if last is None:
            log.warning("no checkpoint in %s: starting from iteration 0", self.run_dir)
            self.metrics.truncate_after(-1)
            return
        state = ckpt.load_state(last)
        self._load_weights(last / "model")
        self.optimizer.load_state_dict(torch.load(last / "optimizer.pt", weights_only=False))
        self.task_sampler.load_state_dict(state["task_sampler"])
        self.mode_sampler.load_state_dict(state["mode_sampler"])
        self.novelty.load_state_dict(state["novelty"])
        self.zero_adv_streak = state.get("zero_adv_streak", 0)
        ckpt.set_rng_state(state["rng"])
        self.start_iteration = state["iteration"] + 1
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
        for it in range(self.start_iteration, cfg.train.iterations):
            t_iter = time.perf_counter()
            record = self.iteration(it, progress)
            if cfg.train.eval_every and (it + 1) % cfg.train.eval_every == 0 and it + 1 < cfg.train.iterations:
                last_eval = self.evaluate(tag=f"iter_{it:06d}")
                record["eval"] = last_eval["summary"]
            record["time"]["iteration"] = time.perf_counter() - t_iter
            self.metrics.log(record)
            if (it + 1) % cfg.train.save_every == 0 or it + 1 == cfg.train.iterations:
                self.save(it)
            self._say(_iteration_line(record))
        final = self.evaluate(tag="final")
        self._say(f"final eval (no memory, {cfg.env.eval_split}): score {final['summary']['score_mean']:.1f}, "
                  f"success {final['summary']['success_rate']:.2f}")
        plot_run(self.run_dir)
        return final

    def iteration(self, it: int, progress=None) -> dict[str, Any]:
        cfg = self.cfg
        G = cfg.algo.num_generations
        picks = self.task_sampler.sample(cfg.train.tasks_per_batch)
        modes = self.mode_sampler.sample(len(picks))
        specs = [(task, var, g, modes[g]) for g, (task, var) in enumerate(picks) for _ in range(G)]
        t0 = time.perf_counter()
        cb = (lambda done, total: progress(f"iter {it}: rollouts", done, total)) if progress else None
        episodes, rstats = run_episodes(self.ctx, specs, temperature=cfg.policy.temperature, reflect=None
                                        if self.use_memory else False, progress=cb)
        t_rollout = time.perf_counter() - t0

        w = intrinsic_weight(it, cfg.train.iterations, cfg.algo.intrinsic_schedule, cfg.algo.intrinsic_weight,
                             cfg.algo.intrinsic_weight_start, cfg.algo.intrinsic_weight_end)
        if w > 0:
            novelty_rewards(self.novelty, self.embedder, episodes)
        ok = [ep for ep in episodes if not ep.failed]
        returns = combine_returns([ep.extrinsic_return for ep in ok], [ep.intrinsic_return for ep in ok], w)
        adv, adv_metrics = compute_advantages(cfg.algo.advantage, returns, [ep.group for ep in ok],
                                              scale_rewards=cfg.algo.scale_rewards, eps=cfg.algo.adv_eps)
        t0 = time.perf_counter()
        loss_metrics = self.update(ok, adv.tolist(), progress)
        t_update = time.perf_counter() - t0

        self.zero_adv_streak = self.zero_adv_streak + 1 if adv_metrics["zero_adv_groups"] == adv_metrics["groups"] \
            else 0
        if self.zero_adv_streak >= cfg.train.zero_adv_warn_iters:
            self._say(f"[warning] {self.zero_adv_streak} iterations in a row with zero advantage in every group: "
                      "no learning signal (all rollouts of each task scored the same). Consider more generations, "
                      "easier tasks, memory rollouts or the intrinsic reward.")
        self._write_samples(it, episodes)
        mem_size = self.memory.stats()["tips"] if self.memory is not None else 0
        scores = [ep.score for ep in episodes]
        tokens = rstats["gen_tokens"]
        return {
            "iteration": it,
            "modes": modes,
            "mode_counts": dict(Counter(modes)),
            "train": {"score_mean": float(np.mean(scores)), "score_max": float(np.max(scores)),
                      "success_rate": float(np.mean([ep.success for ep in episodes])),
                      "return_mean": float(np.mean(returns)) if len(ok) else 0.0,
                      "intrinsic_mean": float(np.mean([ep.intrinsic_return for ep in ok])) if ok else 0.0,
                      "intrinsic_weight": w, "failed_episodes": len(episodes) - len(ok),
                      "steps_mean": float(np.mean([len(ep.steps) for ep in episodes]))},
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
            "long_prompts": rstats["long_prompts"],
        }

    # ----------------------------------------------------------------------------------------------- update
    def update(self, episodes: list[Episode], advantages: list[float], progress=None) -> dict[str, float]:
        """PPO epochs over token-budgeted micro-batches; one optimizer step per ``gradient_accumulation_steps``."""
        cfg, model = self.cfg, self.model
        rows = []  # (train_prompt, response, logp_old, advantage, mode, behaviour_prompt)
        for ep, a in zip(episodes, advantages):
            if a == 0.0 and cfg.algo.beta == 0:
                continue  # zero advantage and no KL term: the row's loss and gradient are exactly zero
            for s in ep.steps:
                if s.response_ids:
                    rows.append((s.train_prompt_ids, s.response_ids, s.logp_old, a, ep.mode, s.prompt_ids))
        if not rows:
            return {"rows": 0, "response_tokens": 0, "tokens": 0, "optimizer_steps": 0, "skipped_steps": 0}
        total_tokens = sum(len(r[1]) for r in rows)
        if cfg.algo.off_policy_ratio == "tip_free":
            rows = self._tip_free_old_logp(rows)
        model.train()
        sums: Counter = Counter()
        n_mb = steps = skipped = 0
        for epoch in range(cfg.train.ppo_epochs):
            order = list(range(len(rows)))
            random.shuffle(order)
            batches = _token_batches([rows[i] for i in order], cfg.train.micro_batch_tokens)
            per_step = cfg.train.gradient_accumulation_steps or len(batches)
            self.optimizer.zero_grad(set_to_none=True)
            bad = False
            for b, batch in enumerate(batches):
                metrics, ok = self._backward(batch, total_tokens, len(rows))
                bad |= not ok
                for k, v in metrics.items():
                    sums[k] += v
                n_mb += 1
                if progress:
                    progress("update", b + 1, len(batches))
                if (b + 1) % per_step == 0 or b + 1 == len(batches):
                    if self._step(inputs_ok=not bad):
                        steps += 1
                    else:
                        skipped += 1
                    bad = False
        model.eval()
        out = {k: v / max(n_mb, 1) for k, v in sums.items()}
        processed = sum(len(r[0]) + len(r[1]) for r in rows) * cfg.train.ppo_epochs  # prompt + response tokens
        out.update(rows=len(rows), response_tokens=total_tokens, tokens=processed, optimizer_steps=steps,
                   skipped_steps=skipped)
        return out

    def _backward(self, batch, total_tokens: int, total_rows: int) -> tuple[dict[str, float], bool]:
        cfg = self.cfg
        prompts = [r[0] for r in batch]
        responses = [r[1] for r in batch]
        logp_new, mask = response_logprobs(self.model, prompts, responses, self.tokenizer.pad_token_id)
        logp_old = _pad([r[2] for r in batch], logp_new.shape[1])
        adv = torch.tensor([r[3] for r in batch], dtype=torch.float32)
        modes = [r[4] for r in batch]
        logp_ref = None
        if cfg.algo.beta > 0:
            with torch.no_grad(), self._reference():
                logp_ref, _ = response_logprobs(self.model, prompts, responses, self.tokenizer.pad_token_id)
        loss, metrics = self.loss_fn(
            logp_new, logp_old.to(logp_new.device), adv.to(logp_new.device), mask, logp_ref=logp_ref, modes=modes,
            epsilon=cfg.algo.epsilon, epsilon_high=cfg.algo.epsilon_high, dual_clip=cfg.algo.dual_clip,
            delta=cfg.algo.delta, mask_granularity=cfg.algo.mask_granularity, beta=cfg.algo.beta,
            aggregation=cfg.algo.loss_aggregation,
        )
        # The loss is a mean inside the micro-batch; weight it by its share so the sum over micro-batches equals
        # the mean over the whole iteration (token-mean: share of tokens; sequence-mean: share of rows).
        share = (mask.sum().item() / total_tokens) if cfg.algo.loss_aggregation == "token_mean" \
            else len(batch) / total_rows
        if metrics.get("skipped", 0.0) == 0.0:
            (loss * share).backward()
        return metrics, metrics.get("skipped", 0.0) == 0.0

    def _step(self, inputs_ok: bool) -> bool:
        params = [p for p in self.model.parameters() if p.requires_grad]
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
    def _tip_free_old_logp(self, rows):
        """Pre-release variant: recompute off_tips rows' old log-probs on the tip-free prompt before the update."""
        out = []
        for r in rows:
            if r[4] == "off_tips":
                lp, _ = response_logprobs(self.model, [r[0]], [r[1]], self.tokenizer.pad_token_id)
                new_old = behaviour_logp_for_ratio("off_tips", torch.tensor(r[2]), lp[0], variant="tip_free")
                r = (r[0], r[1], new_old.tolist(), r[3], r[4], r[5])
            out.append(r)
        return out

    # ----------------------------------------------------------------------------------------------- eval/save
    def evaluate(self, tag: str, with_memory: bool = False) -> dict[str, Any]:
        cfg = self.cfg
        result = evaluate(self.ctx, self.task_names, cfg.env.eval_split, cfg.env.eval_variations,
                          cfg.train.eval_episodes_per_task, cfg.policy.eval_temperature, self.pool_size,
                          with_memory=with_memory)
        write_eval_tables(result, self.run_dir / "eval", tag, label=env_label(cfg))
        return result

    def save(self, it: int) -> Path:
        state = {"task_sampler": self.task_sampler.state_dict(), "mode_sampler": self.mode_sampler.state_dict(),
                 "novelty": self.novelty.state_dict(), "zero_adv_streak": self.zero_adv_streak,
                 "config": self.cfg.to_dict()}
        copy = self.memory.copy_to if self.memory is not None else None
        return ckpt.save_checkpoint(self.run_dir, it, self.model, self.optimizer, state, copy,
                                    self.cfg.train.keep_checkpoints)

    def _write_samples(self, it: int, episodes: list[Episode]) -> None:
        n = self.cfg.train.sample_trajectories
        if n <= 0:
            return
        with open(self.run_dir / "trajectories.jsonl", "a") as fh:
            for ep in episodes[:n]:
                fh.write(json.dumps({"iteration": it, **episode_record(ep, self.tokenizer)}) + "\n")

    def _say(self, text: str) -> None:
        (self.console.print if self.console is not None else print)(text)

    def close(self) -> None:
        self.pool.close()
        self.metrics.close()
        if self.memory is not None:
            self.memory.close()


def _mean(values: list[float]) -> float:
    return float(np.mean(values)) if values else 0.0


def _pad(rows: list[list[float]], width: int) -> torch.Tensor:
    out = torch.zeros((len(rows), width), dtype=torch.float32)
    for i, r in enumerate(rows):
        out[i, : len(r)] = torch.tensor(r, dtype=torch.float32)
    return out


def _token_batches(rows: list, budget: int) -> list[list]:
    """Split rows into micro-batches whose padded size (rows × longest prompt+response) stays within ``budget``."""
    batches, current, longest = [], [], 0
    for r in rows:
        length = len(r[0]) + len(r[1])
        if current and max(longest, length) * (len(current) + 1) > budget:
            batches.append(current)
            current, longest = [], 0
        current.append(r)
        longest = max(longest, length)
    if current:
        batches.append(current)
    return batches


def _iteration_line(r: dict[str, Any]) -> str:
    line = (f"iter {r['iteration']:>3} | modes {','.join(sorted(set(r['modes'])))} | "
            f"score {r['train']['score_mean']:6.1f} | success {r['train']['success_rate']:.2f} | "
            f"memory {r['memory']['size']:>4} (+{r['memory']['added']}) | "
            f"zero-adv groups {r['advantage']['zero_adv_groups']}/{r['advantage']['groups']} | "
            f"rollout {r['time']['rollout']:.0f}s update {r['time']['update']:.0f}s")
    if r.get("eval"):
        line += f" | eval {r['eval']['score_mean']:.1f}"
    return line
