"""Upstream faults: the client gets the API's own error, the record names the phase.

- `error_reply` (pure) is the relay's answer before the response head, a JSON
  error in the API's format (`apierrors`); after the head, the stream ends with
  the API's error event.
- `ErrorReplies` installs `patches.fixes.error_replies` (the one place mitmproxy decides what a
  client sees when the upstream fails) and renders those errors for in-scope flows;
  out-of-scope flows keep mitmproxy's behaviour.
- `FailedConnects` gives a flow whose upstream connect or TLS handshake failed
  the marks of that connection: with `connection_strategy=lazy` mitmproxy keeps
  the failed connection off `flow.server_conn`, and the record would blame the
  wrong phase.
- `Deadlines` bounds every wait: connect, response head, first token, idle stream.
  A deadline that passes ends the flow's upstream request (its stream, on an HTTP/2
  connection other flows share; else the connection); the ordinary failure path
  then answers the client (through `ErrorReplies`) and writes the record.
- `Shutdown` ends the flows in flight at a clean stop through that same path, so
  each client hears why and each flow gets its record; `StopFirst` runs that stop
  before any other addon's `done`.
"""

from __future__ import annotations

import asyncio
import logging
import time
from dataclasses import dataclass
from collections.abc import Callable
from typing import Any

from mitmproxy import connection, ctx, http
from mitmproxy.proxy import server_hooks
from mitmproxy.tls import TlsData

from .. import listeners, state
from ..apis.other import API as OTHER_API
from ..apis.api import Api
from ..apis.reader import Watcher
from . import apierrors
from ..patches import connections, pins
from ..patches.fixes import answer_on_head, error_replies, inherited_listeners, stream_resets, trailers
from ..observe import selfwatch
from ..timing import addon as timing

logger = logging.getLogger(__name__)

ERROR_HEADER = "x-relay-error"
"""Set on the relay's own error replies, so a client can tell them from the upstream's."""
MESSAGE_PREFIX = "ttft-relay: "


# --- pure ------------------------------------------------------------------------------


def error_reply(api: Api, status: int, message: str) -> http.Response:
    """The relay's answer to an upstream failure before the response head."""
    return apierrors.error_response(
        api,
        status,
        message,
        {
            ERROR_HEADER: apierrors.error_code(status),
            # After a failed eager connect mitmproxy keeps the error on the client
            # connection: a new one retries the upstream.
            "connection": "close",
        },
    )


def can_append_event(response: http.Response, watcher: Watcher | None) -> bool:
    """Whether an SSE event can end this streamed body: an event stream, framed
    by chunks or by the close (not a length), not compressed, between events."""
    headers = response.headers
    return (
        headers.get("content-type", "").lower().startswith("text/event-stream")
        and "content-length" not in headers
        and "content-encoding" not in headers
        and watcher is not None
        and watcher.at_event_boundary
    )


# --- the error replies ---------------------------------------------------------------


class ErrorReplies:
    """Answers upstream failures of in-scope flows in the API's format: an HTTP
    error with the API's JSON error body before the response head went out, a
    final SSE error event and a clean end after it. Out-of-scope flows, and
    bodies an event cannot end cleanly (JSON, compressed), keep mitmproxy's
    behaviour: an HTML error page, or a cut connection."""

    def load(self, loader) -> None:
        if pins.on(error_replies):
            error_replies.install(self.render)
        if pins.on(trailers):
            trailers.answer_trailers()

    def done(self) -> None:
        error_replies.uninstall()
        trailers.uninstall()

    def render(self, flow: http.HTTPFlow, message: str, head_sent: bool) -> tuple[http.Response | None, bytes] | None:
        st = state.get(flow)
        if st is None:
            return None
        _replying.discard(flow)  # a stop waiting for this reply may go on once it is written
        status = st.error_status or 502
        text = MESSAGE_PREFIX + (st.error or message)
        if not head_sent:
            reply = error_reply(st.api, status, text)
            return reply, reply.raw_content or b""
        w = st.watcher
        if flow.response is not None and w is not None and can_append_event(flow.response, w):
            return None, apierrors.error_event(st.api, status, text, w.response_id)
        return None


