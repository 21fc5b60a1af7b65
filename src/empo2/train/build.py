"""The trainer's parts, built from a config (:class:`TrainerParts`): the decisions ``auto`` leaves to this machine,
the policy (model, LoRA, optimizer, update), the environment workers, the memory and embedder, the run folder and its
metrics log, the rollout context and engine, and what a resume restores. :class:`empo2.train.trainer.Trainer` adds
the loop; parts given by the caller stay the caller's (:meth:`TrainerParts.close` closes only what was made here).
"""

from __future__ import annotations

import copy
import logging
import random
import shutil
import tempfile
from functools import partial
from pathlib import Path

import numpy as np
import torch

from empo2.algo.losses import get_policy_loss
from empo2.algo.modes import ModeSampler
from empo2.algo.registry import load_hook
from empo2.config import Config, ConfigError
from empo2.envs.factory import make_env_kwargs, resolve_tasks
from empo2.envs.local_pool import LocalEnvPool
from empo2.envs.pool import FailureStreak, make_pool
from empo2.episodes.drivers import has_state, make_driver
from empo2.episodes.rollout import RolloutContext
from empo2.memory import open_tip_memory
from empo2.memory.embedder import get_embedder
from empo2.memory.novelty import NoveltyReward
from empo2.memory.store import TipMemory
from empo2.parallel import distributed as dp
from empo2.parallel import sharding
from empo2.policy import loader
from empo2.policy.backend import check_backend, make_backend
from empo2.policy.loader import autocast_context, load_model
from empo2.policy.sampling import Sampling
from empo2.rundir import checkpoint as ckpt
from empo2.rundir import warm_start
from empo2.rundir.metrics import MetricsLog, trackers
from empo2.rundir.resume import align_memory, pick_checkpoint, truncate_samples
from empo2.train import preflight
from empo2.train.compute import decide
from empo2.train.overlap import BackgroundReflection, overlap_wanted
from empo2.train.task_choice import TaskSampler
from empo2.train.update import PolicyUpdate

log = logging.getLogger("empo2.train")


