"""A request refused on its head is answered at once, its body never read.

A request the relay refuses on its head (no relay key, the relay stopping) would still
have its whole body read first: mitmproxy sends a response set in `requestheaders` only
after the body, however large. Killing the flow there stops the body
(`HttpStream.check_killed` after the hook), but the client gets a closed connection and
no answer. The wrap of `check_killed` sends the response of a flow given to
`answer_now` instead of that bare close, so the body is never read into memory: HTTP/1
then closes the connection; HTTP/2 resets the stream with NO_ERROR once the answer is
out (RFC 9113 §8.1: how a server that answered early asks the client to stop sending).
The answer alone ends only the relay's half of the stream, and mitmproxy grants flow
control as it reads: an HTTP/2 client went on uploading its whole body (64 MB, all read
and thrown away).
"""

from __future__ import annotations

import weakref
from collections.abc import Iterable, Iterator
from typing import Any

import h2.errors
from mitmproxy import http
from mitmproxy.net.http import http1
from mitmproxy.proxy import commands, layer
from mitmproxy.proxy.layers.http import (
    HttpLayer,
    HttpStream,
    ResponseData,
    ResponseEndOfMessage,
    ResponseHeaders,
    SendHttp,
)
from mitmproxy.proxy.layers.http._events import ErrorCode, ResponseProtocolError
from mitmproxy.proxy.layers.http._http1 import Http1Server
from mitmproxy.proxy.layers.http._http2 import Http2Connection, Http2Server
from mitmproxy.proxy.layers.http._http_h2 import BufferedH2Connection

from ..rewrite import replacing
from ..users import Users

_ORIGINAL_CHECK_KILLED = HttpStream.check_killed
ORIGINALS = {(HttpStream, "check_killed"): _ORIGINAL_CHECK_KILLED}
PINS = {
    "HttpStream.check_killed": (_ORIGINAL_CHECK_KILLED, "368cad352d1e82b6"),
    "HttpStream.state_wait_for_request_headers": (HttpStream.state_wait_for_request_headers, "3706d5d5ce01dcd4"),
    "Http1Server.send": (Http1Server.send, "cc218a1337c0f5cf"),
    # HTTP/2: the stream's state, and a reset that drops what flow control holds back
    "Http2Connection.is_closed": (Http2Connection.is_closed, "26e8192aca68a486"),
    "BufferedH2Connection.reset_stream": (BufferedH2Connection.reset_stream, "4066479f1b95343e"),
}
_users = Users()
_answer_now: weakref.WeakSet[http.HTTPFlow] = weakref.WeakSet()
_answered: weakref.WeakSet[http.HTTPFlow] = weakref.WeakSet()


def install(by: str) -> None:
    """Answers on the head for `by` (the relay keys, the field checks, a stop): on while anyone asks."""
    _users.add(by)
    HttpStream.check_killed = _check_killed  # type: ignore[method-assign]


def uninstall(by: str | None = None) -> None:
    """Off for `by` (None: for everyone)."""
    if _users.release(by):
        HttpStream.check_killed = _ORIGINAL_CHECK_KILLED  # type: ignore[method-assign]


def installed() -> bool:
    return HttpStream.check_killed is _check_killed


def answer_now(flow: http.HTTPFlow, response: http.Response) -> None:
    """From `requestheaders`: answer `flow` with `response` at once, without reading
    its body, and close the client connection (where this patch is off: the flow is
    killed, its client gets a closed connection)."""
    flow.response = response
    _answer_now.add(flow)
    flow.kill()


def _check_killed(self: HttpStream, emit_error_hook: bool) -> layer.CommandGenerator[bool]:
    return (yield from replacing(_ORIGINAL_CHECK_KILLED(self, emit_error_hook), lambda c: _answer(self, c)))


def _answer(stream: HttpStream, command: Any) -> Iterable[Any] | None:
    flow = stream.flow
    if not (
        isinstance(command, SendHttp)
        and isinstance(command.event, ResponseProtocolError)
        and command.event.code == ErrorCode.KILL
        and flow in _answer_now
        and flow.response is not None
    ):
        return None
    if flow in _answered:
        # The stream ended with the answer; a later error of the connection (the client
        # closing it) finds the flow killed again: nothing more to say on that stream.
        return []
    _answered.add(flow)
    return _answered_commands(stream, flow.response)


def _answered_commands(stream: HttpStream, response: http.Response) -> Iterator[Any]:
    sid, client = stream.stream_id, stream.context.client
    body = response.raw_content or b""
    yield SendHttp(ResponseHeaders(sid, response, end_stream=False), client)
    if body:
        yield SendHttp(ResponseData(sid, body), client)
    yield SendHttp(ResponseEndOfMessage(sid), client)
    # The HTTP layer has sent each of those as it was yielded.
    served_by = _client_connection(stream)
    if isinstance(served_by, Http1Server) and _body_to_come(stream.flow.request):
        # HTTP/1: close the connection after the answer, so the body is never read
        # (the connection itself, not the stream: by the time this runs the body may
        # have ended and the connection moved on). A request without a body is
        # complete, its connection kept.
        yield commands.CloseConnection(client)
    elif isinstance(served_by, Http2Server) and not served_by.is_closed(sid):
        # The client's half is still open: its body is still coming. Reset once the
        # whole answer is out (a reset drops what flow control still holds back).
        h2_conn = served_by.h2_conn
        if not h2_conn.stream_buffers.get(sid):
            h2_conn.reset_stream(sid, h2.errors.ErrorCodes.NO_ERROR)
            yield commands.SendData(client, h2_conn.data_to_send())


def _client_connection(stream: HttpStream) -> Any:
    """The layer that speaks HTTP with `stream`'s client (Http1Server, Http2Server, …)."""
    layer_ = next((lay for lay in reversed(stream.context.layers) if isinstance(lay, HttpLayer)), None)
    return layer_.connections.get(stream.context.client) if layer_ is not None else None


def _body_to_come(request: http.Request) -> bool:
    try:
        return http1.expected_http_body_size(request) != 0
    except ValueError:
        return True
