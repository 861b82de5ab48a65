"""Self-watch: the relay measures itself, so that when it is the slow hop it says so.

mitmproxy runs every connection on one event loop. When that loop is busy (a burst of
streams, neighbours on the same core), work waits where none of mitmproxy's
timestamps sees it: a new connection in the kernel's accept queue, a request or the
upstream's first token in a socket buffer. Its timestamps are taken when the loop
gets to the bytes, so without this the waiting shows up as client upload, upstream
wait or a stream stall: the network is blamed exactly when the relay is the cause.

- `LoopLag`: a timer every `LAG_INTERVAL_S`; how late it fires is the event loop's
  lag, sampled continuously (one callback per interval, nothing per flow).
- The accept queue of every listener: TCP_INFO of a listening socket gives the
  number of connections waiting to be accepted (`tcpi_unacked`).
- Per flow, TCP_INFO of its sockets (`tcpi_last_data_recv`: how long ago the kernel
  last received data) tells when the kernel had the bytes the relay is reading now:
  the marks `client_arrived` (request head), `body_arrived`, `head_arrived`
  (response head) and `token_arrived` (the chunk of the first token), from which
  `phases.compute` makes the `relay_queue` phase; and the record's `loop_lag_ms`
  (worst lag while the request ran), the client's and the upstream's smoothed RTT
  and retransmits (`record.LINK_KEYS`), so a slow client link is named even on a
  kept-alive connection.

The kernel keeps those receive times in jiffies (1-10 ms), so a hold shorter than
`HOLD_MIN_MS` is taken as none: the relay read the bytes at once. Linux only: where
TCP_INFO is missing (or laid out otherwise) nothing is marked and the link keys are
null. What loopback can show: the relay's own queueing (a saturated loop holds
bytes on loopback as anywhere). What it cannot: the RTT and retransmits of a real
path — on loopback they are microseconds and zero; through a local forwarder (or
any proxy) the kernel sees the link to that next hop only.

The metrics addon draws the lag and the accept queues (`subscribe`).
"""

from __future__ import annotations

import asyncio
import functools
import logging
import socket
import struct
import time
from collections import deque
from collections.abc import Callable
from typing import NamedTuple

from mitmproxy import connection, http
from mitmproxy.proxy import server_hooks

from .. import state
from ..patches import connections, upstream_pool

logger = logging.getLogger(__name__)

LAG_INTERVAL_S = 0.05
"""How often the event loop's lag is sampled."""
LAG_HORIZON_S = 600.0
"""How far back a request's worst lag is looked up (longer requests see their last 10 minutes)."""
ACCEPT_QUEUE_EVERY = 5
"""Accept queues are read every this many lag samples."""
HOLD_MIN_MS = 10.0
"""Bytes held for less than this are taken as read at once: the kernel's receive times
are in jiffies, up to 10 ms."""

_TCP_INFO = getattr(socket, "TCP_INFO", None) if hasattr(socket, "IPPROTO_TCP") else None
_TCP_INFO_LEN = 104
"""Up to tcpi_total_retrans; every Linux since 2.6 fills that much."""


class TcpInfo(NamedTuple):
    """The fields of Linux's `struct tcp_info` the relay reads (times in ms)."""

    unacked: int
    """For a listening socket: connections waiting in its accept queue."""
    sacked: int
    """For a listening socket: the accept queue's limit (the backlog)."""
    last_data_recv_ms: int
    """How long ago the kernel last received data on this connection."""
    rtt_ms: float
    """Smoothed round-trip time."""
    total_retrans: int
    """Segments retransmitted over the connection's life."""


def parse_tcp_info(raw: bytes) -> TcpInfo | None:
    """`struct tcp_info` (linux/tcp.h) → the fields the relay reads; None if too short."""
    if len(raw) < _TCP_INFO_LEN:
        return None
    unacked, sacked = struct.unpack_from("=II", raw, 24)
    (last_data_recv,) = struct.unpack_from("=I", raw, 52)
    (rtt_us,) = struct.unpack_from("=I", raw, 68)
    (total_retrans,) = struct.unpack_from("=I", raw, 100)
    return TcpInfo(unacked, sacked, last_data_recv, rtt_us / 1000, total_retrans)


