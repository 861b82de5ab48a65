"""WebSocket turns: one timing record per turn of an LLM API's WebSocket.

Codex CLI talks to the Responses API over a WebSocket by default: one upgrade
(`GET /v1/responses`, `Upgrade: websocket`) per session, then per turn one
`response.create` text message from the client, answered by the events an SSE
stream would carry, one JSON text message each (`response.created`, ...,
`response.output_text.delta`, ..., `response.completed`). The Realtime API
(`/v1/realtime`) works the same way, its turns ending in `response.done`.

Which sockets carry turns, and how a turn starts, is the API module's
`websocket_turns` (`ttft_relay/apis/`); the turn's events go to the API's reader.

The handshake is the flow itself: scope marks it `transport: websocket`,
streaming and timing leave its `101` exactly as it came, and timing records it
as turn 0 (upgrade request → 101, upstream connect and TLS included; a refused
or hung handshake gets the time it cost and a "websocket handshake failed"
verdict). This addon records every turn after it, with marks relative to the
moment the client's `response.create` reached the relay:

    request_body   0: the message arrived whole
    forwarded      the relay passed it on (every hook done)
    response_head  the turn's first server event (`response.created`): the upstream
                   wait is one round trip plus the upstream's queueing, as for HTTP
    first_token    the first visible output, by the API's stream reader (`ttft_relay/apis/`)
    last_token, end  the terminal event, or the close that cut the turn

A prewarm (`"generate": false`) is recorded as such, without a first token. The
first-token and idle bounds of `faults.Deadlines` apply to turns as well: a turn
that passes one is ended for the client with the API's own failure event
(`response.failed`), and the upstream side of the socket is closed, so the client
reconnects rather than waits on a response it was told has failed. An upstream that
accepts the upgrade and closes the socket before any turn fails the turn the client
sent meanwhile (mitmproxy drops it unseen): a turn record with the close code, timed
from the `101`.

mitmproxy keeps every message of a WebSocket flow in `flow.websocket.messages` for
the life of the flow, so one coding-agent session would hold every request and
every event; only the newest `relay_websocket_messages` are kept (mitmweb shows
them).
"""

from __future__ import annotations

import asyncio
import logging
import socket
import time
import weakref
from collections import deque
from dataclasses import dataclass, field

import orjson
from mitmproxy import ctx, http
from mitmproxy.net.http import http1
from mitmproxy.utils import human
from mitmproxy.websocket import WebSocketMessage

from .. import state
from ..apis.api import Api, Turns
from ..faults import addons as faults
from ..faults import apierrors
from ..patches import connections, error_texts
from ..patches.fixes import websocket_limits
from ..patches.speed import splice
from . import sse
from ..observe import selfwatch
from ..timing import phases, record
from ..flows import upstream_name
from ..timing.addon import SHUTDOWN_ERROR, SLOW_MARKER, Timing

logger = logging.getLogger(__name__)

CLOSED_EARLY = "WebSocket closed before the turn ended"
CLOSED_BEFORE_TURN = "WebSocket closed by the upstream before its first turn"
CORK_POLL_S, CORK_POLLS = 0.001, 50
"""How often, and how many times at most, a refused upgrade's client socket is looked at for
the whole answer before it is let go (the kernel lets a corked socket go after 200 ms anyway)."""
COMMENT_TURNS = 20
"""The newest turns listed in the flow's comment (mitmweb), newest first."""


# --- pure ------------------------------------------------------------------------------


def turn_marks(started: float, forwarded: float, w: sse.StreamWatcher, end: float | None) -> dict[str, float]:
    """A turn's marks in ms since its message reached the relay (see the module docstring)."""
    absolute = {
        "request_body": started,
        "forwarded": forwarded,
        "response_head": w.first_event,
        "first_byte": w.first_byte,
        "longest_gap": w.longest_gap,
        "first_event": w.first_event,
        "first_token": w.first_token,
        "last_token": w.last_token,
        "end": end,
    }
    return phases.relative_marks(absolute, started)


QUICK_CLOSE_S = 5.0
"""An upstream that closes a socket this soon after accepting it, before any turn, refused the session."""
NORMAL_CLOSES = (1000, 1001)
"""Normal closure, going away (RFC 6455 7.4.1): an idle socket ended, not a refusal."""


