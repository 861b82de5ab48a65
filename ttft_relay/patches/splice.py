"""A streamed HTTP/1 response body goes from the upstream's reader to the client's
framing in one step, instead of through mitmproxy's per-chunk event routing.

mitmproxy 12.3.1 (pinned, `tests/patches/test_splice.py`) hands every chunk of a streamed
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
"""

from __future__ import annotations

from typing import Any

from mitmproxy.proxy import commands, events, layer
from mitmproxy.proxy.layers.http import HttpLayer, HttpStream, ResponseData
from mitmproxy.proxy.layers.http._base import ReceiveHttp
from mitmproxy.proxy.layers.http._http1 import Http1Client, Http1Connection, Http1Server

assert "read_body" not in vars(Http1Client)  # it inherits Http1Connection's (which `trailers` wraps)
ORIGINALS = {(Http1Client, "read_body"): Http1Connection.read_body}
_ROUTE = "_ttft_relay_splice"


def install() -> None:
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

    __slots__ = ("stream_id", "upstream", "http", "stream", "server", "client", "chunked", "response")

    def __init__(self, upstream: Http1Client, http_layer: HttpLayer) -> None:
        # Routes are made for a body being read, which has a stream (mitmproxy's read_body asserts it).
        assert upstream.stream_id is not None
        self.stream_id = upstream.stream_id
        self.upstream = upstream.conn
        self.http = http_layer
        self.stream: HttpStream | None = http_layer.streams.get(upstream.stream_id)
        self.client = http_layer.context.client
        self.server = http_layer.connections.get(self.client)
        self.response: Any = None
        self.chunked = False

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
        tap = self.stream.flow.response.stream
        chunks = tap(data) if callable(tap) else [data]
        if isinstance(chunks, bytes):
            chunks = [chunks]
        store = self.stream.context.options.store_streamed_bodies
        for chunk in chunks:
            if store:
                self.stream.response_body_buf += chunk
            if self.chunked:
                out.append(b"%x\r\n%s\r\n" % (len(chunk), chunk))
            elif chunk:
                out.append(chunk)


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
