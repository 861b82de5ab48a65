"""Server-sent events: an incremental parser and per-API stream watchers (pure, sans-IO).

Bytes in, values out; nothing here does I/O or reads a clock, so everything can be
tested by feeding chunks.

- `SSEParser` turns chunks of an `text/event-stream` body into `Event`s, per the
  WHATWG event-stream rules, wherever the chunks happen to split.
- `StreamWatcher` is fed every chunk of a response body by the stream callable and
  keeps the marks of the stream (first byte, first event, first token, last token),
  the longest silence between chunks, the usage and any in-stream error the upstream
  reported. What counts as a token, as usage, as an error or as the end depends on
  the API; each API's rules live in one `_Reader` subclass.
- `usage_from_body` reads the same usage from a non-streamed JSON answer.
- `transcript` / `detect_api` assemble the assistant's answer from events, for the
  event-stream contentview.

The watcher sits on the hot path, so it decodes an event's JSON only while that can
still change something: before the first token, and for the few events that may
carry an error. After the first token a byte-level check decides whether an event
is a token, and usage is kept as the raw bytes of the event that carried it and
decoded only when someone reads `StreamWatcher.usage`.
"""

from __future__ import annotations

import logging
import re
from collections.abc import Iterable
from dataclasses import dataclass
from dataclasses import field
from typing import Any
from typing import NamedTuple

import orjson

logger = logging.getLogger(__name__)

DEFAULT_MAX_EVENT_BYTES = 4 * 1024 * 1024
"""Cap on the data of one event (and on one line). Generous because OpenAI's
`response.completed` repeats the whole answer; anything larger is truncated."""

MAX_ERROR_CHARS = 500
"""Error messages are kept for records and console lines, not as evidence."""

_BOM = b"\xef\xbb\xbf"


class Event(NamedTuple):
    """One dispatched server-sent event."""

    event: str
    """The `event:` field, "" if the event had none (the spec's default "message" is not applied)."""
    data: bytes
    """The `data:` lines joined with b"\\n", raw bytes as sent (UTF-8 expected, not validated)."""
    truncated: bool = False
    """The event was larger than the parser's cap: `data` holds only its first bytes."""


