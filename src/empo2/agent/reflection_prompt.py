"""End-of-episode reflection: the prompt that asks the policy for ONE tip, and the parser that cleans its answer.

The tip says what happened, what was learnt and how far the agent is from finishing (the paper's tips). The shown
trajectory is kept short (last few steps, truncated observations) because the default model has a small context.
What a tip becomes in memory (``memory.entry_format``) is :func:`empo2.memory.entry.memory_entry`, re-exported here
for the rollout.
"""

from __future__ import annotations

import re
from collections.abc import Sequence

from empo2.memory.entry import memory_entry

__all__ = ["SYSTEM_PROMPT", "memory_entry", "parse_tip", "reflection_messages"]

SYSTEM_PROMPT = (
    "You review an agent's attempt at a text-game task and write one short tip for its next attempt. "
    "Answer with the tip only: one line, no list, no preamble."
)

_PREFIX = re.compile(r"^\s*(?:[-*•>#]+\s*|\d+[.)]\s*)*(?:\*\*|__)?\s*(?:(?:final\s+|my\s+|new\s+)?(?:tip|advice|hint|"
                     r"lessons?\s+learn(?:ed|t)|lesson|(?:key\s+)?takeaway|insight|reflection|answer|note)s?\s*(?:\d+\s*)?)(?:\*\*|__)?(?:\s*[:：]|\s+[\-–—])\s*(?:\*\*|__)?",
                     re.IGNORECASE)
_QUOTES = "\"'`“”‘’«»„"


def _clip(text: str, max_chars: int) -> str:
    text = " ".join(str(text).split())
    return text if len(text) <= max_chars else text[: max_chars - 1].rstrip() + "…"


def reflection_messages(task_description: str, trajectory: Sequence[tuple[str, str]], final_score: float,
                        max_words: int = 100, max_steps: int = 10, max_obs_chars: int = 200) -> list[dict[str, str]]:
    """Chat messages asking for one tip about a finished episode.

    Args:
        task_description: the task as the agent saw it.
        trajectory: ``(action, observation)`` pairs in order; only the last ``max_steps`` are shown, each
            observation cut to ``max_obs_chars`` characters.
        final_score: the episode's final score, shown to the model.
        max_words: the tip's word limit stated in the prompt.
    """
    steps = list(trajectory)
    shown = steps[-max_steps:] if max_steps > 0 else []
    first = len(steps) - len(shown) + 1
    lines = [f"Task: {_clip(task_description, 600)}", ""]
    if len(shown) < len(steps):
        lines.append(f"(steps 1-{first - 1} omitted)")
    for i, (action, observation) in enumerate(shown, start=first):
        lines.append(f"{i}. > {_clip(action, 80)}")
        lines.append(f"   {_clip(observation, max_obs_chars)}")
    if not steps:
        lines.append("(no actions were taken)")
    lines += [
        "",
        f"Final score: {final_score:g} after {len(steps)} steps.",
        "",
        f"Write ONE tip (one line, under {max_words} words) for the next attempt at this task: what happened, "
        "what you learnt, and how far you are from finishing.",
    ]
    return [{"role": "system", "content": SYSTEM_PROMPT}, {"role": "user", "content": "\n".join(lines)}]


def parse_tip(text: str, max_words: int = 100) -> str:
    """Clean a model's reflection into a one-line tip (may be ``""``; the memory then rejects it as empty).

    Keeps the first line with content, drops prefixes such as ``Tip:`` or ``**Tip 1:**``, list markers, markdown
    emphasis and surrounding quotes, and caps the length at ``max_words`` words.
    """
    if not text:
        return ""
    for line in str(text).splitlines():
        line = line.strip()
        if not line or re.fullmatch(r"[`*_#>\-=\s]*", line) or line.startswith("```"):
            continue
        prev = None
        while prev != line:  # peel nested decorations: '- **Tip:** "..."'
            prev = line
            line = _PREFIX.sub("", line, count=1).strip()
            line = re.sub(r"^(?:[-*•>]+|\d+[.)])\s+", "", line).strip()
            if len(line) >= 2 and line[0] in _QUOTES and line[-1] in _QUOTES:
                line = line[1:-1].strip()
            for mark in ("**", "__", "`"):
                if line.startswith(mark) and line.endswith(mark) and len(line) > 2 * len(mark):
                    line = line[len(mark):-len(mark)].strip()
        line = re.sub(r"(\*\*|__)(.+?)\1", r"\2", line)
        if not line:
            continue
        words = line.split()
        return " ".join(words[:max_words])
    return ""
