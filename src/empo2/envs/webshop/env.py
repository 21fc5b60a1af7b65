"""``WebShopEnv``: the WebShop text shopping task on the :class:`~empo2.envs.base.TextEnv` protocol.

One task, ``"webshop"``; a variation is a goal index. Actions are ``search[query]`` (any page, any text) and
``click[x]`` for a current clickable; anything else is a no-op with reward 0. ``click[buy now]`` ends the episode
with the WebShop reward; the step cap ends it with reward 0. ``info["score"]`` is ``100 × reward`` and
``info["success"]`` is ``reward == 1``.
"""

from __future__ import annotations

import os
import random
import re
from dataclasses import dataclass, field
from typing import Any, ClassVar, Literal

from rapidfuzz import process, utils

from empo2.bounds import bounded
from empo2.envs.actions import similarity
from empo2.envs.base import EnvError, StepResult
from empo2.envs.gold import UNCAPPED, GoldPath
from empo2.envs.specs import EnvSpec, register_env
from empo2.envs.webshop import pages
from empo2.envs.webshop.catalog import Catalog, load_catalog
from empo2.envs.webshop.goals import Goal, split_ranges, synthetic_goals
from empo2.envs.webshop.goals import human_goals as make_human_goals
from empo2.envs.webshop.reward import get_reward
from empo2.envs.webshop.search import PAGE_SIZE, SearchEngine

TASK = "webshop"
SEARCH_TEMPLATE = "search[<query>]"
STARTS = ("search", "results")
_ACTION = re.compile(r"(search|click)\s*\[(.*?)\]", re.IGNORECASE | re.DOTALL)


def parse_action(text: str) -> tuple[str, str] | None:
    """``"click[Buy Now]"`` → ``("click", "buy now")``; the first ``search[...]``/``click[...]`` in ``text``."""
    m = _ACTION.search(text or "")
    if not m:
        return None
    return m.group(1).lower(), m.group(2).strip().lower()


@dataclass
class _Session:
    """Browser state of one episode."""

    goal: Goal
    page: str = "search"            # search | results | item | sub | done
    query: str = ""
    hits: list[str] = field(default_factory=list)
    page_no: int = 1
    asin: str | None = None
    sub: str | None = None
    chosen: dict[str, str] = field(default_factory=dict)
    steps: int = 0
    done: bool = False
    observation: str = ""
    clickables: list[str] = field(default_factory=list)


