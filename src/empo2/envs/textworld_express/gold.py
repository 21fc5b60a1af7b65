"""Gold paths of TextWorldExpress games: made once per game, cached, and replayed by every consumer (the reachability
check, LUFFY's expert member, demonstrations, the warm start).

The package's gold agents draw their choices from an unseeded random generator (``new Random()`` in its game
generators), so two calls give two paths: CoinCollector's is a random walk that opens every door it meets until it
sees the coin (5-room maps: 2 to 29 steps for one game), and CookingWorld's and TWC's walk at random between the rooms
they need. Here:

* ``coin``: the shortest path to the coin. The house is mapped first (a depth-first walk that opens every door and
  reads each room's exits), then the cheapest route from the start room to the coin's room is taken, a closed door
  costing one step to open, and the coin is taken. It depends on the game alone, so every machine gets the same path.
* the other games: the package's gold path, the shortest of :data:`DRAWS` draws, without the leading
  ``look around`` the package records for the start of a game (the reset, not an action).

Either way the path is cached per (game, parameters, seed) in ``$EMPO2_HOME/gold/textworld_express-<package
version>.json`` (the cache of :mod:`empo2.envs.gold`), so that every worker and run plays the same one.
"""

from __future__ import annotations

import heapq
import re
from collections.abc import Callable
from pathlib import Path

from empo2.envs.gold import gold_home, read_cache, write_cache
from empo2.envs.textworld_express.state import room_name, room_objects

DRAWS = 8
"""Package gold paths drawn per game for the games whose gold agent walks at random; the shortest is kept."""
OPPOSITE = {"north": "south", "south": "north", "east": "west", "west": "east"}
_DIR = "(North|South|East|West)"
_OPEN_PASSAGE = re.compile(rf"To the {_DIR} you see the (.+?)\. ")  # "To", not the open door's ", to"
_OPEN_DOOR = re.compile(rf"Through an open .+?, to the {_DIR} you see the (.+?)\. ")
_CLOSED_DOOR = re.compile(rf"To the {_DIR} you see a closed .+?\. ")
_REVEALED = re.compile(r"You open the .+?, revealing the (.+?)\. ")


def cache_path() -> Path:
    from importlib.metadata import version

    return gold_home() / f"textworld_express-{version('textworld-express')}.json"


def cache_key(game: str, params: str, seed: int) -> str:
    return f"{game}|{params}|{seed}"


def cached_actions(key: str) -> list[str] | None:
    actions = read_cache(cache_path())["actions"].get(key)
    return None if actions is None else list(actions)


def store(key: str, actions: list[str] | None = None, steps: dict | None = None) -> None:
    found = {"actions": {key: actions} if actions is not None else {}, "paths": {key: steps} if steps else {}}
    write_cache(cache_path(), found)


def cached_steps(key: str) -> dict | None:
    return read_cache(cache_path())["paths"].get(key)


# ----------------------------------------------------------------------------------------------- coin: shortest path
def exits(look: str) -> list[tuple[str, str | None, bool]]:
    """``(direction, neighbouring room or None behind a closed door, door closed)`` of a room description."""
    line = look.partition("\n")[2] + " "
    out = [(d.lower(), room, False) for d, room in _OPEN_PASSAGE.findall(line)]
    out += [(d.lower(), room, False) for d, room in _OPEN_DOOR.findall(line)]
    out += [(d.lower(), None, True) for d in _CLOSED_DOOR.findall(line)]
    return out