class FailedConnects:
    """Puts the marks of a failed upstream connection (refused, DNS, connect
    timeout, TLS) on the flow that waited for it, so its record blames the right
    phase. mitmproxy fails the flow with the connection's own error text, which
    is how the two are matched."""

    def __init__(self) -> None:
        self.failed: dict[str, connection.Server] = {}
        """The last upstream connection that failed, per client connection id."""

    def server_connect_error(self, data: server_hooks.ServerConnectionHookData) -> None:
        self.failed[data.client.id] = data.server

    def tls_failed_server(self, data: TlsData) -> None:
        if isinstance(data.conn, connection.Server):
            self.failed[data.context.client.id] = data.conn

    def client_disconnected(self, client: connection.Client) -> None:
        self.failed.pop(client.id, None)

    def http_connect_error(self, flow: http.HTTPFlow) -> None:
        # Regular proxy mode connects upstream when the client's CONNECT arrives; if
        # that fails, mitmproxy answers the CONNECT with 502 and the requests the
        # tunnel was for never come. The CONNECT is then the flow to record (timing
        # reads the failed connection's marks from it). A CONNECT refused without a
        # connect attempt (proxy authentication) has no connection error.
        if flow.server_conn.error is None or state.get(flow) is not None:
            return
        st = state.attach(flow, state.FlowState(api=OTHER_API))
        st.record_error(flow.server_conn.error, phase="upstream_connect")

    def error(self, flow: http.HTTPFlow) -> None:
        if state.get(flow) is None or flow.error is None or flow.response is not None:
            return
        server = self.failed.get(flow.client_conn.id)
        if server is None or server is flow.server_conn or server.error != flow.error.msg:
            return  # an eager connection is flow.server_conn: timing reads it itself
        if server.timestamp_start is not None:
            state.mark(flow, "upstream_connect_start", server.timestamp_start)
        if server.timestamp_tcp_setup is not None:
            state.mark(flow, "upstream_tcp", server.timestamp_tcp_setup)


# --- bounded waits -------------------------------------------------------------------


@dataclass(frozen=True, slots=True)
class Limits:
    """Seconds; 0 turns a bound off."""

    head: float = 0
    first_token: float = 0
    idle: float = 0

    OPTIONS = frozenset({"relay_upstream_head_timeout", "relay_first_token_timeout", "relay_idle_timeout"})
    """The options they come from (declared by `Deadlines`; WebSocket turns read them too)."""

    @classmethod
    def from_options(cls, o: Any) -> Limits:
        return cls(max(o.relay_upstream_head_timeout, 0), max(o.relay_first_token_timeout, 0), max(o.relay_idle_timeout, 0))


@dataclass(frozen=True, slots=True)
class Progress:
    """What a flow has received so far (absolute `time.time()` seconds, None: not yet)."""

    started: float
    streamed: bool
    head: float | None = None
    first_token: float | None = None
    last_chunk: float | None = None


def next_deadline(p: Progress, limits: Limits, now: float) -> tuple[float, str | None] | None:
    """The next moment a flow's waits must be checked, and the failure it means
    if nothing happened by then (None: only a check), or None for no more waits.

    - head: from forwarding to the response head;
    - first token: from forwarding to the first visible token, for streamed requests;
    - idle: the longest silence in a response body once its first token (or, for a
      body without tokens, its head) arrived.

    A first token arrives without a hook, so while a stream waits for it with an
    idle bound set, the flow is checked every `idle` seconds as well: the idle bound
    then starts on time.
    """
    due: list[tuple[float, str | None]] = []
    if p.head is None and limits.head:
        due.append((p.started + limits.head, f"no response head after {limits.head:g} s"))
    if p.streamed and p.first_token is None and limits.first_token:
        due.append((p.started + limits.first_token, f"first token timeout after {limits.first_token:g} s"))
    if limits.idle and p.head is not None:
        if p.streamed and p.first_token is None:
            due.append((now + limits.idle, None))
        else:
            quiet_since = max(t for t in (p.head, p.first_token, p.last_chunk) if t is not None)
            due.append((quiet_since + limits.idle, f"{IDLE} {limits.idle:g} s"))
    return min(due, key=lambda d: d[0]) if due else None


IDLE = "stream idle for"
HELD_IDLE = "response body idle for"
"""The idle bound's failure for a body the relay holds for its length (not a stream)."""


def last_arrival(flow: http.HTTPFlow) -> float | None:
    """When the kernel last received bytes on `flow`'s upstream connection (Unix time), from
    TCP_INFO; None where that is unknown (no socket, not Linux). With HTTP/2 upstream, other
    streams' bytes count too: the bound is then looser, never tighter."""
    info = selfwatch.tcp_info(connections.connection_socket(flow.client_conn, flow.server_conn))
    return time.time() - info.last_data_recv_ms / 1000 if info is not None else None


