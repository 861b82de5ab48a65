"""What an API's stream reader is (pure, sans-IO): the events it reads, the base class
each API module's reader extends, what it tells the stream's watcher, and the helpers
they share.

A reader says what one API's events mean: which carry visible output (the first and
last token), which carry usage, which report an error, which end the stream. The
watcher (`ttft_relay/stream/sse.py`'s `StreamWatcher`) feeds it every event of a
stream, whether it came as SSE bytes or as a WebSocket message, and keeps the marks;
`Watcher` is what the reader and the other floors (faults, timing, the self-watch, which
find it on the flow's state) see of it.

Readers sit on the hot path: they decode an event's JSON only while that can still
change something (see `Reader`), and read types and tokens with byte-level checks.
"""

from __future__ import annotations

import builtins
import logging
import re
from dataclasses import dataclass, field
from typing import Any, NamedTuple, Protocol

import orjson

logger = logging.getLogger(__name__)

MAX_ERROR_CHARS = 500
"""Error messages are kept for records and console lines, not as evidence."""


class Event(NamedTuple):
    """One event as a reader sees it: a dispatched server-sent event (`sse.SSEParser`), or
    a WebSocket message's payload, its type inside the JSON."""

    event: str
    """The `event:` field, "" if the event had none (the spec's default "message" is not applied)."""
    data: bytes
    """The `data:` lines joined with b"\\n", raw bytes as sent (UTF-8 expected, not validated)."""
    truncated: bool = False
    """The event was larger than the parser's cap: `data` holds only its first bytes."""


def loads(data: bytes) -> Any:
    """The JSON value of `data`, or None when it is not JSON (or not UTF-8)."""
    try:
        return orjson.loads(data)
    except ValueError:  # orjson.JSONDecodeError, also for invalid UTF-8 and too deep nesting
        return None


def dig(obj: Any, *path: str) -> Any:
    """`obj[path[0]][path[1]]...`, or None as soon as a step is not a dict or lacks the key."""
    for key in path:
        if not isinstance(obj, dict):
            return None
        obj = obj.get(key)
    return obj


def as_str(value: Any) -> str:
    return value if isinstance(value, str) else ""


def as_int(value: Any) -> int | None:
    return value if isinstance(value, int) and not isinstance(value, bool) else None


def counts(**counts: int | None) -> dict[str, int] | None:
    """The usage dict: only the counts the upstream reported; None if it reported none."""
    return {k: v for k, v in counts.items() if v is not None} or None


def error_text(error: Any) -> str:
    """One line for an upstream error object: "type: message" when both are there."""
    if isinstance(error, dict):
        # Responses errors say "type": "error"; the code says more there.
        kind = next((v for k in ("type", "code", "status") if (v := error.get(k)) and v != "error"), None)
        message = error.get("message")
        if kind and message:
            text = f"{kind}: {message}"
        else:
            text = str(message or kind or orjson.dumps(error).decode())
    else:
        text = str(error)
    return text[:MAX_ERROR_CHARS]


def reported_error(event: Event) -> Any:
    """What an `error` event reports: its "error" object (Anthropic nests it there), else
    the whole JSON (OpenAI Responses puts code and message at the top), else its text."""
    obj = loads(event.data)
    return dig(obj, "error") or obj or event.data.decode("utf-8", "replace")


def type_of(event: Event) -> str:
    """The event's type: its `event:` field, else the `"type"` its JSON starts with.

    OpenAI and Anthropic send both; the fallback serves relays that drop `event:` lines.
    Read with a regex rather than a JSON decode: the type is the data's first key.
    """
    if event.event:
        return event.event
    m = _FIRST_TYPE.search(event.data, 0, 200)
    return m.group(1).decode("utf-8", "replace") if m else ""


def event_type(data: bytes) -> str:
    """The `"type"` a JSON event payload starts with (a WebSocket message's), or ""."""
    return type_of(Event("", data))


_FIRST_TYPE = re.compile(rb'"type"\s*:\s*"([^"]*)"')
_TOP_LEVEL_ERROR = re.compile(rb'^\s*\{\s*"error"\s*:')


@dataclass(slots=True)
class ToolCall:
    """A tool / function call the assistant made, as assembled from its deltas."""

    name: str = ""
    arguments: str = ""
    """The argument JSON as streamed (concatenated pieces; not validated)."""
    id: str = ""


