"""The WebShop reward (``web_agent_site.engine.goal.get_reward``), re-implemented.

    reward = (attribute matches + option matches + [price ≤ bound]) / (#attributes + #options + 1) × type factor

Reproduced exactly: the formula; attribute matching (fuzzy token-set ratio, rounded, > 85 against the product's
attributes, else substring of title / bullet points / description); option matching after colour normalisation,
including the original's quirk that a synthetic goal's option is the pair ``(name, value)`` (colour-normalised by
exact element match, fuzzy-matched against the text "name value"); the type factor's query / category (≥ 2 shared
" › " parts) / title-score rules.

Approximated: the original finds title nouns with spaCy's POS tagger (``en_core_web_sm``: NOUN/PROPN). Here
:func:`title_nouns` keeps word tokens that are not stop words, numbers, units, colours or common product adjectives.
It keeps some adjectives and verbs spaCy would drop (e.g. "running", "cotton" both kept; spaCy's tags depend on
context), so ``title_score`` can be higher than the original's when titles share such words. Fuzzy scores use
rapidfuzz with thefuzz's preprocessing (lowercase, non-alphanumerics → spaces), which thefuzz itself wraps.
"""

from __future__ import annotations

import re
from typing import Any

from rapidfuzz import fuzz, utils

from empo2.envs.webshop.catalog import Product
from empo2.envs.webshop.goals import Goal

COLOR_SET = ["alabaster", "apricot", "aqua", "ash", "asphalt", "azure", "banana", "beige", "black", "blue", "blush", "bordeaux", "bronze", "brown", "burgundy", "camel", "camo", "caramel", "champagne", "charcoal", "cheetah", "chestnut", "chocolate", "christmas", "coffee", "cognac", "copper", "coral", "cranberry", "cream", "crystal", "dark", "denim", "eggplant", "elephant", "espresso", "fuchsia", "gold", "granite", "grape", "graphite", "grass", "gray", "green", "grey", "heather", "indigo", "ivory", "ivy", "khaki", "lavender", "lemon", "leopard", "light", "lilac", "lime", "magenta", "maroon", "mauve", "merlot", "metallic", "mint", "mocha", "multicolor", "mushroom", "mustard", "natural", "navy", "nude", "olive", "orange", "peach", "pewter", "pink", "plum", "purple", "rainbow", "red", "rose", "royal", "rust", "sand", "sapphire", "seashell", "silver", "skull", "slate", "steel", "stone", "stonewash", "sunflower", "tan", "taupe", "teal", "tiger", "turquoise", "violet", "walnut", "wheat", "white", "wine", "yellow"]
"""The original's colour list, in its order (the first colour found wins)."""

_STOP = frozenset(
    ["a", "an", "and", "are", "as", "at", "be", "but", "by", "for", "from", "if", "in", "into", "is", "it", "its", "of", "on", "or", "such", "that", "the", "their", "then", "there", "these", "they", "this", "to", "was", "will", "with", "without", "your", "you", "our", "we", "i", "me", "my", "up", "out", "new", "all", "any", "each", "per", "plus", "set"])
_ADJECTIVES = frozenset(
    ["classic", "premium", "everyday", "ultra", "advanced", "original", "deluxe", "essential", "pro", "daily", "signature", "best", "great", "good", "high", "low", "large", "small", "medium", "big", "mini", "extra", "super", "soft", "hard", "heavy", "light", "lightweight", "portable", "wireless", "organic", "natural", "fresh", "free", "non", "long", "short", "wide", "slim", "thin", "thick", "adjustable", "waterproof", "durable", "comfortable", "cute", "casual", "elegant", "modern", "vintage", "professional", "compatible", "multi", "full", "half", "double", "single", "easy", "quick", "perfect", "sexy", "warm", "cool", "hot", "cold", "dry", "wet", "clean", "pure", "real", "true", "fast", "slow", "strong", "womens", "mens", "unisex", "kids"])
_UNITS = frozenset(["oz", "fl", "ml", "l", "g", "kg", "lb", "lbs", "inch", "inches", "in", "cm", "mm", "ft", "pcs", "pc", "count", "ct", "pack", "packs", "x"])
_WORD = re.compile(r"[a-z]+")


def _fuzz(a: Any, b: Any) -> int:
    """thefuzz's ``token_set_ratio``: str() the inputs, default preprocessing, rounded to an int."""
    return int(round(fuzz.token_set_ratio(str(a), str(b), processor=utils.default_process)))


def normalize_color(option: Any) -> Any:
    """The first colour of :data:`COLOR_SET` found in ``option`` (substring for a string; element for a pair)."""
    for color in COLOR_SET:
        if color in option:
            return color
    return option


def title_nouns(title: str) -> list[str]:
    """Light noun extractor standing in for spaCy (see the module docstring for the difference)."""
    return [w for w in _WORD.findall(title.lower())
            if len(w) > 1 and w not in _STOP and w not in _ADJECTIVES and w not in _UNITS and w not in COLOR_SET]


def type_reward(product: Product, goal: Goal) -> dict[str, Any]:
    """Type factor 1.0, lowered to 0.5 (no query/category/title match), 0.1 (title score < 0.1) or 0 (no overlap)."""
    query_match = product.query == goal.query
    bought = {x.strip() for x in product.product_category.split("›")}
    wanted = {x.strip() for x in goal.product_category.split("›")}
    category_match = len(bought & wanted) >= 2
    bought_nouns, wanted_nouns = title_nouns(product.title), title_nouns(goal.name)
    title_score = 0.2 if not wanted_nouns else len(set(bought_nouns) & set(wanted_nouns)) / len(wanted_nouns)
    r_type = 1.0
    if not (query_match or category_match or title_score > 0.2):
        r_type = 0.5
    if title_score < 0.1:
        r_type = 0.1
    if title_score == 0.0:
        r_type = 0.0
    return dict(r_type=r_type, query_match=query_match, category_match=category_match, title_score=title_score)


def attribute_matches(product: Product, goal: Goal) -> int:
    """Goal attributes found in the product's attributes (fuzzy) or its title / bullets / description (substring)."""
    n = 0
    for g_attr in goal.attributes:
        if any(_fuzz(p_attr, g_attr) > 85 for p_attr in product.attributes) or (g_attr in product.title.lower() or g_attr in " ".join(product.bullets).lower()
              or g_attr in product.description.lower()):
            n += 1
    return n


def option_matches(chosen: dict[str, str], goal: Goal) -> int:
    """Goal options hit by the chosen option values (after colour normalisation, fuzzy > 85)."""
    goal_opts = list(goal.options.items()) if isinstance(goal.options, dict) else list(goal.options)
    bought = [normalize_color(o) for o in chosen.values()]
    n = 0
    for g in (normalize_color(o) for o in goal_opts):
        g_text = " ".join(g) if isinstance(g, tuple) else g
        if any(_fuzz(p, g_text) > 85 for p in bought):
            n += 1
    return n


def get_reward(product: Product, goal: Goal, price: float, chosen: dict[str, str]) -> tuple[float, dict[str, Any]]:
    """``(reward in [0, 1], details)`` for buying ``product`` at ``price`` with options ``chosen``."""
    t = type_reward(product, goal)
    n_attr = attribute_matches(product, goal)
    n_opt = option_matches(chosen, goal)
    r_price = price <= goal.price_upper
    total = (n_attr + n_opt + int(r_price)) / (len(goal.attributes) + len(goal.options) + 1) * t["r_type"]
    return total, dict(t, attribute_matches=n_attr, option_matches=n_opt, price_ok=r_price,
                       n_attributes=len(goal.attributes), n_options=len(goal.options))