class SSEParser:
    """Incremental `text/event-stream` parser: `feed(chunk)` returns the events the chunk completed.

    Follows the WHATWG rules: lines end in CR LF, LF or CR (a CR LF split across chunks
    is one line end); a leading BOM is skipped; `:` starts a comment; one space after
    the field's colon is dropped; `data:` lines accumulate, joined with LF; a blank
    line dispatches the event if it had any `data:` line. `id:` and `retry:` are
    ignored (nothing the relay reads depends on them), as is an unterminated last event.

    Memory is bounded: an event's data, and a line still waiting for its end, are each
    cut at `max_event_bytes`; the bytes beyond are skipped until the event ends and the
    event is dispatched with `truncated=True`.
    """

    __slots__ = ("max_event_bytes", "_line", "_at_start", "_after_cr", "_type", "_data", "_size", "_truncated")

    def __init__(self, max_event_bytes: int = DEFAULT_MAX_EVENT_BYTES) -> None:
        self.max_event_bytes = max_event_bytes
        self._line = bytearray()
        """The incomplete last line seen so far (or the first bytes of a possible BOM)."""
        self._at_start = True
        self._after_cr = False
        """The previous chunk ended in CR: an LF opening the next one belongs to that line end."""
        self._type = ""
        self._data: list[bytes] = []
        self._size = 0
        self._truncated = False

    def feed(self, data: bytes) -> list[Event]:
        if self._at_start:
            data = self._skip_bom(data)
        if self._after_cr and data:
            self._after_cr = False
            if data[0] == 0x0A:
                data = data[1:]
        if not data:
            return []
        last = data[-1]
        lines = data.splitlines()
        if last == 0x0A or last == 0x0D:
            self._after_cr = last == 0x0D
            tail = None
        else:
            tail = lines.pop()
        events: list[Event] = []
        if lines:
            if self._line:
                self._line += lines[0]
                lines[0] = bytes(self._line)
                self._line.clear()
            for line in lines:
                # The blank line is half of all lines: handled here rather than in a call.
                if line:
                    self._take_field(line)
                elif self._data:
                    events.append(self._dispatch())
                else:  # an event without data is dropped, and forgotten
                    self._type, self._truncated = "", False
        if tail is not None:
            self._keep_partial_line(tail)
        return events

    @property
    def at_event_boundary(self) -> bool:
        """No event or line is half read: bytes appended now start a new event."""
        return not (self._line or self._data or self._type)

    def _skip_bom(self, data: bytes) -> bytes:
        head = bytes(self._line) + data if self._line else data
        if len(head) < len(_BOM) and _BOM.startswith(head):
            # Possibly a BOM split across chunks: decide when more bytes arrive.
            self._line[:] = head
            return b""
        self._line.clear()
        self._at_start = False
        return head[len(_BOM) :] if head.startswith(_BOM) else head

    def _keep_partial_line(self, tail: bytes) -> None:
        room = self.max_event_bytes - len(self._line)
        if len(tail) > room:
            tail = tail[: max(room, 0)]
            self._truncated = True
        self._line += tail

    def _dispatch(self) -> Event:
        data = self._data[0] if len(self._data) == 1 else b"\n".join(self._data)
        event = Event(self._type, data, self._truncated)
        self._type = ""
        self._data = []
        self._size = 0
        self._truncated = False
        return event

    def _take_field(self, line: bytes) -> None:
        if line.startswith(b"data:"):
            self._add_data(line[6:] if line[5:6] == b" " else line[5:])
        elif line.startswith(b"event:"):
            value = line[7:] if line[6:7] == b" " else line[6:]
            self._type = value.decode("utf-8", "replace")
        elif line[0] != 0x3A and b":" not in line:
            # A field name alone means an empty value: only "data" matters then.
            if line == b"data":
                self._add_data(b"")
            elif line == b"event":
                self._type = ""

    def _add_data(self, value: bytes) -> None:
        room = self.max_event_bytes - self._size
        if room <= 0 and self._data:
            self._truncated = True
            return
        if len(value) > room:
            value = value[: max(room, 0)]
            self._truncated = True
        self._size += len(value) + 1
        self._data.append(value)


# --- helpers shared by the readers -------------------------------------------------


def _loads(data: bytes) -> Any:
    """The JSON value of `data`, or None when it is not JSON (or not UTF-8)."""
    try:
        return orjson.loads(data)
    except ValueError:  # orjson.JSONDecodeError, also for invalid UTF-8 and too deep nesting
        return None


def _get(obj: Any, *path: str) -> Any:
    """`obj[path[0]][path[1]]...`, or None as soon as a step is not a dict or lacks the key."""
    for key in path:
        if not isinstance(obj, dict):
            return None
        obj = obj.get(key)
    return obj


def _str(value: Any) -> str:
    return value if isinstance(value, str) else ""


def _int(value: Any) -> int | None:
    return value if isinstance(value, int) and not isinstance(value, bool) else None


def _counts(**counts: int | None) -> dict[str, int] | None:
    """The usage dict: only the counts the upstream reported; None if it reported none."""
    return {k: v for k, v in counts.items() if v is not None} or None


def _error_text(error: Any) -> str:
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


def _reported_error(event: Event) -> Any:
    """What an `error` event reports: its "error" object (Anthropic nests it there), else
    the whole JSON (OpenAI Responses puts code and message at the top), else its text."""
    obj = _loads(event.data)
    return _get(obj, "error") or obj or event.data.decode("utf-8", "replace")


def _event_type(event: Event) -> str:
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
    return _event_type(Event("", data))


_FIRST_TYPE = re.compile(rb'"type"\s*:\s*"([^"]*)"')
_TOP_LEVEL_ERROR = re.compile(rb'^\s*\{\s*"error"\s*:')
_RESPONSE_ID = re.compile(rb'"response"\s*:\s*\{\s*"id"\s*:\s*"([^"]{1,200})"')


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


# --- per-API readers -----------------------------------------------------------------


