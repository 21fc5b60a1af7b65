"""Reading ScienceWorld's text: the state a step reached (with the task's progress), the readings of an ambiguity
question and a compact list of valid actions. Pure functions of strings (no JVM)."""

from __future__ import annotations


def compact_actions(actions: list[str], limit: int = 64) -> list[str]:
    """A short, deterministic subset of ``actions`` covering every verb: verbs in a useful order, then round-robin
    over them, shortest action first within a verb (``reset task`` and the rarely useful ``mix``/``eat`` go last)."""
    order = ["look around", "inventory", "go to", "teleport", "open", "pick up", "focus on", "look at", "look in",
             "move", "use", "activate", "deactivate", "connect", "disconnect", "pour", "dunk", "read", "put down",
             "wait", "close", "flush", "mix", "eat", "task", "reset task"]
    groups: dict[str, list[str]] = {}
    for action in dict.fromkeys(actions):
        verb = next((v for v in sorted(order, key=len, reverse=True) if action == v or action.startswith(v + " ")),
                    action.split(" ")[0])
        groups.setdefault(verb, []).append(action)
    queues = [sorted(groups[v], key=lambda a: (len(a), a)) for v in sorted(groups, key=lambda v: (
        order.index(v) if v in order else len(order) - 3, v))]
    out: list[str] = []
    while len(out) < limit and any(queues):
        for queue in queues:
            if queue and len(out) < limit:
                out.append(queue.pop(0))
    return out


def scienceworld_state(look: str, inventory: str, score: int, focus: str = "") -> str:
    """The state of a ScienceWorld step: the task's progress, then the inventory, then the room as ``look around``
    describes it.

    The progress line holds what the task has scored (the simulator's score counts the subgoals reached) and the
    object the agent focused on (``focus``, from the simulator's "You focus on the soap." reply): a focus scores and
    ends a find task's first subgoal, yet leaves the room and the inventory as they were, so without it the state
    before the focus and the state after it read the same. The short parts come first, so that an embedder that cuts
    its input (MiniLM keeps 256 word pieces; a kitchen is 240–310) loses the end of the room's listing, never the
    progress or the inventory.

    The step's own reply is left out: it is a message about the last action ("The door is already open." in every
    room). Each listing (the lines indented under a heading) is sorted, because the simulator lists a room's objects
    in a different order after a reload, and whitespace is folded, so the same situation reads the same way however
    it was reached.
    """
    progress = f"Task progress: score {int(score)}" + (f", focused on {focus}" if focus else ", no focus yet")
    lines: list[str] = [progress]
    listing: list[str] = []
    for raw in f"{inventory}\n{look}".splitlines():
        line = " ".join(raw.split())
        if not line:
            continue
        if raw[:1].isspace():
            listing.append(line)
            continue
        lines += sorted(listing)
        listing = []
        lines.append(line)
    return "\n".join(lines + sorted(listing))


FOCUS_REPLY = "You focus on "
"""How the simulator answers a focus it accepted ("You focus on the soap.")."""


def focused_object(reply: str) -> str | None:
    """The object a reply says the agent focused on (``the soap``), or ``None`` for any other reply."""
    reply = reply.strip()
    if not reply.startswith(FOCUS_REPLY):
        return None
    return reply[len(FOCUS_REPLY):].splitlines()[0].rstrip(".").strip() or None


def readings_of(question: str) -> list[str]:
    """The readings the simulator offers in an ambiguity question (``0:\topen drawer (in cupboard, in kitchen)``)."""
    return [line.split(":", 1)[1].strip() for line in question.splitlines()[1:] if line.split(":", 1)[0].isdigit()]

