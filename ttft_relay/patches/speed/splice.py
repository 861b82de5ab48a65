"""A streamed HTTP/1 response body goes from the upstream's reader to the client's
framing in one step, instead of through mitmproxy's per-chunk event routing.

mitmproxy 12.3.1 (pinned, `tests/patches/speed/test_splice.py`) hands every chunk of a streamed
body through five layers of command generators: `Http1Client.read_body` yields
`ReceiveHttp(ResponseData)`, which `HttpLayer.event_to_child` routes to the flow's
`HttpStream` (`state_stream_response_body`: the stream callable, then
`SendHttp(ResponseData)` to the client), which `HttpLayer` routes to the client's
`Http1Server.send` (the chunked framing, after reading the response's
`transfer-encoding` header again), which yields `SendData`. Under a py-spy profile of
long streams that walk was about a third of the relay's event-loop time.

The wrap of `Http1Client.read_body` does the same for each chunk directly, while
the flow is exactly where mitmproxy would do it: its `HttpStream` is in
`state_stream_response_body`, neither it nor the client's `Http1Server` is paused
or debugging, and the client side is HTTP/1 (an HTTP/2 client keeps mitmproxy's
path). It calls the flow's stream callable, keeps `store_streamed_bodies`, frames
each chunk as `Http1Server.send` does, and yields the `SendData` that path would
have yielded, so the client's TLS layer (if any) and the connection handler see
the same commands in the same order. Everything that is not a body chunk — the end
of the body, protocol errors, trailers — and every chunk while the flow is not in
that state takes mitmproxy's path unchanged: keep-alive, close, the response hook
and errors stay mitmproxy's.

Chunks that arrive in one read reach the client in one `SendData` (one send, their
framing unchanged): data already received is never held back for more.

**Direct reads** (`install(direct=True)`, the second stage): once a spliced body is
chunked, each of its two connections is plain TCP or TLS (mitmproxy's TLS layer on it,
nothing else), and everything read so far has been parsed, the upstream's reads skip
mitmproxy altogether. `_DirectReads` stands in for the upstream transport's asyncio
protocol (mitmproxy's `StreamReaderProtocol`, whose reader feeds
`ConnectionHandler.handle_connection`): each read is decoded where it arrives (`stream.chunked.ChunkedData`, which takes h11's
`ChunkedReader` state over and yields the pieces h11 would for the same bytes), tapped
and framed by the same `_Route.forward`, and written to the client's transport. The
bytes the client decodes are the same; where its chunks begin may differ from
mitmproxy's path, which frames every piece it reads as one chunk: asyncio hands this
protocol reads of up to 256 KiB where mitmproxy's reader takes 64 KiB at a time, and
over TLS a piece ends with its TLS record. The wake-up of the reader's
task, `server_event`'s lock, the layers, h11 and `drain_writers` are not paid per read;
what they do for a body read is done here: the connection's inactivity watchdog is
told, and upstream reads wait while the client's write buffer is over its limit. Over
TLS, the TLS layers' own TLS connections are used as those layers use them (`_decrypt`,
`_send`, `_flush`): the upstream's records are decrypted one at a time and only what
was decoded is taken out of them, so that whatever is handed back is still there for
the TLS layer to read; the client's bytes are encrypted and sent as its TLS layer would.

Anything else hands the connection back, with h11's state set to where the decoding
stopped: the end of the body (the last chunk, trailers), a chunk header or footer the
decoder does not take, a header split across reads, the flow leaving the state above
(the client gone, a pause), and the connection's end (EOF, reset, a close by mitmproxy).
The bytes not decoded are handed to mitmproxy as the `DataReceived` they were (over TLS,
an empty one: the TLS layer reads what is left in its TLS connection), through
`server_event`, before any later read; EOF and errors go to mitmproxy's protocol as they
came. mitmproxy then goes on exactly as if it had read everything itself, and the next
read it parses may hand the connection over again.
"""

from __future__ import annotations

import asyncio
import logging
import socket
import weakref
from typing import Any, Literal