class _Reader:
    """What one API's events mean: which are tokens, which carry usage, errors, the end.

    `is_token` is exact (decodes JSON) and decides the first token; `looks_like_token`
    is a byte-level check of the same rule, used for every later event. `observe`
    finds usage, errors and the end, decoding only the events that carry an error.
    """

    def is_token(self, event: Event) -> bool:
        return False

    def looks_like_token(self, event: Event) -> bool:
        return False

    def observe(self, event: Event, watcher: StreamWatcher) -> None:
        if event.data[:6] == b"[DONE]":
            watcher.done = True
        elif event.event == "error":
            watcher.set_error(_reported_error(event))
        else:
            self.observe_top_level_error(event, watcher)

    @staticmethod
    def observe_top_level_error(event: Event, watcher: StreamWatcher) -> None:
        """OpenAI-style errors: a data object whose first key is "error"."""
        if _TOP_LEVEL_ERROR.match(event.data):
            error = _get(_loads(event.data), "error")
            if error:
                watcher.set_error(error)

    def usage(self, source: str, obj: Any) -> dict | None:
        """The raw usage object inside a decoded usage-carrying event (`source` as `keep_usage` named it)."""
        return None

    def body_usage(self, body: Any) -> dict | None:
        """The raw usage object of a non-streamed response body."""
        return _get(body, "usage")

    def normalize(self, raw: dict) -> dict[str, int] | None:
        """The API's usage object in the relay's terms (see `usage_from_body`)."""
        return _counts(
            input_tokens=_int(raw.get("prompt_tokens")),
            output_tokens=_int(raw.get("completion_tokens")),
        )

    def assemble(self, obj: Any, event_type: str, out: Transcript) -> None:
        """Add one decoded event to the transcript."""


class _OpenAIChat(_Reader):
    """`/v1/chat/completions`: `data:` JSON chunks, a usage-only last chunk, `data: [DONE]`."""

    _TEXT_FIELDS = ("content", "reasoning_content", "reasoning", "refusal")
    # A non-empty string in a delta field, or a tool call (name or arguments).
    _TOKEN = re.compile(rb'"(?:content|reasoning_content|reasoning|refusal|arguments|name)"\s*:\s*"[^"]')
    _USAGE_OBJECT = re.compile(rb'"usage"\s*:\s*\{')

    def is_token(self, event: Event) -> bool:
        for choice in _choices(_loads(event.data)):
            delta = choice.get("delta")
            if not isinstance(delta, dict):
                continue
            if any(isinstance(delta.get(k), str) and delta[k] for k in self._TEXT_FIELDS):
                return True
            if delta.get("tool_calls") or delta.get("function_call"):
                return True
        return False

    def looks_like_token(self, event: Event) -> bool:
        # Start at the delta: halves the scan, the id/model/fingerprint come first.
        data = event.data
        return self._TOKEN.search(data, max(data.find(b'"delta"'), 0)) is not None

    def observe(self, event: Event, watcher: StreamWatcher) -> None:
        data = event.data
        # With include_usage every chunk says "usage":null; only the last one has an object.
        at = data.find(b'"usage"')
        if at >= 0 and self._USAGE_OBJECT.match(data, at):
            watcher.keep_usage("final", data)
        super().observe(event, watcher)

    def usage(self, source: str, obj: Any) -> dict | None:
        return _get(obj, "usage")

    def normalize(self, raw: dict) -> dict[str, int] | None:
        cached = _get(raw, "prompt_tokens_details", "cached_tokens")
        if cached is None:
            cached = raw.get("prompt_cache_hit_tokens")  # DeepSeek's spelling
        return _counts(
            input_tokens=_int(raw.get("prompt_tokens")),
            output_tokens=_int(raw.get("completion_tokens")),
            cached_tokens=_int(cached),
            reasoning_tokens=_int(_get(raw, "completion_tokens_details", "reasoning_tokens")),
        )

    def assemble(self, obj: Any, event_type: str, out: Transcript) -> None:
        for choice in _choices(obj):
            delta = choice.get("delta")
            # Only the first choice: n > 1 streams are rare and would interleave.
            if choice.get("index", 0) != 0 or not isinstance(delta, dict):
                continue
            out.add(out.text_parts, delta.get("content"))
            out.add(out.text_parts, delta.get("refusal"))
            out.add(out.reasoning_parts, delta.get("reasoning_content"))
            out.add(out.reasoning_parts, delta.get("reasoning"))
            tools = delta.get("tool_calls")
            for tool in tools if isinstance(tools, list) else ():
                if not isinstance(tool, dict):
                    continue
                call = out.call(tool.get("index", 0))
                call.id = _str(tool.get("id")) or call.id
                call.name = _str(_get(tool, "function", "name")) or call.name
                call.arguments += _str(_get(tool, "function", "arguments"))


