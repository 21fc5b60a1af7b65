"""ScienceWorld (Wang et al., 2022) as a :class:`~empo2.envs.base.TextEnv`.

One instance drives one JVM through the ``scienceworld`` package. Episodes follow the released EMPO² setup:
simplification ``easy``, per-task step caps, reward = score delta, success = the simulator finished the task with
score 100. A timeout is never a success; a wrong focus (score −100) ends the episode.

Score vs return: ``info['score']`` is always the simulator's absolute score, so the last step's ``info['score']`` is
the episode score. A few tasks start above 0 (find-animal variation 0 scores 8 before any action); that initial score
is reported as ``info['initial_score']`` by :meth:`ScienceWorldEnv.reset` and is not paid out as a reward, so the sum
of rewards is ``final score − initial score`` (crediting it to the first action, whatever it was, would reward noise).

Action correction trusts the simulator first: the cleaned model output is sent as is, and only when the simulator
cannot parse it is it replaced by the closest valid action (:func:`empo2.envs.actions.correct_action`). Gold paths use
forms such as ``focus on thermometer in inventory`` that are absent from the simulator's valid-action list, so
correcting before trying would break them.
"""

from __future__ import annotations

import operator
from dataclasses import dataclass
from typing import Any, ClassVar

from empo2.envs.actions import clean_action, closest_actions
from empo2.envs.base import EnvError, StepResult, short_line, stop_java_simulator
from empo2.envs.scienceworld import gold
from empo2.envs.scienceworld.simulator import CONSTANT_HASH, DEFAULT_JAVA_OPTIONS, start_simulator
from empo2.envs.scienceworld.tasks import SPLITS, TASK_NAMES, check_task, expand_tasks, parse_focus_targets, step_cap
from empo2.envs.scienceworld.text import compact_actions, focused_object, readings_of, scienceworld_state
from empo2.envs.specs import EnvSpec, register_env

UNPARSED = "No known action matches that input."
AMBIGUOUS = "Ambiguous request"
ANSWER = "answer: "
"""How an answer to the simulator's question is recorded: this prefix and the text of the reading taken, since the
order of the readings changes between loads (``open drawer (in cupboard, ...)`` is 0 in one load, 1 in the next)."""