def refused_session(flow: http.HTTPFlow, open_s: float) -> bool:
    """Whether the upstream ended an accepted socket that carried no turn as a refusal: it
    closed it (or the connection broke on its side) at once, or with a code that is not a
    normal closure."""
    ws = flow.websocket
    if ws is None or ws.closed_by_client:
        return False
    if ws.closed_by_client is None:  # no close frame: the connection broke (the `error` hook)
        return flow.error is not None and not error_texts.client_gone(flow.error.msg)
    return open_s <= QUICK_CLOSE_S or ws.close_code not in NORMAL_CLOSES


def _uncork_when_written(sock: socket.socket, size: int, polls: int) -> None:
    """Let `sock` send once `size` bytes wait in it (or after `polls` more looks, or when it is gone).
    Counted in looks, not time: on a busy event loop the writes wait their turn as the looks do."""
    info = selfwatch.tcp_info(sock)
    if info is None or info.notsent_bytes is None or info.notsent_bytes >= size or polls <= 0:
        _cork(sock, False)
        return
    asyncio.get_running_loop().call_later(CORK_POLL_S, _uncork_when_written, sock, size, polls - 1)


def _cork(sock: socket.socket, on: bool) -> bool:
    """Hold (or let go) what is written to `sock` until a full segment or the release (Linux's
    TCP_CORK; elsewhere nothing). False where it cannot be set."""
    try:
        sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_CORK, int(on))
    except (AttributeError, OSError):
        return False
    return True


# --- the addon -------------------------------------------------------------------------


@dataclass(slots=True, eq=False)
class Turn:
    number: int
    started: float
    forwarded: float
    model: str | None
    prewarm: bool
    watcher: sse.StreamWatcher
    timer: asyncio.TimerHandle | None = None
    error: str | None = None
    trim: dict | None = None
    """What trimming did to its message (`FlowState.turn_trim`)."""


@dataclass(slots=True, eq=False)
class Session:
    """One WebSocket flow's turns."""

    api: Api
    protocol: Turns
    """How its turns start."""
    turns: int = 0
    turn: Turn | None = None
    closing: bytes | None = None
    """The failure event injected for a turn that passed a deadline: once it goes out, the
    upstream side is closed."""
    handshake_comment: str = ""
    turn_lines: deque[str] = field(default_factory=lambda: deque(maxlen=COMMENT_TURNS))