def _choices(obj: Any) -> list[dict]:
    choices = _get(obj, "choices")
    return [c for c in choices if isinstance(c, dict)] if isinstance(choices, list) else []


class _OpenAIResponses(_Reader):
    """`/v1/responses`: typed events (`event:` = data's "type"), ending in response.completed/failed/incomplete."""

    TOKEN_TYPES = frozenset(
        {
            "response.output_text.delta",
            "response.refusal.delta",
            "response.reasoning_text.delta",
            "response.reasoning_summary_text.delta",
            "response.function_call_arguments.delta",
            "response.custom_tool_call_input.delta",
        }
    )
    TERMINAL_TYPES = frozenset({"response.completed", "response.failed", "response.incomplete"})
    _EMPTY_DELTA = re.compile(rb'"delta"\s*:\s*""')

    def is_token(self, event: Event) -> bool:
        if _event_type(event) not in self.TOKEN_TYPES:
            return False
        delta = _get(_loads(event.data), "delta")
        return isinstance(delta, str) and delta != ""

    def looks_like_token(self, event: Event) -> bool:
        return _event_type(event) in self.TOKEN_TYPES and self._EMPTY_DELTA.search(event.data) is None

    def observe(self, event: Event, watcher: StreamWatcher) -> None:
        kind = _event_type(event)
        if kind == "response.created" and watcher.response_id is None:
            m = _RESPONSE_ID.search(event.data)
            watcher.response_id = m.group(1).decode("utf-8", "replace") if m else None
        elif kind in self.TERMINAL_TYPES:
            watcher.done = True
            watcher.keep_usage("final", event.data)
            if kind == "response.failed":
                watcher.set_error(_get(_loads(event.data), "response", "error") or "response.failed")
        elif kind == "error":
            watcher.set_error(_reported_error(event))

    def usage(self, source: str, obj: Any) -> dict | None:
        return _get(obj, "response", "usage")

    def normalize(self, raw: dict) -> dict[str, int] | None:
        return _counts(
            input_tokens=_int(raw.get("input_tokens")),
            output_tokens=_int(raw.get("output_tokens")),
            cached_tokens=_int(_get(raw, "input_tokens_details", "cached_tokens")),
            reasoning_tokens=_int(_get(raw, "output_tokens_details", "reasoning_tokens")),
        )

    def assemble(self, obj: Any, event_type: str, out: Transcript) -> None:
        delta = obj.get("delta")
        if event_type in ("response.output_text.delta", "response.refusal.delta"):
            out.add(out.text_parts, delta)
        elif event_type in ("response.reasoning_text.delta", "response.reasoning_summary_text.delta"):
            out.add(out.reasoning_parts, delta)
        elif event_type == "response.output_item.added":
            if _get(obj, "item", "type") in ("function_call", "custom_tool_call"):
                call = out.call(_str(_get(obj, "item", "id")))
                call.name, call.id = _str(_get(obj, "item", "name")), _str(_get(obj, "item", "call_id"))
        elif event_type in ("response.function_call_arguments.delta", "response.custom_tool_call_input.delta"):
            out.call(_str(obj.get("item_id"))).arguments += _str(delta)


class _OpenAIRealtime(_OpenAIResponses):
    """The Realtime API's WebSocket (`/v1/realtime`): a turn's server events end in
    `response.done`; output is text, audio or an audio transcript, in the GA names
    and the beta's."""

    TOKEN_TYPES = frozenset(
        {
            "response.output_text.delta",
            "response.output_audio.delta",
            "response.output_audio_transcript.delta",
            "response.text.delta",
            "response.audio.delta",
            "response.audio_transcript.delta",
            "response.function_call_arguments.delta",
        }
    )
    TERMINAL_TYPES = frozenset({"response.done"})

    def observe(self, event: Event, watcher: StreamWatcher) -> None:
        kind = _event_type(event)
        if kind in self.TERMINAL_TYPES:
            watcher.done = True
            watcher.keep_usage("final", event.data)
            if _get(_loads(event.data), "response", "status") == "failed":
                watcher.set_error(_get(_loads(event.data), "response", "status_details", "error") or "response failed")
        elif kind == "error":
            watcher.set_error(_reported_error(event))

    def normalize(self, raw: dict) -> dict[str, int] | None:
        return _counts(
            input_tokens=_int(raw.get("input_tokens")),
            output_tokens=_int(raw.get("output_tokens")),
            cached_tokens=_int(_get(raw, "input_token_details", "cached_tokens")),
        )


