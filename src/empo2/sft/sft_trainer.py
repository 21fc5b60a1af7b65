"""The warm start (SPEC §11): behaviour cloning on the gold paths of training variations, a LoRA adapter like the RL
runs', before RL.

One epoch, top-down (:meth:`SFTTrainer.epoch`):

1. shuffle the demonstrations' episodes whole and cut their rows, in that order, into batches of ``sft.batch_rows``
   (most rows of a batch share their episode's prompt head, which runs once per batch; where rows chain, each
   episode stays whole in one batch, :meth:`SFTTrainer.batches`);
2. per batch, the negative log-likelihood of the targets (the gold action's tokens and the end-of-sequence token, a
   rollout's response) given the prompt a rollout renders at that step, summed over the batch's target tokens and
   divided by their number. Prompt tokens are inputs only: no prompt token is in the loss;
3. one AdamW step, the gradient clipped at ``train.max_grad_norm``.

Then the validation loss (gold episodes of the dev split of ``env.tasks``), the held-out evaluation (the first
``sft.eval_variations`` dev variations, played as a training run evaluates), a checkpoint, and, when the epoch is the
best so far (``sft.select``), the warm start (:mod:`empo2.rundir.warm_start`). The run folder::

    RUN/config.yaml  demos.json  metrics.jsonl  eval/epoch_NNN.{json,md}  checkpoints/iter_NNNNNN/  warm_start/

The loop is the project's own rather than TRL's ``SFTTrainer``: the rows are prompts the rollout code has already
rendered and tokenised (history window cut to ``policy.max_prompt_length`` by the prompt builder), the rows of an
episode share a long prompt head that :mod:`empo2.policy.prefix` computes once (TRL pads every row to its full
length), checkpoints are the run folder's atomic ones with checksums, and the held-out evaluation plays episodes
through the same rollout code as RL.
"""

from __future__ import annotations

import copy
import json
import math
import random
import time
from pathlib import Path
from typing import Any

import numpy as np
import torch

from empo2 import signals
from empo2.config import Config, ConfigError
from empo2.envs.factory import env_label, make_env_kwargs, resolve_tasks
from empo2.envs.local_pool import LocalEnvPool
from empo2.envs.pool import make_pool
from empo2.episodes.evaluate import EvalPlan, evaluate, write_eval_tables
from empo2.episodes.rollout import RolloutContext
from empo2.policy import loader
from empo2.policy import prefix as px
from empo2.policy.logprobs import packs_chains, response_logprobs, shared_micro_batches
from empo2.policy.packing import chain_batches, packed_batches, plan_packing
from empo2.policy.seeded import row_seed
from empo2.rundir import checkpoint as ckpt
from empo2.rundir import warm_start
from empo2.rundir.metrics import MetricsLog, peak_rss_gb, reset_peak_rss, trackers
from empo2.sft.demos import DemoRow, Demos, collect
from empo2.train.compute import decide


