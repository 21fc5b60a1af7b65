"""``python -m empo2.cli``: the console script's :func:`~empo2.cli.app.entry`, with Ctrl-C and SIGTERM held until
its handler is installed instead of breaking an import."""

from empo2.signals import block_for_exec

block_for_exec()

from empo2.cli.app import entry  # noqa: E402  (after the signals are blocked)

entry()
