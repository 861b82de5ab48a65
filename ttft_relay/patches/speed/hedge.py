"""A request still waiting for its answer's head is sent to a second upstream as well; the
first head wins, the other attempt is closed before any byte of it reaches the client.

mitmproxy 12.3.1 gives each flow one upstream connection (`HttpStream.make_server_connection`
sets `context.server`); nothing in it runs two requests for one flow. What its HTTP layer
does give: it routes what a connection's HTTP client layer reads to the stream whose id that
layer was sent (`HttpLayer.event_to_child`: `ReceiveHttp` by `event.stream_id`, `SendHttp` by
connection), and answers a `GetHttpConnection` to whatever `command_sources` names for it
(`HttpLayer.get_connection`, as `early_connects` uses it). `race` hands the flow's HTTP layer
a `Race` (through the `layer_events` seam), whose handler registers a `_Second` under an id
no stream has (the negative of the flow's) and asks the layer for a new connection to the
second upstream (never one open: the first attempt's may match it); once it is there, the request (the copy `Race.request`, already aimed and keyed for
that upstream) goes on it under that id. The first attempt goes on untouched.

What the second connection reads reaches the `_Second`. Its response head, while the flow has
none (`HttpStream.state_wait_for_response_headers` sets `flow.response` before anything
else): the second wins. The first connection's layer is replaced by a sink (whatever it still
reads goes nowhere) and closed, the stream's `context.server` and the flow's `server_conn`
become the second's, and from then on every event of the second connection goes to the flow's
stream, under the flow's id, as the first's went (`HttpStream._handle_event` never reads an
event's stream id), with the commands the stream answers. A head the first connection
brought arrives while the second is still waiting: the first won, and `lose_second` (the
`responseheaders` hook, before the head is sent on) closes the second; its close, and anything
it read, goes nowhere. A second attempt that fails before its head ends the race quietly (one
whose connection failed, nothing of it sent, is told to `Race.unconnected`); a
first attempt that fails before its head while the second is in flight is dropped
(`first_failed`, from the group's failover): the second is then the flow's only attempt, its
head or its failure the flow's. An HTTP/2 second
connection that loses is left to finish (closing it would end its other streams): its events
go nowhere.

A streamed HTTP/1 response that came on the second connection takes mitmproxy's path (`splice`
finds no `HttpStream` under its id); one that came on the first is spliced as any.
"""

from __future__ import annotations

import dataclasses
import logging
import weakref
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import Any

from mitmproxy import connection, http
from mitmproxy.proxy import commands, events, layer
from mitmproxy.proxy.layers.http import (
    ErrorCode,
    GetHttpConnection,
    GetHttpConnectionCompleted,
    HttpLayer,
    HttpStream,
    RequestData,
    RequestEndOfMessage,
    RequestHeaders,
    ResponseEndOfMessage,
    ResponseHeaders,
    ResponseProtocolError,
    SendHttp,
)

from .. import connections, layer_events

logger = logging.getLogger(__name__)

USES = (layer_events, connections)
PINS = {
    # how the layer answers a connection request (to its command source) and routes the
    # second connection's events to the id it was sent, and the stream's commands back
    "HttpLayer.get_connection": (HttpLayer.get_connection, "1aa1c63e3175766c"),
    "HttpLayer.event_to_child": (HttpLayer.event_to_child, "1095f6e1581d1780"),
    # a head sets flow.response first; events reach the states whatever their stream id
    "HttpStream.state_wait_for_response_headers": (HttpStream.state_wait_for_response_headers, "10e32e91b2948164"),
    "HttpStream._handle_event": (HttpStream._handle_event, "e3cbfef7310ae81f"),
}

Won = Callable[[http.HTTPFlow], None]
Unconnected = Callable[[http.HTTPFlow, str], None]


