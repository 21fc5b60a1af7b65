"""TextWorldExpress (Jansen & Côté, 2022) as a :class:`~empo2.envs.base.TextEnv`: text games generated on the fly,
CoinCollector first (find the coin in a map of rooms), MapReader, TWC and CookingWorld beside it.

One instance drives one JVM through the ``textworld-express`` package. A task is a game (``coin``, ``mapreader``,
``twc``, ``cookingworld``) and a variation is one of the package's seeds, which also name the fold: train 0-999, dev
10000-10999, test 20000-20999. A game's generation parameters (``numLocations=5,includeDoors=1`` …) come from the
run's ``env.textworld_express.params``; ``env.textworld_express.eval_params`` may give the dev and test games others
(larger maps: an out-of-distribution evaluation).

Score and success are the game's: ``info['score']`` is the package's normalised score × 100, the reward the change of
it, ``info['success']`` the package's ``tasksuccess``. The package's ``taskfailure`` (CookingWorld: an ingredient
eaten or spoilt) ends the episode with ``info['failure']`` and no success; the score keeps what was earned before it.
The step cap ends an episode too (``info['truncated']``), never as a success.

Observations: a room description comes with its exits first and its objects without the package's filler phrases
(:func:`~.state.compact_room`; ``info['look']`` keeps the package's text), so that a prompt that shortens long
observations keeps the exits and the coin.

Actions: the valid list (``info['valid_actions']``, sorted) is known at every step, so the model's output is cleaned
and, when it is not a valid action, replaced by the closest valid one (:func:`empo2.envs.actions.closest_actions`,
below ``action_cutoff`` it is sent as it is and the game answers ``Unknown action``).
"""

from __future__ import annotations

import operator
from dataclasses import dataclass
from typing import Any, ClassVar

from empo2.envs.actions import clean_action, closest_actions, normalise
from empo2.envs.base import EnvError, StepResult, short_line, start_java_simulator, stop_java_simulator
from empo2.envs.specs import EnvSpec, register_env
from empo2.envs.textworld_express import gold
from empo2.envs.textworld_express.games import GAME_NAMES, check_game, check_param_table, params_text, step_cap
from empo2.envs.textworld_express.state import compact_room, twx_state

FOLDS = ("train", "dev", "test")
SPLITS = {"train": "train", "dev": "dev", "eval": "dev", "test": "test"}
JAVA_HINT = "TextWorldExpress needs Java >= 11 on PATH; install it with: apt-get install -y openjdk-17-jre-headless"
UNKNOWN = "Unknown action"
DEFAULT_JAVA_OPTIONS = "-Xmx512m -XX:+UseSerialGC"
"""A small heap and the serial collector: a worker's games are a few rooms, and many workers share one machine."""


