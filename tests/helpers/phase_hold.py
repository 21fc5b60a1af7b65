"""``python tests/helpers/phase_hold.py ARGS`` runs ``python -m empo2.cli ARGS``; with ``EMPO2_TEST_HOLD_PHASE`` set, the
process stays in that phase (``the update of iteration 1``) until a signal comes. The tiny test model leaves some
phases within milliseconds, sooner than a test can read the phase's log line and send its signal, so a test that
means to stop a run inside a phase holds it there. A held signal under ``train.preempt_save`` ends the wait and the
phase goes on as it would; without it the signal stops the process inside the wait, still in that phase."""

from __future__ import annotations

import os
import runpy
import time


def hold_in(phase: str) -> None:
    from empo2 import signals

    original = signals.set_phase

    def set_phase(*args, **kwargs):
        original(*args, **kwargs)
        if signals.current_phase() == phase:
            while not signals.stop_requested():
                time.sleep(0.01)

    signals.set_phase = set_phase


if __name__ == "__main__":
    if os.environ.get("EMPO2_TEST_HOLD_PHASE"):
        hold_in(os.environ["EMPO2_TEST_HOLD_PHASE"])
    runpy.run_module("empo2.cli", run_name="__main__", alter_sys=True)
