"""A relay deadline on one HTTP/2 upstream stream resets that stream, not the connection its siblings share.

The flows of one client connection share one HTTP/2 upstream connection, and closing it
(all an addon could do) cut the healthy siblings of the stream at fault. `reset` hands the
flow's HTTP layer a `ResetUpstreamStream` (through the `layer_events` seam): the layer sends
the upstream side a `RequestProtocolError` for the flow's stream (as for a client that
cancels: `Http2Client` answers it with RST_STREAM CANCEL) and the stream a
`ResponseProtocolError` with the reason (as for an upstream failure: the `error` hook, then
the client's reply). Only for a stream not waiting on a hook, on an established HTTP/2
connection; otherwise undone, and the caller closes the connection (`faults.Deadlines`).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from mitmproxy import http
from mitmproxy.proxy import layer
from mitmproxy.proxy.layers.http import HttpStream
from mitmproxy.proxy.layers.http._events import ErrorCode, RequestProtocolError, ResponseProtocolError
from mitmproxy.proxy.layers.http._http2 import Http2Client, Http2Connection

from .. import layer_events

USES = (layer_events,)
PINS = {
    # the upstream side: our stream id mapped to the connection's, then RST_STREAM
    "Http2Client._handle_event": (Http2Client._handle_event, "02de05a5b89f087b"),
    "Http2Connection._handle_event": (Http2Connection._handle_event, "7fc814a8a507f234"),
    # the stream: the error hook, then the client's reply
    "HttpStream.handle_protocol_error": (HttpStream.handle_protocol_error, "59fc3b2eeeabf63a"),
}
WITHOUT = ("a deadline on an HTTP/2 upstream stream closes its whole upstream connection: the other "
           "requests on it fail too, their records saying the relay cut them")


@dataclass
class ResetUpstreamStream(layer_events.FlowEvent):
    """End the flow's upstream stream, the flow failing with `reason`."""

    reason: str = ""


def install() -> None:
    layer_events.handle(ResetUpstreamStream, _reset)


def uninstall() -> None:
    layer_events.unhandle(ResetUpstreamStream)


def installed() -> bool:
    return layer_events.handled(ResetUpstreamStream)


def reset(handler: Any, flow: http.HTTPFlow, reason: str, then: Callable[[bool], object]) -> None:
    """Reset `flow`'s HTTP/2 upstream stream, failing it with `reason`; `then(done)` once
    its HTTP layer had the event (done False: not reset, the caller closes the connection)."""
    layer_events.hand(handler, ResetUpstreamStream(flow, reason=reason), then)


def _reset(self: Any, event: ResetUpstreamStream) -> layer.CommandGenerator[None]:
    flow = event.flow
    upstream = self.connections.get(flow.server_conn)
    stream = layer_events.stream_of(self, flow)
    if stream is None or stream._paused is not None or upstream is None or flow.server_conn.alpn != b"h2":
        return  # not here, waiting on a hook, or not HTTP/2
    event.done = True
    yield from self.event_to_child(upstream, RequestProtocolError(stream.stream_id, event.reason, ErrorCode.CANCEL))
    yield from self.event_to_child(
        stream, ResponseProtocolError(stream.stream_id, event.reason, ErrorCode.GENERIC_SERVER_ERROR)
    )
