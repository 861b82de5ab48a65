"""An HTTP/1 request head that never ends is refused with a 431 instead of growing the process.

mitmproxy buffers a request head until it ends, without a bound ("FIXME: protect
against header size DoS" in `Http1Server.read_headers`): a head that never ends grows
the process by gigabytes. The wrap of `read_headers` answers a head that has not ended
within `limit_request_heads` bytes with a 431 and closes the connection.
"""

from __future__ import annotations

from mitmproxy.proxy import commands, events, layer
from mitmproxy.proxy.layers.http._http1 import Http1Server, make_error_response

_ORIGINAL_READ_HEADERS = Http1Server.read_headers
ORIGINALS = {(Http1Server, "read_headers"): _ORIGINAL_READ_HEADERS}
PINS = {
    "Http1Server.read_headers": (_ORIGINAL_READ_HEADERS, "3fe0945216bcf7bc"),
}
_max_head = 0


def limit_request_heads(limit: int) -> None:
    """HTTP/1 request heads longer than `limit` bytes get a 431; 0: no limit."""
    global _max_head
    _max_head = limit
    Http1Server.read_headers = _read_headers if limit > 0 else _ORIGINAL_READ_HEADERS  # type: ignore[method-assign]


def uninstall() -> None:
    limit_request_heads(0)


def _read_headers(self: Http1Server, event: events.ConnectionEvent) -> layer.CommandGenerator[None]:
    # The head ends within the limit or is extracted at once: a longer buffer before
    # extraction is a head still going (a read brings at most 64 KiB).
    if isinstance(event, events.DataReceived) and 0 < _max_head < len(self.buf):
        if b"\r\n\r\n" not in bytes(self.buf)[: _max_head + 4]:
            yield commands.Log(f"request head over {_max_head} bytes without an end: refused (431)")
            yield commands.SendData(self.conn, make_error_response(431, f"request head over {_max_head} bytes"))
            yield commands.CloseConnection(self.conn)
            self.state = self.done
            return
    yield from _ORIGINAL_READ_HEADERS(self, event)
