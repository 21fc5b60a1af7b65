"""``empo2`` command line: play · sft · train · compare · eval · adapt · report · export · memory · gold.

User errors (bad config, unknown task or model, missing Java or data) print one line and exit with code 2.
"""

from __future__ import annotations

if __name__ == "__main__":  # python -m empo2.cli: Ctrl-C waits for main()'s handler instead of breaking an import
    from empo2.signals import block_for_exec

    block_for_exec()

import contextlib
import errno
import json
import logging
import os
import sys
from pathlib import Path

from empo2.cli_parser import build_parser, parse_cli  # noqa: F401  (the CLI's parser, public here)
from empo2.errors import UserError


def _config_error(message: str):
    from empo2.config import ConfigError

    return ConfigError(message)


# -------------------------------------------------------------------------------------------------------- train
def cmd_train(args) -> int:
    from rich.console import Console
    from rich.markup import escape

    from empo2 import allocator, machine, signals
    from empo2.cli_policy import own_run_folder
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
    from empo2.experiments.arms import arm_overrides
    from empo2.experiments.compare import check_estimator_used

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
    from empo2.config_bounds import check_machine_limits
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
    from empo2.cli_policy import own_run_folder
    from empo2.config import Config
    from empo2.config_bounds import check_machine_limits
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


# ------------------------------------------------------------------------------------------------------ compare
def cmd_compare(args) -> int:
    """Algorithms × seeds on one config, each an ``empo2 train`` run folder, then summary.md/json and curves.png."""
    from empo2.experiments.compare import run_compare
    from empo2.rundir.runlock import RunLock

    args.exit_stack.enter_context(RunLock(Path(args.out)))  # a second compare on this folder is refused, naming it
    return run_compare(args.config, args.algos, args.seeds, Path(args.out), list(args.overrides), check_run_inputs,
                       args.jobs, reach=lambda cfg: _check_compare_reachable(cfg, args.allow_unreachable))


def _check_compare_reachable(cfg, allow: bool) -> None:
    """The share of the comparison's evaluation variations whose gold path fits the step cap; below the threshold
    the comparison is refused (``--allow-unreachable``: run anyway)."""
    from empo2.envs.gold import check_reachable, eval_plan_size

    check_reachable(cfg, cfg.env.eval_split, eval_plan_size(cfg), "comparison", allow)


# ------------------------------------------------------------------------------------------------- report/export
def cmd_report(args) -> int:
    """The paper's comparison tables from run, compare and adaptation folders."""
    from empo2.experiments.report import write_report

    write_report(args.folders, Path(args.out), partial=args.partial)
    print((Path(args.out) / "report.md").read_text())
    print(f"wrote {args.out}/report.md, report.json and one PNG per table")
    return 0


def cmd_export(args) -> int:
    """A run's last checkpoint as a Hugging Face model folder that ``from_pretrained`` loads."""
    from empo2.rundir.export import export

    last = export(Path(args.run), Path(args.out))
    print(json.dumps({"checkpoint": str(last), "out": str(args.out)}))
    return 0


# --------------------------------------------------------------------------------------------------------- gold
def cmd_gold(args) -> int:
    """``empo2 gold TASK``: the gold length of every variation of a task's splits, with the share within caps."""
    from empo2.config import Config
    from empo2.envs.base import EnvError
    from empo2.envs.factory import resolve_tasks
    from empo2.envs.gold import length_summary, parse_caps, reachability

    overrides = [f"env.name={args.env}", f"env.tasks=[{args.task}]", f"env.simplification={args.simplification}"]
    overrides += [f"env.max_steps={args.max_steps}"] if args.max_steps else []
    overrides += [f"env.webshop_data={args.webshop_data}"] if args.webshop_data else []
    cfg = Config.load(None, overrides)
    splits = [args.split] if args.split else ["train", "dev", "test"]
    tasks, caps = resolve_tasks(cfg.env), parse_caps(args.caps) if args.caps else None  # bad input costs no JVM
    found = {split: reachability(cfg.env, tasks, split, args.variations) for split in splits}  # a JVM per split
    if None in found.values():
        raise EnvError(f"environment {cfg.env.name!r} registers no gold paths")
    table: dict[str, dict[str, dict[int, int | None]]] = {}
    for task in tasks:
        for split in splits:
            paths = [p for p in found[split] if p.task == task]
            print(f"{task} · {split} · {len(paths)} variations · our env's steps to success along the gold path "
                  f"(variation:steps):")
            print("  " + " ".join(f"{p.variation}:{p.steps if p.steps is not None else '-'}" for p in paths))
            print("  " + length_summary(paths, caps or sorted({p.cap for p in paths})))
            table.setdefault(task, {})[split] = {p.variation: p.steps for p in paths}
    print(json.dumps({"env": cfg.env.name, "simplification": cfg.env.simplification, "steps": table}))
    return 0