def tcp_info(sock: socket.socket | None) -> TcpInfo | None:
    """TCP_INFO of `sock`, or None (no socket, closed, not Linux)."""
    if sock is None or _TCP_INFO is None:
        return None
    try:
        return parse_tcp_info(sock.getsockopt(socket.IPPROTO_TCP, _TCP_INFO, _TCP_INFO_LEN))
    except OSError:
        return None


def arrival(sock: socket.socket | None, read_at: float) -> float | None:
    """When the kernel last received data on `sock`, if that was at least HOLD_MIN_MS
    before `read_at` (the relay's own timestamp of reading it); else None."""
    now = time.time()
    info = tcp_info(sock)
    if info is None:
        return None
    arrived = now - info.last_data_recv_ms / 1000
    return arrived if (read_at - arrived) * 1000 >= HOLD_MIN_MS else None


class LoopLag:
    """Samples the running event loop's lag: how late a timer due every `interval` fires.

    `worst(since)` is the largest lag sampled since a `time.time()` moment; each
    sample also goes to `on_sample(lag_s, tick)`.
    """

    def __init__(self, on_sample: Callable[[float, int], None], interval: float = LAG_INTERVAL_S) -> None:
        self.interval = interval
        self.on_sample = on_sample
        self.samples: deque[tuple[float, float]] = deque(maxlen=int(LAG_HORIZON_S / interval))
        """(wall time, lag in s), oldest first."""
        self.ticks = 0
        self._handle: asyncio.TimerHandle | None = None
        self._loop: asyncio.AbstractEventLoop | None = None

    def start(self, loop: asyncio.AbstractEventLoop) -> None:
        self.stop()
        self._loop = loop
        self._schedule()

    def stop(self) -> None:
        if self._handle is not None:
            self._handle.cancel()
            self._handle = None

    def _schedule(self) -> None:
        assert self._loop is not None  # start() sets it before the first tick is scheduled
        due = self._loop.time() + self.interval
        self._handle = self._loop.call_at(due, self._tick, due)

    def _tick(self, due: float) -> None:
        assert self._loop is not None  # set by start(), which scheduled this tick
        lag = max(0.0, self._loop.time() - due)
        self.samples.append((time.time(), lag))
        self.ticks += 1
        self._schedule()
        self.on_sample(lag, self.ticks)

    def worst(self, since: float) -> float:
        """The largest lag (s) sampled after `since`, including the sample that was
        due before it and fired after it; 0.0 if none."""
        worst = 0.0
        for at, lag in reversed(self.samples):
            if at + self.interval < since:
                break
            worst = max(worst, lag)
        return worst


def _probe_token(st: state.FlowState, sock: socket.socket | None) -> None:
    """Mark when the kernel had the first token's chunk (called once by the stream tap)."""
    if st.watcher is not None and st.watcher.first_token is not None:
        if (t := arrival(sock, st.watcher.first_token)) is not None:
            st.marks.setdefault("token_arrived", t)


