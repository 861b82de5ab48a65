"""An upstream's interim answer (100, 103) is dropped, so its real answer reaches the client.

An upstream's interim answer (`100 Continue`, `103 Early Hints`) before its real one
costs the real one: mitmproxy's `Http1Client` reads the 1xx head as the response
(bodiless), passes it to the client as the answer, and then meets the real head as
"unexpected data from server" — the client waits for an answer that never comes, and
the record says 103. mitmproxy has one response per flow and no way to forward an
interim head, so the wrap of `Http1Client.read_headers` drops interim heads (every 1xx
but `101 Switching Protocols`, which is the answer of an upgrade) from the upstream's
buffer before the original reads the real head. RFC 9110 §15.2 lets a client ignore
1xx answers it did not ask for; mitmproxy answers a client's `Expect: 100-continue`
itself.
"""

from __future__ import annotations

import logging

from mitmproxy.proxy import events, layer
from mitmproxy.proxy.layers.http._http1 import Http1Client, ReceiveBuffer  # h11's, as mitmproxy reads into it

logger = logging.getLogger(__name__)

_ORIGINAL_READ_RESPONSE_HEADERS = Http1Client.read_headers
ORIGINALS = {(Http1Client, "read_headers"): _ORIGINAL_READ_RESPONSE_HEADERS}
PINS = {
    # the response head is read from the buffer the wrap takes interim heads out of
    "Http1Client.read_headers": (_ORIGINAL_READ_RESPONSE_HEADERS, "415454c5fa8b5981"),
    "ReceiveBuffer.maybe_extract_at_most": (ReceiveBuffer.maybe_extract_at_most, "a283b372f1fb7393"),
}


def install() -> None:
    Http1Client.read_headers = _read_response_headers  # type: ignore[method-assign]  # the patch itself


def uninstall() -> None:
    Http1Client.read_headers = _ORIGINAL_READ_RESPONSE_HEADERS  # type: ignore[method-assign]  # the patch itself


def interim_head_size(data: bytes) -> int:
    """The length of the interim (1xx, not 101) response head `data` starts with, once it
    is complete; 0 if `data` does not start with one (or its end has not arrived)."""
    if not (data.startswith(b"HTTP/1.") and data[8:10] == b" 1" and data[9:12] != b"101"):
        return 0
    end = data.find(b"\r\n\r\n")
    return end + 4 if end >= 0 else 0


def _read_response_headers(self: Http1Client, event: events.ConnectionEvent) -> layer.CommandGenerator[None]:
    if isinstance(event, events.DataReceived) and self.request is not None:
        while size := interim_head_size(bytes(self.buf)[:65536]):
            dropped = self.buf.maybe_extract_at_most(size)
            logger.debug("dropped an interim answer from %s: %r", self.context.server.address, bytes(dropped or b"")[:80])
    return (yield from _ORIGINAL_READ_RESPONSE_HEADERS(self, event))
