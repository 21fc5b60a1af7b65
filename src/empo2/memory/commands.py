"""``empo2 memory``: inspect a tip memory — stats, show, search, export (JSONL) and an HTML report.

Every subcommand takes ``--db PATH``: a memory SQLite file, or a run folder holding ``memory.sqlite``.
Wired into the main CLI with :func:`add_memory_parser` and :func:`run_memory_command`; also runnable as
``python -m empo2.memory.commands memory stats --db runs/x``.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

from empo2.errors import UserError

from .store import MemoryStoreError, TipMemory, json_line

MEMORY_FILENAME = "memory.sqlite"


class MemoryCliError(UserError):
    """A user error: printed as one line, exit code 2."""


def add_memory_parser(subparsers: argparse._SubParsersAction) -> argparse.ArgumentParser:
    """Register ``memory`` and its subcommands on the main parser's ``subparsers``."""
    mem = subparsers.add_parser("memory", help="inspect a tip memory (stats, show, search, export, report)",
                                description=__doc__.split("\n\n")[0])
    sub = mem.add_subparsers(dest="memory_command", metavar="{stats,show,search,export,report}")
    sub.required = True

    def with_db(p: argparse.ArgumentParser) -> argparse.ArgumentParser:
        p.add_argument("--db", required=True, metavar="PATH",
                       help=f"memory SQLite file, or a run folder containing {MEMORY_FILENAME}")
        return p

    p = with_db(sub.add_parser("stats", help="counts per namespace, rejections by reason, mean utility"))
    p.add_argument("--json", action="store_true", help="print JSON")
    p.add_argument("--check", action="store_true",
                   help="full SQLite integrity_check of the file first (every open runs the faster quick_check)")
    p = with_db(sub.add_parser("show", help="list tips, newest first"))
    p.add_argument("--namespace", help="only this namespace (task)")
    p.add_argument("--limit", type=int, default=20, help="at most N tips (default 20; 0 = all)")
    p.add_argument("--json", action="store_true", help="print JSON lines")
    p = with_db(sub.add_parser("search", help="what a state (text) would retrieve"))
    p.add_argument("text", help="the state text: task + current observation")
    p.add_argument("--namespace", help="search this namespace only (default: each namespace)")
    p.add_argument("-k", type=int, default=10, help="tips per namespace (default 10)")
    p.add_argument("--threshold", type=float, default=0.5, help="minimum cosine similarity (default 0.5)")
    p.add_argument("--json", action="store_true", help="print JSON lines")
    p = with_db(sub.add_parser("export", help="write every tip as JSON lines"))
    p.add_argument("out", metavar="OUT.jsonl")
    p = with_db(sub.add_parser("report", help="write a self-contained HTML report"))
    p.add_argument("out", metavar="OUT.html")
    mem.set_defaults(func=run_memory_command)
    return mem


def resolve_db(path: str | Path) -> Path:
    """The memory file for ``--db`` (a file, or a folder with ``memory.sqlite``); it must exist."""
    p = Path(path)
    if p.is_dir():
        p = p / MEMORY_FILENAME
    if not p.is_file():
        raise MemoryCliError(f"no memory database at {p}")
    return p


def _line(tip, extra: str = "") -> str:
    util = "-" if tip.utility is None else f"{tip.utility:.3f}"
    return f"[{tip.id}] {tip.namespace} | score {tip.score:g} | utility {util} | uses {tip.use_count}{extra}\n    {tip.text}"


def _run(args: argparse.Namespace) -> None:
    check = "full" if getattr(args, "check", False) else "quick"
    command = {"stats": _stats, "show": _show, "search": _search, "export": _export, "report": _report}.get(
        args.memory_command)
    if command is None:  # pragma: no cover - argparse enforces the choices
        raise MemoryCliError(f"unknown memory command {args.memory_command!r}")
    with TipMemory(resolve_db(args.db), dim=None, integrity_check=check, read_only=True) as mem:
        command(mem, args)


