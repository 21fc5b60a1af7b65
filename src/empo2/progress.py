"""The ``train`` command's progress, fed by the trainer's progress callback: a rich bar on a terminal, and plain
lines where the output goes to a file (``compare --jobs`` logs, ``nohup``, a cluster job's log), where a live bar
shows nothing until it ends."""

from __future__ import annotations

import time
from collections.abc import Callable

LINE_EVERY_S = 60.0
"""Where output is not a terminal: the most often a stage's progress line repeats (its start and end always show)."""


class ProgressBar:
    """Fed by ``callback(description, done, total)``; a no-op when disabled."""

    def __init__(self, console, enabled: bool, clock: Callable[[], float] = time.monotonic):
        self.console, self.enabled, self.clock = console, enabled, clock
        self.bar = self.task = None
        self.stage, self.stage_start, self.last_line = None, 0.0, 0.0

    def __enter__(self):
        if not self.enabled:
            return None
        if not _watched(self.console):
            return self.line
        from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn

        self.bar = Progress(TextColumn("{task.description}"), BarColumn(), MofNCompleteColumn(), TimeElapsedColumn(),
                            console=self.console, transient=True)
        self.bar.__enter__()
        self.task = self.bar.add_task("starting", total=1)
        return self.update

    def update(self, description: str, done: int, total: int) -> None:
        self.bar.update(self.task, description=description, completed=done, total=total)

    def line(self, description: str, done: int, total: int) -> None:
        """One plain line when a stage starts or ends, and at most every :data:`LINE_EVERY_S` seconds between."""
        now = self.clock()
        if description != self.stage:
            self.stage, self.stage_start = description, now
        elif done < total and now - self.last_line < LINE_EVERY_S:
            return
        self.last_line = now
        self.console.print(f"  {description}: {done}/{total} ({now - self.stage_start:.0f} s)", markup=False,
                           highlight=False)

    def __exit__(self, *exc):
        if self.bar is not None:
            self.bar.__exit__(*exc)
        return False


def _watched(console) -> bool:
    """Whether the console writes to a terminal. Asked of its file, not of rich: ``FORCE_COLOR`` or
    ``TTY_COMPATIBLE``, set for colours in a CI log, make rich call a file a terminal, and a live bar there shows
    nothing until it ends."""
    isatty = getattr(console.file, "isatty", None)
    return bool(isatty and isatty())
