"""An upstream's answer is looked at before any byte of it reaches the client, and the
request may be sent once more in its place.

When an upstream refuses a request as too long, the relay trims it to the limit the
refusal names and sends it again (`trim.Trim`, once `trim.windows.judge_refusal` found the
refusal to be the provider's word about that request); the client must see only the
second answer, streamed as any answer is. No hook can do that: an answer's body is read after
`responseheaders`, and once the `response` hook has run, mitmproxy sends it
(`HttpStream.send_response`). The wrap of `send_response` runs, for a flow given to
`hold` whose answer was read whole (not streamed), the `relay_held_answer` hook
(`HeldAnswerHook`) before anything is sent: every addon's `response` hook and the send
wait for it. An addon that changed `flow.request` there and called `again(flow)` gets the
request sent once more, as `HttpStream.state_consume_request_body` sends one after the
`request` hook: on the flow's upstream connection if it is still open (an HTTP/1
keep-alive, the HTTP/2 connection), else on a new one (`make_server_connection`), and
the stream waits for response headers again. From there the second answer goes the way
of any answer: `responseheaders` (streaming, the stream watcher, deadlines), its body,
`response`. The first answer never reaches the client nor the `response` hook; the
addon keeps what it needs of it; the `relay_resent` hook (`ResentHook`) tells the
addons that wait on an answer (deadlines) that the wait starts again. A flow is held
once: its second answer is sent as it comes.

Held answers are read whole by mitmproxy: `hold` is for small bodies (an error), which
the holding addon makes sure of in `responseheaders` (`flow.response.stream = False`).
"""

from __future__ import annotations

import weakref
from dataclasses import dataclass
from typing import ClassVar

from mitmproxy import http
from mitmproxy.proxy import commands, layer
from mitmproxy.proxy.layers.http import (
    HttpStream,
    RequestData,
    RequestEndOfMessage,
    RequestHeaders,
    RequestTrailers,
    SendHttp,
)

from . import upstream_copy
from ..users import Users

_ORIGINAL_SEND_RESPONSE = HttpStream.send_response
ORIGINALS = {(HttpStream, "send_response"): _ORIGINAL_SEND_RESPONSE}
PINS = {
    "HttpStream.send_response": (_ORIGINAL_SEND_RESPONSE, "d581bc106152e369"),
    # _resend does what this does after the request hook, once more
    "HttpStream.state_consume_request_body": (HttpStream.state_consume_request_body, "45459c1bbd8bdb1a"),
    "HttpStream.make_server_connection": (HttpStream.make_server_connection, "ddc7bc72f4d2fbc7"),
    # a held answer is read whole (not streamed) and ends in send_response
    "HttpStream.state_wait_for_response_headers": (HttpStream.state_wait_for_response_headers, "10e32e91b2948164"),
    "HttpStream.state_consume_response_body": (HttpStream.state_consume_response_body, "5323db61dfc7e2e1"),
}
WITHOUT = ("an upstream's refusal of a request as too long reaches the client as the upstream sent it, "
           "not trimmed and sent again, and no window is learned from it (it is never read)")
_users = Users()
_held: weakref.WeakSet[http.HTTPFlow] = weakref.WeakSet()
_again: weakref.WeakSet[http.HTTPFlow] = weakref.WeakSet()


@dataclass
class HeldAnswerHook(commands.StartHook):
    """A held flow's answer was read whole and nothing of it was sent: an addon may
    change `flow.request` and call `again(flow)` to send it once more instead."""

    name: ClassVar[str] = "relay_held_answer"
    flow: http.HTTPFlow


@dataclass
class ResentHook(commands.StartHook):
    """A held flow's request went upstream once more: its wait for an answer starts again."""

    name: ClassVar[str] = "relay_resent"
    flow: http.HTTPFlow


def install(by: str) -> None:
    """Answers may be held for `by` (trim's refusals, the upstream groups' failover): on while anyone asks."""
    _users.add(by)
    HttpStream.send_response = _send_response  # type: ignore[method-assign]


def uninstall(by: str | None = None) -> None:
    """`by` no longer holds answers (None: no one does); out once no one does."""
    if not _users.release(by):
        return
    HttpStream.send_response = _ORIGINAL_SEND_RESPONSE  # type: ignore[method-assign]
    _held.clear()
    _again.clear()


def installed() -> bool:
    return HttpStream.send_response is _send_response


def hold(flow: http.HTTPFlow) -> None:
    """From `responseheaders` of an answer read whole: run `relay_held_answer` before it is sent."""
    _held.add(flow)


def again(flow: http.HTTPFlow) -> None:
    """From `relay_held_answer`: send `flow.request` once more instead of the held answer."""
    _again.add(flow)


def _send_response(self: HttpStream, already_streamed: bool = False) -> layer.CommandGenerator[None]:
    flow = self.flow
    if already_streamed or flow not in _held:
        return (yield from _ORIGINAL_SEND_RESPONSE(self, already_streamed))
    _held.discard(flow)
    yield HeldAnswerHook(flow)
    if flow not in _again or not flow.live or flow.error is not None:
        _again.discard(flow)
        return (yield from _ORIGINAL_SEND_RESPONSE(self, already_streamed))
    _again.discard(flow)
    return (yield from send_again(self))


def can_send_again(stream: HttpStream) -> bool:
    """`send_again` may send the stream's request: it went whole from a body the relay holds
    (not streamed), and nothing of its answer has come (no head, no error, the flow live)."""
    flow = stream.flow
    return (
        flow.response is None
        and flow.error is None
        and flow.live
        and stream.client_state == stream.state_done
        and stream.server_state == stream.state_wait_for_response_headers
        and not flow.request.stream
        and flow.request.raw_content is not None
    )


def send_again(self: HttpStream) -> layer.CommandGenerator[None]:
    """What `state_consume_request_body` does after the `request` hook, once more (also the
    upstream pool's retry of a request its reused connection lost: `speed.upstream_pool`)."""
    flow = self.flow
    flow.response = None
    self.response_body_buf.clear()
    self.server_state = self.state_wait_for_response_headers
    ok = yield from self.make_server_connection()
    if not ok:
        return
    content = flow.request.raw_content
    sent = upstream_copy.outgoing(flow, flow.request)  # with the upstream key, as the first time
    yield SendHttp(RequestHeaders(self.stream_id, sent, not (content or flow.request.trailers)), self.context.server)
    if content:
        yield SendHttp(RequestData(self.stream_id, content), self.context.server)
    if flow.request.trailers:
        yield SendHttp(RequestTrailers(self.stream_id, flow.request.trailers), self.context.server)
    yield SendHttp(RequestEndOfMessage(self.stream_id), self.context.server)
    yield ResentHook(flow)
