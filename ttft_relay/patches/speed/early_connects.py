"""A request's upstream connect starts once its head is accepted, while its body uploads.

A keyed listener connects upstream only after a request's hooks (no client gets an
upstream connection before its key is checked: `fixes.eager_connects`), and so does the
upstream pool's when no connection is at hand: the first request of each client connection
paid the upstream connect and TLS handshake after its whole body had arrived. `connect_early`
hands the flow's HTTP layer a `ConnectEarly` (through the `layer_events` seam), which asks
the layer for the flow's connection as the flow itself will (`HttpLayer.get_connection`,
the address, TLS and proxy `make_server_connection` asks for) with a sink that ignores the
answer: the connect runs while the body uploads, and the flow's own request finds it open or
opening. An HTTP/2 client's streams share an HTTP/2 upstream connection but each take an
HTTP/1 one of their own: for them only the first stream of a client connection to an HTTPS
upstream connects early (ALPN may give HTTP/2), and an upstream that answers with HTTP/1
leaves that one connection unused. Off, the connect starts after the request hooks.
"""

from __future__ import annotations

import weakref
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

from mitmproxy import http
from mitmproxy.proxy import events, layer
from mitmproxy.proxy.layers.http import GetHttpConnection, HttpLayer, HttpStream

from .. import layer_events
from ..users import Users

USES = (layer_events,)
PINS = {
    # the request a flow makes for its connection, and how the layer answers it (an open
    # one reused, one opening waited for, the answer to its source)
    "HttpStream.make_server_connection": (HttpStream.make_server_connection, "ddc7bc72f4d2fbc7"),
    "HttpLayer.get_connection": (HttpLayer.get_connection, "1aa1c63e3175766c"),
    "HttpLayer.register_connection": (HttpLayer.register_connection, "deed6282affc431f"),
}


@dataclass
class ConnectEarly(layer_events.FlowEvent):
    """Open (or find) the upstream connection the flow's request will take."""


_users = Users()
_connecting: weakref.WeakSet[http.HTTPFlow] = weakref.WeakSet()
"""Flows whose ConnectEarly was handed."""


def install(by: str) -> None:
    """Early connects for `by` (the relay keys, the upstream pool): on while anyone asks."""
    _users.add(by)
    layer_events.handle(ConnectEarly, _connect)


def uninstall(by: str | None = None) -> None:
    """Off for `by` (None: for everyone)."""
    if _users.release(by):
        layer_events.unhandle(ConnectEarly)


def installed() -> bool:
    return layer_events.handled(ConnectEarly)


def connect_early(handler: Any, flow: http.HTTPFlow) -> None:
    """From `requestheaders`: open `flow`'s upstream connection now, through `handler` (its
    client connection's handler). Once per flow (the relay keys and the upstream pool both
    ask); nothing where early connects are off."""
    if not installed() or flow in _connecting:
        return
    _connecting.add(flow)
    layer_events.hand(handler, ConnectEarly(flow))


class _Ignore:
    """Where the answer to an early connect goes: nowhere (the flow asks again). It names
    the flow it asked for, as the flow's own `HttpStream` would (the upstream pool reads it)."""

    def __init__(self, flow: http.HTTPFlow) -> None:
        self.flow = flow

    def handle_event(self, event: events.Event) -> Iterator[Any]:
        return iter(())


def _connect(self: HttpLayer, event: ConnectEarly) -> layer.CommandGenerator[None]:
    flow, request = event.flow, event.flow.request
    if layer_events.stream_of(self, flow) is None or flow.response is not None or flow.error is not None:
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