class WebSocketTurns:
    """Times each turn of a Responses (or Realtime) WebSocket and publishes one
    record per turn through `timing`; bounds what mitmproxy keeps of the socket."""

    def __init__(self, timing: Timing, watch: selfwatch.SelfWatch | None = None) -> None:
        self.timing = timing
        self.watch = watch
        """The self-watch, for each turn's link figures (the client's round trip, retransmits, ...)."""
        self.sessions: dict[http.HTTPFlow, Session] = {}
        self.keep = 100
        self.keep_bytes = 256 * 1024
        self.limits = faults.Limits()
        self.corked: weakref.WeakKeyDictionary[http.HTTPFlow, socket.socket] = weakref.WeakKeyDictionary()
        """Refused upgrades whose client socket holds the answer until it is complete."""

    def load(self, loader) -> None:
        loader.add_option(
            "relay_websocket_messages",
            int,
            100,
            "WebSocket messages kept per flow for viewing (mitmweb), at most relay_stream_view_max bytes "
            "of them besides the newest; older ones are dropped so a long agent session does not hold "
            "every message. Negative: keep all.",
        )

    def configure(self, updated: set[str]) -> None:
        if "relay_websocket_messages" in updated:
            self.keep = ctx.options.relay_websocket_messages
        if "relay_stream_view_max" in updated:  # Streaming's option: the bytes kept for viewing
            self.keep_bytes = human.parse_size(ctx.options.relay_stream_view_max) or 0
        # The bounds are the Deadlines addon's options: one setting for HTTP and WebSocket turns.
        if updated & faults.Limits.OPTIONS:
            self.limits = faults.Limits.from_options(ctx.options)

    def done(self) -> None:
        # Turns still open when the relay stops are recorded while the log is open:
        # this addon's `done` runs before timing's (relay.py's order).
        for flow, session in list(self.sessions.items()):
            self._finish(flow, session, error=SHUTDOWN_ERROR)
        self.sessions.clear()

    def responseheaders(self, flow: http.HTTPFlow) -> None:
        st = state.get(flow)
        if st is None or st.transport != record.WEBSOCKET or flow.response is None or flow.response.status_code == 101:
            return
        # A refused upgrade leaves in one write: a WebSocket client (Codex's) reads the answer
        # once, and a head without its body reads as "Unknown error" instead of the
        # upstream's text. mitmproxy writes head and body apart; the client's socket holds
        # them (TCP_CORK) until the answer is complete (`response`, or `error`).
        sock = connections.connection_socket(flow.client_conn, flow.client_conn)
        if sock is not None and _cork(sock, True):
            self.corked[flow] = sock

    def response(self, flow: http.HTTPFlow) -> None:
        if (sock := self.corked.pop(flow, None)) is not None and flow.response is not None:
            # mitmproxy writes the answer after this hook, in a step of its own: let it go once
            # the socket holds all of it.
            whole = len(http1.assemble_response_head(flow.response)) + len(flow.response.raw_content or b"")
            _uncork_when_written(sock, whole, CORK_POLLS)

    def websocket_start(self, flow: http.HTTPFlow) -> None:
        st = state.get(flow)
        if st is None:
            return
        protocol = st.api.websocket_turns
        if protocol is not None:
            self.sessions[flow] = Session(st.api, protocol, handshake_comment=flow.comment)

    def websocket_message(self, flow: http.HTTPFlow) -> None:
        assert flow.websocket is not None
        messages = flow.websocket.messages
        session = self.sessions.get(flow)
        if session is not None:
            self._observe(flow, session, messages[-1])
        if self.keep >= 0:
            self._keep_newest(messages)

    def _keep_newest(self, messages: list[WebSocketMessage]) -> None:
        """The newest `keep` messages; of those before the newest (passed on already), only as
        many as `relay_stream_view_max` bytes hold (ten 50 MB messages held 623 MB)."""
        if self.keep == 0:
            messages.clear()
            return
        n, kept = len(messages) - 1, len(messages[-1].content)
        oldest = max(len(messages) - self.keep, 0)
        while n > oldest and kept + len(messages[n - 1].content) <= self.keep_bytes:
            n -= 1
            kept += len(messages[n].content)
        if n:
            del messages[:n]

    def websocket_end(self, flow: http.HTTPFlow) -> None:
        session = self.sessions.pop(flow, None)
        if session is None:
            return
        ws = flow.websocket
        refused = websocket_limits.refused_by(flow.client_conn, flow.server_conn)
        if refused is not None and ws is not None:
            # A message past the relay's bounds (patches/fixes/websocket_limits.py) closed the socket. One
            # from the client started no turn: its record is one of its own, failed in the relay.
            if session.turn is None:
                self._start(flow, session, time.time(), None, False)
            self._finish(flow, session, error=ws.close_reason, error_phase="relay" if refused == "client" else None)
            return
        code = f" (close code {ws.close_code})" if ws is not None and ws.close_code is not None else ""
        by_client = bool(ws is not None and ws.closed_by_client)
        opened = flow.response.timestamp_start if flow.response is not None else time.time()
        if session.turn is None and session.turns == 0 and refused_session(flow, time.time() - opened):
            # A client sends its first turn as soon as it is connected (mitmproxy drops what
            # arrives after the close): that turn failed with the socket. Timed from the 101.
            st = state.get(flow)
            session.turns = 1
            session.turn = Turn(1, opened, opened, st.model if st is not None else None, False,
                                sse.StreamWatcher(session.api))
            self._finish(flow, session, error=CLOSED_BEFORE_TURN + code)
            return
        if session.turn is not None:
            self._finish(flow, session, error=CLOSED_EARLY + code, client_aborted=by_client)

    def error(self, flow: http.HTTPFlow) -> None:
        if (sock := self.corked.pop(flow, None)) is not None:
            _cork(sock, False)
        if flow.websocket is not None:
            self.websocket_end(flow)

    def _observe(self, flow: http.HTTPFlow, session: Session, message: WebSocketMessage) -> None:
        if message.injected:
            if session.closing is not None and message.content == session.closing:
                # The client gets the failure event as this hook returns; then the socket ends.
                session.closing = None
                faults.close_upstream(flow, "websocket turn deadline passed")
            return
        if not message.is_text or message.dropped:  # dropped: a refusal the turn is sent again for
            return
        if message.from_client:
            protocol = session.protocol
            body = protocol.request(message.content)
            if body is not None:
                self._start(flow, session, message.timestamp, protocol.model(body), protocol.prewarm(body))
                st = state.get(flow)
                if st is not None:
                    st.prefill_traits = session.api.prefill_traits(body)  # the turn's first-token line
                    if session.turn is not None:
                        session.turn.trim, st.turn_trim = st.turn_trim, None
            return
        if session.turn is None:
            if not session.protocol.server_started(message.content):
                return
            self._start(flow, session, message.timestamp, None, False)
        turn = session.turn
        assert turn is not None
        # Progress needs no timer work here: a deadline's timer rechecks the turn when it fires.
        turn.watcher.feed_event(message.content, message.timestamp)
        if turn.watcher.done or turn.watcher.error:
            self._finish(flow, session)

    def _start(self, flow: http.HTTPFlow, session: Session, at: float, model: str | None, prewarm: bool) -> None:
        if session.turn is not None:
            # A new turn before the last one ended: the client gave up on it.
            self._finish(flow, session, error="superseded by the next turn", client_aborted=True)
        session.turns += 1
        session.turn = Turn(session.turns, at, time.time(), model, prewarm, sse.StreamWatcher(session.api))
        self._check(flow, session)

    def _check(self, flow: http.HTTPFlow, session: Session) -> None:
        """(Re)arm the turn's deadline, or fail it if it passed."""
        turn = session.turn
        if turn is None:
            return
        if turn.timer is not None:
            turn.timer.cancel()
            turn.timer = None
        w = turn.watcher
        progress = faults.Progress(
            started=turn.forwarded,
            streamed=not turn.prewarm,
            head=w.first_event,
            first_token=w.first_token,
            last_chunk=w.last_chunk,
        )
        now = time.time()
        due = faults.next_deadline(progress, self.limits, now)
        if due is None:
            return
        at, failure = due
        if at > now:
            turn.timer = asyncio.get_running_loop().call_later(at - now, self._check, flow, session)
        elif failure is not None:
            self._fail(flow, session, failure)

    def _fail(self, flow: http.HTTPFlow, session: Session, failure: str) -> None:
        turn = session.turn
        assert turn is not None
        text = faults.MESSAGE_PREFIX + failure
        event = orjson.dumps(apierrors.stream_error(session.api, 504, text, turn.watcher.response_id))
        self._finish(flow, session, error=failure)
        if flow.live:
            session.closing = event
            ctx.master.commands.call("inject.websocket", flow, True, event, True)

    def _finish(self, flow: http.HTTPFlow, session: Session, *, error: str | None = None,
                client_aborted: bool = False, error_phase: str | None = None) -> None:
        turn, session.turn = session.turn, None
        if turn is None:
            return
        if turn.timer is not None:
            turn.timer.cancel()
        w = turn.watcher
        end = w.last_chunk if (w.done or w.error) and error is None else time.time()
        marks = turn_marks(turn.started, turn.forwarded, w, end)
        upstream = upstream_name(flow)
        st = state.get(flow)
        rec = record.measure(record.RecordInput(
            id=f"{flow.id}#{turn.number}",
            ts=turn.started,
            api=session.api.name,
            model=turn.model or (st.model if st is not None else None),
            stream=True,
            status=flow.response.status_code if flow.response is not None else None,
            upstream=upstream,
            marks=marks,
            tokens_expected=not turn.prewarm,
            tls_expected=flow.request.scheme == "https",
            reused_connection=True,
            rtt_ms=self.timing.upstream_rtt_ms(upstream),
            max_gap_ms=w.max_gap * 1000,
            chunks=w.chunks,
            bytes=w.bytes,
            token_events=w.token_events,
            usage=w.usage,
            prompt_tokens=turn.trim.get("tokens_after") if turn.trim else None,
            trim=turn.trim,
            error=error or w.error,
            error_phase=error_phase,
            client_aborted=client_aborted,
            request_id=flow.request.headers.get("x-request-id"),
            transport=record.WEBSOCKET,
            turn=turn.number,
            prewarm=turn.prewarm,
            body_path=splice.MITMPROXY,  # a WebSocket's messages go through mitmproxy's layers
            links=self.watch.turn_links(flow, turn.started) if self.watch is not None else None,
        ))
        data = self.timing.publish(rec, flow)
        # mitmweb shows one flow per socket: its comment lists the turns, newest first.
        slow = self.timing.is_slow(rec)
        session.turn_lines.appendleft(record.turn_line(data, slow=slow))
        if slow:
            flow.marked = SLOW_MARKER
        flow.comment = "\n".join(line for line in (*session.turn_lines, session.handshake_comment) if line)