# --------------------------------------------------------------------------------------------------------- main
def cmd_play(args) -> int:
    from empo2.play import play

    return play(args)


def _command(name: str):
    """The function that runs command ``name``; the parser (:mod:`empo2.cli_parser`) knows no code that runs."""
    if name == "memory":
        from empo2.memory.cli import run_memory_command

        return run_memory_command
    if name in ("eval", "adapt"):
        from empo2 import cli_policy

        return {"eval": cli_policy.cmd_eval, "adapt": cli_policy.cmd_adapt}[name]
    return {"play": cmd_play, "sft": cmd_sft, "train": cmd_train, "compare": cmd_compare,
            "report": cmd_report, "export": cmd_export, "gold": cmd_gold}[name]


def main(argv: list[str] | None = None) -> int:
    from empo2 import signals

    return signals.run_command(_main, argv)  # SIGTERM / Ctrl-C: one line and 128 + signal


def _warn_renamed_keys_plainly() -> None:
    """A config key's old name is the user's to fix, not the code's: its warning prints as one ``warning:`` line
    instead of a source location; other warnings print as Python prints them."""
    import warnings

    from empo2.config_renames import ConfigRenameWarning

    show = warnings.showwarning
    if getattr(show, "plain_renames", False):
        return

    def plain(message, category, filename, lineno, file=None, line=None):
        if issubclass(category, ConfigRenameWarning):
            print(f"warning: {message}", file=sys.stderr)
        else:
            show(message, category, filename, lineno, file, line)

    plain.plain_renames = True
    warnings.showwarning = plain


def _main(argv: list[str] | None) -> int:
    from empo2 import signals

    args = parse_cli(argv)
    signals.set_phase(f"empo2 {args.command}")
    logging.basicConfig(level=logging.INFO if args.verbose else logging.WARNING, format="%(levelname)s %(message)s")
    _warn_renamed_keys_plainly()
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
    if not args.verbose and args.command != "memory":  # library chatter (weight-loading bars, deprecation notices) hides the run's own output
        import warnings

        warnings.filterwarnings("ignore", category=FutureWarning)
        os.environ.setdefault("HF_HUB_DISABLE_PROGRESS_BARS", "1")
        with signals.held():  # a signal inside torch's import would leave a half-made module (a crash at exit)
            from transformers.utils import logging as hf_logging

        hf_logging.disable_progress_bar()
        hf_logging.set_verbosity_error()
    from empo2.stdio import ClosedStdoutGuard

    stdout, sys.stdout = sys.stdout, ClosedStdoutGuard(sys.stdout)  # `| head` or a dead tee does not end a run
    try:
        with contextlib.ExitStack() as stack:  # locks and error translators a command holds until it returns
            args.exit_stack = stack
            code = int(_command(args.command)(args) or 0)
        signals.safe_point()  # a signal held inside a late import still stops the command
        return code
    except UserError as exc:  # every error a user can cause: one line, exit 2
        print(f"error: {exc}", file=sys.stderr)
        return 2
    except OSError as exc:
        if exc.errno != errno.ENAMETOOLONG:
            raise
        print(f"error: {name_too_long(exc.filename)}", file=sys.stderr)  # a path the user gave
        return 2
    except KeyboardInterrupt:
        print("interrupted", file=sys.stderr)
        return 130
    finally:
        sys.stdout.flush()
        sys.stdout = stdout


def name_too_long(path) -> str:
    """One line for a path the file system refuses as too long, with its limits (a name, the whole path)."""
    path = Path(os.fsdecode(path or "?"))
    folder = path.absolute().parent
    while folder != folder.parent and not _is_dir(folder):
        folder = folder.parent
    try:
        name_max, path_max = os.pathconf(folder, "PC_NAME_MAX"), os.pathconf(folder, "PC_PATH_MAX")
    except (OSError, ValueError):
        name_max, path_max = 255, 4096
    longest = max((len(os.fsencode(part)) for part in path.parts), default=0)
    shown = str(path) if len(str(path)) <= 100 else f"{str(path)[:60]}…{str(path)[-30:]}"
    return (f"{shown}: the path is too long for its file system ({len(os.fsencode(str(path)))} bytes, its longest "
            f"name {longest} bytes; {folder} allows {name_max} bytes a name and {path_max} a path); choose a "
            "shorter name")


def _is_dir(path: Path) -> bool:
    try:
        return path.is_dir()
    except OSError:  # itself too long
        return False


def entry() -> None:
    """The ``empo2`` console script: :func:`main` on jemalloc when the machine has it (:mod:`empo2.allocator`)."""
    from empo2 import signals
    from empo2.allocator import reexec_with_jemalloc

    signals.block_for_exec()  # until main() installs the handlers, in this process or the re-executed one
    reexec_with_jemalloc()
    code = main()
    signals.ignore()  # the command is over: a late Ctrl-C must not print a traceback while the interpreter exits
    sys.exit(code)


if __name__ == "__main__":
    entry()
