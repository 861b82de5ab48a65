"""Self-watch: the relay measures itself, so that when it is the slow hop it says so.

mitmproxy runs every connection on one event loop. When that loop is busy (a burst of
streams, neighbours on the same core), work waits where none of mitmproxy's
timestamps sees it: a new connection in the kernel's accept queue, a request or the
upstream's first token in a socket buffer. Its timestamps are taken when the loop
gets to the bytes, so without this the waiting shows up as client upload, upstream
wait or a stream stall: the network is blamed exactly when the relay is the cause.

- `LoopLag`: a timer every `LAG_INTERVAL_S`; how late it fires is the event loop's
  lag, sampled continuously (one callback per interval, nothing per flow).
- `GcPauses`: every garbage collection of the process, timed through `gc.callbacks`
  (a collection stops every thread: each live stream stalls for it at once); the
  record's `gc_pause_ms` is the longest one while the request ran, so a stall the loop's
  lag shows is told apart as the collector's or other work's.
- The accept queue of every listener: TCP_INFO of a listening socket gives the
  number of connections waiting to be accepted (`tcpi_unacked`).
- Per flow, TCP_INFO of its sockets (`tcpi_last_data_recv`: how long ago the kernel
  last received data) tells when the kernel had the bytes the relay is reading now:
  the marks `client_arrived` (request head), `body_arrived`, `head_arrived`
  (response head) and `token_arrived` (the chunk of the first token), from which
  `phases.compute` makes the `relay_queue` phase; and the record's `loop_lag_ms`
  (worst lag while the request ran), the client's and the upstream's round trips,
  retransmits, time in retransmission timeouts and packets that came out of order
  (`record.LINK_KEYS`), so a slow client link is named even on a kept-alive
  connection and a lossy upstream apart from a slow one.
- Per client connection, TCP_INFO as it is accepted tells how long the kernel's TCP
  handshake took (its round trip, or the SYN-ACK's retransmission timeouts): the
  marks `client_syn` (and `client_tcp`, its end) on its first request, where
  `connection_setup` begins.
- The client's figures are final only once it acknowledged the response: a segment
  lost on the way (the first token's among them) is retransmitted after the response
  hook. `settle` keeps the record back until then (every SETTLE_POLL_S, at most
  SETTLE_MAX_S), so those retransmits count in the request that suffered them.

The kernel keeps those receive times in jiffies (1-10 ms), so a hold shorter than
`HOLD_MIN_MS` is taken as none: the relay read the bytes at once. Linux only: where
TCP_INFO is missing (or laid out otherwise) nothing is marked and the link keys are
null; fields newer kernels added (min RTT 4.9+, out-of-order packets 5.4+, time in
retransmission timeouts 6.7+) are null on older ones. What the relay cannot see: a
client's SYN that was lost (the client waits its 1 s timeout before the relay hears
of it), and a lost request that fits in one segment (it arrives late, in order).
What loopback can show: the relay's own queueing (a saturated loop holds bytes on
loopback as anywhere). What it cannot: the RTT and retransmits of a real path — on
loopback they are microseconds and zero; through a TCP forwarder (or any proxy) the
kernel sees the link to that next hop only. ttft_relay/testing/fakes/link.py builds real far and
lossy links in network namespaces for the tests that need one.

The metrics addon draws the lag, the accept queues and the collections' pauses (`subscribe`).
"""

from __future__ import annotations

import asyncio
import functools
import gc
import logging
import socket
import struct
import time
import weakref
from collections import deque
from collections.abc import Callable, Iterable
from typing import NamedTuple

from mitmproxy import connection, http
from mitmproxy.proxy import server_hooks

from .. import state
from ..patches import connections
from ..patches.speed import upstream_pool
from ..timing import record

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
FIRST_FLIGHT_BYTES = 10 * 1448
"""What a new TCP connection sends before its first acknowledgement (RFC 6928: an initial window
of 10 segments of 1448 bytes, with timestamps). A request this small leaves in its first flight:
no upload round trips, whatever the time between the relay's `forwarded` mark and its kernel's
last send (on a loaded machine, the relay's own lateness in writing it, not the link)."""
SETTLE_POLL_S = 0.02
"""How often a finished request's client socket is asked whether the client acknowledged it all."""
SETTLE_MAX_S = 2.0
"""The longest a record waits for that: a retransmission timeout with a back-off or two."""

