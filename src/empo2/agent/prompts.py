"""Agent prompts, assembled from parts: guide, task, demonstration, tips, a history window, the current observation.

The tip-free prompt of an ``off_tips`` step is the same parts with ``tips=()`` — it is never made by cutting tokens out
of a tokenised prompt. When a prompt is too long, the oldest history steps go first, then the demonstration is cut;
the end of the prompt (current observation, the request for an action) is never truncated.

Two layouts (``policy.prompt_layout``): ``window`` (:func:`render_prompt_ids`, the released one) renders each step
afresh: the recent steps as chat turns, the hints, tips and observation in the last message. ``append``
(:func:`append_prompt_ids`) renders the first step the same way, and every later step as the previous prompt, the
model's own response tokens and one new user turn (hints, tips, observation), so each prompt extends the last one
token for token and generation keeps its KV cache from turn to turn.

Text from the environment, the memory or the model's own actions may hold the text of the tokenizer's special tokens
(``<|im_start|>``, ``<|im_end|>`` …). Rendered as it is, a tip ``<|im_start|>system …`` would become real control
tokens and open a new system turn. :func:`chat_prompt_ids` therefore breaks every such text in the messages'
contents with a zero-width space (:func:`neutralise`): it still reads the same, and tokenises as plain text.
"""

from __future__ import annotations

from dataclasses import dataclass, field, replace

from empo2.envs.actions import clean_action
from empo2.envs.specs import get_env_spec


@dataclass
class PromptParts:
    """Everything a step's prompt is made of. ``history`` is [(action, observation after it)] oldest first."""

    env: str
    task: str
    observation: str
    """The current observation."""
    history: list[tuple[str, str]] = field(default_factory=list)
    initial_observation: str = ""
    """The observation at reset (shown before the first step when the window reaches back to it)."""
    demonstration: str = ""
    hints: str = ""
    """Environment facts for the current step (ScienceWorld: focus targets, inventory)."""
    tips: tuple[str, ...] = ()

    def without_tips(self) -> PromptParts:
        return replace(self, tips=())


def _clip(text: str, max_chars: int) -> str:
    text = text.strip()
    return text if len(text) <= max_chars else text[: max_chars - 3] + "..."


def build_messages(parts: PromptParts, history_window: int, obs_chars: int = 600) -> list[dict[str, str]]:
    """Chat messages for one step. The recent steps are real chat turns (observation → action), which small models
    imitate far better than a transcript pasted as text; the tips and hints sit next to the current observation."""
    recent = parts.history[-history_window:] if history_window > 0 else []
    start = len(parts.history) - len(recent)
    intro = [f"Task: {parts.task.strip()}"]
    if parts.demonstration:
        intro.append(f"Example of a solved episode (another variation):\n{parts.demonstration.strip()}")
    if start > 0:
        intro.append(f"({start} earlier steps are not shown.)")
    messages = [{"role": "system", "content": get_env_spec(parts.env).guide}]
    first_obs = parts.history[start - 1][1] if start > 0 else (parts.initial_observation or parts.observation)
    turns = [first_obs] + [obs for _, obs in recent]  # the observation each action answered, then the current one
    for k, (action, _) in enumerate(recent):
        body = _clip(turns[k], 300)
        messages.append({"role": "user", "content": "\n\n".join(intro + [body]) if k == 0 else body})
        messages.append({"role": "assistant", "content": action})
    final = [] if recent else list(intro)
    if parts.hints:
        final.append(parts.hints.strip())
    if parts.tips:
        final.append("Tips from your earlier attempts:\n" + "\n".join(f"- {t}" for t in parts.tips))
    final.append(f"Observation:\n{_clip(parts.observation, obs_chars)}\n\nYour next action:")
    messages.append({"role": "user", "content": "\n\n".join(final)})
    return messages


ZERO_WIDTH_SPACE = "\u200b"


def special_texts(tokenizer) -> tuple[str, ...]:
    """The texts ``tokenizer`` turns into special tokens wherever they appear: its special tokens and its added
    tokens marked special (SmolLM2: ``<|im_start|>``, ``<|im_end|>``, ``<|endoftext|>``, ``<file_sep>`` …), longest
    first."""
    texts = set(getattr(tokenizer, "all_special_tokens", None) or ())
    texts |= {str(t) for t in (getattr(tokenizer, "added_tokens_decoder", None) or {}).values()
              if getattr(t, "special", True)}
    return tuple(sorted((t for t in texts if len(t) > 1), key=lambda t: (-len(t), t)))


def neutralise(text: str, specials: tuple[str, ...]) -> str:
    """``text`` with every occurrence of a special token's text broken by a zero-width space after its first
    character, so that the tokenizer reads it as plain text (a broken occurrence cannot form a new one, so one pass
    per text is enough; the loop catches occurrences that overlapped)."""
    while any(s in text for s in specials):
        for s in specials:
            text = text.replace(s, s[0] + ZERO_WIDTH_SPACE + s[1:])
    return text