class WebShopEnv:
    """WebShop over the official small set (``data_dir`` / ``$EMPO2_WEBSHOP_DATA``) or the bundled fixture.

    ``name`` is ``"webshop"`` for the official data and ``"webshop-fixture"`` for the fixture, so results on the
    fixture are never labelled WebShop.
    """

    def __init__(self, data_dir: str | None = None, seed: int = 0, max_steps: int = 15, action_correction: bool = True,
                 num_products: int | None = None, human_goals: bool = False, action_cutoff: float = 0.0,
                 start: str = "search"):
        if start not in STARTS:
            raise EnvError(f"unknown WebShop start page {start!r}; use one of {', '.join(STARTS)}")
        self.catalog: Catalog = load_catalog(data_dir, seed=seed, num_products=num_products, human_goals=human_goals)
        self.start = start
        self.name = env_name(self.catalog.source == "official", start)
        self.seed, self.max_steps, self.action_correction = seed, max_steps, action_correction
        self.action_cutoff = float(action_cutoff)
        self.engine = SearchEngine(self.catalog.products)
        self.goals: list[Goal] = (make_human_goals if human_goals else synthetic_goals)(self.catalog.products, seed)
        if not self.goals:
            raise EnvError(f"no WebShop goals in {self.catalog.data_dir} (no product has an instruction)")
        self.splits = split_ranges(len(self.goals))
        self._s: _Session | None = None
        self._gold_cache: dict[int, list[str]] = {}
        self._variation: int | None = None

    # ------------------------------------------------------------------ protocol
    def task_names(self) -> list[str]:
        return [TASK]

    def variations(self, task: str, split: str) -> list[int]:
        """Goal indices of ``split``: ``test`` (0–500), ``eval``/``dev`` (500–1500), ``train`` (the rest)."""
        self._check_task(task)
        key = {"dev": "eval"}.get(split, split)
        if key not in self.splits:
            raise EnvError(f"unknown WebShop split {split!r}; use train, eval (dev) or test")
        return list(self.splits[key])

    def reset(self, task: str = TASK, variation: int = 0) -> tuple[str, dict[str, Any]]:
        self._check_task(task)
        if not 0 <= variation < len(self.goals):
            raise EnvError(f"WebShop goal {variation} out of range 0..{len(self.goals) - 1}")
        self._variation = variation
        self._s = self._new_session(self.goals[variation])
        return self._s.observation, self._info(self._s, "", "", 0.0)

    def step(self, action: str) -> StepResult:
        s = self._session()
        if s.done:
            raise EnvError("the WebShop episode is over; call reset()")
        raw = action
        action = self._correct(s, action) if self.action_correction else action.strip()
        reward, details = self._apply(s, action)
        s.steps += 1
        info = self._info(s, raw, action, reward)
        info.update(details)
        info["accepted"] = not details.get("invalid", False)
        info["commands"] = [action]  # what replays this step (after correction)
        if not s.done and s.steps >= self.max_steps:
            s.done, info["truncated"], info["valid_actions"] = True, True, []
        return StepResult(s.observation, reward, s.done, info)

    def restore_prefix(self, task: str, variation: int, step_commands: list[list[str]]) -> tuple[str, dict[str, Any]]:
        """The state after the first ``len(step_commands)`` steps of a recorded episode: a fresh session of goal
        ``variation`` with each step's commands (its ``info['commands']``) applied. Returns ``(observation, info)`` as
        :meth:`reset` does, with ``info['observations']``, the page after each replayed step. A replay whose episode
        ends before the prefix does (a purchase, the step cap) stops there, with ``info['done']`` set."""
        self.reset(task, variation)
        s = self._s
        observations = []
        for commands in step_commands:
            if s.done or s.steps >= self.max_steps:
                break
            for command in commands:
                self._apply(s, command)
            s.steps += 1
            observations.append(s.observation)
        s.done = s.done or s.steps >= self.max_steps
        info = self._info(s, "", "", 0.0)
        info.update(observations=observations, done=s.done)
        return s.observation, info

    def valid_actions(self) -> list[str]:
        return self._valid(self._session())

    def task_description(self) -> str:
        return self._session().goal.instruction

    def gold_actions(self) -> list[str]:
        self._session()
        return list(self._gold(self._variation))

    def demonstration(self, task: str, variation: int, n: int = 1) -> str:
        """Gold runs of ``n`` OTHER goals (same split as ``variation``), observations shortened."""
        self._check_task(task)
        split = next((r for r in self.splits.values() if variation in r), range(len(self.goals)))
        pool = [g for g in (split if len(split) > 1 else range(len(self.goals))) if g != variation]
        picks = random.Random(self.seed * 100_003 + variation).sample(pool, min(n, len(pool)))
        demos = []
        for g in picks:
            s = self._new_session(self.goals[g])
            lines = [f"Instruction: {s.goal.instruction}"]
            for a in self._gold(g):
                self._apply(s, a)
                lines += [f"> {a}", _shorten(s.observation)]
            demos.append("\n".join(lines))
        return "\n\n".join(demos)

    def close(self) -> None:
        self._s = None

    # ------------------------------------------------------------------ mechanics
    def _new_session(self, goal: Goal) -> _Session:
        """A session on the start page: the search page, or the results of searching the instruction's stem."""
        s = _Session(goal=goal)
        if self.start == "results":
            query = goal.base_instruction.lower()
            s.page, s.query, s.hits = "results", query, self.engine.search(query)
        self._render(s)
        return s

    def _apply(self, s: _Session, action: str) -> tuple[float, dict[str, Any]]:
        """Execute ``action`` on ``s`` (no-op when invalid); return (reward, extra info)."""
        parsed = parse_action(action)
        if parsed is None or (parsed[0] == "search" and not parsed[1]) or (
                parsed[0] == "click" and parsed[1] not in s.clickables):
            return 0.0, {"invalid": True}
        kind, arg = parsed
        if kind == "search":
            s.page, s.query, s.hits, s.page_no = "results", arg, self.engine.search(arg), 1
        elif arg == "back to search":
            s.page = "search"
        elif arg == "next >":
            s.page_no += 1
        elif arg == "< prev":
            if s.page == "results":
                s.page_no -= 1
            elif s.page == "item":
                s.page = "results"
            else:
                s.page = "item"
        elif s.page == "results":
            s.page, s.asin, s.chosen = "item", arg.upper(), {}
        elif arg in ("description", "features", "reviews"):
            s.page, s.sub = "sub", arg
        elif arg == "buy now":
            product = self.catalog.by_asin[s.asin]
            reward, details = get_reward(product, s.goal, product.price, s.chosen)
            s.page, s.done = "done", True
            s.observation, s.clickables = pages.done_page(product, s.chosen, reward), []
            return reward, {"reward_details": details, "purchased": product.asin}
        else:  # an option value
            product = self.catalog.by_asin[s.asin]
            name = next(n for n, vals in product.options.items() if arg in vals)
            s.chosen[name] = arg
        self._render(s)
        return 0.0, {}

    def _render(self, s: _Session) -> None:
        if s.page == "search":
            s.observation, s.clickables = pages.search_page(s.goal.instruction)
        elif s.page == "results":
            hits = [self.catalog.by_asin[a] for a in self._page_hits(s)]
            s.observation, s.clickables = pages.results_page(hits, s.page_no, len(s.hits), PAGE_SIZE)
        elif s.page == "item":
            s.observation, s.clickables = pages.item_page(self.catalog.by_asin[s.asin])
        elif s.page == "sub":
            s.observation, s.clickables = pages.sub_page(self.catalog.by_asin[s.asin], s.sub)

    @staticmethod
    def _page_hits(s: _Session) -> list[str]:
        """ASINs shown on the current results page."""
        start = (s.page_no - 1) * PAGE_SIZE
        return s.hits[start:start + PAGE_SIZE]

    def _valid(self, s: _Session) -> list[str]:
        if s.done:
            return []
        clicks = [f"click[{c}]" for c in s.clickables]
        return clicks if clicks else [SEARCH_TEMPLATE]

    def _correct(self, s: _Session, text: str) -> str:
        """Map free-form output to a valid action: ``search[...]`` stays; on the search page other text becomes the
        query; elsewhere the clickable most :func:`~empo2.envs.actions.similarity`-like to the output (its ``[...]``
        argument, else its first line), where a product's title on a results page stands for its link. Below
        ``action_cutoff`` the output is kept as is, an invalid no-op."""
        parsed = parse_action(text)
        if not (text or "").strip():
            return ""  # nothing to correct: an invalid no-op
        if parsed and parsed[0] == "search" and parsed[1]:
            return f"search[{parsed[1]}]"
        if parsed and parsed[1] in s.clickables:
            return f"click[{parsed[1]}]"
        line = text.strip().splitlines()[0].strip()
        if not s.clickables:  # the search page: treat the text as a query
            query = parsed[1] if parsed else re.sub(r"^\s*search\b[:\s]*", "", line, flags=re.I)
            return f"search[{query}]" if query else text
        # Word overlap, not only edit distance: with edit distance alone a sentence naming a product lands nearest
        # to the short "back to search". Punctuation is dropped so that "lotion" meets a title's "lotion,".
        targets = {c: f"click[{c}]" for c in s.clickables}
        if s.page == "results":
            titles = {self.catalog.by_asin[a].title.lower(): f"click[{a.lower()}]" for a in self._page_hits(s)}
            targets |= titles
        best = process.extractOne(parsed[1] if parsed else line, list(targets), scorer=similarity,
                                  processor=utils.default_process, score_cutoff=self.action_cutoff)
        return targets[best[0]] if best else text

    def _gold(self, variation: int) -> list[str]:
        """search (the instruction stem, else the title) → [next >]* → click target → click options → buy now."""
        if variation in self._gold_cache:
            return self._gold_cache[variation]
        goal = self.goals[variation]
        product = self.catalog.by_asin[goal.asin]
        actions: list[str] = []
        for query in (goal.base_instruction.lower(), product.title.lower()):
            hits = self.engine.search(query)
            if goal.asin in hits:
                actions = [f"search[{query}]"] + ["click[next >]"] * (hits.index(goal.asin) // PAGE_SIZE)
                break
        else:
            raise EnvError(f"gold path: target {goal.asin} of goal {variation} is not found by search")
        if self.start == "results":  # already on the stem's results; when the title is the query, go back first
            stem_found = actions[0] == f"search[{goal.base_instruction.lower()}]"
            actions = actions[1:] if stem_found else ["click[back to search]"] + actions
        actions.append(f"click[{goal.asin.lower()}]")
        wanted = goal.options.values() if isinstance(goal.options, dict) else goal.options
        values = {v for vals in product.options.values() for v in vals}
        actions += [f"click[{v}]" for v in wanted if v in values]
        actions.append("click[buy now]")
        self._gold_cache[variation] = actions
        return actions

    def _info(self, s: _Session, raw: str, action: str, reward: float) -> dict[str, Any]:
        return dict(score=100.0 * reward if s.done else 0.0, success=bool(s.done and abs(reward - 1.0) < 1e-9),
                    valid_actions=self._valid(s), raw_action=raw, action=action, page=s.page, steps=s.steps,
                    state=" ".join(s.observation.split()))  # the page is the whole situation

    def _session(self) -> _Session:
        if self._s is None:
            raise EnvError("call reset() first")
        return self._s

    def _check_task(self, task: str) -> None:
        if task != TASK:
            raise EnvError(f"unknown WebShop task {task!r}; the only task is {TASK!r}")


def _shorten(text: str, limit: int = 240) -> str:
    return text if len(text) <= limit else text[:limit].rstrip() + " ..."


GUIDE = (
    "You are a web shopping agent. Find and buy the product that matches the instruction.\n"
    "Actions: search[QUERY] | click[BUTTON, PRODUCT ID or OPTION]. Click options before 'buy now'.\n"
    "Answer with exactly one action on one line, nothing else."
)


@dataclass(frozen=True)
class WebShopOptions:
    """WebShop's settings, ``env.webshop.*``."""

    key: ClassVar[str] = "webshop"

    data: str | None = None
    """Directory with the official WebShop small set; ``None`` = ``$EMPO2_WEBSHOP_DATA`` or the bundled fixture."""
    human_goals: bool = False
    """WebShop goals from the human instructions (``items_human_ins.json``; the WebShop/GiGPO evaluation setup)
    instead of the synthetic ones (one per instructed product × option combination)."""
    num_products: int | None = bounded(None, 1, 10 ** 9)
    """Use only the first N catalog products (``None`` = all)."""
    start: Literal["search", "results"] = "search"
    """Where a WebShop episode starts: ``search``, the search page (WebShop's protocol); ``results``, the results page
    of a search for the goal's instruction without its option and price clauses, an easier start for models too small
    to write a query. Its results are labelled apart (``webshop-fixture-from-results``)."""


def _env_kwargs(cfg) -> dict:
    return {"data_dir": cfg.webshop.data, "seed": cfg.seed, "max_steps": cfg.max_steps or 15,
            "action_correction": cfg.action_correction, "action_cutoff": cfg.action_cutoff,
            "human_goals": cfg.webshop.human_goals, "num_products": cfg.webshop.num_products,
            "start": cfg.webshop.start}


def env_name(official: bool, start: str) -> str:
    """``webshop`` on the official data, ``webshop-fixture`` on the bundled one; ``-from-results`` for that start."""
    return ("webshop" if official else "webshop-fixture") + ("-from-results" if start == "results" else "")


def _label(cfg) -> str:
    """WebShop on the bundled fixture is never reported as plain ``webshop``, nor an easier start as the usual one."""
    return env_name(bool(cfg.webshop.data or os.environ.get("EMPO2_WEBSHOP_DATA")), cfg.webshop.start)


def _gold_paths(env_cfg, tasks: list[str], split: str, per_task: int | None, say=print) -> list[GoldPath]:
    """:class:`~empo2.envs.gold.GoldPath` of the first ``per_task`` goals of ``split``: each goal's gold path played
    through an environment built with the run's settings, its step cap lifted."""
    kwargs = _env_kwargs(env_cfg)
    env = WebShopEnv(**{**kwargs, "max_steps": UNCAPPED})
    out = []
    for variation in env.variations(TASK, split)[:per_task]:
        env.reset(TASK, variation)
        steps = None
        for k, action in enumerate(env.gold_actions(), 1):
            result = env.step(action)
            if result.done:
                steps = k if result.info["success"] else None
                break
        out.append(GoldPath(TASK, variation, steps, kwargs["max_steps"]))
    return out


register_env(EnvSpec("webshop", factory=WebShopEnv, kwargs=_env_kwargs, guide=GUIDE, tasks=lambda cfg: [TASK],
                     label=_label, gold_paths=_gold_paths, options=WebShopOptions))
