"""The state of a TextWorldExpress step: the room as ``look around`` describes it, then the inventory, in a canonical
form. Pure functions of the package's text (no JVM).

The package describes a room as one sentence per object, each opened by one of four phrases in turn ("In one part of
the room you see ...", "There is also ...", ...), in the order the objects were put there, and a container's contents
as "a, b, and c" in the same order. An object taken and put back moves to the end of the list, which shifts every
later object's phrase. So the state keeps the objects without their phrases, one per line and sorted, sorts each
contents list and the inventory's lines, and keeps the exits line (north, south, east, west: a fixed order). The same
situation then reads the same way however it was reached, and a door opened, an object taken or put away, or an
ingredient chopped changes the text.
"""

from __future__ import annotations

import re

OPENERS = re.compile(r"(?:In one part of the room you see |There is also |You also see |"
                     r"In another part of the room you see )")
ROOM = re.compile(r"^\s*You are in the (.+?)\.\s")
CONTENTS = re.compile(r"^(.*? that (?:has|contains) )(.+?)( on it)?$")


def room_name(look: str) -> str | None:
    """``kitchen`` from ``You are in the kitchen. ...`` (``None`` when the text is not a room description)."""
    m = ROOM.match(look + " ")
    return m.group(1) if m else None


def room_objects(look: str) -> list[str]:
    """The objects a room description names, in its order, without their opening phrases."""
    first = look.split("\n", 1)[0]
    m = ROOM.match(first + " ")
    if m is None:
        return []
    return [obj for obj in (part.strip().rstrip(".").strip() for part in OPENERS.split(first[m.end():])) if obj]


def canonical_object(text: str) -> str:
    """An object's description with its contents list sorted: ``a counter that has a knife, and a cookbook on it`` →
    ``a counter that has a cookbook, a knife on it``."""
    m = CONTENTS.match(text)
    if m is None or "," not in m.group(2):
        return text
    items = sorted(re.sub(r"^and ", "", item.strip()) for item in m.group(2).split(","))
    return f"{m.group(1)}{', '.join(items)}{m.group(3) or ''}"


def compact_room(text: str) -> str:
    """A room description as the agent reads it: where it is, the exits, then the objects without their opening
    phrases (``You are in the kitchen. To the North you see the corridor.`` / ``You see: a stove; an oven; a
    coin.``), in the game's order. Half as long as the package's text, so that a prompt that shortens long
    observations keeps the exits and the last object (where the coin is put). Other text is returned unchanged."""
    first, _, exits = text.partition("\n")
    name = room_name(first)
    if name is None:
        return text
    objects = room_objects(first)
    head = " ".join(f"You are in the {name}. {exits}".split())
    return head + (f"\nYou see: {'; '.join(objects)}." if objects else "")


def twx_state(look: str, inventory: str) -> str:
    """The state: ``You are in the kitchen.``, the room's objects (sorted, one per line), its exits, then the
    inventory's heading and its items (sorted). Text that is not a room description is kept with its whitespace
    folded."""
    lines: list[str] = []
    first, _, exits = look.partition("\n")
    name = room_name(first)
    if name is None:
        lines.append(" ".join(look.split()))
    else:
        lines.append(f"You are in the {name}.")
        lines += sorted(f"  {canonical_object(obj)}" for obj in room_objects(first))
        if exits.strip():
            lines.append(" ".join(exits.split()))
    heading, *items = [line for line in inventory.splitlines() if line.strip()] or [""]
    lines.append(" ".join(heading.split()))
    lines += sorted(f"  {canonical_object(' '.join(item.split()))}" for item in items)
    return "\n".join(line for line in lines if line.strip())