@dataclass(slots=True)
class Transcript:
    """The assistant's answer assembled from a stream's events."""

    text_parts: list[str] = field(default_factory=list)
    reasoning_parts: list[str] = field(default_factory=list)
    calls: dict[Any, ToolCall] = field(default_factory=dict)
    """Keyed by the API's own handle for the call (index or item id), in order of appearance."""

    @property
    def text(self) -> str:
        return "".join(self.text_parts)

    @property
    def reasoning(self) -> str:
        return "".join(self.reasoning_parts)

    @property
    def tool_calls(self) -> list[ToolCall]:
        return list(self.calls.values())

    def call(self, key: Any) -> ToolCall:
        return self.calls.setdefault(key, ToolCall())

    def add(self, parts: list[str], piece: Any) -> None:
        """Append `piece` to `parts` if it is text: the events are the upstream's, not trusted."""
        if isinstance(piece, str):
            parts.append(piece)


class Watcher(Protocol):
    """The watcher of one stream as readers and the relay's other floors see it (what
    `ttft_relay/stream/sse.py`'s `StreamWatcher` is). Times are absolute seconds."""

    first_byte: float | None
    first_event: float | None
    first_token: float | None
    last_token: float | None
    chunks: int
    bytes: int
    token_events: int
    max_gap: float
    """Longest time between two consecutive chunks, in seconds."""
    longest_gap: float | None
    """When that longest silence began."""
    error: str | None
    """The first in-stream error the upstream reported."""
    done: bool
    """The API's terminal event was seen (a reader sets it)."""
    response_id: str | None
    """The upstream's id of the response being streamed, once seen (a reader sets it)."""

    @property
    def last_chunk(self) -> float | None: ...

    @property
    def at_event_boundary(self) -> bool: ...

    @property
    def usage(self) -> dict[str, int] | None: ...

    def keep_usage(self, source: str, data: builtins.bytes) -> None:  # `bytes` is the count above
        """Remember the (latest) event of kind `source` that carries usage."""

    def set_error(self, error: Any) -> None:
        """Record an upstream error object or message; the first one is the cause."""


class Reader:
    """What one API's events mean: which are tokens, which carry usage, errors, the end.

    `is_token` is exact (decodes JSON) and decides the first token; `looks_like_token`
    is a byte-level check of the same rule, used for every later event. `observe`
    finds usage, errors and the end, decoding only the events that carry an error.
    """

    def is_token(self, event: Event) -> bool:
        return False

    def looks_like_token(self, event: Event) -> bool:
        return False

    def observe(self, event: Event, watcher: Watcher) -> None:
        if event.data[:6] == b"[DONE]":
            watcher.done = True
        elif event.event == "error":
            watcher.set_error(reported_error(event))
        else:
            self.observe_top_level_error(event, watcher)

    @staticmethod
    def observe_top_level_error(event: Event, watcher: Watcher) -> None:
        """OpenAI-style errors: a data object whose first key is "error"."""
        if _TOP_LEVEL_ERROR.match(event.data):
            error = dig(loads(event.data), "error")
            if error:
                watcher.set_error(error)

    def usage(self, source: str, obj: Any) -> dict | None:
        """The raw usage object inside a decoded usage-carrying event (`source` as `keep_usage` named it)."""
        return None

    def body_usage(self, body: Any) -> dict | None:
        """The raw usage object of a non-streamed response body."""
        return dig(body, "usage")

    def usage_from_body(self, body: object) -> dict[str, int] | None:
        """Usage of a non-streamed response from its parsed JSON body, normalized; None
        when it reports none (never raises).

        Keys, each present only when the upstream reported it:
        `input_tokens` (the whole prompt, cached part included), `output_tokens`
        (reasoning included), `cached_tokens` (prompt tokens read from cache),
        `reasoning_tokens`, `cache_creation_tokens` (Anthropic: prompt tokens written to cache).
        """
        try:
            raw = self.body_usage(body)
            return self.normalize(raw) if isinstance(raw, dict) else None
        except Exception:
            logger.exception("Cannot read usage from a %s body", type(self).__name__)
            return None

    def normalize(self, raw: dict) -> dict[str, int] | None:
        """The API's usage object in the relay's terms (see `usage_from_body`)."""
        return counts(
            input_tokens=as_int(raw.get("prompt_tokens")),
            output_tokens=as_int(raw.get("completion_tokens")),
        )

    def assemble(self, obj: Any, event_type: str, out: Transcript) -> None:
        """Add one decoded event to the transcript."""

    def recognizes(self, event: Event) -> bool:
        """`event` looks like one of this API's: the event-stream view guesses the API
        of a flow whose request it does not know by the first event a reader claims."""
        return False