from mitmproxy.connection import ConnectionState
from mitmproxy.http import HTTPFlow
from mitmproxy.proxy import commands, context, events, layer, server, tunnel
from mitmproxy.proxy.layers.http import HttpLayer, HttpStream, ResponseData
from mitmproxy.proxy.layers.http._base import ReceiveHttp
from mitmproxy.proxy.layers.http._http1 import Http1Client, Http1Connection, Http1Server
from mitmproxy.proxy.layers.tls import TLSLayer
from OpenSSL import SSL

from ...chunked import ChunkedData
from .. import chunk_reader, connections

assert "read_body" not in vars(Http1Client)  # it inherits Http1Connection's (which `trailers` wraps)
ORIGINALS = {(Http1Client, "read_body"): Http1Connection.read_body}
USES = (connections, chunk_reader)
PINS = {
    # what the splice does for each chunk instead, and the states it checks
    "HttpStream.state_stream_response_body": (HttpStream.state_stream_response_body, "3fb6320300d3ddd5"),
    "Http1Server.send": (Http1Server.send, "cc218a1337c0f5cf"),
    "HttpLayer.event_to_child": (HttpLayer.event_to_child, "1095f6e1581d1780"),
    "HttpStream._handle_event": (HttpStream._handle_event, "e3cbfef7310ae81f"),
    # what it wraps, and where the read chunks come from
    "Http1Connection.read_body": (Http1Connection.read_body, "aece271029af36e4"),
    "Http1Connection._handle_event": (Http1Connection._handle_event, "2ac8db3e43ae743f"),
    "Layer.handle_event": (layer.Layer.handle_event, "fd88b0fb09ceddbb"),
    # direct reads (h11's state they take over and hand back: `chunk_reader`): what a read
    # does in mitmproxy (handle_connection: server_event with the data, then drain_writers;
    # EOF and errors through the reader), and the watchdog they tell
    "ConnectionHandler.handle_connection": (server.ConnectionHandler.handle_connection, "95c3f93e9824e527"),
    "ConnectionHandler.drain_writers": (server.ConnectionHandler.drain_writers, "6b57434604561e3e"),
    "TimeoutWatchdog.register_activity": (server.TimeoutWatchdog.register_activity, "41e033f7debf79d3"),
    # over TLS: what the TLS layer does with a read and a send (which they do the same way,
    # and which reads what they leave in the TLS connection), where they find it (a
    # connection's tunnel layers: in its context's layers, a fork keeps them)
    "TLSLayer.receive_data": (TLSLayer.receive_data, "85c0e6b656c324e5"),
    "TLSLayer.send_data": (TLSLayer.send_data, "35a29a1b0b0cb184"),
    "TLSLayer.tls_interact": (TLSLayer.tls_interact, "62d6d57d43dd1a2e"),
    "TunnelLayer._handle_event": (tunnel.TunnelLayer._handle_event, "00676a887c456cec"),
    "TunnelLayer.event_to_child": (tunnel.TunnelLayer.event_to_child, "119a33642637d420"),
    "Context.fork": (context.Context.fork, "cad9374a0689f10a"),
    "HttpLayer.get_connection": (HttpLayer.get_connection, "1aa1c63e3175766c"),
}
logger = logging.getLogger(__name__)
_ROUTE = "_ttft_relay_splice"

MITMPROXY, SPLICE, DIRECT = "mitmproxy", "splice", "direct"
"""The paths a response body takes to the client (a record's `body_path`): mitmproxy's layers,
the splice (each chunk from the upstream's reader to the client's framing in one step), and
its direct reads (socket to socket, below mitmproxy's layers)."""
_carried: weakref.WeakKeyDictionary[HTTPFlow, str] = weakref.WeakKeyDictionary()
"""The path each flow's response body took, where it was not mitmproxy's alone."""


def body_path(flow: HTTPFlow) -> str:
    """The path `flow`'s response body took: DIRECT once any of it was read directly, else
    SPLICE once any chunk of it was spliced, else MITMPROXY (all of it through mitmproxy's
    layers: HTTP/2 on either side, a body not streamed, a flow paused, the splice off)."""
    return _carried.get(flow, MITMPROXY)


_direct = True