def _stats(mem: TipMemory, args: argparse.Namespace) -> None:
    stats = mem.stats()
    if args.json:
        print(json.dumps(stats, ensure_ascii=False, indent=2))
        return
    mu = "-" if stats["mean_utility"] is None else f"{stats['mean_utility']:.3f}"
    print(f"{stats['path']}: {stats['tips']} tips, {stats['rated_tips']} rated, mean utility {mu}, "
          f"{stats['rejected']} rejected, {stats['evicted']} evicted")
    for ns, s in stats["namespaces"].items():
        nu = "-" if s["mean_utility"] is None else f"{s['mean_utility']:.3f}"
        print(f"  {ns}: {s['tips']} tips, mean utility {nu}, {s['uses'] or 0} uses")
    for reason, n in sorted(stats["rejections"].items()):
        print(f"  rejected {reason}: {n}")


def _show(mem: TipMemory, args: argparse.Namespace) -> None:
    if args.limit < 0:
        raise MemoryCliError("--limit must be >= 0")
    tips = mem.all_tips(args.namespace)[::-1]
    tips = tips[: args.limit] if args.limit else tips
    for t in tips:
        print(json_line(_public(t)) if args.json else _line(t))


def _search(mem: TipMemory, args: argparse.Namespace) -> None:
    if args.k < 1:
        raise MemoryCliError("-k must be >= 1")
    text = query_text(args.text)
    namespaces = [args.namespace] if args.namespace else mem.namespaces()
    if not namespaces:
        print("no tips: the memory is empty", file=sys.stderr if args.json else sys.stdout)
        return
    from .embedder import DEFAULT_EMBEDDER, get_embedder

    embedder = get_embedder(mem.meta.get("embedder") or DEFAULT_EMBEDDER)
    if embedder.dim != mem.dim:
        raise MemoryCliError(f"embedder {embedder.name} gives {embedder.dim}-d vectors; the memory has {mem.dim}")
    query = embedder.encode([text])
    hits = mem.retrieve(namespaces, query.repeat(len(namespaces), axis=0), k=args.k, threshold=args.threshold)
    if not any(hits):
        print(f"no tips with similarity >= {args.threshold:g} in {len(namespaces)} namespace(s)",
              file=sys.stderr if args.json else sys.stdout)
    for tips in hits:
        for t in tips:
            print(json_line(_public(t, True)) if args.json else _line(t, f" | similarity {t.similarity:.3f}"))


def _export(mem: TipMemory, args: argparse.Namespace) -> None:
    n = mem.export_jsonl(args.out)
    print(f"wrote {n} tips to {args.out}")


def _report(mem: TipMemory, args: argparse.Namespace) -> None:
    from .html_report import write_report

    print(f"wrote {write_report(mem, args.out)}")


def query_text(raw: str) -> str:
    """The search text as valid UTF-8: bytes the shell passed that are not UTF-8 (which Python keeps as lone
    surrogates) become U+FFFD; an empty text is a user error."""
    try:
        data = raw.encode("utf-8", "surrogateescape")
    except UnicodeEncodeError:  # surrogates that did not come from undecodable bytes
        data = raw.encode("utf-8", "replace")
    text = data.decode("utf-8", "replace").strip()
    if not text:
        raise MemoryCliError("the search text is empty; give the state to search for (task + observation)")
    return text


def _public(tip, with_similarity: bool = False) -> dict:
    d = tip.to_dict()
    if not with_similarity:
        d.pop("similarity"), d.pop("rank_score")
    return d


def run_memory_command(args: argparse.Namespace) -> int:
    """Run a parsed ``memory`` command; returns the exit code (user errors: one line on stderr, 2)."""
    try:
        _run(args)
    except (MemoryCliError, MemoryStoreError) as exc:
        print(f"empo2 memory: error: {exc}", file=sys.stderr)
        return 2
    except OSError as exc:
        print(f"empo2 memory: error: {exc}", file=sys.stderr)
        return 2
    return 0


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="empo2")
    add_memory_parser(parser.add_subparsers(dest="command", required=True))
    return run_memory_command(parser.parse_args(argv))


if __name__ == "__main__":
    sys.exit(main())
