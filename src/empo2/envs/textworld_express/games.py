"""TextWorldExpress's games and their generation parameters, checked without a JVM.

The package takes a game's parameters as one string (``numLocations=5,includeDoors=1``) and refuses unknown names and
out-of-range values only once a JVM has loaded the game; here the same names and ranges are checked at config load,
so a typo in a preset ends with one line before any worker starts. The ranges are those the package's generators
accept (``tests/test_textworld_express.py`` checks them against the package); on/off parameters are 0 or 1.
"""

from __future__ import annotations

from dataclasses import dataclass

from empo2.envs.base import EnvError


@dataclass(frozen=True)
class Param:
    low: int
    high: int
    default: int
    """The package's value when the parameter is not given."""


GAMES: dict[str, dict[str, Param]] = {
    "coin": {  # CoinCollector: find the coin in a map of rooms and take it
        "numLocations": Param(1, 11, 11), "numDistractorItems": Param(0, 10, 0),
        "includeDoors": Param(0, 1, 1), "limitInventorySize": Param(0, 1, 1)},
    "mapreader": {  # read a map, fetch the coin from the named room, put it in the box of the start room
        "numLocations": Param(2, 50, 15), "maxDistanceApart": Param(1, 8, 4),
        "maxDistractorItemsPerLocation": Param(0, 3, 3), "includeDoors": Param(0, 1, 0),
        "limitInventorySize": Param(0, 1, 0)},
    "twc": {  # TextWorld Commonsense: put the misplaced objects where they belong
        "numLocations": Param(1, 3, 3), "numItemsToPutAway": Param(1, 4, 4),
        "includeDoors": Param(0, 1, 0), "limitInventorySize": Param(0, 1, 0)},
    "cookingworld": {  # read the recipe, gather and prepare the ingredients, prepare and eat the meal
        "numLocations": Param(1, 11, 11), "numIngredients": Param(1, 5, 3), "numDistractorItems": Param(0, 10, 10),
        "includeDoors": Param(0, 1, 1), "limitInventorySize": Param(0, 1, 1)},
}
"""The games this environment plays (the package has four more puzzle games without a map: arithmetic, sorting,
simonsays, peckingorder). Each game's parameters: range and the package's default."""
GAME_NAMES = list(GAMES)
DEFAULT_STEP_CAP = 30


def step_cap(game: str, max_steps: int | None = None, step_caps: dict[str, int] | None = None) -> int:
    """A game's episode step cap: ``step_caps[game]``, else ``max_steps``, else :data:`DEFAULT_STEP_CAP`."""
    return (step_caps or {}).get(game, max_steps or DEFAULT_STEP_CAP)


def check_game(game: str, where: str = "") -> None:
    if game not in GAMES:
        raise EnvError(f"unknown TextWorldExpress game {game!r}{where}; valid games: {', '.join(GAME_NAMES)}")


def check_params(game: str, params: dict | None, key: str = "env.textworld_express.params") -> dict[str, int]:
    """``params`` of ``game`` checked against the package's names and ranges, as ``{name: int}``; one
    :class:`~empo2.envs.base.EnvError` line naming the valid parameters otherwise."""
    check_game(game, f" in {key}")
    table = GAMES[game]
    valid = ", ".join(f"{name} ({p.low}-{p.high})" for name, p in table.items())
    out = {}
    for name, value in (params or {}).items():
        if name not in table:
            raise EnvError(f"{game} has no parameter {name!r} in {key}; valid parameters of {game}: {valid}")
        p = table[name]
        if isinstance(value, bool) or not isinstance(value, int) or not p.low <= value <= p.high:
            raise EnvError(f"{game} {name}={value!r} in {key} is out of range; valid parameters of {game}: {valid}")
        out[name] = value
    return out


def check_param_table(table: dict | None, key: str) -> dict[str, dict[str, int]]:
    """A ``{game: {name: value}}`` table (``env.textworld_express.params`` / ``.eval_params``), every entry checked."""
    return {game: check_params(game, params, key) for game, params in (table or {}).items()}


def params_text(params: dict[str, int]) -> str:
    """The package's parameter string, names sorted so that one setting has one text (and one gold-cache key)."""
    return ",".join(f"{name}={params[name]}" for name in sorted(params))


def full_params(game: str, params: dict[str, int]) -> dict[str, int]:
    """Every parameter of ``game``: the given ones, the package's defaults for the rest."""
    return {name: params.get(name, p.default) for name, p in GAMES[game].items()}
