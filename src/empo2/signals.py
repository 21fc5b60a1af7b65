"""SIGTERM, SIGINT and SIGHUP as one clean stop: the phase the run was in, its last checkpoint, exit 128 + signal.

SIGTERM is what SLURM, Kubernetes and ``timeout`` send before SIGKILL; SIGINT is Ctrl-C; SIGHUP comes when the
terminal or ssh session the run was started from goes away. :func:`install` makes each raise :class:`Stopped` (a
``BaseException``, like ``KeyboardInterrupt``, so no ``except Exception`` swallows it). The ``finally`` blocks on the
way out close the environment workers and release the run lock; the CLI prints :meth:`Stopped.message` and exits 143,
130 or 129.

A signal that lands inside an ``import`` is held until a safe point (:func:`safe_point`, the end of :func:`held`, a
phase change): raising in the middle of a C extension's initialisation leaves a half-made module behind, and the
interpreter then crashes at exit. ``train.preempt_save`` holds the first signal until the current iteration is saved
(:func:`grace`); a second signal stops at once.
"""

from __future__ import annotations

import contextlib
import logging
import signal
from collections.abc import Callable
from pathlib import Path

SIGNALS = (signal.SIGTERM, signal.SIGINT, signal.SIGHUP)

_state = {"phase": "startup", "where": None, "run_dir": None, "latest_checkpoint": None, "pending": None,
          "pending_phase": None, "holds": 0, "grace": False, "stopping": False}


class Stopped(BaseException):
    """The process received SIGTERM, SIGINT or SIGHUP; ``exit_code`` is the shell's 128 + signal number."""

    def __init__(self, signum: int):
        super().__init__(signal.Signals(signum).name)
        self.signum = signum
        self.exit_code = 128 + signum
        self.phase = _state["pending_phase"] or _state["phase"]  # where the signal came in, if it was held
        _state["stopping"] = True

    def message(self) -> str:
        """One line: which signal, the phase it stopped, and where the run continues from."""
        name = signal.Signals(self.signum).name
        text = f"stopped by {name} during {self.phase}"
        run_dir, latest_checkpoint = _state["run_dir"], _state["latest_checkpoint"]
        if run_dir is None or latest_checkpoint is None:
            return text
        last = latest_checkpoint(Path(run_dir))
        if last is None:
            return f"{text}; no checkpoint was written yet (start again with the same command)"
        return f"{text}; last checkpoint {last} (continue with: empo2 train --resume {run_dir})"


def install() -> None:
    """Route SIGTERM, SIGINT and SIGHUP to :class:`Stopped` (main thread only; a no-op elsewhere), and deliver any that
    :func:`block_for_exec` held back."""
    for signum in SIGNALS:
        try:
            if signum == signal.SIGHUP and signal.getsignal(signum) == signal.SIG_IGN:
                continue  # started under nohup: the user asked the run to outlive its terminal
            signal.signal(signum, _handler)
        except ValueError:  # not the main thread
            return
    signal.pthread_sigmask(signal.SIG_UNBLOCK, SIGNALS)


@contextlib.contextmanager
def installed():
    """:func:`install` for one command: a fresh state, and the previous handlers back afterwards (a test or a
    notebook that calls ``main()`` keeps its own Ctrl-C)."""
    try:
        before = {signum: signal.getsignal(signum) for signum in SIGNALS}
    except ValueError:
        before = {}
    _state.update(phase="startup", where=None, run_dir=None, latest_checkpoint=None, pending=None, pending_phase=None,
                  holds=0, grace=False, stopping=False)
    install()
    try:
        yield
    finally:
        for signum, handler in before.items():
            try:
                signal.signal(signum, handler if handler is not None else signal.SIG_DFL)
            except ValueError:
                pass


def run_command(command, argv) -> int:
    """``command(argv)`` with the handlers installed; a stop prints its one line and gives 128 + signal."""
    import sys

    try:
        with installed():  # a signal held since start-up arrives as the handlers go in, so inside this try
            return command(argv)
    except Stopped as exc:  # the finally blocks on the way here closed the workers and released the lock
        print(exc.message(), file=sys.stderr)
        return exc.exit_code


def ignore() -> None:
    for signum in SIGNALS:
        signal.signal(signum, signal.SIG_IGN)


def block_for_exec() -> None:
    """Block the three signals before re-executing the process: the mask survives ``execve``, so one that comes while the
    new interpreter starts waits for its :func:`install` instead of killing it mid-import."""
    signal.pthread_sigmask(signal.SIG_BLOCK, SIGNALS)


def _handler(signum: int, frame) -> None:
    if _state["stopping"]:  # already on the way out (a repeated Ctrl-C, a signal to the group): let cleanup finish
        return
    if _state["pending"] is not None and not _in_import(frame) and not _state["holds"]:
        raise Stopped(signum)  # a second signal: stop now, whatever was held
    if _state["holds"] or _state["grace"] or _in_import(frame):
        _state["pending"], _state["pending_phase"] = signum, _state["phase"]
        return
    raise Stopped(signum)


def _in_import(frame) -> bool:
    while frame is not None:
        if frame.f_code.co_filename.startswith("<frozen importlib"):
            return True
        frame = frame.f_back
    return False


def safe_point() -> None:
    """Raise a held signal now, unless a grace period holds it to the iteration's end."""
    if _state["pending"] is not None and not _state["grace"] and not _state["holds"]:
        raise Stopped(_state["pending"])


def stop_requested() -> bool:
    return _state["pending"] is not None


def raise_pending() -> None:
    """At the end of a grace period's iteration: stop now if a signal came in."""
    if _state["pending"] is not None:
        raise Stopped(_state["pending"])


@contextlib.contextmanager
def held():
    """Hold signals for the block (heavy imports at startup), then raise one that came in."""
    _state["holds"] += 1
    try:
        yield
    finally:
        _state["holds"] -= 1
    safe_point()


@contextlib.contextmanager
def grace(enabled: bool):
    """With ``enabled``, a signal waits for :func:`raise_pending` (``train.preempt_save``)."""
    before, _state["grace"] = _state["grace"], bool(enabled)
    try:
        yield
    finally:
        _state["grace"] = before


def set_phase(phase: str, where: str | None = None, keep_where: bool = False) -> None:
    """Name what the process does now (``set_phase("the rollout", "iteration 3")``) for the stop message and the
    ``-v`` log; a safe point. ``keep_where``: a step inside the current one (the reflection of that iteration)."""
    where = _state["where"] if keep_where else where
    _state["where"] = where
    _state["phase"] = f"{phase} of {where}" if where else phase
    logging.getLogger("empo2.phase").info("phase: %s", _state["phase"])
    safe_point()


def current_phase() -> str:
    """What the process does now, as the last :func:`set_phase` named it (``the update of iteration 1``)."""
    return _state["phase"]


def set_run_dir(run_dir: Path | str | None, latest_checkpoint: Callable[[Path], Path | None] | None = None) -> None:
    """The run a stop names; ``latest_checkpoint`` finds its newest checkpoint (the run folder's layout is the
    trainer's, above this module, so the caller hands it in)."""
    _state["run_dir"] = run_dir
    _state["latest_checkpoint"] = latest_checkpoint