class _AnthropicMessages(_Reader):
    """`/v1/messages`: message_start, content blocks and their deltas, message_delta, message_stop."""

    # Delta type -> the field holding its visible text. signature_delta is not output.
    _DELTA_FIELDS = {"text_delta": "text", "thinking_delta": "thinking", "input_json_delta": "partial_json"}
    _TOKEN = re.compile(rb'"(?:text|thinking|partial_json)"\s*:\s*"[^"]')

    def is_token(self, event: Event) -> bool:
        if _event_type(event) != "content_block_delta":
            return False
        delta = _get(_loads(event.data), "delta")
        key = self._DELTA_FIELDS.get(_get(delta, "type"))
        return key is not None and isinstance(delta.get(key), str) and delta[key] != ""

    def looks_like_token(self, event: Event) -> bool:
        return _event_type(event) == "content_block_delta" and self._TOKEN.search(event.data) is not None

    def observe(self, event: Event, watcher: StreamWatcher) -> None:
        kind = _event_type(event)
        if kind == "message_start":
            watcher.keep_usage("message_start", event.data)
        elif kind == "message_delta":
            watcher.keep_usage("message_delta", event.data)
        elif kind == "message_stop":
            watcher.done = True
        elif kind == "error":
            watcher.set_error(_reported_error(event))

    def usage(self, source: str, obj: Any) -> dict | None:
        return _get(obj, "message", "usage") if source == "message_start" else _get(obj, "usage")

    def normalize(self, raw: dict) -> dict[str, int] | None:
        # Anthropic's input_tokens leaves out the cached part; the relay's counts all of the prompt.
        uncached = _int(raw.get("input_tokens"))
        cache_read = _int(raw.get("cache_read_input_tokens"))
        cache_creation = _int(raw.get("cache_creation_input_tokens"))
        return _counts(
            input_tokens=None if uncached is None else uncached + (cache_read or 0) + (cache_creation or 0),
            output_tokens=_int(raw.get("output_tokens")),
            cached_tokens=cache_read,
            cache_creation_tokens=cache_creation,
        )

    def assemble(self, obj: Any, event_type: str, out: Transcript) -> None:
        index = obj.get("index")
        if event_type == "content_block_start":
            if _get(obj, "content_block", "type") in ("tool_use", "server_tool_use"):
                call = out.call(index)
                call.name = _str(_get(obj, "content_block", "name"))
                call.id = _str(_get(obj, "content_block", "id"))
        elif event_type == "content_block_delta":
            kind = _get(obj, "delta", "type")
            if kind == "text_delta":
                out.add(out.text_parts, _get(obj, "delta", "text"))
            elif kind == "thinking_delta":
                out.add(out.reasoning_parts, _get(obj, "delta", "thinking"))
            elif kind == "input_json_delta":
                out.call(index).arguments += _str(_get(obj, "delta", "partial_json"))