class SelfWatch:
    """Measures the relay's own event loop and sockets; marks what the kernel held."""

    def __init__(self) -> None:
        self.lag = LoopLag(self._sample)
        self.subscribers: list[Callable[[float, dict[str, int] | None], None]] = []
        self.retrans_seen: dict[str, int] = {}
        """Retransmits per connection id already counted in an earlier record."""

    def subscribe(self, fn: Callable[[float, dict[str, int] | None], None]) -> None:
        """`fn(lag_s, accept_queues)` for every lag sample; `accept_queues` ({listen
        address: connections waiting}) every ACCEPT_QUEUE_EVERY samples, else None."""
        self.subscribers.append(fn)

    def running(self) -> None:
        self.lag.start(asyncio.get_running_loop())

    def done(self) -> None:
        self.lag.stop()

    def _sample(self, lag: float, tick: int) -> None:
        queues = self.accept_queues() if tick % ACCEPT_QUEUE_EVERY == 0 else None
        for fn in self.subscribers:
            fn(lag, queues)

    def accept_queues(self) -> dict[str, int]:
        """Connections waiting to be accepted, per listen address."""
        queues = {}
        for sock in connections.listening_sockets():
            if (info := tcp_info(sock)) is not None:
                host, port = sock.getsockname()[:2]
                queues[f"{host}:{port}"] = info.unacked
        return queues

    def _socket(self, flow: http.HTTPFlow, conn) -> socket.socket | None:
        return connections.connection_socket(flow.client_conn, conn)

    # --- per flow ---------------------------------------------------------------------

    def requestheaders(self, flow: http.HTTPFlow) -> None:
        if state.get(flow) is None:
            return
        t = arrival(self._socket(flow, flow.client_conn), flow.request.timestamp_start)
        if t is not None:
            accepted = flow.client_conn.timestamp_start
            # Within a jiffy before the accept is the kernel's clock, not a queue.
            state.mark(flow, "client_arrived", accepted if accepted - HOLD_MIN_MS / 1000 < t < accepted else t)

    def request(self, flow: http.HTTPFlow) -> None:
        end = flow.request.timestamp_end
        if state.get(flow) is not None and end is not None and end - flow.request.timestamp_start > HOLD_MIN_MS / 1000:
            # The body was read after the head: did it arrive after it too?
            if (t := arrival(self._socket(flow, flow.client_conn), end)) is not None:
                state.mark(flow, "body_arrived", t)

    def responseheaders(self, flow: http.HTTPFlow) -> None:
        st = state.get(flow)
        if st is None or flow.response is None:
            return
        upstream = self._socket(flow, flow.server_conn)
        if (t := arrival(upstream, flow.response.timestamp_start)) is not None:
            state.mark(flow, "head_arrived", t)
        tap = flow.response.stream
        if hasattr(tap, "on_first_token"):  # streaming.StreamTap: it calls back once, after the first token
            tap.on_first_token = functools.partial(_probe_token, st, upstream)

    def response(self, flow: http.HTTPFlow) -> None:
        self._links(flow)

    def error(self, flow: http.HTTPFlow) -> None:
        self._links(flow)

    def _links(self, flow: http.HTTPFlow) -> None:
        """The request's `record.LINK_KEYS`, for timing's record (which comes next)."""
        st = state.get(flow)
        if st is None or st.links is not None:
            return
        start = min(st.marks.get("client_arrived", flow.request.timestamp_start), flow.request.timestamp_start)
        links: dict[str, float | int | None] = {"loop_lag_ms": round(self.lag.worst(start) * 1000, 3)}
        for side, conn in (("client", flow.client_conn), ("upstream", flow.server_conn)):
            info = tcp_info(self._socket(flow, conn)) if conn.timestamp_start is not None else None
            if info is not None:
                links["client_rtt_ms" if side == "client" else "upstream_tcp_rtt_ms"] = round(info.rtt_ms, 3)
                links[f"{side}_retransmits"] = info.total_retrans - self.retrans_seen.get(conn.id, 0)
                self.retrans_seen[conn.id] = info.total_retrans
        st.links = links

    def server_connected(self, data: server_hooks.ServerConnectionHookData) -> None:
        # A pooled connection's retransmits so far were earlier clients'.
        if upstream_pool.adopted(data.server):
            if (info := tcp_info(connections.connection_socket(data.client, data.server))) is not None:
                self.retrans_seen[data.server.id] = info.total_retrans

    def client_disconnected(self, client: connection.Client) -> None:
        self.retrans_seen.pop(client.id, None)

    def server_disconnected(self, data: server_hooks.ServerConnectionHookData) -> None:
        self.retrans_seen.pop(data.server.id, None)