def chat_prompt_ids(tokenizer, messages: list[dict[str, str]]) -> list[int]:
    """Token ids of ``messages`` under the tokenizer's chat template, generation prompt added; the template's own
    control tokens are the only special tokens in them (every content is :func:`neutralise`-d)."""
    specials = special_texts(tokenizer)
    safe = [{**m, "content": neutralise(m["content"], specials)} for m in messages]
    ids = tokenizer.apply_chat_template(safe, add_generation_prompt=True, tokenize=True, return_dict=False)
    if isinstance(ids, dict) or hasattr(ids, "keys"):
        ids = ids["input_ids"]
    return list(ids)


def render_prompt_ids(tokenizer, parts: PromptParts, history_window: int, max_prompt_length: int) -> list[int]:
    """Token ids of the chat prompt, shortened from the oldest history until it fits ``max_prompt_length``."""
    window = history_window
    demo = parts.demonstration
    while True:
        current = replace(parts, demonstration=demo)
        ids = chat_prompt_ids(tokenizer, build_messages(current, window))
        if len(ids) <= max_prompt_length:
            return ids
        if window > 0 and parts.history:
            window -= 1  # drop the oldest step first
        elif demo:
            demo = demo[: len(demo) // 2]  # then halve the demonstration
        else:
            return ids  # nothing left to drop; the trainer counts and logs over-long prompts


def append_prompt_ids(tokenizer, parts: PromptParts, history_window: int, max_prompt_length: int,
                      previous: tuple[list[int], list[int]] | None = None) -> list[int]:
    """The ``append`` layout's prompt: ``previous`` = (the last step's prompt ids, its response ids) continued by the
    response's end-of-turn token (where generation stopped short of it) and a user turn with ``parts``' hints, tips
    and observation. The first step (``previous`` None), and a step whose prompt would outgrow ``max_prompt_length``,
    start over from :func:`render_prompt_ids` (the ``window`` layout's rendering of the same parts); later steps
    append to that.

    The response is kept as the tokens the model sampled (a re-tokenised text could differ), and the history shows
    what the model wrote, where the window layout shows the action the environment ran."""
    if previous is None:
        return render_prompt_ids(tokenizer, parts, history_window, max_prompt_length)
    prompt, response = previous
    end = tokenizer.eos_token_id
    ids = list(prompt) + list(response) + ([] if response and response[-1] == end else [end])
    ids += _turn_ids(tokenizer, build_messages(parts, 1)[-1]["content"])  # the last message: hints, tips, observation
    if len(ids) <= max_prompt_length:
        return ids
    return render_prompt_ids(tokenizer, parts, history_window, max_prompt_length)


_SENTINEL = "\x00empo2-response\x00"


def _turn_ids(tokenizer, content: str) -> list[int]:
    """Tokens that follow an assistant turn's end-of-turn token: the chat template's separator, a user message
    ``content`` (:func:`neutralise`-d) and the opening of the next assistant turn."""
    glue = _turn_template(tokenizer)
    safe = neutralise(content, special_texts(tokenizer))
    return list(tokenizer(glue[0] + safe + glue[1], add_special_tokens=False)["input_ids"])


def _turn_template(tokenizer) -> tuple[str, str]:
    """(text before, text after) a user message that follows an assistant turn, from the tokenizer's chat template."""
    key = (tokenizer.chat_template, tokenizer.eos_token)
    if key not in _TEMPLATES:
        messages = [{"role": "system", "content": "s"}, {"role": "user", "content": "u"},
                    {"role": "assistant", "content": _SENTINEL}, {"role": "user", "content": _SENTINEL}]
        text = tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=False)
        _, after_response, after_user = text.split(_SENTINEL)
        eos = tokenizer.eos_token or ""
        if not eos or not after_response.startswith(eos):
            raise ValueError("policy.prompt_layout=append needs a chat template that ends an assistant turn with the "
                             f"tokenizer's end-of-sequence token ({eos!r}); this one does not: use "
                             "policy.prompt_layout=window")
        _TEMPLATES[key] = (after_response[len(eos):], after_user)
    return _TEMPLATES[key]


_TEMPLATES: dict = {}


def parse_action(text: str) -> str:
    """The action in a model output: its first non-empty line without "Action:"/">" prefixes, quotes and trailing
    punctuation (the environment's corrector then maps it to the closest valid action)."""
    return clean_action(text)


def hints_text(info: dict) -> str:
    """Environment facts shown beside the observation (ScienceWorld: the allowed focus targets, the inventory)."""
    parts = []
    if info.get("focus_targets"):
        parts.append("Objects you may focus on: " + ", ".join(info["focus_targets"]))
    if info.get("inventory"):
        parts.append(str(info["inventory"]).strip()[:200])
    return "\n".join(parts)
