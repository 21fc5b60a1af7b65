"""The README cannot drift from the code: every ``empo2`` command in its code blocks parses with the CLI's own parser,
and a command's ``--config`` file loads with its ``key=value`` overrides through the config loader, so a renamed flag
or config key fails here. The imports in its Python blocks resolve. It stays a short user's document (at most 160
lines of at most 160 characters) with no commit hash outside its results section. Nothing runs: no model loads, no
subprocess starts.
"""

from __future__ import annotations

import ast
import importlib
import re
import shlex
from pathlib import Path

import pytest

from empo2.cli import parse_cli
from empo2.config import Config, ConfigError

ROOT = Path(__file__).resolve().parents[1]
README = ROOT / "README.md"
MAX_LINES = 160
MAX_WIDTH = 160  # characters per line, code blocks included: the page reads without side-scrolling
MAIN_JOB = ("bash scripts/setup.sh && .venv/bin/empo2 train --config configs/scienceworld_reach_cpu.yaml "
            "train.iterations=2 env.eval_variations=10 --overwrite")
TESTS_COMMAND = "bash scripts/test.sh"
# A commit hash: 7-40 lowercase hex characters with a digit among them (English words such as "defaced" have none).
COMMIT_HASH = re.compile(r"\b(?=[0-9a-f]*[0-9])[0-9a-f]{7,40}\b")
SHELL_LANGUAGES = {"bash", "sh", "shell", "console"}


def code_blocks(text: str) -> list[tuple[str, str]]:
    """``(language, body)`` of every fenced code block."""
    return [(m.group(1), m.group(2)) for m in re.finditer(r"^```(\w*)[^\n]*\n(.*?)^```", text, re.M | re.S)]


def shell_commands(text: str) -> list[list[str]]:
    """Every simple command in the shell blocks, as argv lists: continuation lines joined, comments dropped, and
    ``a && b`` / ``a; b`` / ``a | b`` split into their parts."""
    commands = []
    for language, body in code_blocks(text):
        if language not in SHELL_LANGUAGES:
            continue
        for line in body.replace("\\\n", " ").splitlines():
            lexer = shlex.shlex(line, posix=True, punctuation_chars=True)
            lexer.whitespace_split = True
            current: list[str] = []
            for token in lexer:
                if token in ("&&", "||", ";", "|", "&"):
                    commands.append(current)
                    current = []
                else:
                    current.append(token)
            commands.append(current)
    return [c for c in commands if c]


def empo2_argv(command: list[str]) -> list[str] | None:
    """The arguments given to the ``empo2`` CLI by one shell command, or ``None`` when it does not call it."""
    words = list(command)
    while words and re.fullmatch(r"[A-Z_][A-Z0-9_]*=.*", words[0]):  # leading VAR=value assignments
        words.pop(0)
    if words and (words[0] == "empo2" or words[0].endswith("/empo2")):
        return words[1:]
    for i in range(1, len(words)):  # python -m empo2.cli …, torchrun … -m empo2.cli …
        if words[i - 1] == "-m" and words[i] == "empo2.cli":
            return words[i + 1:]
    return None


def readme_cli_calls(text: str) -> list[list[str]]:
    return [argv for argv in map(empo2_argv, shell_commands(text)) if argv is not None]


def check_cli_call(argv: list[str]) -> None:
    """Parse ``empo2 ARGV`` without running it; load its config with its overrides the way the command would."""
    try:
        args = parse_cli(argv)
    except SystemExit as exc:  # argparse's way of refusing a command line
        raise AssertionError(f"README command does not parse: empo2 {shlex.join(argv)}") from exc
    config = getattr(args, "config", None)
    if config and not getattr(args, "resume", None):
        overrides = list(getattr(args, "overrides", []))
        if getattr(args, "algo", None):
            overrides.append(f"algo.name={args.algo}")
        if getattr(args, "output_dir", None):
            overrides.append(f"train.output_dir={args.output_dir}")
        try:
            Config.load(ROOT / config, overrides)
        except ConfigError as exc:
            raise AssertionError(f"README command's config does not load: empo2 {shlex.join(argv)}: {exc}") from exc