def client_backlogged(flow: http.HTTPFlow) -> bool:
    """Whether the relay holds bytes for this flow's client that the client has not
    taken yet (its receive window is full): mitmproxy then stops reading the upstream."""
    transport = getattr(connections.writer(flow.client_conn, flow.client_conn), "transport", None)
    return transport is not None and transport.get_write_buffer_size() > 0


def close_upstream(flow: http.HTTPFlow, reason: str) -> bool:
    """Close the upstream connection `flow` waits on, through the connection handler
    that owns it; the HTTP layer then fails the flow as for any broken connection.

    With HTTP/2 to the upstream this closes the connection other flows share.
    """
    open_ = connections.open_on(flow.client_conn)
    target = flow.server_conn if flow.server_conn in open_ else None
    if target is None:
        # A lazy connect still in progress is not on the flow yet: find it by address.
        address = (flow.request.host, flow.request.port)
        target = next(
            (c for c in open_ if isinstance(c, connection.Server) and not c.connected and c.address == address),
            None,
        )
    if target is None:
        return False
    logger.info("%s: closing upstream connection: %s", flow.request.host, reason)
    return connections.close(flow.client_conn, target)


CONNECT_TIMEOUT = "upstream connect timeout after {:g} s"
SHARED_CUT = "the relay closed the shared upstream connection"


