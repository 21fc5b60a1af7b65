"""The commands that play a policy outside training, ``empo2 eval`` and ``empo2 adapt``: what they play (a run's last
checkpoint, or a model under a config), and the run folder a command owns."""

from __future__ import annotations

import json
import sys
from functools import partial
from pathlib import Path

from empo2.config import ConfigError


def own_run_folder(args, run_dir: Path) -> None:
    """Take ``run_dir``'s lock (one train/adapt per folder) for the rest of the command; storage failures from here
    on end with one line naming the path."""
    from empo2.rundir.runlock import RunLock
    from empo2.rundir.storage import reported

    args.exit_stack.enter_context(RunLock(run_dir))
    args.exit_stack.enter_context(reported(run_dir))


def policy_config(args):
    """The config eval/adapt play under: a run's, or a config file's (or the defaults) with ``--model``; the
    ``--env``, ``--tasks`` and ``--max-steps`` flags on top."""
    from empo2.config import Config
    from empo2.config.bounds_check import check_worker_count

    if args.run:
        cfg = Config.load(Path(args.run) / "config.yaml")
    else:
        config = getattr(args, "config", None)
        cfg = Config.load(config, [f"policy.model={args.model}"] if args.model else [])
    for key, value in (("env.name", args.env), ("env.tasks", args.tasks), ("env.max_steps", args.max_steps)):
        if value:
            cfg.set(key, value)  # typed like a config override: "a, b" → [a, b]
    cfg.validate()  # an unknown environment or task from the flags exits here, before the model loads
    check_worker_count(args.batch, cfg.env, "--batch")
    return cfg


def policy_context(args, with_memory_path: Path | None):
    """Model (a run's last checkpoint, or a plain model), pool and embedder for eval/adapt."""
    from empo2.envs.factory import make_env_kwargs
    from empo2.envs.pool import EnvPool
    from empo2.episodes.rollout import RolloutContext
    from empo2.memory import open_tip_memory
    from empo2.memory.embedder import get_embedder
    from empo2.policy.loader import load_model
    from empo2.rundir import checkpoint as ckpt
    from empo2.rundir import warm_start

    cfg = policy_config(args)
    warm_start.check(cfg.policy)  # before the model loads
    last = ckpt.latest_intact(Path(args.run), lambda line: print(line, file=sys.stderr)) if args.run else None
    if last is not None and (last / "sharded").is_dir():
        raise ConfigError(f"{last} is sharded (train.sharding=fsdp): write Hugging Face weights with "
                          f"`empo2 export {args.run} OUT`, then use --model OUT")
    model, tokenizer = load_model(cfg.policy.model, cfg.policy.device, cfg.policy.dtype,
                                  cfg.policy.trust_remote_code)
    if cfg.policy.warm_start and (cfg.policy.lora or not args.run):  # a full fine-tune's checkpoint holds it already
        model, _ = warm_start.start_from(model, cfg.policy)
    if last is not None:
        if cfg.policy.lora:
            from peft import PeftModel

            model = PeftModel.from_pretrained(model, str(last / "model"))
        else:
            model, tokenizer = load_model(str(last / "model"), cfg.policy.device, cfg.policy.dtype,
                                          cfg.policy.trust_remote_code)
    model.eval()
    embedder = get_embedder(cfg.memory.embedder)
    memory = None
    if with_memory_path is not None:
        with_memory_path.parent.mkdir(parents=True, exist_ok=True)  # only now: a bad run or model writes nothing
        memory = open_tip_memory(with_memory_path, embedder.dim, cfg.memory)
    pool = EnvPool(cfg.env.name, make_env_kwargs(cfg.env), args.batch)
    ctx = RolloutContext(model, tokenizer, pool, embedder, memory, cfg.env.name, cfg.policy, cfg.memory)
    return cfg, ctx