def python_imports(text: str) -> list[tuple[str, str]]:
    """``(module, name)`` of every ``from empo2... import name`` in the Python blocks."""
    found = []
    for language, body in code_blocks(text):
        if language != "python":
            continue
        for node in ast.walk(ast.parse(body)):
            if isinstance(node, ast.ImportFrom) and (node.module or "").split(".")[0] == "empo2":
                found += [(node.module, alias.name) for alias in node.names]
    return found


def hashes_outside_results(text: str) -> list[str]:
    """Commit-hash-like words on lines outside the ``## Results`` section (HTML comments ignored)."""
    found, in_results = [], False
    for number, line in enumerate(text.splitlines(), 1):
        if line.startswith("## "):
            in_results = line.strip().lower() == "## results"
        if not in_results:
            found += [f"line {number}: {h}" for h in COMMIT_HASH.findall(re.sub(r"<!--.*?-->", "", line))]
    return found


@pytest.fixture(scope="module")
def readme() -> str:
    return README.read_text(encoding="utf-8")


def test_the_two_commands_are_shown_and_ci_runs_the_second(readme):
    assert MAIN_JOB in readme
    assert TESTS_COMMAND in readme
    assert TESTS_COMMAND in (ROOT / ".ci" / "run").read_text()
    assert (ROOT / "scripts" / "setup.sh").is_file()


def test_every_empo2_command_parses_and_its_config_loads(readme):
    calls = readme_cli_calls(readme)
    commands = {argv[0] for argv in calls}
    assert {"train", "compare", "eval", "adapt", "report", "memory", "play"} <= commands, commands
    for argv in calls:
        check_cli_call(argv)


def test_a_renamed_key_or_flag_would_fail(readme):
    """The checks above have teeth: the main job with a key or a flag the code does not know is refused."""
    main = next(argv for argv in readme_cli_calls(readme) if "train.iterations=2" in argv)
    check_cli_call(main)
    with pytest.raises(AssertionError, match="config does not load"):
        check_cli_call([a if a != "train.iterations=2" else "train.iteration=2" for a in main])
    with pytest.raises(AssertionError, match="does not parse"):
        check_cli_call([*main, "--no-such-flag"])


def test_python_blocks_import_what_exists(readme):
    imports = python_imports(readme)
    assert imports, "the Extending section shows how to register an algorithm and an environment"
    for module, name in imports:
        assert hasattr(importlib.import_module(module), name), f"README imports {name} from {module}"


def test_short(readme):
    assert len(readme.splitlines()) <= MAX_LINES


def test_no_line_wider_than_max_width(readme):
    wide = [f"line {n}: {len(line)} characters" for n, line in enumerate(readme.splitlines(), 1) if len(line) > MAX_WIDTH]
    assert wide == []


def test_no_commit_hash_outside_results(readme):
    assert hashes_outside_results(readme) == []


def test_extraction_reads_continuations_chains_and_comments():
    text = ("```bash\nbash scripts/setup.sh && .venv/bin/empo2 train --config c.yaml \\\n    a=1 --overwrite  # note\n"
            "EMPO2_HOME= empo2 memory stats --db runs/x; torchrun --nproc_per_node=2 -m empo2.cli train --resume r\n"
            "```\n```\nempo2 output lines are not commands\n```\n")
    assert readme_cli_calls(text) == [["train", "--config", "c.yaml", "a=1", "--overwrite"],
                                      ["memory", "stats", "--db", "runs/x"], ["train", "--resume", "r"]]
    assert hashes_outside_results("## Usage\nsee 3dce61e\n## Results\non f7923d7\n") == ["line 2: 3dce61e"]
