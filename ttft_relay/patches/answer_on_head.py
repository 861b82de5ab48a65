"""A request refused on its head is answered at once, its body never read.

A request the relay refuses on its head (no relay key, the relay stopping) would still
have its whole body read first: mitmproxy sends a response set in `requestheaders` only
after the body, however large. Killing the flow there stops the body
(`HttpStream.check_killed` after the hook), but the client gets a closed connection and
no answer. The wrap of `check_killed` sends the response of a flow given to
`answer_now` instead of that bare close, then closes the connection (HTTP/1; HTTP/2
ends the stream), so the body is never read into memory.
"""

from __future__ import annotations

import weakref
from typing import Any

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

from .rewrite import replacing

_ORIGINAL_CHECK_KILLED = HttpStream.check_killed
ORIGINALS = {(HttpStream, "check_killed"): _ORIGINAL_CHECK_KILLED}
_answer_now: weakref.WeakSet[http.HTTPFlow] = weakref.WeakSet()
_answered: weakref.WeakSet[http.HTTPFlow] = weakref.WeakSet()


def answer_now(flow: http.HTTPFlow, response: http.Response) -> None:
    """From `requestheaders`: answer `flow` with `response` at once, without reading
    its body, and close the client connection."""
    flow.response = response
    _answer_now.add(flow)
    HttpStream.check_killed = _check_killed  # type: ignore[method-assign]
    flow.kill()


def uninstall() -> None:
    HttpStream.check_killed = _ORIGINAL_CHECK_KILLED  # type: ignore[method-assign]


def _check_killed(self: HttpStream, emit_error_hook: bool) -> layer.CommandGenerator[bool]:
    return (yield from replacing(_ORIGINAL_CHECK_KILLED(self, emit_error_hook), lambda c: _answer(self, c)))


def _answer(stream: HttpStream, command: Any) -> list[Any] | None:
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
    sid, client = stream.stream_id, stream.context.client
    body = flow.response.raw_content or b""
    out = [
        SendHttp(ResponseHeaders(sid, flow.response, end_stream=False), client),
        *([SendHttp(ResponseData(sid, body), client)] if body else []),
        SendHttp(ResponseEndOfMessage(sid), client),
    ]
    if _http1_body_to_come(stream):
        # HTTP/1: close the connection after the answer, so the body is never read
        # (the connection itself, not the stream: by the time this runs the body may
        # have ended and the connection moved on). A request without a body is
        # complete, its connection kept; HTTP/2 ends the stream with the response.
        out.append(commands.CloseConnection(client))
    return out


def _http1_body_to_come(stream: HttpStream) -> bool:
    layer_ = next((lay for lay in reversed(stream.context.layers) if isinstance(lay, HttpLayer)), None)
    if layer_ is None or not isinstance(layer_.connections.get(stream.context.client), Http1Server):
        return False
    try:
        return http1.expected_http_body_size(stream.flow.request) != 0
    except ValueError:
        return True
