"""Map free-form model output to an environment action (shared by ScienceWorld and WebShop).

A small model writes ``Action: pick up thermometr.``; the environment wants ``pick up thermometer``.
:func:`clean_action` strips the chatter, :func:`correct_action` then picks the closest valid action.
"""

from __future__ import annotations

import re

from rapidfuzz import fuzz, process

_PREFIX = re.compile(r"^\s*(?:(?:action|next action|command)\s*[:：]\s*|>+\s*|[-*]\s+|\d+[.)]\s+)+", re.IGNORECASE)
_TRAILING = re.compile(r"[\s.,;:!?\"'`]+$")
_LEADING = re.compile(r"^[\s\"'`]+")

DEFAULT_CUTOFF = 75.0
"""Below this :func:`similarity` (0–100) the cleaned text is kept as is: ``pick up thermometr`` in a room without a
thermometer stays unparsed instead of becoming ``pick up fire pit`` (65)."""


def clean_action(raw: str) -> str:
    """First non-empty line of ``raw`` minus ``Action:``/``>`` prefixes, quotes, trailing punctuation, extra spaces."""
    line = next((ln for ln in str(raw).splitlines() if ln.strip()), "")
    previous = None
    while previous != line:  # prefixes and quotes can nest: `> "Action: go to kitchen."`
        previous = line
        line = _LEADING.sub("", _PREFIX.sub("", line))
        line = _TRAILING.sub("", line)
    return " ".join(line.split())


def normalise(text: str) -> str:
    """Lower-case, whitespace-collapsed form used for comparisons."""
    return " ".join(str(text).lower().split())


def similarity(a: str, b: str, **_: object) -> float:
    """Mean of rapidfuzz ``ratio`` (typos) and ``token_set_ratio`` (extra words, word order), 0–100.

    ``WRatio`` was tried and rejected: its partial matching scores ``go to kitchen`` ~ ``move bowl to hallway`` at 85.
    """
    return (fuzz.ratio(a, b) + fuzz.token_set_ratio(a, b)) / 2


def closest_actions(raw: str, valid_actions: list[str], cutoff: float = DEFAULT_CUTOFF, limit: int = 3) -> list[str]:
    """Up to ``limit`` valid actions closest to ``raw``, best first (empty when none reaches ``cutoff``).

    An exact match after :func:`clean_action` and :func:`normalise` comes first (in the valid list's spelling); then
    the best :func:`similarity` matches at or above ``cutoff``; ties go to the higher plain ``fuzz.ratio``, then to the
    earlier action.
    """
    key = normalise(clean_action(raw))
    exact = [a for a in valid_actions if normalise(a) == key][:1]
    found = process.extract(key, valid_actions, scorer=similarity, processor=normalise, score_cutoff=cutoff,
                            limit=limit + 8)
    ranked = sorted(found, key=lambda m: (-m[1], -fuzz.ratio(key, normalise(m[0])), m[2]))
    return list(dict.fromkeys(exact + [m[0] for m in ranked]))[:limit]


def correct_action(raw: str, valid_actions: list[str], cutoff: float = DEFAULT_CUTOFF) -> str:
    """The valid action closest to ``raw`` (see :func:`closest_actions`); the cleaned ``raw`` when none is close."""
    best = closest_actions(raw, valid_actions, cutoff, limit=1)
    return best[0] if best else clean_action(raw)


def replayable_gold(actions: list[str]) -> list[str]:
    """The gold actions to send to :class:`ScienceWorldEnv`: the simulator's gold paths answer an "Ambiguous request"
    prompt with a bare ``0``, which ``step`` already answers itself; sent as an action, the ``0`` would reach the
    action corrector and become some arbitrary valid action."""
    return [a for a in actions if a.strip() != "0"]
