"""The ``empo2`` command line's parser: every command and flag, and no code that runs them (that is :mod:`empo2.cli.app`)."""

from __future__ import annotations

import argparse

from empo2.envs.gold import REACHABLE_SHARE
from empo2.experiments.arm_runs import arms_help
from empo2.memory.commands import add_memory_parser

DESCRIPTION = "empo2 command line: play · sft · train · compare · eval · adapt · report · export · memory · gold."


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="empo2", description=DESCRIPTION)
    parser.add_argument("-v", "--verbose", action="store_true")
    sub = parser.add_subparsers(dest="command", required=True)
    _add_play_parser(sub)
    _add_run_parsers(sub)
    _add_eval_adapt_parsers(sub)

    p = sub.add_parser("report", help="the paper's tables (ScienceWorld, WebShop, OOD) from run/compare/adapt folders")
    p.add_argument("folders", nargs="+", metavar="RUN_OR_COMPARE_DIR")
    p.add_argument("--out", required=True)
    p.add_argument("--partial", action="store_true",
                   help="report the finished runs of a compare still under way; report.md names the runs left out")

    p = sub.add_parser("export", help="a run's last checkpoint (sharded or not, LoRA merged) as Hugging Face weights")
    p.add_argument("run", metavar="RUN_DIR")
    p.add_argument("out", metavar="OUT_DIR", help="a new (or empty) folder for config, safetensors and tokenizer")

    p = sub.add_parser("gold", help="gold path length of every variation of a task's splits, and the share a cap admits")
    p.add_argument("task", help="task or task-set name (WebShop's only task: webshop)")
    p.add_argument("--env", default="scienceworld", help="environment registry name (scienceworld, webshop)")
    p.add_argument("--split", choices=["train", "dev", "eval", "test"], default=None,
                   help="one split (default: train, dev and test)")
    p.add_argument("--variations", type=int, default=None, help="only the first N variations of each split")
    p.add_argument("--max-steps", type=int, default=None, help="the step cap to compare with (default: the task's)")
    p.add_argument("--caps", default=None, help="comma-separated step caps to give the share within, e.g. 8,10,12")
    p.add_argument("--simplification", default="easy", help="ScienceWorld simplification string")
    p.add_argument("--webshop-data", default=None)

    add_memory_parser(sub)
    return parser


def _add_play_parser(sub) -> None:
    p = sub.add_parser("play", help="play one episode and print the transcript and a JSON result line")
    p.add_argument("--env", default="scienceworld", help="environment registry name (scienceworld, webshop, …)")
    p.add_argument("--task")
    p.add_argument("--variation", type=int, default=0)
    p.add_argument("--policy", default="gold", choices=["gold", "random", "model"])
    p.add_argument("--model", default="smollm2-135m")
    p.add_argument("--device", default="auto")
    p.add_argument("--max-steps", type=int, default=None)
    p.add_argument("--temperature", type=float, default=0.4)
    p.add_argument("--max-new-tokens", type=int, default=24)
    p.add_argument("--history-window", type=int, default=4)
    p.add_argument("--webshop-data", default=None)
    p.add_argument("--webshop-start", choices=["search", "results"], default=None,
                   help="WebShop's first page (env.webshop.start; default search)")
    p.add_argument("--seed", type=int, default=0)