def install(direct: bool = True) -> None:
    """Splice streamed bodies; with `direct`, hand their reads below mitmproxy too."""
    global _direct
    _direct = direct
    # Installed on Http1Client alone, so its self is one (narrower than Http1Connection's).
    Http1Client.read_body = _read_body  # type: ignore[method-assign, assignment]


def uninstall() -> None:
    """Http1Client inherits `Http1Connection.read_body` again."""
    if installed():
        del Http1Client.read_body


def installed() -> bool:
    return vars(Http1Client).get("read_body") is _read_body


class _Route:
    """Where one upstream connection's current response body goes: the flow's stream
    and the client's HTTP/1 layer, found once per response."""

    __slots__ = ("stream_id", "upstream", "http", "stream", "server", "client", "chunked", "response", "store",
                 "direct", "path")

    def __init__(self, upstream: Http1Client, http_layer: HttpLayer) -> None:
        # Routes are made for a body being read, which has a stream (mitmproxy's read_body asserts it).
        assert upstream.stream_id is not None
        self.stream_id = upstream.stream_id
        self.upstream = upstream.conn
        self.http = http_layer
        stream = http_layer.streams.get(upstream.stream_id)
        # A hedge's second attempt stands under an id of its own (`hedge`): its body goes mitmproxy's path.
        self.stream: HttpStream | None = stream if isinstance(stream, HttpStream) else None
        self.client = http_layer.context.client
        self.server = http_layer.connections.get(self.client)
        self.response: Any = None
        self.chunked = False
        # mitmproxy reads it for every chunk; an option access deep-copies its default.
        self.store = bool(http_layer.context.options.store_streamed_bodies)
        self.direct: _DirectReads | None = None
        self.path = MITMPROXY
        """The path this body took so far (`body_path`)."""

    def open(self) -> bool:
        """Whether mitmproxy would now pass a chunk straight from the stream callable to
        the client's `Http1Server.send`."""
        stream, server = self.stream, self.server
        if (
            stream is None
            or type(server) is not Http1Server
            or stream._paused is not None
            or server._paused is not None
            or stream.debug is not None
            or server.debug is not None
            or getattr(stream.server_state, "__func__", None) is not HttpStream.state_stream_response_body
            or self.http.streams.get(self.stream_id) is not stream
            or server.stream_id != self.stream_id
            or server.response is None
            or stream.flow.response is None
            or stream.flow.server_conn is not self.upstream
        ):
            return False
        if server.response is not self.response:
            # Http1Server.send reads this for every chunk; the head is sent, so it is settled.
            self.response = server.response
            self.chunked = "chunked" in server.response.headers.get("transfer-encoding", "").lower()
        return True

    def forward(self, data: bytes, out: list[bytes]) -> None:
        """What `state_stream_response_body` and `Http1Server.send` make of one chunk."""
        assert self.stream is not None and self.stream.flow.response is not None
        if self.path == MITMPROXY:
            self.carried(SPLICE)
        tap = self.stream.flow.response.stream
        chunks = tap(data) if callable(tap) else [data]
        if isinstance(chunks, bytes):
            chunks = [chunks]
        for chunk in chunks:
            if self.store:
                self.stream.response_body_buf += chunk
            if self.chunked:
                out.append(b"%x\r\n%s\r\n" % (len(chunk), chunk))
            elif chunk:
                out.append(chunk)

    def carried(self, path: str) -> None:
        """This body went `path` (from here on: DIRECT after SPLICE)."""
        assert self.stream is not None
        self.path = _carried[self.stream.flow] = path


def _http_layer(upstream: Http1Client) -> HttpLayer | None:
    for candidate in reversed(upstream.context.layers):
        if isinstance(candidate, HttpLayer):
            return candidate
    return None


def _route(upstream: Http1Client) -> _Route | None:
    route: _Route | None = getattr(upstream, _ROUTE, None)
    if route is None or route.stream_id != upstream.stream_id:
        http_layer = _http_layer(upstream)
        if http_layer is None:
            return None
        route = _Route(upstream, http_layer)
        setattr(upstream, _ROUTE, route)
    return route