@dataclass
class Race(layer_events.FlowEvent):
    """Send `request` (aimed and keyed for the second upstream) as well; `won(flow)` runs,
    inside the layer, when the second's head comes first (before the stream sees it);
    `unconnected(flow, why)` when the second's connection failed (nothing of it was sent)."""

    request: http.Request | None = None
    won: Won | None = None
    unconnected: Unconnected | None = None


class _Second:
    """The second attempt: stands under its own id in the HTTP layer's streams, and is the
    source of its connection request and of the commands the flow's stream answers its events with."""

    def __init__(self, http_layer: HttpLayer, stream: HttpStream, race: Race) -> None:
        self.http = http_layer
        self.stream = stream  # not `flow`: layer_events.stream_of and the upstream pool read that
        self.race = race
        self.id = -stream.stream_id
        self.ask: GetHttpConnection | None = None
        self.server: connection.Server | None = None
        self.state = "racing"
        """"racing", "won" (its events are the stream's), or "lost" (they go nowhere)."""
        self.first_failed = False
        """The first attempt failed before its head while this one was racing: this one is all there is."""

    def start(self) -> layer.CommandGenerator[None]:
        request = self.race.request
        assert request is not None
        self.ask = GetHttpConnection((request.host, request.port), request.scheme == "https",
                                     self.stream.flow.server_conn.via, self.stream.flow.server_conn.transport_protocol)
        self.http.streams[self.id] = self  # type: ignore[assignment]
        self.http.command_sources[self.ask] = self  # type: ignore[assignment]
        # A connection of its own: the first attempt's may match the address (two keys of one host).
        yield from self.http.get_connection(self.ask, reuse=False)

    def handle_event(self, event: events.Event) -> Iterator[commands.Command]:
        if isinstance(event, GetHttpConnectionCompleted) and event.command is self.ask:
            return self._connected(event)
        if self.state == "won":
            return self._forward(event)
        if self.state == "racing" and isinstance(event, ResponseHeaders) and _still_waiting(self.stream):
            return self._win(event)
        if self.state == "racing" and self.first_failed and isinstance(event, ResponseProtocolError):
            self.state = "won"  # the only attempt left: its failure is the flow's
            self.stream.context.server = self.stream.flow.server_conn = self.server or self.stream.context.server
            return self._forward(event)
        if self.state == "racing":
            # A head after the first's (lose_second closes this one), or a failure before its head.
            self.lose()
        return iter(())

    def _forward(self, event: events.Event) -> Iterator[commands.Command]:
        """An event of the second connection (or the completion of a command the stream
        answered one with), to the flow's stream as the first connection's would go."""
        if isinstance(event, events.CommandCompleted):
            return self.stream.handle_event(event)
        if isinstance(event, (ResponseEndOfMessage, ResponseProtocolError)):
            self.http.streams.pop(self.id, None)  # its last event: the connection may serve the next request
            _racing.pop(self.stream.flow, None)  # it holds the flow: a weak key alone would never go
        return self.stream.handle_event(dataclasses.replace(event, stream_id=self.stream.stream_id))  # type: ignore[type-var]

    def _connected(self, event: GetHttpConnectionCompleted) -> layer.CommandGenerator[None]:
        server, err = event.reply
        if err or not isinstance(server, connection.Server):
            if self.race.unconnected is not None:
                self.race.unconnected(self.stream.flow, str(err or "no connection"))
            if self.first_failed and self.state == "racing":
                self.state = "won"  # the only attempt left: its failure is the flow's
                yield from self.stream.handle_event(
                    ResponseProtocolError(self.stream.stream_id, err or "no connection", ErrorCode.CONNECT_FAILED))
                return
            self.lose()
            return
        self.server = server
        if self.state != "racing":
            yield from self._close(server)
            return
        request = self.race.request
        assert request is not None
        content = request.raw_content or b""
        yield SendHttp(RequestHeaders(self.id, request, not content), server)
        if content:
            yield SendHttp(RequestData(self.id, content), server)
        yield SendHttp(RequestEndOfMessage(self.id), server)

    def _win(self, head: ResponseHeaders) -> layer.CommandGenerator[None]:
        assert self.server is not None
        self.state = "won"
        first = self.stream.context.server
        self.http.connections[first] = _Sink()  # type: ignore[assignment]
        if first.connected:  # not where it failed already (`first_failed`)
            yield commands.CloseConnection(first)
        self.stream.context.server = self.stream.flow.server_conn = self.server
        if self.race.won is not None:
            self.race.won(self.stream.flow)
        yield from self.stream.handle_event(dataclasses.replace(head, stream_id=self.stream.stream_id))

    def lose(self) -> None:
        """The first attempt goes on alone: whatever comes of this one goes nowhere."""
        if self.state != "racing":
            return
        self.state = "lost"
        self.http.streams.pop(self.id, None)
        _racing.pop(self.stream.flow, None)
        if self.server is not None and self.server.alpn != b"h2":
            self.http.connections[self.server] = _Sink()  # type: ignore[assignment]
            connections.close(self.http.context.client, self.server)

    def _close(self, server: connection.Server) -> layer.CommandGenerator[None]:
        if server.alpn != b"h2":
            self.http.connections[server] = _Sink()  # type: ignore[assignment]
            yield commands.CloseConnection(server)


