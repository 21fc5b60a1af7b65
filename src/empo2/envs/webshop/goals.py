"""Goals: synthetic (one per instructed product × option combination) and, optionally, human instructions.

As the original ``web_agent_site.engine.goal``: the price clause takes, from 10, 20, …, 990, the first four values
above the product's price, samples two and keeps the larger (", and price lower than X.00 dollars"); no clause when
fewer than two exist. Goals are then shuffled. Unlike the original (global ``random``, fixed shuffle seed 233),
the price bounds and the shuffle use RNGs derived from ``seed``, so the same seed gives the same goals.
"""

from __future__ import annotations

import itertools
import random
from dataclasses import dataclass
from typing import Any

from empo2.envs.webshop.catalog import Product

PRICE_RANGE = [10.0 * i for i in range(1, 100)]
NO_PRICE_LIMIT = 1_000_000.0


@dataclass
class Goal:
    asin: str
    instruction: str
    """The full instruction text shown to the agent."""
    attributes: list[str]
    options: dict[str, str] | list[str]
    """Synthetic goals: ``{option name: value}``; human goals: a list of values (as in the original)."""
    price_upper: float
    query: str
    product_category: str
    name: str
    """The target's title (the reward compares nouns of titles)."""
    base_instruction: str
    """The instruction without the option and price clauses (the gold search query)."""

    def to_dict(self) -> dict[str, Any]:
        return dict(self.__dict__)


def price_clause(price: float, rng: random.Random) -> tuple[float, str]:
    """``(price_upper, text)`` by the original rule."""
    candidates = [p for p in PRICE_RANGE if p > price][:4]
    if len(candidates) < 2:
        return NO_PRICE_LIMIT, ""
    _, upper = sorted(rng.sample(candidates, 2))
    return upper, f", and price lower than {upper:.2f} dollars"


def synthetic_goals(products: list[Product], seed: int = 0) -> list[Goal]:
    """One goal per option combination of every product with an instruction (original ordering, then shuffled)."""
    rng = random.Random(seed * 7919 + 1)
    goals = []
    for p in products:
        if not p.instruction or not p.instruction_attributes:
            continue
        upper, price_text = price_clause(p.price, rng)
        names = sorted(p.options)
        for combo in itertools.product(*(p.options[n] for n in names)):
            chosen = dict(zip(names, combo))
            option_text = ", and ".join(f"{k}: {v}" for k, v in chosen.items())
            option_text = f" with {option_text}" if option_text else ""
            goals.append(Goal(p.asin, f"{p.instruction}{option_text}{price_text}", list(p.instruction_attributes),
                              chosen, upper, p.query, p.product_category, p.title, p.instruction))
    return _shuffled(goals, seed)


def human_goals(products: list[Product], seed: int = 0) -> list[Goal]:
    """One goal per human instruction with at least one attribute (the original skips the others)."""
    rng = random.Random(seed * 7919 + 2)
    goals = []
    for p in products:
        for ins in p.human_instructions:
            if not ins.get("instruction_attributes") or not ins.get("instruction"):
                continue
            upper, price_text = price_clause(p.price, rng)
            text = ins["instruction"].strip(".")
            goals.append(Goal(p.asin, text + price_text, list(ins["instruction_attributes"]),
                              [str(o) for o in ins.get("instruction_options", [])], upper, p.query,
                              p.product_category, p.title, text))
    return _shuffled(goals, seed)


def _shuffled(goals: list[Goal], seed: int) -> list[Goal]:
    random.Random(seed * 7919 + 233).shuffle(goals)
    return goals


def split_ranges(n_goals: int) -> dict[str, range]:
    """Goal index ranges per split.

    With at least 3000 goals the original boundaries hold: test = 0–500, eval = 500–1500, train = the rest. A smaller
    catalog (the fixture) keeps the same proportions as a 3000-goal set: test = first sixth, eval = next third,
    train = the remaining half.
    """
    if n_goals >= 3000:
        t, e = 500, 1500
    else:
        t, e = n_goals // 6, n_goals // 6 + n_goals // 3
    return {"test": range(0, t), "eval": range(t, e), "train": range(e, n_goals)}