class _Gemini(_Reader):
    """Gemini `:streamGenerateContent?alt=sse`: `data:` JSON chunks with candidates and running usageMetadata."""

    _TOKEN = re.compile(rb'"text"\s*:\s*"[^"]|"functionCall"')

    def is_token(self, event: Event) -> bool:
        return any(
            (isinstance(part.get("text"), str) and part["text"]) or part.get("functionCall")
            for part in _gemini_parts(_loads(event.data))
        )

    def looks_like_token(self, event: Event) -> bool:
        return self._TOKEN.search(event.data) is not None

    def observe(self, event: Event, watcher: StreamWatcher) -> None:
        data = event.data
        # Every chunk may repeat the running totals: keep the latest, decode it once at the end.
        if b'"usageMetadata"' in data:
            watcher.keep_usage("final", data)
        if b'"finishReason"' in data:
            watcher.done = True
        self.observe_top_level_error(event, watcher)

    def usage(self, source: str, obj: Any) -> dict | None:
        return _get(obj, "usageMetadata")

    def body_usage(self, body: Any) -> dict | None:
        # streamGenerateContent without alt=sse answers a JSON array of chunks.
        if isinstance(body, list):
            return next((u for u in map(self.body_usage, reversed(body)) if u), None)
        return _get(body, "usageMetadata")

    def normalize(self, raw: dict) -> dict[str, int] | None:
        # Gemini counts thoughts apart from candidates; the relay's output includes reasoning, as OpenAI's does.
        candidates = _int(raw.get("candidatesTokenCount"))
        thoughts = _int(raw.get("thoughtsTokenCount"))
        output = None if candidates is None and thoughts is None else (candidates or 0) + (thoughts or 0)
        return _counts(
            input_tokens=_int(raw.get("promptTokenCount")),
            output_tokens=output,
            cached_tokens=_int(raw.get("cachedContentTokenCount")),
            reasoning_tokens=thoughts,
        )

    def assemble(self, obj: Any, event_type: str, out: Transcript) -> None:
        for part in _gemini_parts(obj):
            if isinstance(part.get("text"), str):
                out.add(out.reasoning_parts if part.get("thought") else out.text_parts, part["text"])
            elif isinstance(part.get("functionCall"), dict):
                # Gemini sends a call whole, its args already parsed.
                call = out.call(len(out.calls))
                call.name = _str(part["functionCall"].get("name"))
                call.arguments = orjson.dumps(part["functionCall"].get("args") or {}).decode()


def _gemini_parts(obj: Any) -> list[dict]:
    candidates = _get(obj, "candidates")
    if not isinstance(candidates, list):
        return []
    return [
        part
        for candidate in candidates
        if isinstance(parts := _get(candidate, "content", "parts"), list)
        for part in parts
        if isinstance(part, dict)
    ]


_READERS: dict[str, _Reader] = {
    "openai.chat": _OpenAIChat(),
    "openai.responses": _OpenAIResponses(),
    "openai.realtime": _OpenAIRealtime(),
    "anthropic.messages": _AnthropicMessages(),
    "gemini": _Gemini(),
}
_OTHER = _Reader()
"""Any other stream: never a token (the relay cannot tell content from metadata), but [DONE] and errors."""


def _reader(api: str) -> _Reader:
    return _READERS.get(api, _OTHER)


# --- the watcher ---------------------------------------------------------------------


