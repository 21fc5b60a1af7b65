"""ScienceWorld (pip ``scienceworld``): the environment (:mod:`.env`), its simulator's JVM (:mod:`.simulator`), its
tasks, sets and step caps (:mod:`.tasks`), the text it reads (:mod:`.text`) and its gold paths (:mod:`.gold`);
importing it starts no JVM."""

from empo2.envs.scienceworld.env import ANSWER, ScienceWorldEnv
from empo2.envs.scienceworld.simulator import DEFAULT_JAVA_OPTIONS, fresh_gold_path
from empo2.envs.scienceworld.tasks import SPLITS, TASK_NAMES, TASK_SETS, expand_tasks, parse_focus_targets, step_cap

__all__ = ["ANSWER", "DEFAULT_JAVA_OPTIONS", "SPLITS", "TASK_NAMES", "TASK_SETS", "ScienceWorldEnv", "expand_tasks",
           "fresh_gold_path", "parse_focus_targets", "step_cap"]