_TCP_INFO = getattr(socket, "TCP_INFO", None) if hasattr(socket, "IPPROTO_TCP") else None
_TCP_INFO_LEN = 104
"""Up to tcpi_total_retrans; every Linux since 2.6 fills that much."""
_TCP_INFO_ASK = 248
"""Up to tcpi_total_rto_time (Linux 6.7); older kernels return less."""
_NO_MIN_RTT = 0xFFFFFFFF


class TcpInfo(NamedTuple):
    """The fields of Linux's `struct tcp_info` the relay reads (times in ms)."""

    unacked: int
    """For a listening socket: connections waiting in its accept queue; else segments sent
    and not acknowledged yet."""
    sacked: int
    """For a listening socket: the accept queue's limit (the backlog)."""
    last_data_recv_ms: int
    """How long ago the kernel last received data on this connection."""
    rtt_ms: float
    """Smoothed round-trip time."""
    total_retrans: int
    """Segments retransmitted over the connection's life."""
    last_data_sent_ms: int | None = None
    """How long ago the kernel last sent data (a retransmission included)."""
    bytes_received: int | None = None
    """Payload bytes received over the connection's life."""
    notsent_bytes: int | None = None
    """Bytes written but not sent yet."""
    min_rtt_ms: float | None = None
    """The smallest round trip the kernel measured (over its window of minutes)."""
    out_of_order: int | None = None
    """Packets that arrived out of order (a segment before them was lost)."""
    rto_count: int | None = None
    """Retransmission timeouts, the handshake's included."""
    rto_time_ms: int | None = None
    """Time spent in retransmission-timeout recoveries (for an accepted connection whose
    SYN-ACK timed out: from the first SYN-ACK to the handshake's end)."""


def _field(raw: bytes, fmt: str, offset: int) -> int | None:
    return struct.unpack_from(fmt, raw, offset)[0] if len(raw) >= offset + struct.calcsize(fmt) else None


def parse_tcp_info(raw: bytes) -> TcpInfo | None:
    """`struct tcp_info` (linux/tcp.h) → the fields the relay reads; None if too short.
    Fields a kernel does not fill (older ones return less) are None."""
    if len(raw) < _TCP_INFO_LEN:
        return None
    unacked, sacked = struct.unpack_from("=II", raw, 24)
    (last_data_recv,) = struct.unpack_from("=I", raw, 52)
    (rtt_us,) = struct.unpack_from("=I", raw, 68)
    (total_retrans,) = struct.unpack_from("=I", raw, 100)
    min_rtt_us = _field(raw, "=I", 148)
    return TcpInfo(
        unacked, sacked, last_data_recv, rtt_us / 1000, total_retrans,
        last_data_sent_ms=_field(raw, "=I", 44),
        bytes_received=_field(raw, "=Q", 128),
        notsent_bytes=_field(raw, "=I", 144),
        min_rtt_ms=None if min_rtt_us in (None, _NO_MIN_RTT) else min_rtt_us / 1000,
        out_of_order=_field(raw, "=I", 224),
        rto_count=_field(raw, "=H", 240),
        rto_time_ms=_field(raw, "=I", 244),
    )


def tcp_info(sock: socket.socket | None) -> TcpInfo | None:
    """TCP_INFO of `sock`, or None (no socket, closed, not Linux)."""
    if sock is None or _TCP_INFO is None:
        return None
    try:
        return parse_tcp_info(sock.getsockopt(socket.IPPROTO_TCP, _TCP_INFO, _TCP_INFO_ASK))
    except OSError:
        return None


def handshake_ms(info: TcpInfo) -> float:
    """How long an accepted connection's TCP handshake took at the relay (its SYN in →
    the client's ACK in), from TCP_INFO read before the relay sent anything: its one
    round-trip sample, or the time the SYN-ACK's retransmission timeouts took."""
    if info.rto_count and info.rto_time_ms is not None:
        return float(info.rto_time_ms)
    return info.rtt_ms


