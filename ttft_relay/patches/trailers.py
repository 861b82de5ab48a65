"""HTTP/1 trailers end their flow with an error the client is told, instead of crashing mitmproxy.

HTTP/1 trailers (fields after a chunked body's last chunk) make mitmproxy's
`Http1Connection.read_body` raise NotImplementedError: "mitmproxy has crashed!", no
answer, no record, and the client waits until it gives up. The wrap turns that into a
protocol error of the flow: from a client, a 501 saying so (`REQUEST_TRAILERS`,
mitmproxy's error page, as for its own 400s); from the upstream, `RESPONSE_TRAILERS`
(an upstream failure like any other); then the connection closes.
"""

from __future__ import annotations

from typing import Any

from mitmproxy.proxy import commands, events, layer
from mitmproxy.proxy.layers.http._base import ReceiveHttp
from mitmproxy.proxy.layers.http._events import ErrorCode, RequestProtocolError, ResponseProtocolError
from mitmproxy.proxy.layers.http._http1 import Http1Connection, Http1Server, make_error_response

_ORIGINAL_READ_BODY = Http1Connection.read_body
ORIGINALS = {(Http1Connection, "read_body"): _ORIGINAL_READ_BODY}

REQUEST_TRAILERS = "HTTP/1 request trailers are not supported by the relay (send the request without them)"
RESPONSE_TRAILERS = "the upstream sent HTTP/1 trailers, which the relay cannot pass on"


def answer_trailers() -> None:
    """Trailers become a flow's protocol error instead of a crash."""
    Http1Connection.read_body = _read_body  # type: ignore[method-assign]


def uninstall() -> None:
    Http1Connection.read_body = _ORIGINAL_READ_BODY  # type: ignore[method-assign]


def _read_body(self: Http1Connection, event: events.Event) -> layer.CommandGenerator[None]:
    try:
        yield from _ORIGINAL_READ_BODY(self, event)
    except NotImplementedError as e:
        if "trailers" not in str(e):
            raise
        assert self.stream_id is not None  # the original read_body asserted it before it read
        if isinstance(self, Http1Server):
            # As for mitmproxy's own 400s, the server side answers: a request error
            # sends nothing to the client.
            yield commands.SendData(self.conn, make_error_response(501, REQUEST_TRAILERS))
            error: Any = RequestProtocolError(self.stream_id, REQUEST_TRAILERS, ErrorCode.GENERIC_CLIENT_ERROR)
        else:
            error = ResponseProtocolError(self.stream_id, RESPONSE_TRAILERS, ErrorCode.GENERIC_SERVER_ERROR)
        yield ReceiveHttp(error)
        yield commands.CloseConnection(self.conn)
        self.state = self.done
