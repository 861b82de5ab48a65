"""Server-sent events: an incremental parser and per-API stream watchers (pure, sans-IO).

Bytes in, values out; nothing here does I/O or reads a clock, so everything can be
tested by feeding chunks.

- `SSEParser` turns chunks of an `text/event-stream` body into `Event`s, per the
  WHATWG event-stream rules, wherever the chunks happen to split.
- `StreamWatcher` is fed every chunk of a response body by the stream callable and
  keeps the marks of the stream (first byte, first event, first token, last token),
  the longest silence between chunks, the usage and any in-stream error the upstream
  reported. What counts as a token, as usage, as an error or as the end depends on
  the API: its reader says (`Api.reader`, `ttft_relay/apis/reader.py`), which also reads
  the same usage from a non-streamed JSON answer (`Reader.usage_from_body`).
- `transcript` assembles the assistant's answer from events, for the event-stream
  contentview.

The watcher sits on the hot path, so it decodes an event's JSON only while that can
still change something: before the first token, and for the few events that may
carry an error. After the first token a byte-level check decides whether an event
is a token, and usage is kept as the raw bytes of the event that carried it and
decoded only when someone reads `StreamWatcher.usage`.
"""

from __future__ import annotations

import logging
from collections.abc import Iterable
from typing import Any

from ..apis.api import Api
from ..apis.reader import Event, Transcript, error_text, loads, type_of

logger = logging.getLogger(__name__)

DEFAULT_MAX_EVENT_BYTES = 4 * 1024 * 1024
"""Cap on the data of one event (and on one line). Generous because OpenAI's
`response.completed` repeats the whole answer; anything larger is truncated."""

_BOM = b"\xef\xbb\xbf"


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


# --- the watcher ---------------------------------------------------------------------


class StreamWatcher:
    """Watches one streamed response body and keeps its marks, usage, error and end.

    The stream callable calls `feed(chunk, time.time())` for every chunk; the bytes
    themselves go on to the client untouched. Times are absolute, as passed in.
    Never raises: whatever the upstream sends, the stream must pass. What the other
    floors read of it is `reader.Watcher`.
    """

    def __init__(self, api: Api, max_event_bytes: int = DEFAULT_MAX_EVENT_BYTES) -> None:
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
        self.longest_gap: float | None = None
        """When that longest silence began (the chunk before it arrived)."""
        self.token_events = 0
        """Events that carried visible output (not tokens: an event may hold several)."""
        self.error: str | None = None
        """The first in-stream error the upstream reported, as "type: message"."""
        self.done = False
        """The API's terminal event was seen: the stream ended as designed."""
        self.response_id: str | None = None
        """The upstream's id of the response being streamed (Responses API), once seen."""
        self._reader = api.reader
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
            logger.exception("SSE watcher failed on a %s stream; marks may be incomplete", self.api.name)

    def feed_event(self, data: bytes, now: float) -> None:
        """One event that arrived whole, not as SSE bytes: a WebSocket message whose
        payload is what an SSE event's `data:` would carry (its type inside the JSON)."""
        self._arrived(len(data), now)
        try:
            self._read([Event("", data)], now)
        except Exception:  # as in feed
            logger.exception("SSE watcher failed on a %s event; marks may be incomplete", self.api.name)

    def _arrived(self, size: int, now: float) -> None:
        self.chunks += 1
        self.bytes += size
        if self._last_chunk is None:
            self.first_byte = now
        elif now - self._last_chunk > self.max_gap:
            self.max_gap = now - self._last_chunk
            self.longest_gap = self._last_chunk
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
            self.error = error_text(error)

    @property
    def usage(self) -> dict[str, int] | None:
        """Usage as the upstream reported it in the stream, normalized (see `Reader.usage_from_body`)."""
        if self._usage_stale:
            self._usage_stale = False
            raw: dict[str, Any] = {}
            for source, data in self._usage_events.items():
                part = self._reader.usage(source, loads(data))
                if isinstance(part, dict):
                    # Later events (message_delta) refine earlier ones (message_start).
                    raw.update((k, v) for k, v in part.items() if v is not None)
            self._usage = self._reader.normalize(raw) if raw else None
        return self._usage


# --- assembling answers for display ---------------------------------------------------


def transcript(api: Api, events: Iterable[Event]) -> Transcript:
    """The assistant's text, reasoning and tool calls, assembled from a stream's events."""
    reader = api.reader
    out = Transcript()
    for event in events:
        obj = loads(event.data)
        if isinstance(obj, dict):
            reader.assemble(obj, type_of(event), out)
    return out