class Counters(NamedTuple):
    """A connection's running totals, whose differences are a request's `LINK_KEYS`."""

    retransmits: int
    rto_time_ms: int | None
    out_of_order: int | None

    @classmethod
    def of(cls, info: TcpInfo) -> Counters:
        return cls(info.total_retrans, info.rto_time_ms, info.out_of_order)

    def since(self, before: Counters | None) -> Counters:
        """What was added after `before` (None: since the connection began)."""
        if before is None:
            return self

        def minus(now: int | None, then: int | None) -> int | None:
            return None if now is None else now - (then or 0)

        return Counters(self.retransmits - before.retransmits, minus(self.rto_time_ms, before.rto_time_ms),
                        minus(self.out_of_order, before.out_of_order))


def settled(info: TcpInfo | None, write_buffered: int) -> bool:
    """Whether everything written to a connection has been sent and acknowledged (or
    nothing more can be known: no TCP_INFO)."""
    return info is None or (write_buffered == 0 and info.unacked == 0 and not info.notsent_bytes)


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


def written_at(conn: connection.Server, forwarded: float) -> float:
    """When the relay wrote a request it forwarded at `forwarded` to `conn`: then, or once the
    connection it opened for it was up."""
    return max(t for t in (forwarded, conn.timestamp_tcp_setup, conn.timestamp_tls_setup) if t is not None)


def alone_on(flow: http.HTTPFlow, since: float, in_flight: Iterable[http.HTTPFlow], last_ended: float | None) -> bool:
    """Whether `flow` was the only stream on its HTTP/2 upstream connection from `since` on, so
    that the connection's last send is its own: no other stream on it in flight now, none ended
    since (`last_ended`: when the connection's last other stream ended). The connection's own
    frames (its SETTINGS acknowledgement) go with its first round trip, as the request's first
    flight does."""
    if last_ended is not None and last_ended > since:
        return False
    conn_id = flow.server_conn.id
    return not any(other is not flow and other.server_conn.id == conn_id for other in in_flight)


GC_PAUSE_KEPT_MS = 1.0
"""Collections shorter than this are drawn in the metrics but not kept for the records (the
youngest generation's, hundreds a second under load, cost microseconds each)."""


class GcPauses:
    """Times the process's garbage collections (`gc.callbacks`, in whichever thread collects).

    The callback only appends to deques (atomic under the GIL, no lock: a collection can
    start inside any allocation, a lock's holder's included); `drain()` hands the pauses
    since the last call to the event loop's side. `worst(since)` is the longest pause of at
    least GC_PAUSE_KEPT_MS since a `time.time()` moment.
    """

    def __init__(self) -> None:
        self.kept: deque[tuple[float, float]] = deque(maxlen=4096)
        """(wall time at its end, pause in s) of the collections of GC_PAUSE_KEPT_MS or more, oldest first."""
        self.fresh: deque[tuple[int, float]] = deque(maxlen=65536)
        """(generation, pause in s) of every collection not drained yet."""
        self._started: float | None = None

    def install(self) -> None:
        if self._callback not in gc.callbacks:
            gc.callbacks.append(self._callback)

    def uninstall(self) -> None:
        if self._callback in gc.callbacks:
            gc.callbacks.remove(self._callback)

    def _callback(self, phase: str, info: dict[str, int]) -> None:
        if phase == "start":
            self._started = time.perf_counter()
            return
        if self._started is None:  # installed in the middle of a collection
            return
        pause, self._started = time.perf_counter() - self._started, None
        self.fresh.append((info.get("generation", 0), pause))
        if pause * 1000 >= GC_PAUSE_KEPT_MS:
            self.kept.append((time.time(), pause))

    def drain(self) -> list[tuple[int, float]]:
        """The (generation, pause in s) of the collections since the last call."""
        out = []
        while self.fresh:
            out.append(self.fresh.popleft())
        return out

    def worst(self, since: float) -> float:
        """The longest pause (s) that ended after `since` (0.0: none of GC_PAUSE_KEPT_MS)."""
        worst = 0.0
        for at, pause in reversed(self.kept):
            if at < since:
                break
            worst = max(worst, pause)
        return worst