class TextWorldExpressEnv:
    """TextWorldExpress behind the :class:`~empo2.envs.base.TextEnv` protocol (one JVM per instance).

    ``params`` / ``eval_params``: ``{game: {parameter: value}}`` (``eval_params`` for the dev and test folds, on top
    of ``params``); a parameter not given has the package's default. ``max_steps`` caps every game (``None``: 30),
    ``step_caps`` single games. ``java_options`` go to the JVM through ``JAVA_TOOL_OPTIONS`` (the user's own, if
    set, come after them and win).
    """

    name = "textworld_express"

    def __init__(self, params: dict | None = None, eval_params: dict | None = None, max_steps: int | None = None,
                 step_caps: dict[str, int] | None = None, action_correction: bool = True, action_cutoff: float = 0.0,
                 java_options: str | None = DEFAULT_JAVA_OPTIONS):
        self.params = check_param_table(params, "params")
        self.eval_params = check_param_table(eval_params, "eval_params")
        self.max_steps, self.step_caps = max_steps, dict(step_caps or {})
        for game in self.step_caps:
            check_game(game, " in step_caps")
        self.action_correction, self.action_cutoff = action_correction, float(action_cutoff)
        try:
            from textworld_express import TextWorldExpressEnv as _Sim
        except ImportError as exc:
            raise EnvError(f"the textworld-express package is missing ({exc}); pip install textworld-express") from None
        self._sim = start_java_simulator(lambda: _Sim(envStepLimit=10**9),  # the step cap is this class's
                                         "TextWorldExpress", java_options, JAVA_HINT)
        self._loaded: tuple[str, str] | None = None
        self._seeds: dict[str, list[int]] = {}
        self._demo_cache: dict[tuple[str, int], str] = {}
        self._task: str | None = None
        self._variation = -1
        self._history: list[str] = []  # commands of the current episode, for restoring it after a scratch game
        self._info: dict[str, Any] = {}
        self._score = 0.0
        self._steps = 0
        self._done = False

    # ------------------------------------------------------------------ tasks and splits
    def task_names(self) -> list[str]:
        return list(GAME_NAMES)

    def step_cap(self, task: str) -> int:
        return step_cap(task, self.max_steps, self.step_caps)

    def variations(self, task: str, split: str) -> list[int]:
        """The package's seeds of ``split`` (``train``, ``dev``/``eval``, ``test``)."""
        check_game(task)
        if split not in SPLITS:
            raise EnvError(f"unknown split {split!r}; valid splits: {', '.join(SPLITS)}")
        if not self._seeds:
            self._scratch(lambda: self._read_seeds(task))
        return list(self._seeds[SPLITS[split]])

    def _read_seeds(self, task: str) -> None:
        """The folds' seeds (the same for every game and parameter setting; read once, with ``task`` loaded)."""
        self._load(task, "train")
        self._seeds = {"train": list(self._sim.getValidSeedsTrain()), "dev": list(self._sim.getValidSeedsDev()),
                       "test": list(self._sim.getValidSeedsTest())}

    def fold_of(self, task: str, variation: int) -> str:
        for fold in FOLDS:
            if variation in self.variations(task, fold):
                return fold
        ranges = ", ".join(f"{f} {s[0]}-{s[-1]}" for f, s in self._seeds.items())
        raise EnvError(f"variation {variation!r} is not a TextWorldExpress seed; valid seeds: {ranges}")

    def game_params(self, task: str, fold: str) -> dict[str, int]:
        """The parameters ``task``'s games of ``fold`` are generated with (defaults left out)."""
        params = dict(self.params.get(task, {}))
        if fold != "train":
            params.update(self.eval_params.get(task, {}))
        return params

    # ------------------------------------------------------------------ episodes
    def reset(self, task: str, variation: int) -> tuple[str, dict[str, Any]]:
        """Start ``task`` (a game) at ``variation`` (a seed); the observation is the first room's description."""
        check_game(task)
        try:
            variation = -1 if isinstance(variation, bool) else operator.index(variation)
        except TypeError:
            raise EnvError(f"variation {variation!r} is not a TextWorldExpress seed") from None
        fold = self.fold_of(task, variation)
        obs, raw = self._new_game(task, variation, fold)
        self._task, self._variation = task, variation
        self._history, self._steps, self._done, self._score = [], 0, False, 0.0
        info = self._step_info(raw, raw="", action="")
        info.update(task_description=raw["taskDescription"], max_steps=self.step_cap(task), fold=fold,
                    params=params_text(self.game_params(task, fold)))
        return compact_room(obs), info

    def step(self, action: str) -> StepResult:
        """Send one action; ``info['raw_action']`` is what was given, ``info['action']`` what the game ran."""
        if self._task is None:
            raise EnvError("step() before reset()")
        if self._done:
            return StepResult("The episode is over; call reset().", 0.0, True, self._step_info(self._info, action, ""))
        command = self._correct(action) if self.action_correction else str(action).strip()
        obs, raw = self._send(command)
        score = 100.0 * float(raw["score"])
        reward, self._score = score - self._score, score
        self._steps += 1
        success, failure = bool(raw["tasksuccess"]), bool(raw["taskfailure"])
        truncated = not (success or failure) and self._steps >= self.step_cap(self._task)
        self._done = success or failure or truncated
        info = self._step_info(raw, raw=action, action=command)
        info.update(success=success, failure=failure, truncated=truncated, accepted=not obs.startswith(UNKNOWN),
                    commands=[command])
        return StepResult(compact_room(obs), reward, self._done, info)

    def restore_prefix(self, task: str, variation: int, step_commands: list[list[str]]) -> tuple[str, dict[str, Any]]:
        """The state after the first ``len(step_commands)`` steps of a recorded episode: ``task`` at ``variation``
        with each step's commands (its ``info['commands']``) sent again. Returns ``(observation, info)`` as
        :meth:`reset` does, with ``info['observations']``, the observation after each replayed step. The games are
        deterministic given their seed, so the replay reaches the recorded state."""
        obs, first = self.reset(task, variation)
        observations = []
        for commands in step_commands:
            if self._done:
                raise EnvError("the replayed prefix goes past the end of its episode")
            for command in commands:
                obs, _ = self._send(command)
            observations.append(compact_room(obs))
            self._steps += 1
            self._score = 100.0 * float(self._info["score"])
            ended = bool(self._info["tasksuccess"] or self._info["taskfailure"])
            self._done = ended or self._steps >= self.step_cap(task)
        info = {**first, **self._step_info(self._info, raw="", action="")}
        info.update(observations=observations, done=self._done)
        return compact_room(obs), info

    def _correct(self, action: str) -> str:
        """The cleaned output if it is a valid action (in the valid list's spelling), else the closest valid action,
        else (below ``action_cutoff``) the cleaned output as it is."""
        command = clean_action(action)
        valid = self.valid_actions()
        exact = [a for a in valid if normalise(a) == normalise(command)]
        found = exact or closest_actions(command, valid, cutoff=self.action_cutoff, limit=1)
        return found[0] if found else command

    def _send(self, command: str) -> tuple[str, dict[str, Any]]:
        """One game command, recorded so the episode can be replayed after a scratch game."""
        self._history.append(command)
        obs, _, _, raw = self._sim.step(command)
        self._info = raw
        return obs, raw

    def _step_info(self, game: dict[str, Any], raw: str, action: str) -> dict[str, Any]:
        """The protocol's info from the package's (``game``): score, state, valid actions, the action's texts."""
        look, inventory = game.get("look", ""), game.get("inventory", "")
        return {"score": self._score, "success": False, "failure": False, "look": look, "inventory": inventory,
                "state": twx_state(look, inventory), "valid_actions": sorted(game.get("validActions", [])),
                "raw_action": raw, "action": action, "steps": self._steps, "task": self._task,
                "variation": self._variation}

    def _load(self, task: str, fold: str) -> None:
        """Load ``task`` with ``fold``'s parameters (only when they differ from the loaded ones)."""
        text = params_text(self.game_params(task, fold))
        if self._loaded != (task, text):
            try:
                self._sim.load(task, text)
            except ValueError as exc:  # the package's own check of the parameters
                raise EnvError(f"TextWorldExpress refused {task} parameters {text!r}: {exc}") from None
            self._loaded = (task, text)

    def _new_game(self, task: str, seed: int, fold: str, gold_path: bool = False) -> tuple[str, dict[str, Any]]:
        """Generate ``task``'s game ``seed`` of ``fold``; the observation and the package's info."""
        self._load(task, fold)
        try:
            obs, raw = self._sim.reset(seed=seed, gameFold=fold, generateGoldPath=gold_path)
        except Exception as exc:  # a generator that fails for this seed and these parameters (py4j, JSON)
            raise EnvError(f"TextWorldExpress could not generate {task} game {seed} ({fold}) with parameters "
                           f"{params_text(self.game_params(task, fold))!r}: {type(exc).__name__}; choose other "
                           "parameters (MapReader fails for some seeds when maxDistanceApart is close to "
                           "numLocations)") from None
        self._info = raw
        return obs, raw

    def _scratch(self, fn):
        """Run ``fn`` (which plays other games) and then restore the current episode by replaying its commands."""
        try:
            return fn()
        finally:
            if self._task is not None:
                history = self._history
                self._new_game(self._task, self._variation, self.fold_of(self._task, self._variation))
                self._history = []
                for command in history:
                    self._send(command)

    # ------------------------------------------------------------------ helpers for prompts and policies
    def valid_actions(self) -> list[str]:
        """The valid actions of the current state, sorted (the package lists them in a shuffled order)."""
        return sorted(self._info.get("validActions", []))

    def task_description(self) -> str:
        return str(self._info.get("taskDescription", ""))

    def look(self) -> str:
        return str(self._info.get("look", ""))

    def inventory(self) -> str:
        return str(self._info.get("inventory", ""))

    def gold_actions(self) -> list[str]:
        """The current episode's gold path (``[]`` before any reset), from the gold cache (:mod:`.gold`)."""
        if self._task is None:
            return []
        return self.gold_path(self._task, self._variation)

    def gold_path(self, task: str, variation: int) -> list[str]:
        """The gold path of ``task`` at ``variation``: cached, or made now in a scratch game."""
        fold = self.fold_of(task, variation)
        key = gold.cache_key(task, params_text(self.game_params(task, fold)), variation)
        actions = gold.cached_actions(key)
        if actions is None:
            actions = self._scratch(lambda: self._make_gold(task, variation, fold))
            gold.store(key, actions)
        return actions

    def _make_gold(self, task: str, seed: int, fold: str) -> list[str]:
        if task == "coin":
            obs, _ = self._new_game(task, seed, fold)
            return gold.coin_shortest_path(obs, lambda command: self._sim.step(command)[0])

        def draw() -> list[str]:
            self._new_game(task, seed, fold, gold_path=True)
            return list(self._sim.getGoldActionSequence())

        return gold.package_gold_path(draw)

    def demonstration(self, task: str, variation: int, n: int = 1) -> str:
        """``n`` gold runs of ``task`` from train seeds other than ``variation``, as ``> action`` / observation
        lines. Cached; the current episode is restored if one is running."""
        check_game(task)
        others = [v for v in self.variations(task, "train") if v != variation][:n]
        for seed in others:
            if (task, seed) not in self._demo_cache:
                actions = self.gold_path(task, seed)
                self._demo_cache[(task, seed)] = self._scratch(lambda s=seed, a=actions: self._demo_text(task, s, a))
        return "\n\n".join(self._demo_cache[(task, v)] for v in others)

    def _demo_text(self, task: str, seed: int, actions: list[str]) -> str:
        obs, raw = self._new_game(task, seed, "train")
        lines = [f"Task: {raw['taskDescription']}", short_line(compact_room(obs))]
        for action in actions:
            obs, _, _, raw = self._sim.step(action)
            lines += [f"> {action}", short_line(compact_room(obs))]
            if raw["tasksuccess"] or raw["taskfailure"]:
                break
        return "\n".join(lines)

    def generation_properties(self) -> dict[str, int]:
        """The package's record of the current game's generation (its seed and every parameter, defaults included)."""
        return dict(self._sim.getGenerationProperties())

    def java_pid(self) -> int:
        """Process id of this instance's JVM."""
        return int(self._sim._gateway.java_process.pid)

    def close(self) -> None:
        """Stop the JVM (idempotent)."""
        sim, self._sim = getattr(self, "_sim", None), None
        if sim is not None:
            stop_java_simulator(sim)

    def __enter__(self) -> TextWorldExpressEnv:
        return self

    def __exit__(self, *exc) -> None:
        self.close()


