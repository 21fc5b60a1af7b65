"""``empo2 train`` and ``empo2 sft``: the commands that train a policy, each in a run folder it owns; and the checks
of a run's inputs that fail before the run writes anything (a comparison runs them for each of its runs)."""

from __future__ import annotations

import json
from pathlib import Path


def _config_error(message: str):
    from empo2.config import ConfigError

    return ConfigError(message)


def cmd_train(args) -> int:
    from rich.console import Console
    from rich.markup import escape

    from empo2 import allocator, machine, signals
    from empo2.cli.policy import own_run_folder
    from empo2.envs.factory import env_label
    from empo2.envs.gold import check_reachable, eval_plan_size
    from empo2.experiments.report import method_label
    from empo2.memory.sqlite_file import check_file
    from empo2.parallel import distributed
    from empo2.progress import ProgressBar
    from empo2.rundir import checkpoint
    from empo2.rundir.runlock import RUN_LAYOUT, RUN_MARKER, mark_run_folder, start_run_folder
    from empo2.train.compute import decide
    from empo2.train.trainer import Trainer

    main_rank = distributed.env_rank() == 0  # under torchrun/accelerate only rank 0 writes and prints
    console = Console(soft_wrap=True, quiet=not main_rank)  # one line per message in logs, whatever the width
    cfg, run_dir = train_config(args)
    check_run_inputs(cfg)
    if main_rank:  # the ranks of one data-parallel run are one owner: rank 0 holds the folder's lock
        own_run_folder(args, run_dir)
        signals.set_run_dir(run_dir, checkpoint.latest_checkpoint)  # a SIGTERM from here on names the run's last checkpoint
    if args.resume:  # a damaged live memory is refused (exit 2, file untouched) before anything loads it
        check_file(run_dir / "memory.sqlite")
    if not args.resume and main_rank:  # a fresh run: no stale memory, checkpoints or metrics from the previous one
        start_run_folder(run_dir, args.overwrite)
    elif main_rank and not (run_dir / RUN_MARKER).is_file():  # a run made before the marker: its layout is its own
        mark_run_folder(run_dir, RUN_LAYOUT)
    cfg, compute = decide(cfg)  # what the trainer will decide: said before the model loads
    precision = compute.autocast + (f" (auto: {compute.why['autocast']})" if "autocast" in compute.why else "")
    remote_code = " trust_remote_code=true (the model's own code runs)" if cfg.policy.trust_remote_code else ""
    engine = compute.backend + (f" (auto: {compute.why['backend']})" if "backend" in compute.why else "")
    console.print("[bold]empo2 train[/bold] " + escape(  # names and paths are the user's text, not markup
        f"algo={method_label(cfg)} env={env_label(cfg.env)} tasks={_tasks_text(cfg)} model={cfg.policy.model} "
        f"G={cfg.algo.num_generations} iterations={cfg.train.iterations} autocast={precision} engine={engine} "
        f"old_logprobs={compute.old_logprobs} "
        f"malloc={allocator.active()}{remote_code} → {run_dir}"))
    if main_rank:  # a run's evals may be unwinnable by their step cap: said, not refused (see check_reachable)
        check_reachable(cfg, cfg.env.eval_split, eval_plan_size(cfg), "training", allow=False, refuse=False,
                        say=lambda line: console.print(line, markup=False))
    signals.set_phase("the start of the run (model, environment workers)")
    trainer = Trainer(cfg, output_dir=run_dir, resume=bool(args.resume), console=console)
    if not main_rank:
        try:
            trainer.train()
        finally:
            trainer.close()
        return 0
    trainer.cfg.save(run_dir / "config.yaml")  # with the trainer's decisions (e.g. the linear schedule's length)
    machine.record(run_dir, "resume" if args.resume else "start")
    try:
        with ProgressBar(console, cfg.train.progress) as progress:
            final = trainer.train(progress)
    finally:
        trainer.close()
    console.print((run_dir / "eval" / "final.md").read_text(), markup=False)  # task names and paths are not markup
    console.print(f"run folder: {run_dir}  (metrics.jsonl, scores.png, memory.sqlite, checkpoints/, eval/)",
                  markup=False)
    print(json.dumps({"run": str(run_dir), "final_eval": final["summary"]}))
    return 0


def train_config(args):
    """The run's config and folder: a resumed run's saved config with the flags' overrides (refused when they make it
    another run), or a new run's config file with its overrides."""
    from empo2.config import Config
    from empo2.rundir.runlock import check_new_run_folder, check_run_to_resume

    if args.resume:
        unused = [flag for flag, value in (("--config", args.config), ("--algo", args.algo),
                                           ("--output-dir", args.output_dir), ("--overwrite", args.overwrite)) if value]
        if unused:
            raise _config_error(f"--resume continues a run under its own config.yaml and folder; {', '.join(unused)} "
                                "would be ignored: leave it out (or start a new run without --resume)")
        run_dir = Path(args.resume)
        check_run_to_resume(run_dir)
        saved = run_dir / "config.yaml"
        cfg = Config.load(saved, args.overrides)
        from empo2.rundir.resume import check_checkpoint_settings, check_same_run

        check_same_run(Config.load(saved), cfg, run_dir)  # another G, model, task list … is another run: exit 2
        check_checkpoint_settings(cfg, run_dir)  # … also when config.yaml itself was edited
        return cfg, run_dir
    from empo2.experiments.arm_runs import arm_overrides
    from empo2.experiments.compare_plan import check_estimator_used

    # the arm's settings first, so that an override contradicting them is refused at load instead of lost
    overrides = [*(arm_overrides(args.algo) if args.algo else []), *args.overrides]
    if args.output_dir:
        overrides.append(f"train.output_dir={args.output_dir}")
    cfg = Config.load(args.config, overrides)
    if args.algo:
        check_estimator_used(args.algo, cfg)
    run_dir = Path(cfg.train.output_dir)
    check_new_run_folder(run_dir, args.overwrite)
    return cfg, run_dir