class SelfWatch:
    """Measures the relay's own event loop and sockets; marks what the kernel held."""

    def __init__(self) -> None:
        self.lag = LoopLag(self._sample)
        self.gc = GcPauses()
        self.subscribers: list[Callable[[float, dict[str, int] | None, list[tuple[int, float]]], None]] = []
        self.counted: dict[str, Counters] = {}
        """Per connection id, its totals already counted in an earlier record (for a client
        at its accept, the handshake's time in retransmission timeouts: connection set-up)."""
        self.handshakes: dict[str, tuple[float, float]] = {}
        """Per client id whose first request is still to come: when its SYN reached the relay,
        and when its TCP handshake was done (the client's ACK in)."""
        self.settling: dict[str, http.HTTPFlow] = {}
        """Per client id, its flow whose client figures wait for the client's acknowledgement."""
        self.reordered: weakref.WeakKeyDictionary[http.HTTPFlow, int] = weakref.WeakKeyDictionary()
        """Per flow, answer packets from the upstream that came out of order before its first token."""
        self.request_reordered: weakref.WeakKeyDictionary[http.HTTPFlow, int] = weakref.WeakKeyDictionary()
        """Per flow, packets of its request that came out of order (the client's losses)."""
        self.uploads_reordered: dict[str, int] = {}
        """Per client id, its out-of-order packets already counted in a request."""
        self.in_flight: weakref.WeakSet[http.HTTPFlow] = weakref.WeakSet()
        """Every flow from its request hook (before any byte of it goes upstream) to its end."""
        self.h2_ended: dict[str, float] = {}
        """Per HTTP/2 upstream connection id, when its last stream ended: until then the relay
        may have sent that stream's frames on it (its request, its window updates)."""
        self.serving_since: float | None = None
        """When this process began to serve (`running`): a worker's listeners exist before it,
        and what the kernel queued for them meanwhile waited for the start, not on a busy relay."""

    def subscribe(self, fn: Callable[[float, dict[str, int] | None, list[tuple[int, float]]], None]) -> None:
        """`fn(lag_s, accept_queues, gc_pauses)` for every lag sample; `accept_queues` ({listen
        address: connections waiting}) every ACCEPT_QUEUE_EVERY samples, else None;
        `gc_pauses` the (generation, pause in s) of the collections since the last sample."""
        self.subscribers.append(fn)

    def running(self) -> None:
        self.serving_since = time.time()
        self.gc.install()
        self.lag.start(asyncio.get_running_loop())

    def done(self) -> None:
        self.lag.stop()
        self.gc.uninstall()

    def _sample(self, lag: float, tick: int) -> None:
        queues = self.accept_queues() if tick % ACCEPT_QUEUE_EVERY == 0 else None
        pauses = self.gc.drain()
        for fn in self.subscribers:
            fn(lag, queues, pauses)

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

    # --- per connection ---------------------------------------------------------------

    def client_connected(self, client: connection.Client) -> None:
        info = tcp_info(connections.connection_socket(client, client))
        if info is None:
            return
        # The kernel's last receive is the handshake's end, or the client's first bytes
        # right after it; either way not after the accept.
        done = min(time.time() - info.last_data_recv_ms / 1000, client.timestamp_start)
        self.handshakes[client.id] = (done - handshake_ms(info) / 1000, done)
        # The handshake's retransmits count in the first request; their time is its set-up's.
        self.counted[client.id] = Counters(0, info.rto_time_ms, 0 if info.out_of_order is not None else None)

    def client_disconnected(self, client: connection.Client) -> None:
        self.counted.pop(client.id, None)
        self.uploads_reordered.pop(client.id, None)
        self.handshakes.pop(client.id, None)
        self.settling.pop(client.id, None)

    def server_connected(self, data: server_hooks.ServerConnectionHookData) -> None:
        # A pooled connection's totals so far were earlier clients'.
        if upstream_pool.adopted(data.server):
            if (info := tcp_info(connections.connection_socket(data.client, data.server))) is not None:
                self.counted[data.server.id] = Counters.of(info)

    def server_disconnected(self, data: server_hooks.ServerConnectionHookData) -> None:
        self.counted.pop(data.server.id, None)
        self.h2_ended.pop(data.server.id, None)

    # --- per flow ---------------------------------------------------------------------

    def requestheaders(self, flow: http.HTTPFlow) -> None:
        if (earlier := self.settling.pop(flow.client_conn.id, None)) is not None:
            # The connection's next request: what comes from here on is its own.
            self._settled(earlier)
        if state.get(flow) is None:
            return
        syn = None
        if (handshake := self.handshakes.pop(flow.client_conn.id, None)) is not None:
            syn, done = handshake
            state.mark(flow, "client_syn", syn)
            state.mark(flow, "client_tcp", done)
        t = arrival(self._socket(flow, flow.client_conn), flow.request.timestamp_start)
        if t is not None:
            accepted = flow.client_conn.timestamp_start
            # Within a jiffy before the accept is the kernel's clock, not a queue.
            state.mark(flow, "client_arrived", accepted if accepted - HOLD_MIN_MS / 1000 < t < accepted else t)
        seen = [x for x in (syn, t) if x is not None]
        if (since := self.serving_since) is not None and seen and min(seen) < since:
            state.mark(flow, "relay_serving", since)

    def request(self, flow: http.HTTPFlow) -> None:
        self.in_flight.add(flow)  # timed or not: its frames share an HTTP/2 connection all the same
        if state.get(flow) is None:
            return
        sock = self._socket(flow, flow.client_conn)
        end = flow.request.timestamp_end
        if end is not None and end - flow.request.timestamp_start > HOLD_MIN_MS / 1000:
            # The body was read after the head: did it arrive after it too?
            if (t := arrival(sock, end)) is not None:
                state.mark(flow, "body_arrived", t)
        # The client sends nothing more until its next request: what came out of order
        # so far is this request's (counted now, not when the answer was acknowledged,
        # by when the next request's first packets may be in).
        if (info := tcp_info(sock)) is not None and info.out_of_order is not None:
            seen = self.uploads_reordered.get(flow.client_conn.id, 0)
            self.request_reordered[flow] = info.out_of_order - seen
            self.uploads_reordered[flow.client_conn.id] = info.out_of_order

    def responseheaders(self, flow: http.HTTPFlow) -> None:
        st = state.get(flow)
        if st is None or flow.response is None:
            return
        upstream = self._socket(flow, flow.server_conn)
        if (t := arrival(upstream, flow.response.timestamp_start)) is not None:
            state.mark(flow, "head_arrived", t)
        self._mark_sent(flow, upstream)
        if flow.server_conn.alpn == b"h2":  # before the relay acknowledges the answer (window updates)
            self._mark_resent(flow, upstream)
        self._count_reordered(flow, upstream)
        tap = flow.response.stream
        if hasattr(tap, "on_first_token"):  # streaming.StreamTap: it calls back once, after the first token
            tap.on_first_token = functools.partial(self._probe_token, flow, st, upstream)

    def _probe_token(self, flow: http.HTTPFlow, st: state.FlowState, sock: socket.socket | None) -> None:
        """Mark when the kernel had the first token's chunk (called once by the stream tap)."""
        if st.watcher is not None and st.watcher.first_token is not None:
            if (t := arrival(sock, st.watcher.first_token)) is not None:
                st.marks.setdefault("token_arrived", t)
        self._count_reordered(flow, sock)

    def _count_reordered(self, flow: http.HTTPFlow, sock: socket.socket | None) -> None:
        if (info := tcp_info(sock)) is not None:
            before = self.counted.get(flow.server_conn.id)
            if (ooo := Counters.of(info).since(before).out_of_order) is not None:
                self.reordered[flow] = ooo

    def response(self, flow: http.HTTPFlow) -> None:
        self._links(flow)
        self._ended(flow)

    def error(self, flow: http.HTTPFlow) -> None:
        self._links(flow)
        self._ended(flow)

    def _ended(self, flow: http.HTTPFlow) -> None:
        self.in_flight.discard(flow)
        if flow.server_conn.alpn == b"h2":
            self.h2_ended[flow.server_conn.id] = time.time()

    def _links(self, flow: http.HTTPFlow) -> None:
        """The request's `record.LINK_KEYS`, for timing's record (which comes next); for
        an HTTP answer the client has not acknowledged yet, `settle` to make its side final."""
        st = state.get(flow)
        if st is None or st.links is not None:
            return
        # From the client's SYN on a connection's first request: a busy loop may have read its handshake late.
        start = min(st.marks.get("client_syn", flow.request.timestamp_start),
                    st.marks.get("client_arrived", flow.request.timestamp_start), flow.request.timestamp_start)
        # A WebSocket's handshake: its turns follow at once on the same connection.
        settling = st.transport == record.HTTP and self._socket(flow, flow.client_conn) is not None
        if flow.server_conn.timestamp_start is not None:
            upstream = self._socket(flow, flow.server_conn)
            if flow.response is None:
                self._mark_sent(flow, upstream)
            if flow.response is None or flow.server_conn.alpn != b"h2":  # HTTP/2's was read at the head
                self._mark_resent(flow, upstream)
        st.links = {**self.pauses(start),
                    **self.side_links(flow, "upstream"), **self.side_links(flow, "client", final=not settling)}
        if "upstream_retransmit_ms" in st.links:
            st.links["upstream_retransmit_ms"] = self._upstream_lost_ms(flow, st)
        if settling:
            st.settle = functools.partial(self._settle, flow, time.monotonic() + SETTLE_MAX_S)
            self.settling[flow.client_conn.id] = flow

    def _settle(self, flow: http.HTTPFlow, deadline: float) -> float | None:
        """Timing asks this until it returns None: then the flow's `links` are final. Else
        the seconds to wait before asking again."""
        st = state.get(flow)
        info = tcp_info(self._socket(flow, flow.client_conn))
        if info is None or st is None or st.links is None or st.settle is None:
            return None  # the connection is gone: the figures read last stand
        writer = connections.writer(flow.client_conn, flow.client_conn)
        buffered = writer.transport.get_write_buffer_size() if isinstance(writer, asyncio.StreamWriter) else 0
        if settled(info, buffered) or time.monotonic() >= deadline:
            self.settling.pop(flow.client_conn.id, None)
            self._settled(flow)
            return None
        # Read each time: a client that closes once it has everything leaves nothing to read after.
        st.links.update(self.side_links(flow, "client", final=False))
        return SETTLE_POLL_S

    def _settled(self, flow: http.HTTPFlow) -> None:
        """The client's figures of `flow` read for good."""
        st = state.get(flow)
        if st is not None and st.links is not None and st.settle is not None:
            st.links.update(self.side_links(flow, "client"))
            st.settle = None

    def _mark_sent(self, flow: http.HTTPFlow, sock: socket.socket | None) -> None:
        """Mark `upstream_sent` if the relay's kernel sent the last byte of a request larger than
        its first flight (FIRST_FLIGHT_BYTES) at least HOLD_MIN_MS after the relay wrote it (the
        request's upload took more round trips than its first flight, or a segment was resent).
        Read as the head arrives, or as the request fails without one: until then the relay
        sends an HTTP/1 upstream nothing but the request. On HTTP/2 another stream's frames may
        be the last sent: marked only where no other stream was in flight on the connection
        since the request was written (`alone_on`)."""
        conn = flow.server_conn
        if (info := tcp_info(sock)) is None or info.last_data_sent_ms is None:
            return
        st = state.get(flow)
        if st is None or (forwarded := st.marks.get("forwarded")) is None:
            return
        if len(flow.request.raw_content or b"") + len(bytes(flow.request.headers)) <= FIRST_FLIGHT_BYTES:
            return
        written = written_at(conn, forwarded)
        if conn.alpn == b"h2" and not alone_on(flow, written, self.in_flight, self.h2_ended.get(conn.id)):
            return
        last_sent = time.time() - info.last_data_sent_ms / 1000
        if (last_sent - written) * 1000 >= HOLD_MIN_MS:
            state.mark(flow, "upstream_sent", last_sent)

    def _mark_resent(self, flow: http.HTTPFlow, sock: socket.socket | None) -> None:
        """Mark `upstream_resent` if the upstream connection retransmitted during the request:
        the kernel's last send on it then is the request's last resending (the relay sends an
        HTTP/1 upstream nothing else while it waits on its answer). On HTTP/2 other streams'
        frames count in the connection's retransmits and may be the last sent: marked only
        where no other stream was in flight on it since the request was written (`alone_on`),
        and read as the head arrives (or the request fails without one), before the relay's
        window updates for the answer."""
        conn = flow.server_conn
        if (info := tcp_info(sock)) is None or info.last_data_sent_ms is None:
            return
        if conn.alpn == b"h2":
            st = state.get(flow)
            if st is None or (forwarded := st.marks.get("forwarded")) is None:
                return
            if not alone_on(flow, written_at(conn, forwarded), self.in_flight, self.h2_ended.get(conn.id)):
                return
        before = self.counted.get(conn.id)
        if info.total_retrans > (before.retransmits if before is not None else 0):
            state.mark(flow, "upstream_resent", time.time() - info.last_data_sent_ms / 1000)

    def _upstream_lost_ms(self, flow: http.HTTPFlow, st: state.FlowState) -> float:
        """What the upstream link lost to retransmissions before the first token: the request's
        resending (`upstream_resent` after it was first sent; already in the `upstream_upload`
        phase where `upstream_sent` is marked) and, where answer packets came out of order, one
        round trip: the least a lost segment costs (the sender learns of the hole from the
        relay's acknowledgements)."""
        m = st.marks
        sent = max(t for t in (m.get("forwarded"), m.get("upstream_tcp"), m.get("upstream_tls")) if t is not None) \
            if m.get("forwarded") is not None else None
        lost = 0.0
        if (resent := m.get("upstream_resent")) is not None and sent is not None and "upstream_sent" not in m:
            lost += max(0.0, resent - sent) * 1000
        if self.reordered.get(flow):
            info = tcp_info(self._socket(flow, flow.server_conn))
            if info is not None and info.min_rtt_ms is not None:
                lost += info.min_rtt_ms
        return round(lost, 3)

    def turn_links(self, flow: http.HTTPFlow, since: float) -> dict[str, float | int | None]:
        """The `record.LINK_KEYS` of a WebSocket turn that began at `since`: what the socket's
        two connections added since the previous turn's record (read as the turn ends)."""
        return {**self.pauses(since), **self.side_links(flow, "upstream"), **self.side_links(flow, "client")}

    def pauses(self, since: float) -> dict[str, float]:
        """The relay's own pauses since `since`: the loop's worst lag, the longest collection."""
        return {"loop_lag_ms": round(self.lag.worst(since) * 1000, 3),
                "gc_pause_ms": round(self.gc.worst(since) * 1000, 3)}

    def side_links(self, flow: http.HTTPFlow, side: str, *, final: bool = True) -> dict[str, float | int | None]:
        """The `record.LINK_KEYS` of one side of `flow` ("client", "upstream"): its round
        trips and what its totals added since the last record on the connection (`final`:
        those are counted now, the next record starts from here)."""
        conn = flow.client_conn if side == "client" else flow.server_conn
        info = tcp_info(self._socket(flow, conn)) if conn.timestamp_start is not None else None
        if info is None:
            return {}
        added = Counters.of(info).since(self.counted.get(conn.id))
        if final:
            self.counted[conn.id] = Counters.of(info)
        links: dict[str, float | int | None] = {}
        if side == "client":
            links["client_rtt_ms"] = round(info.rtt_ms, 3)
            links["client_min_rtt_ms"] = None if info.min_rtt_ms is None else round(info.min_rtt_ms, 3)
        else:
            links["upstream_tcp_rtt_ms"] = round(info.rtt_ms, 3)
        links[f"{side}_retransmits"] = added.retransmits
        links[f"{side}_retransmit_ms"] = None if added.rto_time_ms is None else float(added.rto_time_ms)
        links[f"{side}_out_of_order"] = added.out_of_order
        if side == "client" and (request := self.request_reordered.get(flow)) is not None:
            links["client_out_of_order"] = request  # an HTTP request's, counted when it was in (`request`)
        return links
