"""A relay deadline on one HTTP/2 upstream stream resets that stream, not the connection.

With an HTTP/2 upstream, the flows of one client connection share one upstream
connection. The only way an addon has to end a flow's wait on the upstream is to close
that connection (the HTTP layer then fails every flow on it): a deadline passing on one
stream cut its healthy siblings. mitmproxy has no event for "cancel this flow"; the
wrap of `HttpLayer._handle_event` adds one, `ResetUpstreamStream`, which the connection
handler passes down its layers like any event. The HTTP layer holding the flow's
stream sends the upstream side a `RequestProtocolError` for that stream (as for a
client that cancels: `Http2Client` answers it with RST_STREAM CANCEL on the upstream
stream) and the stream a `ResponseProtocolError` with the reason (as for an upstream
failure: the `error` hook, then the client's reply). Only for a stream that is not
waiting on a hook, on an established HTTP/2 upstream connection; otherwise the event
does nothing and says so (`done` stays False): a caller then closes the connection.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from mitmproxy import http
from mitmproxy.proxy import events, layer
from mitmproxy.proxy.layers.http import HttpLayer
from mitmproxy.proxy.layers.http._events import ErrorCode, RequestProtocolError, ResponseProtocolError

_ORIGINAL_HANDLE_EVENT = HttpLayer._handle_event
ORIGINALS = {(HttpLayer, "_handle_event"): _ORIGINAL_HANDLE_EVENT}


@dataclass
class ResetUpstreamStream(events.Event):
    """End `flow`'s upstream stream with `reason` as its error; `done` once it did."""

    flow: http.HTTPFlow
    reason: str
    done: bool = False


def install() -> None:
    HttpLayer._handle_event = _handle_event  # type: ignore[method-assign]


def uninstall() -> None:
    HttpLayer._handle_event = _ORIGINAL_HANDLE_EVENT  # type: ignore[method-assign]


async def reset_upstream_stream(handler: Any, flow: http.HTTPFlow, reason: str) -> bool:
    """Through `handler` (the flow's client connection handler): reset `flow`'s
    upstream stream and fail the flow with `reason`. False if it could not."""
    install()
    event = ResetUpstreamStream(flow, reason)
    await handler.server_event(event)
    return event.done


def _handle_event(self: HttpLayer, event: events.Event) -> layer.CommandGenerator[None]:
    if not isinstance(event, ResetUpstreamStream):
        return (yield from _ORIGINAL_HANDLE_EVENT(self, event))
    flow = event.flow
    upstream = self.connections.get(flow.server_conn)
    stream = next((s for s in self.streams.values() if getattr(s, "flow", None) is flow), None)
    if stream is None or stream._paused is not None or upstream is None or flow.server_conn.alpn != b"h2":
        return None  # not here (a tunnel's own HTTP layer), waiting on a hook, or not HTTP/2
    event.done = True
    yield from self.event_to_child(upstream, RequestProtocolError(stream.stream_id, event.reason, ErrorCode.CANCEL))
    yield from self.event_to_child(
        stream, ResponseProtocolError(stream.stream_id, event.reason, ErrorCode.GENERIC_SERVER_ERROR)
    )
    return None
