"""The ``empo2`` command line's start: :func:`main` runs one command (the function its name picks), turning a
user's error into one line and exit code 2; :func:`entry` is the console script. The small commands (compare,
report, export, gold, play) are here; train and sft are :mod:`.training`, eval and adapt :mod:`.policy`.
"""

from __future__ import annotations

import contextlib
import errno
import json
import logging
import os
import sys
from pathlib import Path

from empo2.cli.parser import parse_cli
from empo2.cli.training import check_run_inputs
from empo2.errors import UserError


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

    overrides = [f"env.name={args.env}", f"env.tasks=[{args.task}]",
                 f"env.scienceworld.simplification={args.simplification}"]
    overrides += [f"env.max_steps={args.max_steps}"] if args.max_steps else []
    overrides += [f"env.webshop.data={args.webshop_data}"] if args.webshop_data else []
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
    print(json.dumps({"env": cfg.env.name, "simplification": cfg.env.scienceworld.simplification, "steps": table}))
    return 0


# --------------------------------------------------------------------------------------------------------- main
def cmd_play(args) -> int:
    from empo2.play import play

    return play(args)


def _command(name: str):
    """The function that runs command ``name``; the parser (:mod:`.parser`) knows no code that runs."""
    if name == "memory":
        from empo2.memory.commands import run_memory_command

        return run_memory_command
    if name in ("eval", "adapt"):
        from empo2.cli import policy

        return {"eval": policy.cmd_eval, "adapt": policy.cmd_adapt}[name]
    if name in ("train", "sft"):
        from empo2.cli import training

        return {"train": training.cmd_train, "sft": training.cmd_sft}[name]
    return {"play": cmd_play, "compare": cmd_compare, "report": cmd_report, "export": cmd_export,
            "gold": cmd_gold}[name]


def main(argv: list[str] | None = None) -> int:
    from empo2 import signals

    return signals.run_command(_main, argv)  # SIGTERM / Ctrl-C: one line and 128 + signal


def _warn_renamed_keys_plainly() -> None:
    """A config key's old name is the user's to fix, not the code's: its warning prints as one ``warning:`` line
    instead of a source location; other warnings print as Python prints them."""
    import warnings

    from empo2.config.renames import ConfigRenameWarning

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
