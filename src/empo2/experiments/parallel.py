"""Run a list of subprocesses at most N at a time, in order, each started only when it may start.

``empo2 compare --jobs N`` runs its training runs through :func:`run_at_most`. Every run stays an ordinary ``empo2
train`` subprocess in its own session (:func:`spawn_run`); this module decides when each starts and passes stop
signals on. A stop (SIGTERM, Ctrl-C) reaches every running child once, each is waited for while it saves its
checkpoint, and a second signal is passed on too, so a second Ctrl-C stops the runs at once, as it stops ``empo2
train``.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from collections.abc import Callable, Sequence
from pathlib import Path

from empo2.signals import SIGNALS, Stopped

POLL_S = 1.0


def threads_per_job(jobs: int) -> str:
    """The ``OMP_NUM_THREADS`` of each of ``jobs`` runs at once: the user's own setting if there is one, else this
    process's CPUs shared out (a torch run otherwise starts one thread per core and ``jobs`` of them oversubscribe)."""
    return os.environ.get("OMP_NUM_THREADS") or str(max(1, len(os.sched_getaffinity(0)) // jobs))


def run_at_most(slots: int, items: Sequence[int], launch: Callable[[int], subprocess.Popen | None],
                ready: Callable[[int, list[int]], bool], finish: Callable[[int, int, float], None]) -> None:
    """Start ``items`` in their order, at most ``slots`` running at once.

    The first pending item for which ``ready(item, running_items)`` holds is launched next; with nothing running every
    item must be ready, so the loop never waits on itself. ``launch`` returns the child, or ``None`` when the item needs
    no run; ``finish(item, exit_code, seconds)`` follows each child's exit.
    """
    pending, running = list(items), {}
    try:
        while pending or running:
            while len(running) < slots and (item := next((x for x in pending if ready(x, list(running))), None)) \
                    is not None:
                pending.remove(item)
                if (proc := launch(item)) is not None:
                    running[item] = (proc, time.perf_counter())
            for item, (proc, t0) in list(running.items()):
                if proc.poll() is not None:
                    del running[item]
                    finish(item, proc.returncode, time.perf_counter() - t0)
            if running:
                time.sleep(POLL_S)
    except Stopped as stop:
        _stop_all([proc for proc, _ in running.values()], stop.signum)
        raise


def _stop_all(procs: list[subprocess.Popen], signum: int) -> None:
    """Pass ``signum`` to every child and wait for all of them; a further signal is passed on to those still alive."""
    def forward(sig, _frame):
        for proc in procs:
            if proc.poll() is None:
                proc.send_signal(sig)

    previous = {sig: signal.signal(sig, forward) for sig in SIGNALS}
    try:
        forward(signum, None)
        for proc in procs:
            proc.wait()
    finally:
        for sig, handler in previous.items():
            signal.signal(sig, handler)


def spawn_run(cmd: list[str], log: Path | None, env: dict[str, str] | None) -> subprocess.Popen:
    """One training subprocess in its own session, so a Ctrl-C typed in the terminal reaches only this process,
    which passes it on (:func:`run_at_most`); its output goes to this terminal or to ``log``."""
    out = None
    if log is not None:
        log.parent.mkdir(parents=True, exist_ok=True)
        out = log.open("ab")
    try:
        # preexec_fn: one prctl call of a library loaded before the fork, nothing that takes a lock other threads hold
        return subprocess.Popen(cmd, start_new_session=True, preexec_fn=_die_with_parent(),  # noqa: PLW1509
                                stdout=out, stderr=subprocess.STDOUT if out else None, env=env)
    finally:
        if out is not None:
            out.close()  # the child holds its own copy


def _die_with_parent() -> Callable[[], None] | None:
    """A child hook that SIGTERMs the run if this process dies (``kill -9`` included): in its own session no group
    or terminal signal reaches it any more. Linux only (``prctl(PR_SET_PDEATHSIG)``); libc is loaded here, before
    the fork, because loading a library between fork and exec can deadlock."""
    if not sys.platform.startswith("linux"):
        return None
    import ctypes

    prctl = ctypes.CDLL(None, use_errno=True).prctl
    return lambda: prctl(1, signal.SIGTERM)  # 1 = PR_SET_PDEATHSIG