GUIDE = (
    "You are an agent in a text game made of rooms. Explore them and reach the goal of the task.\n"
    "Actions: look around | inventory | move north/south/east/west | open door to DIRECTION | take OBJ | "
    "put OBJ in OBJ | open OBJ | close OBJ | read OBJ | examine OBJ | chop/slice/dice OBJ | cook OBJ in DEVICE | "
    "prepare meal | eat OBJ.\n"
    "A closed door must be opened before you can move through it.\n"
    "Answer with exactly one action on one line, nothing else."
)


@dataclass(frozen=True)
class TextWorldExpressOptions:
    """TextWorldExpress's settings, ``env.textworld_express.*``."""

    key: ClassVar[str] = "textworld_express"

    params: dict[str, dict[str, int]] | None = None
    """Game parameters by game, e.g. ``{coin: {numLocations: 5, includeDoors: 1}}`` (the package's names; a
    parameter not given has the package's default). Checked at load: a wrong name or value is refused with the game's
    valid parameters."""
    eval_params: dict[str, dict[str, int]] | None = None
    """Parameters of the dev and test games, on top of ``params`` (an out-of-distribution evaluation: train on small
    maps, evaluate on larger ones); ``None`` = the training games' parameters."""


def _env_kwargs(cfg) -> dict:
    options = cfg.textworld_express
    return {"params": options.params, "eval_params": options.eval_params, "max_steps": cfg.max_steps,
            "step_caps": cfg.step_caps, "action_correction": cfg.action_correction,
            "action_cutoff": cfg.action_cutoff}


def _tasks(cfg) -> list[str]:
    """The games ``env.tasks`` names (``all``: the four), with every game parameter of the section checked."""
    check_param_table(cfg.textworld_express.params, "env.textworld_express.params")
    check_param_table(cfg.textworld_express.eval_params, "env.textworld_express.eval_params")
    for game in cfg.step_caps or {}:
        check_game(game, " in env.step_caps")
    names = [g for name in cfg.tasks for g in (GAME_NAMES if name == "all" else [name])]
    for game in names:
        check_game(game)
    return list(dict.fromkeys(names))


def _gold_paths(env_cfg, tasks: list[str], split: str, per_task: int | None, say=print) -> list:
    """:class:`~empo2.envs.gold.GoldPath` of ``split``'s first ``per_task`` seeds of every game (cached)."""
    return gold.gold_lengths(TextWorldExpressEnv, _env_kwargs(env_cfg), tasks, split, per_task, say)


register_env(EnvSpec("textworld_express", factory=TextWorldExpressEnv, kwargs=_env_kwargs, guide=GUIDE, tasks=_tasks,
                     gold_paths=_gold_paths, options=TextWorldExpressOptions))
