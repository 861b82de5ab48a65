"""Events the relay hands mitmproxy's HTTP layer, for what no hook can ask of it.

mitmproxy has no event for "cancel this flow's upstream request" or "open this flow's
upstream connection now". The wrap of `HttpLayer._handle_event` adds both; the
connection handler passes them down its layers like any event (`handler.server_event`),
and each reports whether the HTTP layer holding the flow did it (`done`). Any other
layer's HTTP layer (a tunnel's, in regular mode) leaves them undone.

1. `ResetUpstreamStream`: a relay deadline on one HTTP/2 upstream stream resets that
   stream, not the connection. The flows of one client connection share one HTTP/2
   upstream connection, and closing it (all an addon could do) cut the healthy
   siblings of the stream at fault. The HTTP layer sends the upstream side a
   `RequestProtocolError` for the flow's stream (as for a client that cancels:
   `Http2Client` answers it with RST_STREAM CANCEL) and the stream a
   `ResponseProtocolError` with the reason (as for an upstream failure: the `error`
   hook, then the client's reply). Only for a stream not waiting on a hook, on an
   established HTTP/2 connection; otherwise undone, and the caller closes the
   connection.

2. `ConnectEarly`: a keyed listener connects upstream only after a request's hooks
   (no client gets an upstream connection before its key is checked), so the first
   request of each client connection paid the upstream connect and TLS handshake
   after its whole body had arrived. Once the key on the head is accepted, this
   event asks the HTTP layer for the flow's connection as the flow itself will
   (`HttpLayer.get_connection`, the address, TLS and proxy `make_server_connection`
   asks for) with a sink that ignores the answer: the connect runs while the body
   uploads, and the flow's own request finds it open or opening. An HTTP/2 client's
   streams share an HTTP/2 upstream connection but each take an HTTP/1 one of their
   own: for them only the first stream of a client connection to an HTTPS upstream
   connects early (ALPN may give HTTP/2), and an upstream that answers with HTTP/1
   leaves that one connection unused.
"""

from __future__ import annotations

import asyncio
import weakref
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import Any

from mitmproxy import http
from mitmproxy.proxy import events, layer
from mitmproxy.proxy.layers.http import GetHttpConnection, HttpLayer, HttpStream
from mitmproxy.proxy.layers.http._events import ErrorCode, RequestProtocolError, ResponseProtocolError

_ORIGINAL_HANDLE_EVENT = HttpLayer._handle_event
ORIGINALS = {(HttpLayer, "_handle_event"): _ORIGINAL_HANDLE_EVENT}


@dataclass
class FlowEvent(events.Event):
    flow: http.HTTPFlow
    done: bool = False
    """Set by the HTTP layer that did what the event asks."""


@dataclass
class ResetUpstreamStream(FlowEvent):
    """End the flow's upstream stream, the flow failing with `reason`."""

    reason: str = ""


@dataclass
class ConnectEarly(FlowEvent):
    """Open (or find) the upstream connection the flow's request will take."""


def install() -> None:
    HttpLayer._handle_event = _handle_event  # type: ignore[method-assign]


def uninstall() -> None:
    HttpLayer._handle_event = _ORIGINAL_HANDLE_EVENT  # type: ignore[method-assign]


_connecting: weakref.WeakSet[http.HTTPFlow] = weakref.WeakSet()
"""Flows whose ConnectEarly was handed."""
_handing: set[asyncio.Future[None]] = set()
"""Events on their way (a task holds each until the HTTP layer had it)."""


def hand(handler: Any, event: FlowEvent, then: Callable[[bool], object] | None = None) -> None:
    """Hand `event` to the HTTP layer of `handler` (the flow's client connection
    handler) as soon as it takes events; `then(event.done)` once it had it. A flow's
    `ConnectEarly` is handed once (the relay keys and the upstream pool both ask)."""
    if isinstance(event, ConnectEarly):
        if event.flow in _connecting:
            return
        _connecting.add(event.flow)
    install()
    task = asyncio.ensure_future(_hand(handler, event, then))
    _handing.add(task)
    task.add_done_callback(_handing.discard)


async def _hand(handler: Any, event: FlowEvent, then: Callable[[bool], object] | None) -> None:
    await handler.server_event(event)
    if then is not None:
        then(event.done)


def _handle_event(self: HttpLayer, event: events.Event) -> layer.CommandGenerator[None]:
    if isinstance(event, ResetUpstreamStream):
        yield from _reset(self, event)
    elif isinstance(event, ConnectEarly):
        yield from _connect(self, event)
    else:
        return (yield from _ORIGINAL_HANDLE_EVENT(self, event))
    return None


def _stream_of(http_layer: HttpLayer, flow: http.HTTPFlow) -> HttpStream | None:
    return next((s for s in http_layer.streams.values() if getattr(s, "flow", None) is flow), None)


def _reset(self: HttpLayer, event: ResetUpstreamStream) -> layer.CommandGenerator[None]:
    flow = event.flow
    upstream = self.connections.get(flow.server_conn)
    stream = _stream_of(self, flow)
    if stream is None or stream._paused is not None or upstream is None or flow.server_conn.alpn != b"h2":
        return  # not here, waiting on a hook, or not HTTP/2
    event.done = True
    yield from self.event_to_child(upstream, RequestProtocolError(stream.stream_id, event.reason, ErrorCode.CANCEL))
    yield from self.event_to_child(
        stream, ResponseProtocolError(stream.stream_id, event.reason, ErrorCode.GENERIC_SERVER_ERROR)
    )


class _Ignore:
    """Where the answer to an early connect goes: nowhere (the flow asks again). It names
    the flow it asked for, as the flow's own `HttpStream` would (the upstream pool reads it)."""

    def __init__(self, flow: http.HTTPFlow) -> None:
        self.flow = flow

    def handle_event(self, event: events.Event) -> Iterator[Any]:
        return iter(())


def _connect(self: HttpLayer, event: ConnectEarly) -> layer.CommandGenerator[None]:
    flow, request = event.flow, event.flow.request
    if _stream_of(self, flow) is None or flow.response is not None or flow.error is not None:
        return  # not here, or answered by the relay meanwhile
    ask = GetHttpConnection(
        (request.host, request.port),
        request.scheme == "https",
        flow.server_conn.via,
        flow.server_conn.transport_protocol,
    )
    if self.context.client.alpn not in (None, b"", b"http/1.1") and (
        not ask.tls or any(ask.connection_spec_matches(c) for c in self.connections)
    ):
        return  # HTTP/2 (or 3) client: only the first stream, only if HTTP/2 may come
    event.done = True
    self.command_sources[ask] = _Ignore(flow)  # type: ignore[assignment]
    yield from self.get_connection(ask)
