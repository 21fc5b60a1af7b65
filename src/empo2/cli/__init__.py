"""``empo2`` command line: play · sft · train · compare · eval · adapt · report · export · memory · gold.

User errors (bad config, unknown task or model, missing Java or data) print one line and exit with code 2. The
package is the start (:mod:`.app`: :func:`main`, the console script's :func:`entry`), the parser (:mod:`.parser`),
the training commands (:mod:`.training`) and the commands that play a policy outside training (:mod:`.policy`).

Its public names are imported on first use, so that ``python -m empo2.cli`` blocks signals (:mod:`.__main__`) before
it imports any of the commands' modules.
"""

PUBLIC = {"main": "empo2.cli.app", "entry": "empo2.cli.app", "build_parser": "empo2.cli.parser",
          "parse_cli": "empo2.cli.parser"}

__all__ = sorted(PUBLIC)


def __getattr__(name: str):
    if name not in PUBLIC:
        raise AttributeError(f"module 'empo2.cli' has no attribute {name!r}")
    import importlib

    return getattr(importlib.import_module(PUBLIC[name]), name)