class TrainerParts:
    """Builds every part of a training run from a config and the parts given (see :class:`~empo2.train.trainer.
    Trainer` for the arguments), and closes what it made."""

    def __init__(self, config: Config, model=None, tokenizer=None, env=None, memory: TipMemory | None = None, *,
                 output_dir: str | Path | None = None, resume: bool = False, embedder=None, console=None):
        cfg = copy.deepcopy(config)  # the trainer's decisions go into its own copy; the caller's stays as given
        self.pool_size = self._check_parts(cfg, model, tokenizer, env)
        self._temporary = output_dir is None
        self.cfg, self.console = cfg, console
        self.run_dir = None if output_dir is None else Path(output_dir)  # a temporary one is made below
        cfg.check_training()  # sampling the update's log-probs can score (the CLI also checks it before any file)
        self.algorithm = cfg.algorithm  # the registry entry: memory use, modes, loss, estimator
        self.use_memory = self.algorithm.uses_memory
        seed = cfg.train.seed
        random.seed(seed), np.random.seed(seed), torch.manual_seed(seed)
        # "auto" becomes this machine's precision and engine, recorded in the saved config
        cfg, self.compute = decide(cfg)
        self.cfg = cfg
        if cfg.algo.intrinsic_schedule == "linear" and not cfg.algo.intrinsic_schedule_iterations:
            cfg.algo.intrinsic_schedule_iterations = cfg.train.iterations  # kept when a resume changes the length
        loader.check_precision(cfg.policy.dtype, cfg.policy.device, cfg.policy.lora, cfg.policy.autocast)
        check_backend(cfg.policy.backend, cfg.policy.lora_r if cfg.policy.lora else 0)
        if model is None:
            model, tokenizer = load_model(cfg.policy.model, cfg.policy.device, cfg.policy.dtype,
                                          cfg.policy.trust_remote_code)
        if cfg.policy.warm_start:  # merged into the weights: the run's LoRA, its reference and start eval build on it
            model, cfg.policy.warm_start_sha256 = warm_start.start_from(model, cfg.policy)
        self.tokenizer = tokenizer
        self.model = model if hasattr(model, "peft_config") else \
            loader.make_trainable(model, cfg.policy, cfg.train.gradient_checkpointing)
        # before the first rollout: a run that does not fit its GPU would die at its first optimizer step
        preflight.check(self.model, cfg, self.dist.world_size,
                        overlap_snapshot=cfg.policy.backend == "hf" and not cfg.policy.lora and bool(
                            overlap_wanted(cfg.memory.overlap_reflection, self.model, None)))
        if sharding.wanted(cfg):  # before the optimizer: it holds the sharded parameters
            self.model, self.dist = sharding.wrap(self.model, cfg, self.dist)
        self.sampling = Sampling.rollout(cfg.policy)  # what every training rollout samples with
        self.optimizer = torch.optim.AdamW(
            [p for p in self.model.parameters() if p.requires_grad],
            lr=cfg.train.learning_rate, weight_decay=cfg.train.weight_decay,
        )
        self.embedder = get_embedder(cfg.memory.embedder) if embedder is None else embedder
        self.loss_fn = get_policy_loss(self.algorithm.loss)

        names = resolve_tasks(cfg.env)
        self._owns_pool = env is None or not hasattr(env, "call")
        self.pool = self._make_pool(cfg, env)
        self._owns_memory = memory is None
        try:
            if self._temporary:  # made only now: a bad config, model or environment leaves nothing behind
                self.run_dir = Path(tempfile.mkdtemp(prefix="empo2-run-"))
            self._setup(cfg, names, seed, resume, memory)
        except BaseException:  # a bad checkpoint or a SIGTERM here: no JVM outlives the trainer
            if self._owns_pool:
                self.pool.close()
            if self._temporary and self.run_dir is not None:
                shutil.rmtree(self.run_dir, ignore_errors=True)
            raise

    def _check_parts(self, cfg: Config, model, tokenizer, env) -> int:
        """Refuse parts that do not fit together, before anything loads; the number of workers a batch plays on."""
        if (model is None) != (tokenizer is None):
            raise ConfigError("Trainer: give the model together with its tokenizer, or neither")
        self.dist = dp.init_from_env(cfg.policy.device)
        if cfg.train.tasks_per_batch < self.dist.world_size:
            raise ConfigError(f"train.tasks_per_batch ({cfg.train.tasks_per_batch}) must be at least the number of "
                              f"ranks ({self.dist.world_size}): each rank plays whole groups")
        pool_size = self.dist.max_local(cfg.train.tasks_per_batch) * cfg.algo.num_generations
        if env is not None and not hasattr(env, "call") and not callable(env):
            raise ConfigError(f"Trainer: env must be an environment factory or a pool of workers, not {type(env)}")
        if hasattr(env, "call") and getattr(env, "size", pool_size) < pool_size:
            raise ConfigError(f"Trainer: the pool given has {env.size} workers; train.tasks_per_batch × "
                              f"algo.num_generations needs {pool_size}")
        return pool_size

    def _make_pool(self, cfg: Config, env):
        if env is None:
            return make_pool(cfg.env.pool, cfg.env.name, make_env_kwargs(cfg.env), self.pool_size)
        if hasattr(env, "call"):  # a pool of workers, one episode per worker
            return env
        return LocalEnvPool(env, self.pool_size)

    def _setup(self, cfg: Config, names: list[str], seed: int, resume: bool, memory: TipMemory | None) -> None:
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
        self.resume_from = pick_checkpoint(self.run_dir, cfg.policy.lora, self._say, self.dist) if resume else None
        self.memory = (self._open_memory(resume) if memory is None else memory) if self.use_memory else None
        # a resume plays the iterations after its checkpoint again: their logged lines go before a tracker opens
        kept_through = (self.resume_from[1]["iteration"] if self.resume_from else -1) if resume else None
        self.metrics = MetricsLog(self.run_dir, trackers(cfg.train), cfg.to_dict(),
                                  kept_through) if self.dist.is_main else None
        self.start_iteration = 0
        self.zero_adv_streak = 0
        self.resumed_step_counter = 0
        self.env_steps = 0  # environment steps of all sampled training episodes so far (the run's budget spent)
        self.expert_env_steps = 0  # the expert members' environment steps so far, counted apart
        self.rollout = make_driver(self.algorithm, cfg)
        self.method_metrics = load_hook(self.algorithm.metrics, "metrics hook") if self.algorithm.metrics else None
        self.env_failures = FailureStreak(cfg.train.max_consecutive_env_failures)
        if resume:
            self._restore()
        self.next_iteration = self.start_iteration  # what :meth:`iteration` plays when not told
        self.dist.broadcast_params([p for p in self.model.parameters() if p.requires_grad])
        self.update = PolicyUpdate(cfg, self.model, self.tokenizer, self.optimizer, self.loss_fn, self.dist,
                                   compute=self.compute)
        self.ctx = RolloutContext(self.model, self.tokenizer, self.pool, self.embedder, self.memory, cfg.env.name,
                                  cfg.policy, cfg.memory, step_counter=self.resumed_step_counter,
                                  compute=self.compute.options)
        if self.dist.enabled and self.memory is not None:
            self.ctx.memory_sync = dp.memory_sync(self.dist)
        if cfg.policy.backend != "hf":  # HF generates with self.model itself: nothing to build or sync
            weights = str(next(self.model.parameters()).dtype).removeprefix("torch.")
            self.ctx.backend = make_backend(cfg.policy.backend, self.model, self.tokenizer,
                                            loader.resolve_model_path(cfg.policy.model, cfg.policy.trust_remote_code),
                                            cfg.policy.lora_r if cfg.policy.lora else 0, cfg.policy.vllm_memory, seed,
                                            self.compute.engine_dtype(weights) if cfg.policy.engine_dtype == "auto"
                                            else cfg.policy.engine_dtype)
            if self.start_iteration > 0:  # a fresh engine loaded the model's own starting weights already
                self.ctx.backend.sync_weights(self.model)
        self.reflection = None
        overlap = overlap_wanted(cfg.memory.overlap_reflection, self.model, self.ctx.backend)
        if self.use_memory and overlap and not self.dist.sharded:  # sharded: generation must gather, not copy
            self.reflection = BackgroundReflection(self.model, self.ctx.backend,
                                                   partial(autocast_context, self.model, cfg.policy.autocast))

    # ----------------------------------------------------------------------------------------------- setup
    def _open_memory(self, resume: bool) -> TipMemory:
        path = self.run_dir / "memory.sqlite"
        mc = self.cfg.memory
        if not self.dist.is_main:  # a private replica of rank 0's memory, kept equal by memory_sync
            path = dp.write_replica(self.dist.broadcast_object(None), self.dist.rank)
        elif not resume and mc.seed_from and not path.exists():
            shutil.copyfile(mc.seed_from, path)
        elif resume:  # the memory of the weights' iteration (also when the live one is gone)
            align_memory(self.run_dir, self.resume_from[0] if self.resume_from else None, self._say, mc.seed_from)
        memory = open_tip_memory(path, self.embedder.dim, mc)
        if memory.skipped and self.dist.is_main:
            reasons = ", ".join(f"{reason} {n}" for reason, n in sorted(memory.skipped.items()))
            self._say(f"[warning] {path}: {sum(memory.skipped.values())} stored tip(s) fail the checks every new tip "
                      f"passes ({reasons}); they stay in the file but are never retrieved")
        if self.dist.enabled and self.dist.is_main:  # the other ranks start their replicas from these bytes
            self.dist.broadcast_object(dp.database_bytes(memory))
        return memory

    def _restore(self) -> None:
        if self.resume_from is None:
            log.warning("no checkpoint in %s: starting from iteration 0", self.run_dir)
            if self.dist.is_main:
                truncate_samples(self.run_dir, -1)
            return
        last, state, optimizer_state, weights = self.resume_from
        sharding.restore(self.model, self.optimizer, last, weights, optimizer_state, self.cfg.policy.lora)
        self.task_sampler.load_state_dict(state["task_sampler"])
        self.mode_sampler.load_state_dict(state["mode_sampler"])
        self.novelty.load_state_dict(state["novelty"])
        self.zero_adv_streak = state.get("zero_adv_streak", 0)
        self.resumed_step_counter = state.get("step_counter", 0)
        self.env_steps = state.get("env_steps", 0)
        self.expert_env_steps = state.get("expert_env_steps", 0)
        if has_state(self.rollout):
            self.rollout.load_state_dict(state.get(self.rollout.state_key, []))
        ckpt.set_rng_state(state["rng"])
        self.start_iteration = state["iteration"] + 1
        if self.dist.is_main:  # the iterations after the checkpoint are played again
            truncate_samples(self.run_dir, state["iteration"])
        self.resume_from = (last,)  # the loaded tensors are not kept
        log.info("resumed from %s: next iteration %d", last, self.start_iteration)

    def _say(self, text: str) -> None:
        if not self.dist.is_main:
            return
        if self.console is not None:
            self.console.print(text, soft_wrap=True, markup=False)  # one line per message (no 80-col wrap); plain text
        else:
            print(text)

    def close(self) -> None:
        if self.reflection is not None:
            self.reflection.close()
        if getattr(self.ctx.backend, "close", None) is not None:  # a separate engine (vLLM) frees its memory
            self.ctx.backend.close()
        if self._owns_pool:
            self.pool.close()
        if self.metrics is not None:
            self.metrics.close()
        if self.memory is not None and self._owns_memory:
            self.memory.close()
        self.dist.close()
        if self._temporary:
            shutil.rmtree(self.run_dir, ignore_errors=True)
