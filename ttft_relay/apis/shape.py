"""What a trim shape is (pure): how one API lays out a conversation, the base class
each API module's shape extends (`ttft_relay/apis/`), and the parts shrinking replaces.

The trim policy (`trim/policy.py`) asks a shape per item: its role, whether it is pinned or a
prompt, which tool calls it makes or answers, and what it looks like shrunk.
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import orjson

SHRINK_MIN_CHARS = 256
"""Parts shorter than this are not worth a placeholder."""

RESULTS, ARGUMENTS, IMAGES = "tool results", "tool-call arguments", "images"
SHRINK_KINDS = (RESULTS, ARGUMENTS, IMAGES)
"""What shrinking replaces, in this order."""

CONTEXT_MARKERS = ("<environment_context>", "<user_instructions>", "# AGENTS.md instructions")
"""How Codex marks the user messages that carry context rather than a question."""

_PINNED_ROLES = frozenset({"system", "developer"})


def placeholder(what: str, removed_chars: int) -> str:
    """What replaces a shrunk part: says what was there and how much of it."""
    return f"[ttft-relay: {what} removed to fit the context budget ({removed_chars:,} characters)]"


def size(value: Any) -> int:
    """Characters of a part as the model would read it."""
    if isinstance(value, str):
        return len(value)
    try:
        return len(orjson.dumps(value))
    except TypeError:
        return SHRINK_MIN_CHARS


def _first_text(content: Any) -> str:
    if isinstance(content, str):
        return content
    if isinstance(content, list) and content and isinstance(content[0], dict):
        text = content[0].get("text")
        return text if isinstance(text, str) else ""
    return ""


def ids(values: Any, key: str) -> Iterator[str]:
    for v in values if isinstance(values, list) else ():
        if isinstance(v, dict) and key in v:
            yield v[key]


def id_problem(values: Any, *keys: str) -> str | None:
    for v in values if isinstance(values, list) else ():
        for key in keys:
            if isinstance(v, dict) and key in v and not isinstance(v[key], str):
                return f"{key} is not a string"
    return None


class Shape:
    """How one API lays out a conversation. Subclasses answer per item (a dict)."""

    items_key: str
    """Body key of the conversation list."""
    fixed_keys: tuple[str, ...]
    """Body keys of request-level parts that are always sent (and counted)."""
    text_part_type: str
    """Content part type of plain text (notice, image placeholders)."""
    image_part_types: frozenset[str]
    max_output_keys: tuple[str, ...]
    """Body keys that cap the answer's tokens, the first one set counting."""
    gap_notice: bool = False
    """A drop always puts the notice in front of the first kept prompt (not only with
    relay_trim_notice): where the API merges the head's user message and that prompt into
    one turn, the model is told that turns are missing between them."""

    def items(self, body: dict) -> Any:
        """The body's conversation list (anything else when it is malformed)."""
        return body.get(self.items_key)

    def max_output(self, body: dict) -> int | None:
        """The cap on the answer's tokens the request sets, if it sets one."""
        for key in self.max_output_keys:
            value = body.get(key)
            if isinstance(value, int) and not isinstance(value, bool) and value > 0:
                return value
        return None

    def long_context(self, anthropic_beta: str | None) -> bool:
        """The request opens a longer context window than the model's default."""
        return False

    def problem(self, item: Any) -> str | None:
        """Why `item` cannot be trimmed around (ids that cannot be paired), or None."""
        if not isinstance(item, dict):
            return "item is not an object"
        if "role" in item and not isinstance(item["role"], str):
            return "role is not a string"
        return None

    def role(self, item: dict) -> str | None:
        """The role of a message; None for other items (calls, reasoning, ...)."""
        role = item.get("role")
        return role if isinstance(role, str) else None

    def pinned(self, item: dict) -> bool:
        """Always kept as it is: system/developer messages and context items."""
        role = self.role(item)
        return role in _PINNED_ROLES or (role == "user" and _first_text(item.get("content")).lstrip().startswith(CONTEXT_MARKERS))

    def is_prompt(self, item: dict) -> bool:
        """A user message that asks something (not one carrying tool results)."""
        return self.role(item) == "user" and not any(self.results(item))

    def from_model(self, item: dict) -> bool:
        """An item the model wrote (its message, reasoning, tool calls): a run of them is one
        request's answer, so the conversation's runs count its requests."""
        return self.role(item) == "assistant"

    def calls(self, item: dict) -> Iterator[str]:
        """Ids of tool calls this item makes."""
        raise NotImplementedError

    def results(self, item: dict) -> Iterator[str]:
        """Ids of tool calls this item answers."""
        raise NotImplementedError

    def shrink(self, item: dict, kind: str) -> dict | None:
        """`item` with its parts of `kind` replaced by placeholders; None if it has none."""
        if kind == IMAGES and self.role(item) == "user":
            content = self._without_images(item.get("content"))
            return None if content is None else {**item, "content": content}
        return None

    def _without_images(self, content: Any) -> list | None:
        """`content` with each image part replaced by a text part; None if it has none."""
        if not isinstance(content, list) or not any(self._is_image(p) for p in content):
            return None
        return [self._image_placeholder(p) if self._is_image(p) else p for p in content]

    def _is_image(self, part: Any) -> bool:
        return isinstance(part, dict) and part.get("type") in self.image_part_types

    def _image_placeholder(self, part: dict) -> dict:
        return {"type": self.text_part_type, "text": placeholder("image", size(part))}

    def with_notice(self, item: dict, notice: str) -> dict:
        """`item` (a user message) with the notice in front of its content."""
        content = item.get("content")
        if isinstance(content, list):
            content = [{"type": self.text_part_type, "text": notice}, *content]
        else:
            content = f"{notice}\n\n{content or ''}"
        return {**item, "content": content}

    def with_notice_after(self, item: dict, notice: str) -> dict | None:
        """`item` (the last one sent before a gap in the conversation: tool results or a
        prompt) with the notice after its content; None where it has no text to carry it."""
        content = item.get("content")
        if self.from_model(item) or self.role(item) is None:
            return None
        if isinstance(content, list):
            return {**item, "content": [*content, {"type": self.text_part_type, "text": notice}]}
        return {**item, "content": f"{content}\n\n{notice}"} if isinstance(content, str) else None


def json_placeholder(what: str, removed_chars: int) -> str:
    """A placeholder that is still a JSON object, for arguments given as JSON text."""
    return orjson.dumps({"ttft_relay": placeholder(what, removed_chars)}).decode()
