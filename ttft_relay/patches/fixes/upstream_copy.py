"""The request goes upstream as a changed copy (the upstream key in it, the client's hop-by-hop close dropped); the flow keeps the client's.

The relay swaps a client's relay key for the upstream key. Done on the flow, the
upstream key would sit in it while the request is in flight, and mitmweb shows flows in
flight. The wrap of `HttpStream.state_consume_request_body` leaves the flow as the
client sent it (its key redacted) and applies the swap given to `send_upstream_with` to
a copy of the request, the one whose head goes upstream (`SendHttp(RequestHeaders(...))`).
A request streamed upstream (`flow.request.stream`, which the relay never sets on keyed
listeners) would go out as the flow holds it.
"""

from __future__ import annotations

import weakref
from collections.abc import Callable
from typing import Any

from mitmproxy import http
from mitmproxy.proxy import events, layer
from mitmproxy.proxy.layers.http import HttpStream, RequestHeaders, SendHttp

from ..rewrite import replacing
from ..users import Users

_ORIGINAL_CONSUME_REQUEST_BODY = HttpStream.state_consume_request_body
ORIGINALS = {(HttpStream, "state_consume_request_body"): _ORIGINAL_CONSUME_REQUEST_BODY}
PINS = {
    "HttpStream.state_consume_request_body": (_ORIGINAL_CONSUME_REQUEST_BODY, "45459c1bbd8bdb1a"),
}
_users = Users()
_outgoing: weakref.WeakKeyDictionary[http.HTTPFlow, Callable[[http.Request], None]] = weakref.WeakKeyDictionary()


def install(by: str) -> None:
    """Changed copies go upstream for `by` (the relay keys, the upstream pool): on while anyone asks."""
    _users.add(by)
    HttpStream.state_consume_request_body = _consume_request_body  # type: ignore[method-assign]


def installed() -> bool:
    return HttpStream.state_consume_request_body is _consume_request_body


def send_upstream_with(flow: http.HTTPFlow, change: Callable[[http.Request], None]) -> None:
    """Send `flow`'s request upstream as a copy changed by `change` (after any change asked
    for before: the relay keys' swap, the upstream pool's hop-by-hop headers); the flow keeps its own.
    Where this patch is off the flow's own request goes, unchanged."""
    earlier = _outgoing.get(flow)
    _outgoing[flow] = change if earlier is None else _both(earlier, change)


def outgoing(flow: http.HTTPFlow, request: http.Request) -> http.Request:
    """`request` as it goes upstream for `flow`: a copy with its swap applied, or itself
    if it has none (also for a request sent once more, `patches.resend`)."""
    change = _outgoing.get(flow)
    if change is None:
        return request
    sent = request.copy()
    change(sent)
    return sent


def _both(first: Callable[[http.Request], None], then: Callable[[http.Request], None]) -> Callable[[http.Request], None]:
    def change(request: http.Request) -> None:
        first(request)
        then(request)

    return change


def uninstall(by: str | None = None) -> None:
    """Off for `by` (None: for everyone)."""
    if _users.release(by):
        HttpStream.state_consume_request_body = _ORIGINAL_CONSUME_REQUEST_BODY  # type: ignore[method-assign]


def _consume_request_body(self: HttpStream, event: events.Event) -> layer.CommandGenerator[None]:
    return (yield from replacing(_ORIGINAL_CONSUME_REQUEST_BODY(self, event), lambda c: _outgoing_head(self, c)))


def _outgoing_head(stream: HttpStream, command: Any) -> list[SendHttp] | None:
    if not (
        isinstance(command, SendHttp)
        and isinstance(command.event, RequestHeaders)
        and command.connection is stream.context.server
        and stream.flow in _outgoing
    ):
        return None
    sent = outgoing(stream.flow, command.event.request)
    return [SendHttp(RequestHeaders(command.event.stream_id, sent, command.event.end_stream), command.connection)]