class _Sink:
    """Where a closed loser's connection events go: nowhere."""

    def handle_event(self, event: events.Event) -> Iterator[Any]:
        return iter(())


_racing: weakref.WeakKeyDictionary[http.HTTPFlow, _Second] = weakref.WeakKeyDictionary()


def _still_waiting(stream: HttpStream) -> bool:
    flow = stream.flow
    return (flow.response is None and flow.error is None and flow.live
            and stream.server_state == stream.state_wait_for_response_headers)


def install() -> None:
    layer_events.handle(Race, _race)


def uninstall() -> None:
    layer_events.unhandle(Race)
    _racing.clear()


def installed() -> bool:
    return layer_events.handled(Race)


def race(handler: Any, flow: http.HTTPFlow, request: http.Request, won: Won,
         then: Callable[[bool], object] | None = None, unconnected: Unconnected | None = None) -> None:
    """Send `request` (a copy of the flow's, aimed and keyed for another upstream) as well,
    through `handler` (the flow's client connection handler); `won(flow)` if its head comes
    first; `then(started)` once the layer had it; `unconnected(flow, why)` if its connection
    failed (in the layer: it may not raise)."""
    layer_events.hand(handler, Race(flow, request=request, won=won, unconnected=unconnected), then)


def racing(flow: http.HTTPFlow) -> bool:
    """Whether a second attempt of `flow` is still in flight, its head not come."""
    second = _racing.get(flow)
    return second is not None and second.state == "racing"


def lose_second(flow: http.HTTPFlow) -> None:
    """From `responseheaders` of the first attempt's head: the second attempt is closed, and
    nothing of it reaches the client."""
    if (second := _racing.get(flow)) is not None:
        second.lose()


def forget(flow: http.HTTPFlow) -> None:
    """From the flow's record: whatever became of its second attempt, the flow is no longer
    kept for it (the `_Second` holds its flow, so the weak key alone would keep it for good)."""
    _racing.pop(flow, None)


def first_failed(flow: http.HTTPFlow) -> bool:
    """From the first attempt's failure before its head (`error_replies.instead_of_errors`):
    True if a second attempt is racing, which then is the flow's only one (its head, or its
    failure, is the flow's); the first's failure is then to be dropped."""
    second = _racing.get(flow)
    if second is None or second.state != "racing":
        return False
    second.first_failed = True
    return True


def _race(self: HttpLayer, event: Race) -> layer.CommandGenerator[None]:
    stream = layer_events.stream_of(self, event.flow)
    if stream is None or event.request is None or not _still_waiting(stream) or event.flow in _racing \
            or -stream.stream_id in self.streams:
        return
    event.done = True
    second = _racing[event.flow] = _Second(self, stream, event)
    yield from second.start()
