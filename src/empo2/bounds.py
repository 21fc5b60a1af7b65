"""How a setting states the numbers it may hold: :func:`bounded` declares a dataclass field with its default and its
:class:`Bounds`, beside the field, and :func:`empo2.config.bounds_check.check_bounds` checks every such field at load;
and how a registered component brings settings of its own (:func:`check_options`).

In the lowest layer because two floors declare settings: the config's sections (:mod:`empo2.config.sections`) and
the options of each method (:mod:`empo2.algo`: ``algo.gigpo`` …) and each environment (:mod:`empo2.envs`:
``env.webshop`` …), which cannot import the config above them.
"""

from __future__ import annotations

from dataclasses import dataclass, field, is_dataclass
from typing import Any

ANY_COUNT = 10 ** 9
"""The upper bound of a count that may be as large as a user likes."""
SEED_MAX = 2 ** 32 - 1
"""The largest seed: numpy's seeds are 32-bit."""


@dataclass(frozen=True)
class Bounds:
    """The numbers a field may hold: ``low``..``high``, each end inclusive unless marked open, and optionally one
    value outside that range that switches the feature off (``off``). ``why`` says what the bound protects."""

    low: float
    high: float
    open_low: bool = False
    open_high: bool = False
    off: float | None = None
    why: str = ""

    def holds(self, value: float) -> bool:
        if self.off is not None and value == self.off:
            return True
        above = self.low < value if self.open_low else self.low <= value
        below = value < self.high if self.open_high else value <= self.high
        return above and below

    def refusal(self, key: str, value: Any) -> str:
        """One line saying what ``key`` must be and what it got."""
        if self.low == self.high:
            wanted = _number(self.low)
        else:
            wanted = (f"in {'(' if self.open_low else '['}{_number(self.low)}, {_number(self.high)}"
                      f"{')' if self.open_high else ']'}")
        off = f" (or {_number(self.off)} to disable)" if self.off is not None else ""
        return f"{key} must be {wanted}{off}, got {shown(value)}" + (f": {self.why}" if self.why else "")


def bounded(default: Any, low: float, high: float, *, open_low: bool = False, open_high: bool = False,
            off: float | None = None, why: str = ""):
    """A setting's dataclass field with its default and its :class:`Bounds`, read by
    :func:`empo2.config.bounds_check.check_bounds`."""
    return field(default=default, metadata={"bounds": Bounds(low, high, open_low, open_high, off, why)})


def check_options(options: type, owner: str, section: str, taken: dict[str, type]) -> None:
    """A registration's own settings (``owner``: ``algorithm 'elpo'``, ``environment 'webshop'``): a dataclass whose
    class attribute ``key``, an identifier, names its place in the config's ``section`` (``section.<key>.<field>``),
    a place no other class holds (``taken``: ``{key: options class}`` of the registrations so far)."""
    key = getattr(options, "key", None)
    if not is_dataclass(options) or not isinstance(key, str) or not key.isidentifier():
        raise ValueError(f"{owner}: its options must be a dataclass with a class attribute `key`, the name of its "
                         f"settings in the {section} section")
    if taken.get(key, options) is not options:
        raise ValueError(f"{owner}: {section}.{key} already holds the options {taken[key].__name__}")


def _number(x: float) -> str:
    return str(int(x)) if float(x).is_integer() and abs(x) < 1e18 else f"{x:g}"


def shown(value: Any, limit: int = 60) -> str:
    """``repr(value)`` cut to ``limit`` characters, so an error about a huge value stays one short line."""
    text = repr(value)
    return text if len(text) <= limit else f"{text[:limit]}… ({len(text)} characters)"