class SFTTrainer:
    """Make a warm start from a :class:`~empo2.config.Config` (its ``sft``, ``env`` and ``policy`` sections).

    ``model``/``tokenizer``: a Hugging Face causal LM without adapters and its tokenizer (default: ``policy.model``,
    loaded); ``env``: an environment factory played in this process, or a pool of workers (default: ``env.name``'s
    workers, as many as a training run plays at once, ``train.tasks_per_batch × algo.num_generations``);
    ``output_dir``: the run folder (default ``sft.output_dir``). :meth:`train` collects the demonstrations, runs the
    epochs and returns the warm start's record; ``policy.warm_start: <output_dir>`` then starts RL from it::

        cfg = Config.load("configs/scienceworld_reach_warm_cpu.yaml", ["sft.demos=8", "sft.epochs=1"])
        with SFTTrainer(cfg, output_dir="runs/sft_demo") as sft:
            print(sft.train()["metrics"])
    """

    def __init__(self, config: Config, model=None, tokenizer=None, env=None, *, output_dir: str | Path | None = None,
                 console=None):
        cfg = copy.deepcopy(config)
        if output_dir is not None:
            cfg.sft.output_dir = str(output_dir)
        self.check_config(cfg)
        # The warm start is made from the model itself; the run folder's config must not name it (an evaluation of
        # this folder would merge it under its own adapter).
        cfg.policy.warm_start, cfg.policy.warm_start_sha256 = None, None
        if (model is None) != (tokenizer is None):
            raise ConfigError("SFTTrainer: give the model together with its tokenizer, or neither")
        self.cfg, self.compute = decide(cfg)
        self.console = console
        self.run_dir = Path(cfg.sft.output_dir)
        seed = cfg.sft.seed
        random.seed(seed), np.random.seed(seed), torch.manual_seed(seed)
        loader.check_precision(cfg.policy.dtype, cfg.policy.device, True, self.cfg.policy.autocast)
        if model is None:
            model, tokenizer = loader.load_model(cfg.policy.model, cfg.policy.device, cfg.policy.dtype,
                                                 cfg.policy.trust_remote_code)
        if hasattr(model, "peft_config"):
            raise ConfigError("SFTTrainer: give the plain model; the warm start's LoRA adapter is made here")
        self.base = warm_start.base_record(cfg.policy.model, model, tokenizer)  # before the adapter goes on
        self.tokenizer = tokenizer
        self.model = loader.make_trainable(model, cfg.policy, cfg.train.gradient_checkpointing)
        self.optimizer = torch.optim.AdamW([p for p in self.model.parameters() if p.requires_grad],
                                           lr=cfg.sft.learning_rate, weight_decay=cfg.train.weight_decay)
        self.options = self.compute.update_options
        self.shared = self.options.prefix_sharing and not cfg.train.gradient_checkpointing
        size = cfg.train.tasks_per_batch * cfg.algo.num_generations
        self._owns_pool = env is None or not hasattr(env, "call")
        if env is None:
            self.pool = make_pool(cfg.env.pool, cfg.env.name, make_env_kwargs(cfg.env), size)
        else:
            self.pool = env if hasattr(env, "call") else LocalEnvPool(env, size)
        self.ctx = RolloutContext(self.model, tokenizer, self.pool, None, None, cfg.env.name, cfg.policy, cfg.memory,
                                  compute=self.compute.options)
        self.demos: Demos | None = None
        self.validation: Demos | None = None
        self.best: dict[str, Any] | None = None
        self.metrics: MetricsLog | None = None

    @staticmethod
    def check_config(cfg: Config) -> None:
        """What a warm start cannot be made under (one line, exit 2): full fine-tuning, or ``policy.warm_start`` naming
        another folder (a warm start is made from the model itself; a config may name the one it makes, so that one
        preset serves ``empo2 sft`` and then ``empo2 train``)."""
        if not cfg.policy.lora:
            raise ConfigError("empo2 sft trains a LoRA adapter (the warm start a run merges into its model); set "
                              "policy.lora=true")
        made, named = Path(cfg.sft.output_dir).resolve(), cfg.policy.warm_start
        if named and Path(named).expanduser().resolve() != made:
            raise ConfigError(f"empo2 sft starts from the model itself and writes {cfg.sft.output_dir}, but "
                              f"policy.warm_start names {named}; leave it empty or name that folder (one preset "
                              "then makes the warm start and starts RL from it)")

    # ------------------------------------------------------------------------------------------------------ loop
    def train(self, progress=None) -> dict[str, Any]:
        """Collect the demonstrations, train ``sft.epochs`` epochs, keep the best as the warm start; returns its
        ``warm_start.json`` record (with ``sha256``)."""
        cfg = self.cfg
        t0 = time.perf_counter()
        signals.set_phase("the demonstrations of the warm start")
        self.collect(progress)
        self.metrics = MetricsLog(self.run_dir, trackers(cfg.train), cfg.to_dict())
        collected = time.perf_counter() - t0
        start = {"iteration": 0, "epoch": 0, "validation_loss": self.validation_loss(),
                 "time": {"demos": collected}}
        self.metrics.log(start)
        self._say(f"demonstrations: {self.demos.count} gold episodes, {len(self.demos.rows)} steps "
                  f"({len(self.demos.skipped)} skipped: gold path not within the step cap) in {collected:.0f} s; "
                  f"validation loss before training {_text(start['validation_loss'])}")
        for epoch in range(1, cfg.sft.epochs + 1):
            signals.set_phase(f"epoch {epoch} of the warm start")  # what a stop message names
            record = self.epoch(epoch, progress)
            self.metrics.log(record)
            self._say(epoch_line(record))
        self.metrics.close()
        self._say(f"warm start: epoch {self.best['epoch']} → {self.run_dir / warm_start.FOLDER} "
                  f"(sha256 {self.best['sha256'][:12]}…)")
        return self.best

    def collect(self, progress=None) -> None:
        """The training demonstrations (train split of ``sft.tasks``) and the validation ones (dev split of
        ``env.tasks``), written to ``demos.json``."""
        cfg = self.cfg
        say = None if progress is None else (lambda done, total: progress("demonstrations", done, total))
        self.model.eval()
        self.demos = collect(self.ctx, resolve_tasks(cfg.sft_env()), "train", cfg.sft.demos, say)
        if self.demos.count == 0:
            raise ConfigError(f"sft: no gold path of the train split of {', '.join(resolve_tasks(cfg.sft_env()))} "
                              "reaches the goal within the step cap (raise env.max_steps or env.step_caps)")
        self.validation = collect(self.ctx, resolve_tasks(cfg.env), "dev", cfg.sft.validation_demos) \
            if cfg.sft.validation_demos else Demos([], [], [])
        self.run_dir.mkdir(parents=True, exist_ok=True)  # only now: bad settings, a model or a worker failing write nothing
        (self.run_dir / "demos.json").write_text(json.dumps({
            "train": self.demos.episodes, "train_skipped": self.demos.skipped, "train_steps": len(self.demos.rows),
            "validation": self.validation.episodes, "validation_skipped": self.validation.skipped,
            "truncated_targets": self.demos.truncated_targets}, indent=1))

    def epoch(self, epoch: int, progress=None) -> dict[str, Any]:
        """One pass over the demonstrations, then the validation loss, the held-out evaluation, a checkpoint, and the
        warm start when this epoch is the best so far. Returns the epoch's metrics record."""
        cfg = self.cfg
        reset_peak_rss()
        t0 = time.perf_counter()
        batches = self.batches(epoch)
        self.model.train()
        nll = tokens = steps = skipped = 0
        for k, batch in enumerate(batches):
            batch_nll, batch_tokens, ok = self.step(batch)
            nll, tokens, steps, skipped = nll + batch_nll, tokens + batch_tokens, steps + ok, skipped + (not ok)
            if progress is not None:
                progress(f"epoch {epoch}: training", k + 1, len(batches))
        self.model.eval()
        trained = time.perf_counter() - t0
        record = {"iteration": epoch, "epoch": epoch, "train_loss": nll / max(tokens, 1), "target_tokens": tokens,
                  "optimizer_steps": steps, "skipped_steps": skipped, "validation_loss": self.validation_loss()}
        t1 = time.perf_counter()
        record["eval"] = self.evaluate(epoch, progress)
        record["time"] = {"train": trained, "eval": time.perf_counter() - t1}
        record["peak_rss_gb"] = peak_rss_gb()
        ckpt.save_checkpoint(self.run_dir, epoch, self.model, self.optimizer,
                             {"epoch": epoch, "metrics": record, "config": cfg.to_dict()}, None,
                             cfg.train.keep_checkpoints)
        if self.best is None or _better(record, self.best["metrics"], cfg.sft.select):
            meta = {"base": self.base, "epoch": epoch, "metrics": record, "env": env_label(cfg.env),
                    "tasks": resolve_tasks(cfg.sft_env()), "demos": self.demos.count, "made_by": "empo2 sft",
                    "lora": {"r": cfg.policy.lora_r, "alpha": cfg.policy.lora_alpha,
                             "target_modules": list(cfg.policy.lora_target_modules)}}
            made = warm_start.write(self.run_dir, self.model, meta)
            self.best = {**meta, "sha256": made.sha256}
        record["best_epoch"] = self.best["epoch"]
        return record

    def batches(self, epoch: int) -> list[list[DemoRow]]:
        """This epoch's batches: episodes in a seeded shuffle, their rows in order, ``sft.batch_rows`` at a time.

        Where rows chain (the ``append`` layout: a step's prompt and target start the next step's prompt) and
        packing applies, each episode goes whole to the batch its first row falls in (the rule of
        ``train.pack_episodes``, :func:`~empo2.policy.packing.chain_batches`), so a batch may hold up to an episode's
        rows more than ``sft.batch_rows``. Packing reads a row's log-probs off another row's forward within one
        batch only, so a cut inside an episode would forward the episode's shared tokens once in each of two batches.
        Where nothing chains (the ``window`` layout) the cut is every ``sft.batch_rows`` rows, as before: a cut there
        costs no forward."""
        rows = self.demos.rows
        by_episode: dict[int, list[int]] = {}
        for i, row in enumerate(rows):
            by_episode.setdefault(row.episode, []).append(i)
        order = sorted(by_episode)
        random.Random(row_seed(self.cfg.sft.seed, epoch)).shuffle(order)
        chains = [by_episode[e] for e in order]
        if not (packs_chains(self.model, self.options)
                and plan_packing([r.prompt for r in rows], [r.target for r in rows]).packs):
            chains = [[i] for chain in chains for i in chain]
        return [[rows[i] for i in batch] for batch in chain_batches(chains, self.cfg.sft.batch_rows)]

    def step(self, batch: list[DemoRow]) -> tuple[float, int, bool]:
        """One optimizer step on ``batch``: mean NLL over its target tokens. Returns (summed NLL, target tokens,
        whether the step was taken); a non-finite loss or gradient skips it and leaves the weights as they were."""
        tokens = sum(len(r.target) for r in batch)
        total, finite = 0.0, True
        for micro, heads in self._micro_batches(batch):
            logp, mask = self._logprobs(micro, heads)  # [B, T] each
            nll = -(logp * mask).sum()
            finite &= bool(torch.isfinite(nll))
            if finite:
                (nll / tokens).backward()
                total += float(nll.detach())
        params = [p for p in self.model.parameters() if p.requires_grad]
        norm = torch.nn.utils.clip_grad_norm_(params, self.cfg.train.max_grad_norm) if finite else torch.tensor(0.0)
        ok = finite and bool(torch.isfinite(norm))
        if ok:
            self.optimizer.step()
        self.optimizer.zero_grad(set_to_none=True)
        return total, tokens, ok

    @torch.no_grad()
    def validation_loss(self) -> float | None:
        """Mean NLL per target token of the validation demonstrations (``None`` without any)."""
        if not self.validation or not self.validation.rows:
            return None
        rows, nll, tokens = self.validation.rows, 0.0, 0
        for k in range(0, len(rows), self.cfg.sft.batch_rows):
            batch = rows[k:k + self.cfg.sft.batch_rows]
            for micro, _ in self._micro_batches(batch, hold_heads=False):
                logp, mask = self._logprobs(micro, None)
                nll -= float((logp * mask).sum())
                tokens += int(mask.sum())
        return nll / max(tokens, 1)

    def evaluate(self, epoch: int, progress=None) -> dict[str, Any] | None:
        """The held-out evaluation after ``epoch`` (``None`` with ``sft.eval_variations`` 0): success, score and the
        share of raw outputs the environment ran as written, on the first dev variations of ``env.tasks``."""
        cfg = self.cfg
        if not cfg.sft.eval_variations:
            return None
        plan = EvalPlan("dev", cfg.sft.eval_variations, None, cfg.policy.eval_temperature, self.pool.size)
        seed = row_seed(cfg.sft.seed, epoch) if cfg.policy.seeded_sampling else None
        feed = None if progress is None else (lambda done, total: progress(f"epoch {epoch}: eval", done, total))
        with ckpt.separate_stream(row_seed(cfg.sft.seed, epoch, 1)):  # the training's draws stay as they were
            result = evaluate(self.ctx, resolve_tasks(cfg.env), plan, progress=feed, seed=seed)
        write_eval_tables(result, self.run_dir / "eval", f"epoch_{epoch:03d}", env_label(cfg.env))
        return result["summary"]

    # --------------------------------------------------------------------------------------------------- helpers
    def _micro_batches(self, batch: list[DemoRow], hold_heads: bool = True):
        """``(rows, step heads)`` of each micro-batch of ``batch`` (``train.micro_batch_tokens``), inside one block
        that runs each shared head forward once and its backward once after the last micro-batch's."""
        prompts, targets = [r.prompt for r in batch], [r.target for r in batch]
        budget, min_shared = self.cfg.train.micro_batch_tokens, self.options.min_shared_tokens
        hold = hold_heads and self.shared and torch.is_grad_enabled()
        pack = packs_chains(self.model, self.options)  # rows chained by their tokens run as one packed sequence

        def plan(prompts, targets):
            if self.shared:
                return shared_micro_batches(prompts, targets, budget, min_shared, step_heads=hold)
            return [[i] for i in range(len(prompts))]

        packing = plan_packing(prompts, targets) if pack else None  # once: the heads and the micro-batches share it
        head_prompts = packing.prompts if packing is not None else prompts
        with (px.heads_once_per_step(head_prompts, min_shared) if hold else _no_heads()) as heads:
            for idx in packed_batches(packing, plan) if packing is not None else plan(prompts, targets):
                yield [batch[i] for i in idx], heads

    def _logprobs(self, rows: list[DemoRow], heads) -> tuple[torch.Tensor, torch.Tensor]:
        with loader.autocast_context(self.model, self.cfg.policy.autocast):
            return response_logprobs(self.model, [r.prompt for r in rows], [r.target for r in rows],
                                     self.tokenizer.pad_token_id, temperature=1.0, options=self.options,
                                     step_heads=heads)

    def _say(self, text: str) -> None:
        if self.console is not None:
            self.console.print(text, soft_wrap=True, markup=False)
        else:
            print(text)

    def close(self) -> None:
        if self._owns_pool:
            self.pool.close()
        if self.metrics is not None:
            self.metrics.close()

    def __enter__(self) -> SFTTrainer:
        return self

    def __exit__(self, *exc: Any) -> None:
        self.close()