def coin_shortest_path(look: str, step: Callable[[str], str]) -> list[str]:
    """The shortest action sequence that takes the coin, for a game just reset (``look``: its first room
    description; ``step(action) -> observation`` plays the game, and is used to map the house, which leaves the game
    in another state). Raises ``ValueError`` when no room holds a coin."""
    graph: dict[str, dict[str, tuple[str, bool]]] = {}  # room -> direction -> (neighbour, door closed at the start)
    coin_rooms: list[str] = []

    def visit(look: str) -> None:
        room = room_name(look)
        graph.setdefault(room, {})
        if "a coin" in room_objects(look):
            coin_rooms.append(room)
        for direction, neighbour, closed in exits(look):
            if direction in graph[room]:
                continue  # mapped from the other side
            if closed:
                revealed = _REVEALED.search(step(f"open door to {direction}") + " ")
                neighbour = revealed.group(1) if revealed else None
            if neighbour is None:
                continue
            graph[room][direction] = (neighbour, closed)
            graph.setdefault(neighbour, {})[OPPOSITE[direction]] = (room, closed)
            if neighbour not in visited:
                visited.add(neighbour)
                visit(step(f"move {direction}"))
                step(f"move {OPPOSITE[direction]}")

    start = room_name(look)
    visited = {start}
    visit(look)
    if not coin_rooms:
        raise ValueError("no room of this game holds a coin")
    return _cheapest_route(graph, start, coin_rooms[0]) + ["take coin"]


def _cheapest_route(graph: dict[str, dict[str, tuple[str, bool]]], start: str, goal: str) -> list[str]:
    """Dijkstra over the rooms: a move costs 1, a door closed at the start 1 more (opening it)."""
    queue: list[tuple[int, list[str], str]] = [(0, [], start)]
    done: set[str] = set()
    while queue:
        cost, actions, room = heapq.heappop(queue)
        if room == goal:
            return actions
        if room in done:
            continue
        done.add(room)
        for direction, (neighbour, closed) in sorted(graph[room].items()):
            if neighbour not in done:
                opening = [f"open door to {direction}"] if closed else []
                heapq.heappush(queue, (cost + 1 + len(opening), actions + opening + [f"move {direction}"], neighbour))
    raise ValueError(f"the coin's room {goal!r} cannot be reached from {start!r}")


# ------------------------------------------------------------------------------------------ other games: the package's
def package_gold_path(draw: Callable[[], list[str]], draws: int = DRAWS) -> list[str]:
    """The shortest of ``draws`` package gold paths (``draw()`` generates the game with its gold path and returns the
    path), without the leading ``look around`` that stands for the start of the game."""
    paths = []
    for _ in range(draws):
        path = list(draw())
        if path and path[0] == "look around":
            path = path[1:]
        if path and not path[0].startswith("ERROR"):
            paths.append(path)
    if not paths:
        raise ValueError("the package generated no gold path")
    return min(paths, key=len)


# ------------------------------------------------------------------------------------------- lengths, for reachability
def gold_lengths(make_env, env_kwargs: dict, tasks: list[str], split: str, per_task: int | None, say=print) -> list:
    """:class:`~empo2.envs.gold.GoldPath` of the first ``per_task`` seeds of ``split`` of every game: each gold path
    played through ``make_env(**env_kwargs)`` (one JVM, its step cap lifted) until it succeeds, the count cached with
    the path."""
    from empo2.envs.gold import UNCAPPED, GoldPath
    from empo2.envs.textworld_express.games import params_text, step_cap

    out = []
    with make_env(**{**env_kwargs, "max_steps": UNCAPPED, "step_caps": None}) as env:
        for task in tasks:
            seeds = env.variations(task, split)[:per_task]
            fold = env.fold_of(task, seeds[0]) if seeds else "train"
            keys = {seed: cache_key(task, params_text(env.game_params(task, fold)), seed) for seed in seeds}
            missing = [seed for seed in seeds if cached_steps(keys[seed]) is None]
            if missing:
                say(f"gold paths: computing {len(missing)} {task} game(s) (cached in {cache_path()})")
            for seed in missing:
                store(keys[seed], steps={"steps": play_gold(env, task, seed)})
            cap = step_cap(task, env_kwargs.get("max_steps"), env_kwargs.get("step_caps"))
            out += [GoldPath(task, seed, cached_steps(keys[seed])["steps"], cap) for seed in seeds]
    return out


def play_gold(env, task: str, seed: int) -> int | None:
    """Steps ``env`` takes to succeed along the gold path of ``task`` at ``seed`` (``None``: it does not succeed)."""
    env.reset(task, seed)
    for steps, action in enumerate(env.gold_actions(), 1):
        result = env.step(action)
        if result.done:
            return steps if result.info["success"] else None
    return None