class Deadlines:
    """Bounds the waits of in-scope flows (see `next_deadline`) and of upstream
    connects. One timer per flow (or connect) at a time, rescheduled as the flow
    progresses, cancelled when it ends: nothing on the streaming hot path."""

    def __init__(self) -> None:
        self.limits = Limits()
        self.connect_timeout = 0.0
        self.timers: dict[http.HTTPFlow, tuple[float, asyncio.TimerHandle]] = {}
        """Per waiting flow: when it was forwarded, its next check."""
        self.connect_timers: dict[connection.Server, asyncio.TimerHandle] = {}

    def load(self, loader) -> None:
        loader.add_option(
            "relay_connect_timeout", int, 10,
            "Seconds an upstream connect (DNS and TCP) may take; 0: the operating system's limit.",
        )
        loader.add_option(
            "relay_upstream_head_timeout", int, 600,
            "Seconds from forwarding a request to the upstream's response head (a "
            "non-streamed answer sends its head when it is complete); 0: no limit.",
        )
        loader.add_option(
            "relay_first_token_timeout", int, 300,
            "Seconds from forwarding a streamed request to the first visible token; 0: no limit.",
        )
        loader.add_option(
            "relay_idle_timeout", int, 120,
            "Seconds a response body may stay silent once its first token (or head) "
            "arrived; 0: no limit.",
        )
        if pins.on(stream_resets):
            stream_resets.install()

    def configure(self, updated) -> None:
        if updated & Limits.OPTIONS:
            self.limits = Limits.from_options(ctx.options)
        if "relay_connect_timeout" in updated:
            self.connect_timeout = max(ctx.options.relay_connect_timeout, 0)

    def done(self) -> None:
        stream_resets.uninstall()
        for _, timer in self.timers.values():
            timer.cancel()
        for timer in self.connect_timers.values():
            timer.cancel()
        self.timers.clear()
        self.connect_timers.clear()

    # flows

    def request(self, flow: http.HTTPFlow) -> None:
        if state.get(flow) is not None and (self.limits.head or self.limits.first_token or self.limits.idle):
            self._check(flow, time.time())

    def responseheaders(self, flow: http.HTTPFlow) -> None:
        if flow in self.timers:
            self._check(flow)

    def relay_resent(self, flow: http.HTTPFlow) -> None:
        """The request went out once more (`patches.resend`): bounded from now as when forwarded."""
        self.request(flow)

    def response(self, flow: http.HTTPFlow) -> None:
        self._forget(flow)

    def error(self, flow: http.HTTPFlow) -> None:
        self._forget(flow)
        st = state.get(flow)
        if st is not None and flow.error is not None and flow.error.msg == CONNECT_TIMEOUT.format(self.connect_timeout):
            st.record_error(None, status=504)
        elif st is not None and flow.error is not None and flow.error.msg == trailers.REQUEST_TRAILERS:
            st.record_error(None, phase="relay")  # the relay cannot forward them (patches.trailers answered 501)

    def _forget(self, flow: http.HTTPFlow) -> None:
        if entry := self.timers.pop(flow, None):
            entry[1].cancel()

    def _check(self, flow: http.HTTPFlow, started: float | None = None) -> None:
        if started is None:
            started = self.timers[flow][0]
        self._forget(flow)
        st = state.get(flow)
        if st is None or not flow.live:
            return
        w = st.watcher
        held = flow.response is not None and w is None
        if held:
            # A body the relay holds for its length (a known length, or relay_stream off) shows
            # it no tokens. A stream's first token may take relay_first_token_timeout and then
            # none may be silent for relay_idle_timeout: with no tokens to tell which, no bound
            # applies. An answer that is not a stream (`stream: false`) is complete upstream
            # before its head: its silence is bounded by the idle bound, timed by when the
            # kernel last received bytes for it (TCP_INFO; none known, no bound).
            arrived = None if st.stream else last_arrival(flow)
            if arrived is None:
                return
            assert flow.response is not None
            progress = Progress(started=started, streamed=False, head=flow.response.timestamp_start,
                                last_chunk=arrived)
        else:
            progress = Progress(
                started=started,
                streamed=st.stream,
                head=flow.response.timestamp_start if flow.response is not None else None,
                first_token=w.first_token if w is not None else None,
                last_chunk=w.last_chunk if w is not None else None,
            )
        now = time.time()
        due = next_deadline(progress, self.limits, now)
        if due is None:
            return
        at, failure = due
        if held and failure is not None:
            failure = failure.replace(IDLE, HELD_IDLE, 1)
        if failure is not None and at <= now and failure.startswith(IDLE) and client_backlogged(flow):
            # The relay stopped reading the upstream because this client stopped reading
            # what it already has: the silence is the client's, not the stream's.
            logger.debug("%s: client not reading; idle deadline deferred", flow.request.host)
            at = now + self.limits.idle
        if at > now:
            timer = asyncio.get_running_loop().call_later(at - now, self._check, flow)
            self.timers[flow] = (started, timer)
        elif failure is not None:
            self._fail(flow, st, failure)

    def _fail(self, flow: http.HTTPFlow, st: state.FlowState, failure: str) -> None:
        st.record_error(failure, status=504)
        if flow.server_conn.alpn == b"h2" and (handler := connections.handler_of(flow.client_conn)) is not None:
            # The upstream connection carries other flows: reset this flow's stream only.
            def close_unless_reset(done: bool) -> None:
                if not done:
                    self._close_upstream(flow, failure)

            stream_resets.reset(handler, flow, failure, close_unless_reset)
        else:
            self._close_upstream(flow, failure)

    def _close_upstream(self, flow: http.HTTPFlow, failure: str) -> None:
        # With HTTP/2 the connection closed below carries other flows too: their cut is
        # the relay's doing, not their upstream's, and their records and clients say so.
        for other in self.timers:
            if other is not flow and other.server_conn is flow.server_conn and (o := state.get(other)) is not None:
                o.record_error(f"{SHARED_CUT}: {failure} on another request on it", phase="relay", status=502)
        if not close_upstream(flow, failure) and flow.killable:
            flow.kill()

    # connects

    def server_connect(self, data: server_hooks.ServerConnectionHookData) -> None:
        if self.connect_timeout and data.server.address is not None:
            loop = asyncio.get_running_loop()
            self.connect_timers[data.server] = loop.call_later(self.connect_timeout, self._connect_timed_out, data)

    def server_connected(self, data: server_hooks.ServerConnectionHookData) -> None:
        self._connect_over(data.server)

    def server_connect_error(self, data: server_hooks.ServerConnectionHookData) -> None:
        self._connect_over(data.server)

    def _connect_over(self, server: connection.Server) -> None:
        if timer := self.connect_timers.pop(server, None):
            timer.cancel()

    def _connect_timed_out(self, data: server_hooks.ServerConnectionHookData) -> None:
        self.connect_timers.pop(data.server, None)
        # The message becomes the connection's error, which mitmproxy passes on to the
        # flows waiting for it: `error` knows the timeout by it.
        if connections.cancel_connect(data.client, data.server, CONNECT_TIMEOUT.format(self.connect_timeout)):
            logger.info("upstream connect to %s timed out", data.server.address)


# --- a clean stop ------------------------------------------------------------------------


