"""Upstream failures reach the client as the relay renders them, not as mitmproxy's own error.

When the upstream side fails (connect, DNS, TLS, reset, a connection the relay closed
on a timeout) the HTTP layer fires the `error` hook and then hands the client side a
`ResponseProtocolError`: HTTP/1 answers it with an HTML 502 page before the response
head and with a bare close after it; HTTP/2 likewise (HTML, or RST_STREAM). Setting
`flow.response` in the `error` hook changes none of that. The seam chosen is the one
place both protocols share: `HttpStream.handle_protocol_error`, which sends that event.
The wrap lets the original run unchanged (error hook, kill check, stream bookkeeping)
and only replaces its `SendHttp(ResponseProtocolError, client)` by ordinary response
events (`ResponseHeaders` / `ResponseData` / `ResponseEndOfMessage`), which
`Http1Server` and `Http2Server` already know how to send: a complete error response
before the head, or a last body chunk and a clean end after it. What to send is asked
of a `Renderer`; None keeps mitmproxy's behaviour. (The per-protocol alternative,
`Http1Server.send` plus the HTTP/2 equivalent, would be two patches that see a request
but not its flow.)

Before any of that, a stream's error may be taken over instead (`instead_of_errors`): the
upstream pool sends a request once more when its reused connection closed before any byte
of the answer (`speed.upstream_pool`), an upstream group sends it to its next member
(`route.groups`); one wrap of the function, whoever asks.

Installing it also lets a failed eager connect reach the HTTP layer
(`eager_connects`), so that failure gets a rendered reply too. The error text is cut to
`text.ERROR_MAX` on its way in (`text.cut_text`), as the record's: mitmproxy quotes what it could
not parse whatever its size, and the flow's error, the reply and the console all take it
from here.
"""

from __future__ import annotations

import dataclasses
import logging
from collections.abc import Callable
from typing import Any

from mitmproxy import http
from mitmproxy.proxy import layer
from mitmproxy.proxy.layers.http import HttpStream, ResponseData, ResponseEndOfMessage, ResponseHeaders, SendHttp
from mitmproxy.proxy.layers.http._events import ResponseProtocolError
from mitmproxy.proxy.layers.http._http1 import Http1Server
from mitmproxy.proxy.layers.http._http2 import Http2Connection

from ... import text
from . import eager_connects
from ..rewrite import replacing

logger = logging.getLogger(__name__)

Renderer = Callable[[http.HTTPFlow, str, bool], "tuple[http.Response | None, bytes] | None"]
"""`render(flow, message, head_sent)`: what the client gets instead of mitmproxy's error.

`(response, body)` before the head (a complete response, `body` its content);
`(None, body)` after it (`body` is sent as the last piece of the streamed body);
None to leave mitmproxy's behaviour. `message` is mitmproxy's error text.
"""

_ORIGINAL_HANDLE_PROTOCOL_ERROR = HttpStream.handle_protocol_error
ORIGINALS = {(HttpStream, "handle_protocol_error"): _ORIGINAL_HANDLE_PROTOCOL_ERROR}
USES = (eager_connects,)
PINS = {
    "HttpStream.handle_protocol_error": (_ORIGINAL_HANDLE_PROTOCOL_ERROR, "59fc3b2eeeabf63a"),
    # the response events the wrap sends instead, as each protocol sends them
    "Http1Server.send": (Http1Server.send, "cc218a1337c0f5cf"),
    "Http2Connection._handle_event": (Http2Connection._handle_event, "7fc814a8a507f234"),
}
_renderer: Renderer | None = None

Instead = Callable[[HttpStream, Any], "layer.CommandGenerator[None] | None"]
"""Given a stream and its protocol error event: the commands to run in place of the error, or None."""
_instead: dict[str, Instead] = {}


def install(renderer: Renderer) -> None:
    """`renderer` decides the client's error replies, also for a failed eager connect."""
    global _renderer
    _renderer = renderer
    HttpStream.handle_protocol_error = _handle_protocol_error  # type: ignore[method-assign]
    eager_connects.read_request_after_failure(True)


def uninstall() -> None:
    global _renderer
    _renderer = None
    HttpStream.handle_protocol_error = _ORIGINAL_HANDLE_PROTOCOL_ERROR  # type: ignore[method-assign]
    eager_connects.read_request_after_failure(False)


def installed() -> bool:
    return HttpStream.handle_protocol_error is _handle_protocol_error


def instead_of_errors(by: str, handler: Instead | None, *, first: bool = False) -> None:
    """`handler` (None: none) may take a stream's protocol error over before it is one (`by`: who
    asks); the handlers are asked in the order they came, a `first` one before the others (for
    the errors its asker caused itself: a connection it closed)."""
    global _instead
    _instead.pop(by, None)
    if handler is not None:
        _instead = {by: handler, **_instead} if first else {**_instead, by: handler}


def _handle_protocol_error(self: HttpStream, event: Any) -> layer.CommandGenerator[None]:
    for handler in _instead.values():
        if (commands := handler(self, event)) is not None:
            return commands
    if len(event.message) > text.ERROR_MAX:
        # mitmproxy's error text quotes what it could not parse, whatever its size (an 8 MB
        # chunk header became an 8 MB error event and console line): cut here, where the
        # flow's error, the error hook, the reply and mitmproxy's own error page all take it.
        event = dataclasses.replace(event, message=text.cut_text(event.message))
    return replacing(_ORIGINAL_HANDLE_PROTOCOL_ERROR(self, event), lambda command: _client_reply(self, command))


def _client_reply(stream: HttpStream, command: Any) -> list[SendHttp] | None:
    """The events that replace mitmproxy's error to the client, or None to keep it."""
    if not (
        isinstance(command, SendHttp)
        and isinstance(command.event, ResponseProtocolError)
        and command.connection is stream.context.client
        and _renderer is not None
    ):
        return None
    if stream.server_state == stream.state_stream_response_body:
        head_sent = True
    elif stream.server_state in (stream.state_wait_for_response_headers, stream.state_consume_response_body):
        head_sent = False
    else:  # done or already failed: nothing of ours to say
        return None
    try:
        reply = _renderer(stream.flow, command.event.message, head_sent)
    except Exception:  # the patch must never cost the client its error
        logger.exception("rendering the error reply failed; mitmproxy's own error goes out")
        return None
    if reply is None:
        return None
    response, body = reply
    sid, client = stream.stream_id, stream.context.client
    out = [] if response is None else [SendHttp(ResponseHeaders(sid, response, end_stream=False), client)]
    if body:
        out.append(SendHttp(ResponseData(sid, body), client))
    out.append(SendHttp(ResponseEndOfMessage(sid), client))
    return out