def _read_body(self: Http1Client, event: events.Event) -> layer.CommandGenerator[None]:
    original = Http1Connection.read_body(self, event)
    route = _route(self) if type(event) is events.DataReceived else None
    if route is None:
        return (yield from original)
    out: list[bytes] = []
    for command in original:
        if type(command) is ReceiveHttp and type(command.event) is ResponseData and route.open():
            route.forward(command.event.data, out)
            continue
        if out:
            yield commands.SendData(route.client, b"".join(out))
            out.clear()
        yield command
    if out:
        yield commands.SendData(route.client, b"".join(out))
    if _direct and route.direct is None and route.open():
        _hand_over(self, route)


def _hand_over(upstream: Http1Client, route: _Route) -> None:
    """Let `_DirectReads` read `upstream`'s body from now on, if it can (see the module's
    docstring); runs inside `server_event`, after everything read so far was parsed."""
    reader = upstream.body_reader
    at = chunk_reader.position(reader)
    if at is None or at.trailer or len(upstream.buf):
        return
    upstream_tls = _tls_of(upstream.context.layers, upstream.conn)
    client_tls = _tls_of(route.http.context.layers, route.client)
    if upstream_tls is False or client_tls is False or (upstream_tls is not None and upstream_tls.pending()):
        return
    found = connections.plain_streams(route.client, upstream.conn)
    if found is not None:
        route.direct = _DirectReads(route, upstream, reader, *found, upstream_tls=upstream_tls, client_tls=client_tls)
        route.carried(DIRECT)


def _tls_of(layers: list[layer.Layer], conn: Any) -> SSL.Connection | None | Literal[False]:
    """The TLS connection `conn`'s bytes go through: None for none (plain TCP), False for
    anything else in between (a handshake not done, an upstream proxy's tunnel)."""
    tunnels = [t for t in layers if isinstance(t, tunnel.TunnelLayer) and t.tunnel_connection is conn]
    if not tunnels:
        return False if conn.tls else None
    if len(tunnels) == 1 and isinstance(tunnels[0], TLSLayer) and tunnels[0].tunnel_state is tunnel.TunnelState.OPEN:
        return tunnels[0].tls
    return False