def check_policy_source(args) -> None:
    """What eval and adapt play, checked before they write anything: a run folder (its checkpoint and config), or a
    model and/or a config (an untrained model played under a trained run's settings)."""
    if args.run and args.config:
        raise ConfigError("--config goes with --model: a run folder plays under its own config.yaml")
    if not (args.run or args.model or args.config):
        raise ConfigError("give --run RUN_DIR, --model NAME or --config YAML")


def cmd_eval(args) -> int:
    from rich.console import Console

    from empo2.envs.factory import env_label, resolve_tasks
    from empo2.envs.gold import check_reachable
    from empo2.episodes.evaluate import EvalPlan, evaluate, markdown_table, write_eval_tables
    from empo2.progress import ProgressBar
    from empo2.rundir.storage import check_writable

    check_policy_source(args)
    mem_path = (Path(args.run) / "memory.sqlite") if (args.with_memory and args.run) else None
    if args.with_memory and mem_path is None:
        raise ConfigError("--with-memory needs --run RUN_DIR (its memory.sqlite)")
    out = Path(args.out or (Path(args.run) / "eval" if args.run else "eval"))
    check_writable(out, "--out")  # before the evaluation, whose tables would otherwise be lost
    if args.run:  # a run with no intact checkpoint is refused before anything else is said or loaded
        from empo2.rundir import checkpoint as ckpt

        ckpt.latest_intact(Path(args.run), lambda line: None)  # its warning comes once, when the model loads
    check_reachable(policy_config(args), args.split, args.variations, "evaluation",
                    args.allow_unreachable)  # before the model loads: a refused evaluation costs no load
    cfg, ctx = policy_context(args, mem_path)
    try:
        tasks = resolve_tasks(cfg.env)
        plan = EvalPlan(args.split, args.variations, None, args.temperature, args.batch, args.with_memory)
        with ProgressBar(Console(soft_wrap=True), True) as progress:
            result = evaluate(ctx, tasks, plan, progress=partial(progress, f"eval {args.split}"))
    finally:
        ctx.pool.close()
    label = env_label(cfg.env)
    js, md = write_eval_tables(result, out, f"eval_{args.split}{'_memory' if args.with_memory else ''}", label)
    print(markdown_table(result, label))
    print(json.dumps({"json": str(js), "markdown": str(md), **result["summary"]}))
    return 0


def cmd_adapt(args) -> int:
    """Out-of-distribution adaptation (the paper's OOD test): trials with memory updates only, no parameter updates."""
    from empo2.envs.factory import resolve_tasks
    from empo2.experiments import adapt
    from empo2.rundir.runlock import LOCK_NAME

    args.env, args.tasks = adapt.resolve_tasks(args.preset, args.tasks, args.max_tasks, args.env)
    check_policy_source(args)
    out = Path(args.out)
    own_run_folder(args, out)  # a second adapt into the same folder is refused here, naming the first
    if any(p.name != LOCK_NAME for p in out.iterdir()):
        raise ConfigError(f"{out} is not empty")
    cfg, ctx = policy_context(args, out / "memory.sqlite" if args.baseline == "memory" else None)
    if args.baseline == "reflexion":
        adapt.use_reflexion(ctx)
    try:
        tasks = resolve_tasks(cfg.env)
        trials, checksum = adapt.run_trials(ctx, tasks, args.trials or adapt.PRESET_TRIALS, args.split,
                                            args.variations, args.temperature, args.batch, args.baseline,
                                            seed=args.seed)
    except adapt.WeightsChanged as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 1
    finally:
        ctx.pool.close()
        if ctx.memory is not None:
            ctx.memory.close()
    report = adapt.finish(out, tasks, trials, checksum, cfg, preset=args.preset, baseline=args.baseline, run=args.run,
                          split=args.split, seed=args.seed)
    print(json.dumps({k: report[k] for k in ("preset", "method", "scores", "best", "trial0", "gain", "gain_pct")}))
    return 0
