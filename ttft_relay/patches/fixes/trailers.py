"""HTTP/1 chunked bodies mitmproxy reads badly: trailers, endless framing lines, a client's
malformed body. Each becomes a protocol error of its flow, answered.

- HTTP/1 trailers (fields after a chunked body's last chunk) make mitmproxy's
  `Http1Connection.read_body` raise NotImplementedError: "mitmproxy has crashed!", no
  answer, no record, and the client waits until it gives up. The wrap turns that into a
  protocol error of the flow: from a client, a 501 saying so (`REQUEST_TRAILERS`,
  mitmproxy's error page, as for its own 400s); from the upstream, `RESPONSE_TRAILERS`
  (an upstream failure like any other); then the connection closes.
- A chunk header (or a trailer section) is buffered until its line ends, whatever it
  takes: an 8 MB one was buffered whole and quoted back in the error, an endless one
  (200 MB without a line end) held as much of the relay's memory. Past `CHUNK_LINE_MAX`
  without one it is a protocol error (Node.js's bound on chunk extensions): from a client,
  a 400; from the upstream, an upstream failure. What is buffered stays under that bound
  and one read.
- A client's chunked body that h11 refuses (a malformed chunk size) closed the connection
  without an answer; it gets a 400 with mitmproxy's error text, as a malformed request head
  does.

Where h11's reader is in a chunked body is h11's private state, read in `chunk_reader` (whose
pins are this module's too).
"""

from __future__ import annotations

from typing import Any

from mitmproxy.proxy import commands, events, layer
from mitmproxy.proxy.layers.http import HttpStream
from mitmproxy.proxy.layers.http._base import ReceiveHttp
from mitmproxy.proxy.layers.http._events import ErrorCode, RequestProtocolError, ResponseProtocolError
from mitmproxy.proxy.layers.http._http1 import Http1Connection, Http1Server, make_error_response

from .. import chunk_reader
from ..rewrite import replacing

_ORIGINAL_READ_BODY = Http1Connection.read_body
ORIGINALS = {(Http1Connection, "read_body"): _ORIGINAL_READ_BODY}
PINS = {
    "Http1Connection.read_body": (_ORIGINAL_READ_BODY, "aece271029af36e4"),
    "HttpStream.handle_protocol_error": (HttpStream.handle_protocol_error, "59fc3b2eeeabf63a"),
}
USES = (chunk_reader,)  # where h11's reader is in a chunked body

REQUEST_TRAILERS = "HTTP/1 request trailers are not supported by the relay (send the request without them)"
RESPONSE_TRAILERS = "the upstream sent HTTP/1 trailers, which the relay cannot pass on"
BODY_ERROR = "HTTP/1 protocol error"
"""How mitmproxy's error for a body h11 refuses begins (`Http1Connection.read_body`)."""
CHUNK_LINE_MAX = 16 * 1024
LINE_TOO_LONG = f"{BODY_ERROR}: a chunk header or trailer section longer than {CHUNK_LINE_MAX} bytes"


def answer_trailers() -> None:
    """Trailers become a flow's protocol error instead of a crash."""
    Http1Connection.read_body = _read_body  # type: ignore[method-assign]


def uninstall() -> None:
    Http1Connection.read_body = _ORIGINAL_READ_BODY  # type: ignore[method-assign]


def _read_body(self: Http1Connection, event: events.Event) -> layer.CommandGenerator[None]:
    if isinstance(event, events.DataReceived) and _line_too_long(self.body_reader, self.buf):
        yield from _fail(self, 400, LINE_TOO_LONG, LINE_TOO_LONG)
        return
    try:
        if isinstance(self, Http1Server):
            yield from replacing(_ORIGINAL_READ_BODY(self, event), _AnsweredRequestErrors(self))
        else:
            yield from _ORIGINAL_READ_BODY(self, event)
    except NotImplementedError as e:
        if "trailers" not in str(e):
            raise
        yield from _fail(self, 501, REQUEST_TRAILERS, RESPONSE_TRAILERS)


def _fail(self: Http1Connection, status: int, request_error: str, response_error: str) -> layer.CommandGenerator[None]:
    assert self.stream_id is not None  # the original read_body asserted it before it read
    if isinstance(self, Http1Server):
        # As for mitmproxy's own 400s, the server side answers: a request error
        # sends nothing to the client.
        yield commands.SendData(self.conn, make_error_response(status, request_error))
        error: Any = RequestProtocolError(self.stream_id, request_error, ErrorCode.GENERIC_CLIENT_ERROR)
    else:
        error = ResponseProtocolError(self.stream_id, response_error, ErrorCode.GENERIC_SERVER_ERROR)
    yield ReceiveHttp(error)
    yield commands.CloseConnection(self.conn)
    self.state = self.done


def _line_too_long(reader: object, buf: Any) -> bool:
    """Whether a chunked body's reader waits for a chunk header (or its trailers) that has
    passed CHUNK_LINE_MAX bytes in `buf` without ending."""
    if len(buf) <= CHUNK_LINE_MAX or (at := chunk_reader.position(reader)) is None:
        return False
    if at.discard or (at.in_chunk and not at.trailer):
        return False  # in a chunk's data or its CRLF: no line pending
    window = bytes(buf)[:CHUNK_LINE_MAX + 4]  # h11's ReceiveBuffer: at most the bound and a read
    return b"\n\r\n" not in window and b"\n\n" not in window if at.trailer else b"\n" not in window


class _AnsweredRequestErrors:
    """For a client's body h11 refuses, the 400 the original does not send: its close is
    held until the error's text is known, and goes after the answer."""

    def __init__(self, server: Http1Server) -> None:
        self.server = server
        self.close: Any = None

    def __call__(self, command: Any) -> list[Any] | None:
        if isinstance(command, commands.CloseConnection) and command.connection is self.server.conn:
            self.close = command
            return []
        if (self.close is not None and isinstance(command, ReceiveHttp)
                and isinstance(command.event, RequestProtocolError)):
            answer = commands.SendData(self.server.conn, make_error_response(400, command.event.message))
            close, self.close = self.close, None
            self.server.state = self.server.done  # answered: the close that follows is no second error
            return [answer, close, command]
        if self.close is not None:  # not the error path after all: the close as it came
            close, self.close = self.close, None
            return [close, command]
        return None