def check_run_inputs(cfg) -> None:
    """Unknown task or model names, sampling that cannot train, missing or foreign files and a pool too big for the
    machine fail here, before a run writes anything."""
    from empo2.config import ConfigError
    from empo2.config.bounds_check import check_machine_limits
    from empo2.envs.factory import resolve_tasks
    from empo2.memory.sqlite_file import check_seed_file
    from empo2.policy.loader import resolve_model_path
    from empo2.rundir import warm_start
    from empo2.rundir.metrics import check_trackers

    cfg.check_training()
    check_trackers(cfg.train)
    resolve_tasks(cfg.env)
    check_machine_limits(cfg)
    if cfg.memory.seed_from:
        check_seed_file(Path(cfg.memory.seed_from))
    resolve_model_path(cfg.policy.model, cfg.policy.trust_remote_code)  # code in a model folder: only when allowed
    warm_start.check(cfg.policy)  # whole, unchanged, made for this tokenizer and architecture
    if cfg.policy.warm_start and cfg.policy.backend == "vllm":
        raise ConfigError("policy.warm_start does not run with policy.backend=vllm (the engine loads the base "
                          "model's files, without the warm start merged into them): use hf or merged")


def _tasks_text(cfg) -> str:
    """The tasks a run plays (a panel expanded; a long list cut), e.g. ``find-animal, find-living-thing``."""
    from empo2.envs.factory import resolve_tasks

    tasks = resolve_tasks(cfg.env)
    return ", ".join(tasks) if len(tasks) <= 4 else f"{', '.join(tasks[:3])} … ({len(tasks)} tasks)"


# ---------------------------------------------------------------------------------------------------------- sft
def cmd_sft(args) -> int:
    """``empo2 sft``: a warm start made from gold demonstrations, in its own run folder (``sft.output_dir``)."""
    from rich.console import Console
    from rich.markup import escape

    from empo2 import machine, signals
    from empo2.cli.policy import own_run_folder
    from empo2.config import Config
    from empo2.config.bounds_check import check_machine_limits
    from empo2.envs.factory import env_label, resolve_tasks
    from empo2.policy.loader import resolve_model_path
    from empo2.progress import ProgressBar
    from empo2.rundir.runlock import check_new_run_folder, start_run_folder
    from empo2.sft import SFTTrainer

    console = Console(soft_wrap=True)
    overrides = [*args.overrides, *([f"sft.output_dir={args.output_dir}"] if args.output_dir else [])]
    cfg = Config.load(args.config, overrides)
    run_dir = Path(cfg.sft.output_dir)
    if (run_dir / "metrics.jsonl").is_file() and not args.overwrite:
        raise _config_error(f"{run_dir} already holds a run; pass --overwrite or another sft.output_dir")
    check_new_run_folder(run_dir, overwrite=True)  # a folder that is not empo2's is refused, whatever the flag
    SFTTrainer.check_config(cfg)
    demo_tasks, eval_tasks = resolve_tasks(cfg.sft_env()), resolve_tasks(cfg.env)
    check_machine_limits(cfg)
    resolve_model_path(cfg.policy.model, cfg.policy.trust_remote_code)
    own_run_folder(args, run_dir)
    start_run_folder(run_dir, args.overwrite)
    s = cfg.sft
    console.print("[bold]empo2 sft[/bold] " + escape(
        f"env={env_label(cfg.env)} demonstrations={s.demos} gold episodes of {', '.join(demo_tasks)} (train split) "
        f"epochs={s.epochs} lr={s.learning_rate:g} held-out={s.eval_variations} dev variations of "
        f"{', '.join(eval_tasks)} model={cfg.policy.model} LoRA r={cfg.policy.lora_r} → {run_dir}"))
    signals.set_phase("the start of the warm start (model, environment workers)")
    trainer = SFTTrainer(cfg, output_dir=run_dir, console=console)
    trainer.cfg.save(run_dir / "config.yaml")
    machine.record(run_dir, "start")
    try:
        with ProgressBar(console, cfg.train.progress) as progress:
            best = trainer.train(progress)
    finally:
        trainer.close()
    print(json.dumps({"run": str(run_dir), "warm_start": str(run_dir / "warm_start"), "epoch": best["epoch"],
                      "sha256": best["sha256"], "metrics": best["metrics"]}))
    return 0