class StreamWatcher:
    """Watches one streamed response body and keeps its marks, usage, error and end.

    The stream callable calls `feed(chunk, time.time())` for every chunk; the bytes
    themselves go on to the client untouched. Times are absolute, as passed in.
    Never raises: whatever the upstream sends, the stream must pass.
    """

    def __init__(self, api: str, max_event_bytes: int = DEFAULT_MAX_EVENT_BYTES) -> None:
        self.api = api
        self.first_byte: float | None = None
        self.first_event: float | None = None
        """When the first complete event arrived (comments and keep-alives are not events)."""
        self.first_token: float | None = None
        self.last_token: float | None = None
        self.chunks = 0
        self.bytes = 0
        self.events = 0
        self.max_gap = 0.0
        """Longest time between two consecutive chunks, in seconds."""
        self.token_events = 0
        """Events that carried visible output (not tokens: an event may hold several)."""
        self.error: str | None = None
        """The first in-stream error the upstream reported, as "type: message"."""
        self.done = False
        """The API's terminal event was seen: the stream ended as designed."""
        self.response_id: str | None = None
        """The upstream's id of the response being streamed (Responses API), once seen."""
        self._reader = _reader(api)
        self._parser = SSEParser(max_event_bytes)
        self._last_chunk: float | None = None
        self._usage_events: dict[str, bytes] = {}
        self._usage: dict[str, int] | None = None
        self._usage_stale = False

    def feed(self, chunk: bytes, now: float) -> None:
        if not chunk:
            return
        self._arrived(len(chunk), now)
        try:
            self._read(self._parser.feed(chunk), now)
        except Exception:  # a bug here must cost a mark, never the stream
            logger.exception("SSE watcher failed on a %s stream; marks may be incomplete", self.api)

    def feed_event(self, data: bytes, now: float) -> None:
        """One event that arrived whole, not as SSE bytes: a WebSocket message whose
        payload is what an SSE event's `data:` would carry (its type inside the JSON)."""
        self._arrived(len(data), now)
        try:
            self._read([Event("", data)], now)
        except Exception:  # as in feed
            logger.exception("SSE watcher failed on a %s event; marks may be incomplete", self.api)

    def _arrived(self, size: int, now: float) -> None:
        self.chunks += 1
        self.bytes += size
        if self._last_chunk is None:
            self.first_byte = now
        elif now - self._last_chunk > self.max_gap:
            self.max_gap = now - self._last_chunk
        self._last_chunk = now

    def _read(self, events: list[Event], now: float) -> None:
        if not events:
            return
        if self.first_event is None:
            self.first_event = now
        self.events += len(events)
        reader = self._reader
        for event in events:
            if reader.is_token(event) if self.first_token is None else reader.looks_like_token(event):
                if self.first_token is None:
                    self.first_token = now
                self.last_token = now
                self.token_events += 1
            reader.observe(event, self)

    @property
    def last_chunk(self) -> float | None:
        """When the latest chunk arrived."""
        return self._last_chunk

    @property
    def at_event_boundary(self) -> bool:
        """The stream so far ends between events (see `SSEParser.at_event_boundary`)."""
        return self._parser.at_event_boundary

    def keep_usage(self, source: str, data: bytes) -> None:
        """Remember the (latest) event of kind `source` that carries usage; decoded on demand."""
        self._usage_events[source] = data
        self._usage_stale = True

    def set_error(self, error: Any) -> None:
        """Record an upstream error object or message; the first one is the cause."""
        if self.error is None:
            self.error = _error_text(error)

    @property
    def usage(self) -> dict[str, int] | None:
        """Usage as the upstream reported it in the stream, normalized (see `usage_from_body`)."""
        if self._usage_stale:
            self._usage_stale = False
            raw: dict[str, Any] = {}
            for source, data in self._usage_events.items():
                part = self._reader.usage(source, _loads(data))
                if isinstance(part, dict):
                    # Later events (message_delta) refine earlier ones (message_start).
                    raw.update((k, v) for k, v in part.items() if v is not None)
            self._usage = self._reader.normalize(raw) if raw else None
        return self._usage


def usage_from_body(api: str, body: object) -> dict[str, int] | None:
    """Usage of a non-streamed response from its parsed JSON body, normalized.

    Keys, each present only when the upstream reported it:
    `input_tokens` (the whole prompt, cached part included), `output_tokens`
    (reasoning included), `cached_tokens` (prompt tokens read from cache),
    `reasoning_tokens`, `cache_creation_tokens` (Anthropic: prompt tokens written to cache).
    """
    reader = _reader(api)
    try:
        raw = reader.body_usage(body)
        return reader.normalize(raw) if isinstance(raw, dict) else None
    except Exception:
        logger.exception("Cannot read usage from a %s body", api)
        return None


# --- assembling answers for display ---------------------------------------------------


def detect_api(events: Iterable[Event]) -> str:
    """Guess the API shape of a stream from its events, for when the request is unknown."""
    for event in events:
        kind = _event_type(event)
        if kind.startswith("response."):
            return "openai.responses"
        if kind in ("message_start", "content_block_start", "content_block_delta"):
            return "anthropic.messages"
        if b'"chat.completion.chunk"' in event.data or b'"choices"' in event.data:
            return "openai.chat"
        if b'"candidates"' in event.data:
            return "gemini"
    return "other"


def transcript(api: str, events: Iterable[Event]) -> Transcript:
    """The assistant's text, reasoning and tool calls, assembled from a stream's events."""
    reader = _reader(api)
    out = Transcript()
    for event in events:
        obj = _loads(event.data)
        if isinstance(obj, dict):
            reader.assemble(obj, _event_type(event), out)
    return out
