"""HTTP/2 client resets: none is lost, and a connection that resets streams in a loop is closed.

1. A reset read together with its request's end is lost. h2 parses a whole read before
   mitmproxy looks at the events, so when a client's END_STREAM and RST_STREAM arrive
   in one read the stream is already closed when mitmproxy handles the END_STREAM:
   `Http2Connection.handle_h2_event` forgets the stream there and drops the reset that
   follows as one of a stream it does not know. The flow never hears of the reset, its
   request goes upstream and its record says 200 (2000 HEADERS + RST_STREAM in one
   write: 1999 requests reached the upstream). The wrap of `Http2Server.handle_h2_event`
   hands a client's reset of a forgotten stream to the HTTP layer as mitmproxy hands
   any other (the layer ignores a stream it is done with): a request still in its hooks
   is dropped, one already upstream is cancelled (`HttpStream.handle_protocol_error`).

2. Rapid reset (CVE-2023-44487): a client opening and resetting streams in a loop costs
   the relay a flow each, while HTTP/2's concurrency bound never applies (each stream
   is closed as soon as it opens). As Netty and others bound it: past `limit` resets
   by the client within `window` seconds on one connection, the wrap answers with
   GOAWAY (ENHANCE_YOUR_CALM) and closes the connection; its streams end as for a
   client that went away.
"""

from __future__ import annotations

import collections
import time
from typing import Any

import h2.errors
import h2.events
from mitmproxy.proxy import layer
from mitmproxy.proxy.layers.http import HttpStream
from mitmproxy.proxy.layers.http._http2 import Http2Connection, Http2Server, StreamState

_ORIGINAL_HANDLE_H2_EVENT = Http2Server.handle_h2_event
ORIGINALS = {(Http2Server, "handle_h2_event"): _ORIGINAL_HANDLE_H2_EVENT}
PINS = {
    "Http2Server.handle_h2_event": (_ORIGINAL_HANDLE_H2_EVENT, "d24a023c678de6ce"),
    # where a stream is forgotten and a reset of a forgotten one dropped
    "Http2Connection.handle_h2_event": (Http2Connection.handle_h2_event, "f6b6a52b12548102"),
    # GOAWAY with the error code given, then every tracked stream failed
    "Http2Connection.protocol_error": (Http2Connection.protocol_error, "461f5e7de9c9b687"),
    "Http2Connection.close_connection": (Http2Connection.close_connection, "44b76ed198e7916a"),
    # a client's reset of a stream already upstream cancels the upstream request
    "HttpStream.handle_protocol_error": (HttpStream.handle_protocol_error, "59fc3b2eeeabf63a"),
}
_RESETS = "_ttft_relay_client_resets"
"""Where a connection keeps the times of its client's latest resets."""


class ResetBudget:
    """At most `limit` resets within any `window` seconds (limit 0: no bound)."""

    __slots__ = ("limit", "window", "times")

    def __init__(self, limit: int, window: float) -> None:
        self.limit = limit
        self.window = window
        self.times: collections.deque[float] = collections.deque(maxlen=limit + 1)

    def spend(self, now: float) -> bool:
        """Count a reset at `now`; False once it is one too many."""
        if not self.limit:
            return True
        self.times.append(now)
        return len(self.times) <= self.limit or now - self.times[0] > self.window


_limit = 0
_window = 0.0


def install(limit: int, window: float) -> None:
    """Client resets always reach their flow; more than `limit` of them within `window`
    seconds close the connection (limit 0: no bound)."""
    global _limit, _window
    _limit, _window = limit, window
    Http2Server.handle_h2_event = _handle_h2_event  # type: ignore[method-assign]


def uninstall() -> None:
    global _limit
    _limit = 0
    Http2Server.handle_h2_event = _ORIGINAL_HANDLE_H2_EVENT  # type: ignore[method-assign]


def _handle_h2_event(self: Http2Server, event: Any) -> layer.CommandGenerator[bool]:
    if isinstance(event, h2.events.StreamReset) and event.remote_reset:
        if event.stream_id not in self.streams:
            # Forgotten at its END_STREAM (see 1. above): let the original report it,
            # or the connection's close below.
            self.streams[event.stream_id] = StreamState.HEADERS_RECEIVED
        budget = getattr(self, _RESETS, None)
        if budget is None or (budget.limit, budget.window) != (_limit, _window):
            budget = ResetBudget(_limit, _window)
            setattr(self, _RESETS, budget)
        if not budget.spend(time.monotonic()):
            yield from self.protocol_error(
                f"HTTP/2 rapid reset: more than {_limit} streams reset within {_window:g} s, closing the connection",
                error_code=h2.errors.ErrorCodes.ENHANCE_YOUR_CALM,
            )
            return True
    return (yield from _ORIGINAL_HANDLE_H2_EVENT(self, event))