SHUTDOWN_STATUS = 503
SHUTDOWN_GRACE_S = 30
"""The default of relay_shutdown_grace: a coding agent's turn streams for seconds to
minutes, and one cut is sent again (paid twice). deploy/ttft-relay.service gives the stop
TimeoutStopSec=45: the grace, the cut flows' answers (CUT_WAIT_S) and exiting."""
CUT_WAIT_S = 5.0
FIRST_REQUEST_WAIT_S = 5.0
"""How long a stop waits for the first request of a connection it accepted (a head still
arriving, a TLS handshake): a client that connected sends it within a few round trips; one
that has not by then is idle (a preconnect) and is closed with the rest."""
POLL_S = 0.01
"""How long a stop waits for the flows it cut to be answered and recorded (they take
milliseconds); what is left then is recorded by timing's `done` all the same."""


_replying: set[http.HTTPFlow] = set()
"""Flows a stop has ended whose client reply `ErrorReplies.render` has not yet made.
The reply is written in the same step of the event loop as it is made, so once this
is empty the clients have their errors: mitmproxy's `error` hook runs before it."""


class Shutdown:
    """A clean stop (SIGTERM, SIGINT, `scripts/relay` stopping a worker) ends every
    in-scope flow in flight the way an upstream failure would: its client gets the
    API's error ("relay shutting down": a 503 before the response head, the API's
    error event and a clean end after it) and its record is written before the log
    closes. mitmproxy would run the `done` hooks first (the log closes) and only then
    cancel the connections, cutting each client off without a word or a record.

    First the listeners close (`listeners.let_go`): new connections are refused, the
    ones the kernel had queued are served (on sockets systemd holds, socket activation,
    nothing is refused: new connections wait there for the relay's next start). `relay_shutdown_grace` (default
    SHUTDOWN_GRACE_S, within the systemd unit's TimeoutStopSec) lets flows in flight
    finish on their own; a connection accepted just before the stop is waited for
    (FIRST_REQUEST_WAIT_S) and its first request served like those in flight (its client
    connected before the stop: on a restart it would otherwise get an error for a turn
    the relay took), its answer closing the connection; requests arriving meanwhile on
    connections that had one already get the 503. A worker with nothing in flight that
    exited at once would close such a connection under a client sending its POST.
    Flows still uploading their request (nothing forwarded, nothing to end cleanly) are
    recorded by timing's `done` and cut.

    A worker retiring on a reload (`listeners.RETIRE_SIGNAL` from the supervisor,
    ttft_relay/workers.py) lets go of its listeners (the workers replacing it accept
    from them), goes on serving the requests of its open connections, each answer
    with `Connection: close` (HTTP/1: the client's next request goes to a new worker),
    and stops once nothing is in flight or the grace is over. A connection it accepted whose
    first request has not come yet (a CONNECT, a TLS handshake, a head still arriving) is in
    flight too: its client connected to be served, and a worker that left then would reset it.
    Must come before timing in relay.py's list: timing's `done` closes the log; its
    stop runs from `StopFirst`, before every other addon's `done`.
    """

    def __init__(self) -> None:
        self.grace = SHUTDOWN_GRACE_S
        self.stopping = False
        self.retiring = False
        self.in_flight: set[http.HTTPFlow] = set()
        self.unasked: set[str] = set()
        """Client connections (by id) whose first request the relay has not read yet."""
        self._retire_task: asyncio.Task | None = None

    def load(self, loader) -> None:
        loader.add_option(
            "relay_shutdown_grace", int, SHUTDOWN_GRACE_S,
            "Seconds a clean stop (or a worker retiring on a reload) lets requests in flight "
            "finish on their own before it ends them with the API's error; 0: end them at once. "
            "Keep it under the systemd unit's TimeoutStopSec.",
        )

    def configure(self, updated) -> None:
        if "relay_shutdown_grace" in updated:
            self.grace = max(ctx.options.relay_shutdown_grace, 0)
        # Here, not in `load`: the supervisor declares this addon's options without running it.
        if pins.on(answer_on_head):
            answer_on_head.install(by="shutdown")

    def client_connected(self, client: connection.Client) -> None:
        self.unasked.add(client.id)

    def client_disconnected(self, client: connection.Client) -> None:
        self.unasked.discard(client.id)

    def requestheaders(self, flow: http.HTTPFlow) -> None:
        st = state.get(flow)
        # A connection's first request is served within the grace (its client came before the stop).
        first = flow.client_conn.id in self.unasked and self.grace > 0
        if st is not None and flow.response is None and self.stopping and not first:
            st.record_error(timing.SHUTDOWN_ERROR, phase="relay", status=SHUTDOWN_STATUS)
            answer_on_head.answer_now(flow, error_reply(st.api, SHUTDOWN_STATUS, MESSAGE_PREFIX + timing.SHUTDOWN_ERROR))
            return
        self.unasked.discard(flow.client_conn.id)
        if st is not None and flow.response is None:
            self.in_flight.add(flow)

    def responseheaders(self, flow: http.HTTPFlow) -> None:
        if (self.retiring or self.stopping) and flow.response is not None and flow.request.http_version.startswith("HTTP/1"):
            flow.response.headers["connection"] = "close"

    def response(self, flow: http.HTTPFlow) -> None:
        self.in_flight.discard(flow)

    def error(self, flow: http.HTTPFlow) -> None:
        self.in_flight.discard(flow)

    def running(self) -> None:
        try:
            asyncio.get_running_loop().add_signal_handler(listeners.RETIRE_SIGNAL, self.retire)
        except (NotImplementedError, AttributeError, RuntimeError):  # no such signal here (Windows)
            pass

    def retire(self) -> None:
        if self.retiring or self.stopping:
            return
        self.retiring = True
        self._retire_task = asyncio.get_running_loop().create_task(self._retire())

    async def _retire(self) -> None:
        await self._let_go(refuse=False)
        if (waiting := self._live()) or self.unasked:
            logger.info("retiring: finishing %d flow(s) in flight and %d connection(s) whose request has not come yet",
                        len(waiting), len(self.unasked))
            await _until(lambda: not self._live() and not self.unasked, self.grace)
        ctx.master.shutdown()

    async def done(self) -> None:
        await self.stop()  # StopFirst stopped already; where it is not loaded, here
        answer_on_head.uninstall(by="shutdown")

    async def stop(self) -> None:
        if self.stopping:
            return
        self.stopping = True
        try:
            asyncio.get_running_loop().remove_signal_handler(listeners.RETIRE_SIGNAL)
        except (NotImplementedError, AttributeError, RuntimeError):
            pass
        if not self.retiring:
            await self._let_go(refuse=True)
        if self.grace and ((waiting := self._live()) or self.unasked):
            # A connection the relay accepted is answered (served before the stop, the 503
            # after it), never closed under a client that is sending its request.
            logger.info("stopping: waiting up to %d s for %d flow(s) in flight and %d connection(s) whose request "
                        "has not come yet", self.grace, len(waiting), len(self.unasked))
            unasked_until = time.monotonic() + FIRST_REQUEST_WAIT_S
            await _until(lambda: not self._live() and (not self.unasked or time.monotonic() > unasked_until),
                         self.grace)
        for flow in self._live():
            st = state.get(flow)
            if st is None or "forwarded" not in st.marks:
                continue  # still uploading: timing records it
            # Cut in the phase it was in (the upstream's wait, most often): its time went there.
            st.record_error(timing.SHUTDOWN_ERROR, status=SHUTDOWN_STATUS)
            _replying.add(flow)
            if not close_upstream(flow, timing.SHUTDOWN_ERROR):
                _replying.discard(flow)
        if _replying:
            logger.info("stopping: ending %d flow(s) in flight", len(_replying))
            await _until(lambda: not _replying, CUT_WAIT_S)
            _replying.clear()

    @staticmethod
    async def _let_go(refuse: bool) -> None:
        servers = listeners.tcp_servers(ctx.master.addons.get("proxyserver"))
        # On systemd's sockets a stop refuses nothing: what they queue waits for the next start.
        kept = [server for server in servers if inherited_listeners.kept_open(server)]
        await listeners.let_go([server for server in servers if server not in kept], refuse=refuse)
        await listeners.let_go(kept, refuse=False)
        inherited_listeners.release()

    def _live(self) -> list[http.HTTPFlow]:
        return [f for f in self.in_flight if f.live]


class StopFirst:
    """`Shutdown`'s stop as the first `done` of the relay's addons (relay.py puts it first):
    the flows in flight finish, or are answered and recorded, while every other addon
    still runs as it did (its patches in, its log open); only then do they end."""

    def __init__(self, shutdown: Shutdown) -> None:
        self.shutdown = shutdown

    async def done(self) -> None:
        await self.shutdown.stop()


async def _until(condition: Callable[[], bool], seconds: float) -> None:
    """Wait until `condition()` holds, checking it every few ms, at most `seconds`."""
    deadline = time.monotonic() + seconds
    while not condition() and time.monotonic() < deadline:
        await asyncio.sleep(POLL_S)