class _DirectReads(asyncio.Protocol):
    """The upstream transport's protocol while its chunked body is spliced: each read
    goes from the socket to the client's transport here, without mitmproxy."""

    def __init__(self, route: _Route, upstream: Http1Client, reader: object, handler: Any,
                 transport: Any, client: asyncio.StreamWriter, *,
                 upstream_tls: SSL.Connection | None = None, client_tls: SSL.Connection | None = None) -> None:
        self.route = route
        self.upstream = upstream
        self.reader = reader
        self.handler = handler
        self.transport = transport
        self.client = client
        self.client_transport: Any = client.transport
        self.upstream_tls = upstream_tls
        self.client_tls = client_tls
        self.high_water = self.client_transport.get_write_buffer_limits()[1]
        at = chunk_reader.position(reader)
        assert at is not None  # `_hand_over` checked it
        self.decoder = ChunkedData(at.in_chunk, at.discard)
        self.original: Any = transport.get_protocol()
        self.tasks: set[asyncio.Task] = set()
        transport.set_protocol(self)
        logger.debug("direct reads of %s", upstream.conn)

    def data_received(self, data: bytes) -> None:
        try:
            self._read(data)
        except Exception:
            # mitmproxy logs an exception in its layers and carries on; here the flow would
            # hang, so the upstream connection is closed as a CloseConnection would (the flow
            # fails, its client is told).
            logger.exception("direct reads of %s failed, closing it", self.upstream.conn)
            self._restore("an error")
            self.handler.close_connection(self.upstream.conn)

    def _read(self, data: bytes) -> None:
        if not self.upstream.conn.state & ConnectionState.CAN_READ:
            return  # closed by mitmproxy, the transport not yet: its reads were dropped too
        route = self.route
        if not route.open() or self.client_transport.is_closing():
            self._hand_back(data, "the flow left the splice")
            return
        self.handler.timeout_watchdog.register_activity()
        pieces: list[bytes] = []
        if self.upstream_tls is None:
            used = self.decoder.feed(data, pieces)
            rest = data[used:] if used < len(data) else None
        else:
            rest = self._decrypt(data, pieces)
        if pieces:
            out: list[bytes] = []
            for piece in pieces:
                route.forward(piece, out)
            if out:
                self._send(b"".join(out))
        if rest is not None:
            self._hand_back(rest, "bytes for h11")
        elif self.client_transport.get_write_buffer_size() > self.high_water:
            # mitmproxy's drain_writers: no more reads until the client takes what it has.
            self.transport.pause_reading()
            self._run(self._resume_when_drained())

    def _decrypt(self, data: bytes, pieces: list[bytes]) -> bytes | None:
        """The TLS layer's `receive_data` up to the decoding: None if the decoder took all
        there was, b"" if mitmproxy's TLS layer is to read the rest (still in the TLS
        connection: each record is peeked at and only what was decoded taken out of it)."""
        tls = self.upstream_tls
        assert tls is not None
        tls.bio_write(data)
        rest = None
        while True:
            try:
                record = tls.recv(RECORD_MAX, socket.MSG_PEEK)
            except SSL.WantReadError:
                break
            except SSL.ZeroReturnError:  # close_notify: it stays, for the TLS layer to tell
                rest = b""
                break
            except SSL.Error as e:
                # As the TLS layer: said, and the connection left as it is (a later read says
                # it again); the TLS connection keeps only a blank error for the layer to read.
                self.handler.log(f"TLS Error: {e}", logging.WARNING)
                break
            used = self.decoder.feed(record, pieces)
            if used:
                tls.recv(used)
            if used < len(record):
                rest = b""
                break
        _flush(tls, self.transport)  # what the records read may have to answer (tls_interact)
        return rest

    def _send(self, data: bytes) -> None:
        """SendData to the client, through its TLS layer's `send_data` if it has one."""
        if self.client_tls is None:
            self.client_transport.write(data)
            return
        try:
            self.client_tls.sendall(data)
        except (SSL.ZeroReturnError, SSL.SysCallError):
            pass  # as the TLS layer: the client is going, what it would still send is dropped
        _flush(self.client_tls, self.client_transport)

    def eof_received(self) -> bool | None:
        self._restore("the upstream's end of the connection")
        return self.original.eof_received()

    def connection_lost(self, exc: Exception | None) -> None:
        self._restore("the connection closed")
        self.original.connection_lost(exc)

    def pause_writing(self) -> None:
        self.original.pause_writing()

    def resume_writing(self) -> None:
        self.original.resume_writing()

    def _restore(self, why: str) -> None:
        """mitmproxy reads the connection again, its h11 reader where the decoder is."""
        logger.debug("direct reads of %s end: %s", self.upstream.conn, why)
        if self.transport.get_protocol() is self:
            self.transport.set_protocol(self.original)
        chunk_reader.go_on_from(self.reader, self.decoder.in_chunk, self.decoder.discard)
        self.route.direct = None

    def _hand_back(self, rest: bytes, why: str) -> None:
        self._restore(why)
        # Started now, so mitmproxy parses `rest` before any later read: this task asks
        # for server_event's lock before the reader task can with a later read (the
        # transport feeds it only from the next loop pass on), and the lock serves in order.
        self._run(self._parse(rest))

    async def _parse(self, data: bytes) -> None:
        """What handle_connection does with a read."""
        await self.handler.server_event(events.DataReceived(self.upstream.conn, data))
        await self.handler.drain_writers()

    async def _resume_when_drained(self) -> None:
        try:
            await self.client.drain()
        except OSError:
            pass  # the client is gone: mitmproxy ends the flow and closes this connection
        if self.transport.get_protocol() is self and not self.transport.is_closing():
            self.transport.resume_reading()

    def _run(self, coro: Any) -> None:
        task = asyncio.get_running_loop().create_task(coro)
        self.tasks.add(task)
        task.add_done_callback(self.tasks.discard)


RECORD_MAX = 16 * 1024 + 256
"""The most plaintext one TLS record holds (and `recv` with MSG_PEEK returns one record)."""


def _flush(tls: SSL.Connection, transport: Any) -> None:
    """Send what `tls` has for its peer, as the TLS layer's `tls_interact` does."""
    out = []
    while True:
        try:
            out.append(tls.bio_read(65535))
        except SSL.WantReadError:
            break
    if out:
        transport.write(b"".join(out))