class ScienceWorldEnv:
    """ScienceWorld behind the :class:`~empo2.envs.base.TextEnv` protocol (one JVM per instance).

    ``max_steps`` caps every task (``None`` = per-task defaults: 30; chemistry-mix 60;
    measure-melting-point-known-substance 120); ``step_caps`` overrides single tasks and wins over ``max_steps``.
    ``valid_actions_in_info=False`` leaves ``info['valid_actions']`` empty: fetching the valid list is most of a
    step's cost; it is then fetched only when needed (correction, :meth:`valid_actions`).
    ``java_options`` go to the JVM (through ``JAVA_TOOL_OPTIONS``, after any the user set there, so theirs win).
    """

    name = "scienceworld"

    def __init__(self, simplification: str = "easy", max_steps: int | None = None, action_correction: bool = True,
                 step_caps: dict[str, int] | None = None, valid_actions_in_info: bool = True,
                 java_options: str | None = f"{DEFAULT_JAVA_OPTIONS} {CONSTANT_HASH}", action_cutoff: float = 0.0):
        self.simplification = simplification
        self.max_steps = max_steps
        self.action_correction = action_correction
        self.action_cutoff = float(action_cutoff)
        self.step_caps = dict(step_caps or {})
        self.valid_actions_in_info = valid_actions_in_info
        unknown = [t for t in self.step_caps if t not in TASK_NAMES]
        if unknown:
            raise EnvError(f"step_caps names unknown tasks {unknown}; valid tasks: {', '.join(TASK_NAMES)}")
        self._sim = start_simulator(java_options)
        self._splits: dict[str, dict[str, list[int]]] = {}
        self._demo_cache: dict[tuple[str, int], str] = {}
        self._n_variations: dict[str, int] = {}
        self._task: str | None = None
        self._variation = -1
        self._history: list[str] = []  # simulator commands of the current episode, for restoring it
        self._desc = ""
        self._targets: list[str] = []
        self._valid: list[str] | None = None  # None = not fetched for the current state yet
        self._score = 0
        self._focus = ""  # the object the agent focused on in this episode (part of its state)
        self._steps = 0
        self._done = False

    # ------------------------------------------------------------------ tasks and splits
    def task_names(self) -> list[str]:
        return list(TASK_NAMES)

    def step_cap(self, task: str) -> int:
        """Episode step cap of ``task`` under this instance's settings."""
        return step_cap(task, self.max_steps, self.step_caps)

    def num_variations(self, task: str) -> int:
        """Number of variations of ``task`` (all splits together)."""
        check_task(task)
        if task not in self._n_variations:
            self._n_variations[task] = int(self._sim.get_max_variations(task))
        return self._n_variations[task]

    def variations(self, task: str, split: str) -> list[int]:
        """Variation ids of ``task`` in ``split`` (``train``, ``dev``/``eval``, ``test``), from the simulator."""
        check_task(task)
        if split not in SPLITS:
            raise EnvError(f"unknown split {split!r}; valid splits: {', '.join(SPLITS)}")
        if task not in self._splits:
            self._scratch(lambda: self._load(task, 0))
        return list(self._splits[task][SPLITS[split]])

    # ------------------------------------------------------------------ episodes
    def reset(self, task: str, variation: int) -> tuple[str, dict[str, Any]]:
        """Start ``task`` at ``variation``; the observation is the first room's ``look around``."""
        check_task(task)
        n = self.num_variations(task)
        given = variation
        try:
            variation = -1 if isinstance(variation, bool) else operator.index(variation)  # numpy ints are fine
        except TypeError:
            variation = -1
        if not 0 <= variation < n:
            raise EnvError(f"variation {given!r} out of range for {task!r}: valid 0..{n - 1} "
                           f"(train/dev/test splits: see variations())")
        obs = self._load(task, variation)
        self._task, self._variation = task, variation
        self._history, self._steps, self._done, self._focus = [], 0, False, ""
        self._score = self._read_score()  # a few tasks start above 0 (find-animal: 8)
        self._desc = self._sim.get_task_description()
        self._targets = parse_focus_targets(self._desc)
        info = self._info(raw="", action="")
        info.update(task=task, variation=variation, task_description=self._desc, max_steps=self.step_cap(task),
                    initial_score=self._score)
        return obs, info

    def step(self, action: str) -> StepResult:
        """Send one action; ``info['raw_action']`` is what was given, ``info['action']`` what the simulator ran."""
        if self._task is None:
            raise EnvError("step() before reset()")
        if self._done:
            return StepResult("The episode is over; call reset().", 0.0, True, self._info(raw=action, action=""))
        command = clean_action(action) if self.action_correction else str(action).strip()
        first_command = len(self._history)
        obs, completed = self._send(command)
        if self.action_correction and obs.startswith(UNPARSED):
            # An unparsed input leaves the state unchanged, so each candidate is a fresh try. The simulator's
            # valid-action list holds a few combinations its own parser rejects: fall back to the next closest.
            for fixed in closest_actions(command, self.valid_actions(), cutoff=self.action_cutoff, limit=3):
                command = fixed
                obs, completed = self._send(command)
                if not obs.startswith(UNPARSED):
                    break
        if obs.startswith(AMBIGUOUS):  # the simulator asks which object was meant: take the first reading
            readings = readings_of(obs)
            obs, completed = self._send(ANSWER + readings[0] if readings else "0", obs)
        accepted = not obs.startswith(UNPARSED)
        score = self._read_score()
        reward = float(score - self._score)
        self._score = score
        self._steps += 1
        self._valid = None
        truncated = not completed and score >= 0 and self._steps >= self.step_cap(self._task)
        self._done = bool(completed or score < 0 or truncated)
        info = self._info(raw=action, action=command)
        info["success"] = bool(completed and score >= 100)
        info["truncated"] = truncated
        info["accepted"] = accepted
        info["commands"] = self._history[first_command:]  # what replays this step: tries and answers included
        return StepResult(obs, reward, self._done, info)

    def restore_prefix(self, task: str, variation: int, step_commands: list[list[str]]) -> tuple[str, dict[str, Any]]:
        """Put this instance into the state after the first ``len(step_commands)`` steps of a recorded episode: load
        ``task`` at ``variation`` and replay each step's simulator commands (its ``info['commands']``: rejected
        tries, corrections and automatic answers included). Returns ``(observation, info)`` as :meth:`reset` does,
        with ``info['observations']``: the observation after each replayed step, for checking the replay.

        The simulator has no state snapshot; replay is the way back. Its text is not byte-identical across loads
        (object listing order, some readings), so the caller compares what matters to it (the state). A replay whose
        episode ends before the prefix does (completed, a wrong focus, the step cap) stops there, with
        ``info['done']`` set."""
        obs, first = self.reset(task, variation)
        observations = []
        for commands in step_commands:
            if self._done:
                break
            for command in commands:
                obs, completed = self._send(command, obs)
            observations.append(obs)
            self._steps += 1
            self._score = self._read_score()
            truncated = not completed and self._score >= 0 and self._steps >= self.step_cap(task)
            self._done = bool(completed or self._score < 0 or truncated)
        info = {**first, **self._info(raw="", action="")}
        info.update(observations=observations, done=self._done)
        return obs, info

    def _read_score(self) -> int:
        """The simulator's score on the 0–100 scale (−100 after a wrong focus)."""
        return int(round(100 * self._sim.server.getScore()))

    def _send(self, command: str, previous: str = "") -> tuple[str, bool]:
        """One simulator command, recorded so the episode can be replayed after a scratch load; ``previous`` is the
        observation before it (the question an answer answers)."""
        self._history.append(command)
        obs = self._run(command, previous)
        self._focus = focused_object(obs) or self._focus
        return obs, bool(self._sim.server.getCompleted())

    def _run(self, command: str, previous: str) -> str:
        """Send a recorded command; an answer goes as the index its reading has in ``previous``, the question."""
        if command.startswith(ANSWER):
            readings = readings_of(previous)
            reading = command[len(ANSWER):]
            command = str(readings.index(reading)) if reading in readings else "0"
        return self._sim.server.step(command)

    def _info(self, raw: str, action: str) -> dict[str, Any]:
        """What every reset and step reports. The allowed focus targets come with each step, not only the first, so
        that every prompt shows them (the released prompt keeps them in its first message, which stays in view)."""
        valid = self.short_valid_actions() if self.valid_actions_in_info else []
        look, inventory = self._sim.look(), self._sim.inventory()
        return {"score": self._score, "success": False, "look": look, "inventory": inventory, "focus": self._focus,
                "focus_targets": list(self._targets),
                "state": scienceworld_state(look, inventory, self._score, self._focus), "valid_actions": valid,
                "raw_action": raw, "action": action, "steps": self._steps, "task": self._task,
                "variation": self._variation}

    def _load(self, task: str, variation: int) -> str:
        """Load and reset the simulator; cache the task's splits; return the first observation."""
        try:
            self._sim.load(task, variation, self.simplification, generateGoldPath=False)
        except ValueError as exc:  # the package validates the simplification string
            raise EnvError(str(exc)) from None
        self._sim.server.reset()
        if task not in self._splits:
            self._splits[task] = {"train": self._sim.get_variations_train(), "dev": self._sim.get_variations_dev(),
                                  "test": self._sim.get_variations_test()}
        obs = self._sim.server.step("look around")
        self._valid = None
        return obs

    def _scratch(self, fn):
        """Run ``fn`` (which loads other games) and then restore the current episode by replaying its commands."""
        try:
            return fn()
        finally:
            if self._task is not None:
                self._restore()

    def _restore(self) -> None:
        """Reload the current episode and replay its commands (deterministic)."""
        obs = self._load(self._task, self._variation)
        for command in self._history:
            obs = self._run(command, obs)

    # ------------------------------------------------------------------ helpers for prompts and policies
    def valid_actions(self) -> list[str]:
        """All valid action-object combinations in the current state (can be thousands)."""
        if self._valid is None:
            self._valid = list(self._sim.get_valid_action_object_combinations())
        return list(self._valid)

    def short_valid_actions(self, limit: int = 64) -> list[str]:
        """A compact subset of :meth:`valid_actions` (the one ``info['valid_actions']`` carries)."""
        return compact_actions(self.valid_actions(), limit)

    def task_description(self) -> str:
        return self._desc

    def focus_targets(self) -> list[str]:
        """Allowed FOCUS targets parsed from the current task description."""
        return list(self._targets)

    def look(self) -> str:
        return self._sim.look()

    def inventory(self) -> str:
        return self._sim.inventory()

    def gold_actions(self) -> list[str]:
        """The current episode's gold action sequence (``[]`` before any reset): the one a fresh JVM computes
        (:func:`~empo2.envs.scienceworld.simulator.fresh_gold_path`), read from the gold cache after the first time."""
        if self._task is None:
            return []
        return gold.gold_actions(self._task, self._variation, self.simplification)

    def java_version(self) -> str:
        """The JVM's ``java.version`` (gold paths can differ between JVMs)."""
        return str(self._sim._gateway.jvm.java.lang.System.getProperty("java.version"))

    def java_pid(self) -> int:
        """Process id of this instance's JVM."""
        return int(self._sim._gateway.java_process.pid)

    def demonstration(self, task: str, variation: int, n: int = 1) -> str:
        """``n`` gold trajectories of ``task`` from train variations other than ``variation``, as
        ``> action`` / observation lines. Cached; the current episode is restored if one is running."""
        check_task(task)
        others = [v for v in self.variations(task, "train") if v != variation][:n]
        missing = [v for v in others if (task, v) not in self._demo_cache]
        if missing:
            self._scratch(lambda: [self._demo_text(task, v) for v in missing])
        return "\n\n".join(self._demo_cache[(task, v)] for v in others)

    def _demo_text(self, task: str, variation: int) -> str:
        obs = self._load(task, variation)
        lines = [f"Task: {self._sim.get_task_description()}", short_line(obs)]
        for action in gold.gold_actions(task, variation, self.simplification):
            obs = self._sim.server.step(action)
            lines += [f"> {action}", short_line(obs)]
            if self._sim.server.getCompleted():
                break
        self._demo_cache[(task, variation)] = "\n".join(lines)
        return self._demo_cache[(task, variation)]

    def close(self) -> None:
        """Stop the JVM (idempotent)."""
        sim, self._sim = getattr(self, "_sim", None), None
        if sim is not None:
            stop_java_simulator(sim)

    def __enter__(self) -> ScienceWorldEnv:
        return self

    def __exit__(self, *exc) -> None:
        self.close()