def _add_run_parsers(sub) -> None:
    p = sub.add_parser("sft", help="a warm start: supervised fine-tuning on gold paths of training variations, so "
                                   "that RL (policy.warm_start) starts from an agent that acts")
    p.add_argument("--config", help="YAML config: its env, policy and sft sections (configs/*_sft_*.yaml)")
    p.add_argument("--output-dir", help="the warm start's run folder (sft.output_dir)")
    p.add_argument("--overwrite", action="store_true", help="allow writing into a folder that holds a run")
    p.add_argument("overrides", nargs="*", metavar="key=value")

    p = sub.add_parser("train", help="train with EMPO² or GRPO")
    p.add_argument("--config", help="YAML config (configs/*.yaml)")
    p.add_argument("--algo", help="what compare --algos names: an algorithm (empo2, grpo, gigpo, luffy, …), NAME+ESTIMATOR "
                   "or an arm (luffy: LUFFY as its script runs it); the arm's settings, then the overrides")
    p.add_argument("--resume", metavar="RUN_DIR", help="continue the run in RUN_DIR from its last checkpoint")
    p.add_argument("--output-dir")
    p.add_argument("--overwrite", action="store_true", help="allow writing into a folder that holds a run")
    p.add_argument("overrides", nargs="*", metavar="key=value")

    p = sub.add_parser("compare", help="algorithms × seeds on one config with equal budget; summary and curves")
    p.add_argument("--config", required=True, help="YAML config shared by every run")
    p.add_argument("--algos", default="grpo,empo2",
                   help="comma-separated arms: algorithm names; NAME+ESTIMATOR (empo2+gigpo) sets algo.advantage; "
                        f"gigpo-std: std norm; ablations: {arms_help()}")
    p.add_argument("--seeds", default="0-2", help="seed values, never a count: 3 (seed 3), 1,4,7, 0-4 (seeds 0 to 4)")
    p.add_argument("--out", required=True, help="comparison folder (runs/, summary.md, summary.json, curves.png)")
    p.add_argument("--jobs", type=int, default=1,
                   help="runs at once (default 1); each gets CPUs/N torch threads unless OMP_NUM_THREADS is set, and "
                        "writes to OUT/logs/<run>.log")
    p.add_argument("--allow-unreachable", action="store_true",
                   help=f"run even where under {REACHABLE_SHARE * 100:.0f}%% of the evaluation variations have a gold path "
                        "within the step cap (empo2 gold TASK lists them)")
    p.add_argument("overrides", nargs="*", metavar="key=value", help="config overrides applied to every run")


def _add_eval_adapt_parsers(sub) -> None:
    for name, helptext in (("eval", "evaluate a run or a model on held-out variations"),
                           ("adapt", "OOD adaptation: trials with memory updates only")):
        p = sub.add_parser(name, help=helptext)
        p.add_argument("--run", help="run folder (uses its last checkpoint and config)")
        p.add_argument("--model", default=None, help="a model name instead of a run")
        p.add_argument("--config", help="with --model or alone: play under this YAML's policy, memory and env settings "
                                        "(the config a run trained with, for an untrained baseline played alike)")
        p.add_argument("--env", help="environment registry name (default: the run's)")
        p.add_argument("--tasks", help="comma-separated task or task-set names")
        p.add_argument("--split", default="dev" if name == "eval" else "test")
        p.add_argument("--variations", type=int, default=5)
        p.add_argument("--temperature", type=float, default=0.4)
        p.add_argument("--batch", type=int, default=4, help="episodes played in parallel")
        p.add_argument("--max-steps", type=int, default=None, help="episode step cap (default: the run's)")
        if name == "eval":
            p.add_argument("--with-memory", action="store_true")
            p.add_argument("--allow-unreachable", action="store_true",
                           help=f"evaluate even where under {REACHABLE_SHARE * 100:.0f}%% of the variations have a gold "
                                "path within the step cap (empo2 gold TASK lists them)")
            p.add_argument("--out")
        else:
            p.add_argument("--trials", type=int, default=None, help="trials (default 10)")
            p.add_argument("--preset", choices=["bio1-to-bio2", "bio2-to-elec", "elec-to-chem"],
                           help="the paper's OOD pairs: adapt a run trained on the first topic to the second")
            p.add_argument("--max-tasks", type=int, default=None, help="only the first N tasks (quick checks)")
            p.add_argument("--seed", type=int, default=0,
                           help="seeds every trial's sampling: cells with one seed and model share trial 0")
            p.add_argument("--baseline", choices=["memory", "reflexion", "none"], default="memory",
                           help="memory: EMPO²'s state-retrieved tips; reflexion: reflections on failed trials, "
                                "shown in the same variation's next trial; none: no memory, the control for how "
                                "much trials differ by sampling alone")
            p.add_argument("--out", required=True)


def parse_cli(argv: list[str] | None = None) -> argparse.Namespace:
    """Parse a command line; ``key=value`` overrides may come before, between or after the flags."""
    parser = build_parser()
    args, rest = parser.parse_known_args(argv)
    if rest and hasattr(args, "overrides") and all("=" in a and not a.startswith("-") for a in rest):
        args.overrides = [*args.overrides, *rest]  # argparse stops a positional list at the first flag
    elif rest:
        parser.error(f"unrecognized arguments: {' '.join(rest)}")
    return args
