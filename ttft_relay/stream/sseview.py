"""A mitmproxy / mitmweb contentview for `text/event-stream` bodies.

Shows one event per line (`event: {compact JSON data}`), then the assistant's answer
assembled from the deltas: text, reasoning and tool calls, for OpenAI chat
completions, OpenAI Responses, Anthropic Messages and Gemini. mitmproxy 12.3 ships
no event-stream view, and a raw stream of deltas is unreadable.

For a stream the relay passed on (while it holds the flow: arrival times are not
saved with it), each line starts with the event's arrival in ms since the request
head reached the relay, from the stream tap's `arrivals`.

Add `SSEView()` to the addon list to make the view available.
"""

from __future__ import annotations

import orjson
from mitmproxy import contentviews
from mitmproxy import http
from mitmproxy.addonmanager import Loader
from mitmproxy.contentviews import Contentview
from mitmproxy.contentviews import Metadata

from .. import apis
from ..apis.api import Api
from ttft_relay.stream import sse
from ttft_relay.stream import streaming

_SSE_FIELD_STARTS = (b"data:", b"event:", b":", b"id:", b"retry:")


def _event_line(event: sse.Event) -> str:
    """One line for one event: its name, then its data as compact JSON when it is JSON."""
    try:
        data = orjson.dumps(orjson.loads(event.data)).decode()
    except ValueError:  # not JSON (e.g. [DONE]), or not UTF-8
        data = event.data.decode("utf-8", "backslashreplace").replace("\n", "\\n")
    if event.truncated:
        data += " …(truncated)"
    return f"{event.event}: {data}" if event.event else data


def _api_of(metadata: Metadata, events: list[sse.Event]) -> Api:
    """The API by the request path if the flow is known, else guessed from the events (the
    view shows flows scope never saw too: out of scope, loaded from a file)."""
    if isinstance(metadata.flow, http.HTTPFlow):
        api = apis.for_path(metadata.flow.request.path)
        if api is not apis.OTHER_API:
            return api
    return apis.for_events(events)


def _transcript_lines(api: Api, events: list[sse.Event]) -> list[str]:
    answer = sse.transcript(api, events)
    lines = []
    if answer.reasoning:
        lines += ["── reasoning ──", answer.reasoning]
    if answer.text:
        lines += ["── assistant ──", answer.text]
    for call in answer.tool_calls:
        handle = f" ({call.id})" if call.id else ""
        lines += [f"── tool call {call.name}{handle} ──", call.arguments]
    return lines


def timed_events(data: bytes, flow: object) -> list[tuple[float | None, sse.Event]]:
    """The events of `data`, each with its arrival in ms since the request head, or
    None where the relay's stream tap did not time the chunk that completed it."""
    parser = sse.SSEParser()
    out: list[tuple[float | None, sse.Event]] = []
    start = 0
    tap = flow.response.stream if isinstance(flow, http.HTTPFlow) and flow.response else None
    if isinstance(tap, streaming.StreamTap) and isinstance(flow, http.HTTPFlow) and data.startswith(tap.view):
        t0 = flow.request.timestamp_start
        for i in range(0, len(tap.arrivals), 2):
            end = int(tap.arrivals[i])
            ms = (tap.arrivals[i + 1] - t0) * 1000
            out += [(ms, e) for e in parser.feed(data[start:end])]
            start = end
    # A stored streamed body may be cut short: end it so its last event still shows.
    out += [(None, e) for e in parser.feed(data[start:]) + parser.feed(b"\n\n")]
    return out


class EventStreamContentview(Contentview):
    """Server-sent events, one per line (with arrival times where known), and the
    assembled answer of an LLM stream."""

    name = "Event stream"

    def prettify(self, data: bytes, metadata: Metadata) -> str:
        timed = timed_events(data, metadata.flow)
        events = [e for _, e in timed]
        if any(ms is not None for ms, _ in timed):
            lines = [("" if ms is None else f"+{ms:.1f} ms").rjust(12) + "  " + _event_line(e) for ms, e in timed]
        else:
            lines = [_event_line(e) for e in events]
        api = _api_of(metadata, events)
        if answer := _transcript_lines(api, events):
            lines += ["", f"═══ {api.name}: {len(events)} events ═══", *answer]
        return "\n".join(lines)

    def render_priority(self, data: bytes, metadata: Metadata) -> float:
        if metadata.content_type == "text/event-stream":
            return 2  # above every built-in view, JSON included
        if data.lstrip(b"\xef\xbb\xbf").startswith(_SSE_FIELD_STARTS):
            return 0.5  # looks like SSE without saying so: better than raw (0.1)
        return -1


event_stream_view = EventStreamContentview()


class SSEView:
    """Addon: registers the event-stream contentview when loaded.

    mitmproxy 12.3 has no public way to unregister a contentview; registering again
    (a script reload) replaces the view of the same name.
    """

    def load(self, loader: Loader) -> None:
        contentviews.add(event_stream_view)