class _no_heads:
    def __enter__(self):
        return None

    def __exit__(self, *exc):
        return False


def _better(new: dict[str, Any], old: dict[str, Any], select: str) -> bool:
    """Whether epoch record ``new`` beats ``old`` under ``sft.select`` (:class:`~empo2.config.stages.SftConfig`)."""
    def loss(r):
        return r["validation_loss"] if r.get("validation_loss") is not None else math.inf

    have_success = new.get("eval") is not None and old.get("eval") is not None
    have_loss = new.get("validation_loss") is not None
    if select == "success" and have_success or not have_loss and have_success:
        a, b = new["eval"]["success_rate"], old["eval"]["success_rate"]
        return a > b or a == b and loss(new) < loss(old)
    if have_loss:
        return loss(new) < loss(old)
    return True  # neither measure: the last epoch


def _text(value: float | None) -> str:
    return "n/a" if value is None else f"{value:.3f}"


def epoch_line(r: dict[str, Any]) -> str:
    """``epoch 2: train loss 0.412 · validation 0.530 · held-out success 0.30 (raw valid 0.81) · 95 s + 210 s``."""
    ev = r.get("eval")
    held = f" · held-out success {ev['success_rate']:.2f} (score {ev['score_mean']:.1f}, raw outputs valid " \
           f"{ev['raw_valid_rate']:.0%})" if ev else ""
    return (f"epoch {r['epoch']}: train loss {r['train_loss']:.3f} · validation {_text(r['validation_loss'])}{held} · "
            f"{r['time']['train']:.0f} s training + {r['time']['eval']:.0f} s eval · best epoch {r['best_epoch']}")