GUIDE = (
    "You are an agent in ScienceWorld, a text simulation of science experiments. Reach the goal of the task.\n"
    "Actions: look around | look at OBJ | open OBJ | close OBJ | go to LOC | pick up OBJ | put OBJ in OBJ | "
    "move OBJ to OBJ | focus on OBJ | activate OBJ | deactivate OBJ | use OBJ on OBJ | connect OBJ to OBJ | "
    "pour OBJ in OBJ | mix OBJ | read OBJ | wait | inventory | teleport to LOC.\n"
    "Focusing on a wrong object fails the task: only focus on the objects the task names.\n"
    "Answer with exactly one action on one line, nothing else."
)


@dataclass(frozen=True)
class ScienceWorldOptions:
    """ScienceWorld's settings, ``env.scienceworld.*``."""

    key: ClassVar[str] = "scienceworld"

    simplification: str = "easy"
    """ScienceWorld simplification string (``easy`` = the released setup)."""


def _env_kwargs(cfg) -> dict:
    # The per-step valid-action list is most of a step's cost and rollouts do not show it to the model; the
    # corrector still fetches it when the simulator rejects an action.
    return {"simplification": cfg.scienceworld.simplification, "max_steps": cfg.max_steps,
            "action_correction": cfg.action_correction, "action_cutoff": cfg.action_cutoff,
            "step_caps": cfg.step_caps, "valid_actions_in_info": False}


def _gold_paths(env_cfg, tasks: list[str], split: str, per_task: int | None, say=print) -> list:
    """Gold path lengths of ``split``'s first ``per_task`` variations (:mod:`.gold`: cached, one JVM)."""
    return gold.gold_paths(ScienceWorldEnv, env_cfg, tasks, split, per_task, say)


register_env(EnvSpec("scienceworld", factory=ScienceWorldEnv, kwargs=_env_kwargs, guide=GUIDE,
                     tasks=lambda cfg: expand_tasks(cfg.tasks), gold_paths=_gold_paths, options=ScienceWorldOptions))
