"""Starting ScienceWorld's simulator: one JVM through the ``scienceworld`` package, with the JVM options it runs
under, and the gold path a JVM started for it alone computes."""

from __future__ import annotations

from empo2.envs.base import EnvError, start_java_simulator, stop_java_simulator
from empo2.envs.scienceworld.tasks import check_task

JAVA_HINT = "ScienceWorld needs Java >= 11 on PATH; install it with: apt-get install -y openjdk-17-jre-headless"
DEFAULT_JAVA_OPTIONS = "-Xmx1g -XX:+UseSerialGC"
"""A small heap and the serial collector: a worker's JVM holds far less memory and steps faster than with the JVM's
defaults (G1, heap = RAM/4), measured in records/benchmarks.md."""
CONSTANT_HASH = "-XX:+UnlockExperimentalVMOptions -XX:hashCode=2"
"""Every Java object gets the same identity hash. The simulator lists a room's objects, names the referents of its
valid actions ("paint in cup containing red paint") and breaks ties in the order of sets hashed by identity, and the
JVM's default hashes depend on everything the JVM ran before: an evaluation's episodes, or a resume's fresh JVM,
would change the episodes of the training after them. With one constant hash the order is the one the world was
built in, the same in every JVM. Gold paths keep being computed without it (:func:`fresh_gold_path`), so the cached
ones stay valid; they replay the same either way, and steps take as long."""


def start_simulator(java_options: str | None):
    """A ``scienceworld.ScienceWorldEnv`` in a new JVM started with ``java_options`` (after any the user set in
    ``JAVA_TOOL_OPTIONS``, so theirs win); the step limit is left to our environment."""
    try:
        from scienceworld import ScienceWorldEnv as Simulator
    except ImportError as exc:
        raise EnvError(f"the scienceworld package is missing ({exc}); pip install scienceworld") from None
    return start_java_simulator(lambda: Simulator("", envStepLimit=10**9), "ScienceWorld", java_options, JAVA_HINT)


def fresh_gold_path(task: str, variation: int, simplification: str) -> list[str]:
    """The simulator's gold path of (``task``, ``variation``), computed by a JVM started for it alone.

    The simulator makes some of a gold path's choices (which object a find task moves, say) by shuffling sets whose
    order follows Java identity hashes, and those depend on everything the JVM ran before. The same JVM therefore gives
    another path after other episodes, and only a fresh one gives the same path every time."""
    check_task(task)
    sim = start_simulator(DEFAULT_JAVA_OPTIONS)  # as every cached gold path was computed
    try:
        try:
            sim.load(task, variation, simplification, generateGoldPath=True)
        except ValueError as exc:  # the package validates the simplification string
            raise EnvError(str(exc)) from None
        return list(sim.get_gold_action_sequence())
    finally:
        stop_java_simulator(sim)
