"""Upstream connections shared across client connections: no upstream handshake on a new client connection.

mitmproxy gives every client connection upstream connections of its own, so every new
client connection (a CLI run, a script, each Codex session's WebSocket) paid a TCP
connect and a TLS handshake upstream before its first request could leave: for an
upstream 100 ms away, 200–400 ms more on its first token. `UpstreamPool` keeps the
connections of a reverse listener's upstream when their client goes, opens a few ahead
of time (`relay_upstream_pool_warm`), and gives them to the next client connections:
their requests leave at once, as they would on a connection kept alive (the seams into
mitmproxy: `patches/speed/upstream_pool.py`).

What a pooled connection carries from one client to the next, and why that is safe:

- **Nothing of a request.** A connection goes back to the pool only when it is idle and
  clean: its last response read to its end by its framing, no byte unread or unsent,
  HTTP/1.1 kept alive, not upgraded, not half-closed, no error (`upstream_pool.park`).
  So no client can leave bytes behind that the next one would read as its answer.
- **One credential.** A connection that carried requests with one set of credentials
  (API keys in any API's place, proxy authorization, cookies: `upstream_pool.credential`)
  is only ever given to requests with the same set: servers may tie state to a
  connection (connection-based authentication, per-connection limits or affinity), and
  no client should inherit another's. A fresh connection carries none and goes to anyone.
  On a keyed listener every request goes upstream with the listener's key, so all its
  clients share its connections; a client connection that sent several credentials
  gives its connections back to no one.
- **Its TLS session.** Connections are keyed by address, TLS and SNI; their TLS is made
  by mitmproxy's own `tls_start_server` (verification, ciphers, client certificate, the
  options), offering HTTP/1.1 only: HTTP/2 connections stay mitmproxy's own, multiplexed
  per client connection (one HTTP/2 connection shared by several clients' streams would
  need one HTTP/2 state for streams of several of mitmproxy's connection handlers).

Connections wait in the pool at most `relay_upstream_pool_idle` seconds: servers close
idle keep-alive connections, and one closed just as a request is written to it fails
that request. The pool watches every idle connection (an upstream's close takes it out
at once), and replaces the warm ones before they would time out. It learns how long each
upstream's kept connections live (`KeptConnectionLife`): from one it closed idle, and from
one reused that closed before any byte of its answer (the request went again on a new
connection, after the wait for that close); it offers connections only while idle less than
0.8 of the shortest such age, and none that carried a request where that is under a second
(an upstream that closes each connection shortly after its answer, keep-alive advertised or
not: every reuse would pay a lost race, 132 ms at p50 for 3.6 ms without the pool in
`scripts/bench hostile --scenario pool-keepalive-race`); a minute with no such close, and
it forgets. A path that goes silent instead (a
NAT or firewall that forgot the connection, a peer gone: no close, no reset) is found by the
kernel: the pool's sockets have keepalive and TCP_USER_TIMEOUT (`relay_upstream_pool_silence`,
`watch_for_silence`), so an idle one ends with an error and leaves the pool, and a request
written on one ends before any byte of its answer and is sent once more on a new connection
(`upstream_pool`'s retry) — not a 504 after the first-token timeout. The eager connect of reverse
listeners (mitmproxy's, at client connect) gives way to the pool: a request takes its
connection when its head has arrived (`patches.speed.early_connects`), while its body
uploads, a pooled one at once. A client connection that arrives when the pool holds no
idle connection it could count on gets one opened for it at once, as mitmproxy's eager
connect would have (`client_connected`; not on keyed listeners, which connect no client
before its key is checked): its request takes it, and the pool keeps it after. Without
that, a miss began its connect and handshake only at the request's head, after the
client's own handshake and upload: a burst of new clients larger than the pool (every
stream at the start of a load, most of them on a saturated event loop) waited for both
in turn (long streams over TLS at 25/s, the relay with and without the pool in one run:
first token p50 302 ms against 83, the pool's 64 misses of 150 at 458 ms;
docs/benchmarks-notebook.md). Where a request finds nothing (an open listener whose clients bring
several credentials), it connects as before, and its connection joins the pool when its
client goes.

On by default (`relay_upstream_pool`): on a far link it takes the handshake off every new
client connection. Under load over TLS the benchmark once showed more stalled streams with it
(docs/benchmarks-notebook.md, *The pool under load over TLS* and *looked into again*); the
misses' late connects were one cause (fixed above), and in later runs the stalls with and
without it are within each other's noise (docs/benchmarks.md, *The pool's silent paths and
stalls, again*). `relay_upstream_pool=false` gives every client connection its own upstream
connections again (mitmproxy's own behaviour).

The pool's sockets use BBR where the kernel has it and allows it (`relay_upstream_pool_congestion`,
`set_congestion_control`): a pooled connection waits idle between its requests, and after an
idle spell longer than its retransmission timeout cubic sends from the initial window again
(ten segments, ~14 kB), so a longer request body waits a round trip per doubling; BBR keeps its
rate (docs/benchmarks.md, *BBR or cubic on the pool's connections*).

Records say whether a request paid a connect (`reused_connection`: false only for a
connection opened for it, with its `upstream_connect` / `upstream_tls` phases) and which
connection it used (`upstream_connection`: a pooled connection keeps its id from client to
client).
"""

from __future__ import annotations

import asyncio
import logging
import socket
import time
from collections.abc import Callable, Sequence
from typing import Any

from mitmproxy import connection, ctx, exceptions
from mitmproxy import http as mhttp
from mitmproxy.proxy import context, mode_specs
from mitmproxy.proxy.layers.tls import TlsStartServerHook
from mitmproxy.tls import TlsData
from OpenSSL import SSL

from . import dial, tls_resumption
from .patches import connections, pins
from .patches.fixes import eager_connects, upstream_copy
from .patches.speed import early_connects, upstream_pool
from .patches.speed.upstream_pool import HTTP1_ALPN, Opening, PoolKey, Pooled

logger = logging.getLogger(__name__)

POOLED_SCHEMES = ("http", "https")
CONNECT_TIMEOUT_S = 10.0
"""A warm-up connect or handshake that takes longer is given up (the next one is tried later)."""
LEARNED_IDLE_FACTOR = 0.8
MIN_IDLE_S = 1.0
"""A learned idle limit below this gives no reuse at all: connections that die that soon after an answer race every request."""
FORGET_AFTER_S = 60.0
"""A learned limit is forgotten this long after the last kept connection that died: reuse comes back."""
REWARM_BACKOFF_S = (1.0, 30.0)
"""After a failed warm-up the next waits this long, doubling up to the second."""
KEEPALIVE_PROBES_PER_SILENCE = 3
"""Keepalive probes sent within `relay_upstream_pool_silence` on an idle path (the first after a third of it)."""


def watch_for_silence(sock: socket.socket, silence_s: int) -> None:
    """Have the kernel end `sock` with an error once its path stayed silent `silence_s` seconds:
    data sent and not acknowledged that long (TCP_USER_TIMEOUT), or keepalive probes unanswered
    (sent after a third of it, every third of it; TCP_USER_TIMEOUT bounds them too). Without,
    a dead path (a NAT or firewall that forgot the connection, a peer gone) ends a connection
    only after the kernel's retransmissions (about 15 minutes), and an idle one never. Where
    the system lacks an option it is left out: the pool's own limits still hold."""
    if silence_s <= 0:
        return
    step = max(1, silence_s // KEEPALIVE_PROBES_PER_SILENCE)
    for level, name, value in (
        (socket.SOL_SOCKET, "SO_KEEPALIVE", 1),
        (socket.IPPROTO_TCP, "TCP_KEEPIDLE", step),
        (socket.IPPROTO_TCP, "TCP_KEEPINTVL", step),
        (socket.IPPROTO_TCP, "TCP_KEEPCNT", KEEPALIVE_PROBES_PER_SILENCE),
        (socket.IPPROTO_TCP, "TCP_USER_TIMEOUT", silence_s * 1000),
    ):
        if (option := getattr(socket, name, None)) is None:
            continue
        try:
            sock.setsockopt(level, option, value)
        except OSError as e:  # a socket type or system that refuses it
            logger.debug("%s not set on an upstream connection: %s", name, e)


def set_congestion_control(sock: socket.socket, name: str) -> bool:
    """Have `sock` use the kernel's congestion control `name` (TCP_CONGESTION; '': leave the
    system's); False where the system lacks it or does not allow it to this process (an
    unprivileged one may choose only from net.ipv4.tcp_allowed_congestion_control)."""
    if not name or (option := getattr(socket, "TCP_CONGESTION", None)) is None:
        return False
    try:
        sock.setsockopt(socket.IPPROTO_TCP, option, name.encode())
    except OSError as e:
        if name not in _refused_congestion:
            _refused_congestion.add(name)
            logger.info("the upstream pool's connections keep the system's congestion control: %s refused (%s; "
                        "as root: modprobe tcp_%s, and add it to net.ipv4.tcp_allowed_congestion_control)",
                        name, e, name)
        return False
    return True


_refused_congestion: set[str] = set()
"""The congestion controls the kernel refused (said once each)."""


def _watch_transport(writer: asyncio.StreamWriter) -> None:
    if (sock := writer.get_extra_info("socket")) is not None:
        watch_for_silence(sock, ctx.options.relay_upstream_pool_silence)
        set_congestion_control(sock, ctx.options.relay_upstream_pool_congestion)


def drop_close(request: mhttp.Request) -> None:
    """The request without the `close` and `keep-alive` tokens of its Connection header (the
    header gone with them; an upgrade's token stays)."""
    tokens = [t.strip() for t in request.headers.get("connection", "").split(",")]
    kept = [t for t in tokens if t and t.lower() not in ("close", "keep-alive")]
    if kept:
        request.headers["connection"] = ", ".join(kept)
    else:
        request.headers.pop("connection", None)


def pooled_listener(mode: mode_specs.ProxyMode) -> bool:
    """A reverse listener whose upstream connections the pool keeps (HTTP over TCP)."""
    return isinstance(mode, mode_specs.ReverseMode) and mode.scheme in POOLED_SCHEMES


def listener_key(mode: mode_specs.ProxyMode, keep_host_header: bool) -> PoolKey | None:
    """The connections a reverse listener's requests take (with the upstream's own name as
    SNI); None where that is not known before a request (with keep_host_header the SNI is
    each client's)."""
    if not isinstance(mode, mode_specs.ReverseMode) or mode.scheme not in POOLED_SCHEMES:
        return None
    host, port = mode.address
    tls = mode.scheme == "https"
    if tls and keep_host_header:
        return None
    return PoolKey(host, port, tls, host if tls else None)


def warm_keys(modes: Sequence[str], keep_host_header: bool) -> list[PoolKey]:
    """The connections to keep warm: one kind per reverse listener's upstream."""
    keys = []
    for spec in modes:
        try:
            mode = mode_specs.ProxyMode.parse(spec)
        except ValueError:
            continue
        key = listener_key(mode, keep_host_header)
        if key is not None and key not in keys:
            keys.append(key)
    return keys


class KeptConnectionLife:
    """How long each upstream's kept connections live idle, learned from those that died: an
    idle one the upstream closed in the pool, or a reused one that closed before any byte of
    its answer (its request then went once more on a new connection, a round trip and a wait
    for the close later). Connections are offered while idle less than `LEARNED_IDLE_FACTOR`
    of the shortest idle time after which one died; below `MIN_IDLE_S` not at all (an upstream
    that closes its connections shortly after each answer, whatever it advertises: each reuse
    would race its close), but a fresh one that never carried a request still is. What was
    learned is forgotten `FORGET_AFTER_S` after the last death, so a one-off close (a restart)
    does not end reuse for good; an upstream that goes on closing teaches it again."""

    def __init__(self) -> None:
        self.shortest: dict[PoolKey, tuple[float, float]] = {}
        """Per upstream, (the shortest idle time after which a kept connection died, when the last died)."""

    def died(self, key: PoolKey, idle_s: float, now: float) -> float | None:
        """A kept connection of `key`'s died after `idle_s` idle (seen at `now`, monotonic): the
        new limit if that cut reuse back further (`limit`), else None."""
        before = self.limit(key, now)
        shortest = min(idle_s, self.shortest[key][0]) if key in self.shortest else idle_s
        self.shortest[key] = (shortest, now)
        after = self.limit(key, now)
        assert after is not None
        return after if before is None or after < before else None

    def limit(self, key: PoolKey, now: float) -> float | None:
        """How long `key`'s connections may have been idle to be reused: None, as long as they
        stay in the pool (nothing learned); 0.0, no reuse."""
        if (learned := self.shortest.get(key)) is None:
            return None
        shortest, last_died = learned
        if now - last_died > FORGET_AFTER_S:
            del self.shortest[key]
            return None
        limit = LEARNED_IDLE_FACTOR * shortest
        return limit if limit >= MIN_IDLE_S else 0.0

    def offers(self, key: PoolKey, idle_s: float, answered: bool, now: float) -> bool:
        """Whether a connection of `key`'s idle `idle_s` may go to a request (`answered`: it carried one)."""
        limit = self.limit(key, now)
        if limit is None:
            return True
        if limit == 0.0:
            return not answered
        return idle_s < limit


class UpstreamPool:
    """Keeps reverse listeners' upstream connections for later client connections (see the module docstring)."""

    def __init__(self) -> None:
        self.idle: dict[PoolKey, list[Pooled]] = {}
        self.warm: list[PoolKey] = []
        self.connecting: dict[PoolKey, int] = {}
        self.life = KeptConnectionLife()
        self.backoff: dict[PoolKey, float] = {}
        self.timers: dict[Pooled, asyncio.TimerHandle] = {}
        self.tasks: set[asyncio.Task] = set()
        self.counting_on_idle: dict[PoolKey, set[str]] = {}
        """Per upstream, the clients that connected while an idle connection was there for them."""
        self.opening_for: dict[str, Opening] = {}
        """Per client, the connection being opened for it since it connected."""
        self.on = False
        self.started = False

    def load(self, loader) -> None:
        loader.add_option(
            "relay_upstream_pool", bool, True,
            "Keep reverse listeners' upstream connections when their client connection ends and give "
            "them to the next client connections (one credential per connection, HTTP/1.1), so that a "
            "new client connection does not wait for an upstream connect and TLS handshake. Off: every "
            "client connection connects upstream itself (mitmproxy's own behaviour).",
        )
        loader.add_option(
            "relay_upstream_pool_warm", int, 2,
            "Upstream connections the pool keeps open ahead of any request, per reverse listener's upstream.",
        )
        loader.add_option(
            "relay_upstream_pool_idle", int, 30,
            "Seconds an upstream connection may wait in the pool (it is replaced before then, if warm): "
            "below the upstream's own idle timeout, which the pool also learns when an upstream closes "
            "an idle connection sooner.",
        )
        loader.add_option(
            "relay_upstream_pool_silence", int, 15,
            "Seconds a pooled upstream connection's path may stay silent (data sent and not "
            "acknowledged, keepalive probes unanswered) before the kernel ends it (TCP_USER_TIMEOUT, "
            "TCP keepalive): an idle one leaves the pool, one whose request has no byte of answer yet "
            "has its request sent once more on a new connection. 0: the system's own limits (minutes).",
        )
        loader.add_option(
            "relay_upstream_pool_congestion", str, "bbr",
            "The TCP congestion control of the pool's upstream connections (TCP_CONGESTION), where the "
            "kernel has it and allows it to the relay, else the system's ('': the system's). BBR keeps "
            "its sending rate across a pooled connection's idle spells, where cubic starts over from "
            "ten segments: a 64 kB request to a far upstream left in one round trip instead of three "
            "(docs/benchmarks.md).",
        )
        loader.add_option(
            "relay_upstream_pool_max", int, 32,
            "Idle upstream connections the pool keeps at most, per upstream (more are closed).",
        )

    def configure(self, updated: set[str]) -> None:
        names = {"relay_upstream_pool", "relay_upstream_pool_warm", "relay_upstream_pool_idle",
                 "relay_upstream_pool_max", "relay_upstream_pool_silence", "mode", "keep_host_header",
                 pins.SPEED_OPTION}
        if not updated & names:
            return
        opts = ctx.options
        if opts.relay_upstream_pool_warm < 0 or opts.relay_upstream_pool_max < 0:
            raise exceptions.OptionsError("relay_upstream_pool_warm and relay_upstream_pool_max must be >= 0")
        if opts.relay_upstream_pool_idle <= 0:
            raise exceptions.OptionsError("relay_upstream_pool_idle must be > 0")
        if opts.relay_upstream_pool_silence < 0:
            raise exceptions.OptionsError("relay_upstream_pool_silence must be >= 0")
        self.on = bool(opts.relay_upstream_pool) and pins.on(upstream_pool)
        upstream_pool.install(self if self.on else None)
        eager_connects.defer(pooled_listener if self.on else None, by="pool")
        for patch in (upstream_copy, early_connects):
            if self.on and pins.on(patch):
                patch.install(by="pool")
            else:
                patch.uninstall(by="pool")
        self.warm = warm_keys(opts.mode, opts.keep_host_header) if self.on else []
        if not self.on:
            self._close_all()
        elif self.started:
            self._rewarm_all()

    def running(self) -> None:
        self.started = True
        self._rewarm_all()

    def done(self) -> None:
        self.started = False
        for client_id in list(self.opening_for):
            self._forget_client(client_id)
        upstream_pool.install(None)
        eager_connects.defer(None, by="pool")
        upstream_copy.uninstall(by="pool")
        early_connects.uninstall(by="pool")
        self._close_all()
        for task in list(self.tasks):
            task.cancel()

    def requestheaders(self, flow: mhttp.HTTPFlow) -> None:
        # Where the request has no connection at hand (none of its client's, none idle in the
        # pool), it connects once its head is here, while its body uploads: the eager connect
        # gave way to the pool. (Before the relay keys are checked too: the connect is handed
        # to the HTTP layer after every requestheaders hook, and skipped for a refused flow.)
        mode = flow.client_conn.proxy_mode
        if not self.on or flow.response is not None or not pooled_listener(mode):
            return
        assert isinstance(mode, mode_specs.ReverseMode)
        if flow.request.http_version == "HTTP/1.1" and "close" in flow.request.headers.get("connection", "").lower():
            # The client's hop ends after this answer, not the upstream connection (Connection is
            # hop-by-hop): the request goes upstream without it, the client's connection closes as asked.
            upstream_copy.send_upstream_with(flow, drop_close)
        if self._idle_for(mode.address) or any(
            isinstance(c, connection.Server) and c.address == mode.address and c.connected
            for c in connections.open_on(flow.client_conn)
        ):
            return
        if (handler := connections.handler_of(flow.client_conn)) is not None:
            early_connects.connect_early(handler, flow)

    def _idle_for(self, address: tuple[str, int]) -> bool:
        return any(self._offerable(key) for key in self.idle if (key.host, key.port) == address)

    def _offerable(self, key: PoolKey) -> list[Pooled]:
        """`key`'s idle connections a request may take (`KeptConnectionLife.offers`)."""
        now = time.monotonic()
        return [p for p in self.idle.get(key, ()) if self.life.offers(key, now - p.idle_since, p.uses > 0, now)]

    def client_connected(self, client: connection.Client) -> None:
        # Where mitmproxy would connect upstream now (its eager connect, which gave way to the
        # pool), the pool does unless it has an idle connection for this client: a miss would
        # otherwise connect only once the request's head is here (see the module docstring).
        mode = client.proxy_mode
        if not self.on or not pooled_listener(mode) or eager_connects.deferred(mode, besides="pool"):
            return
        key = listener_key(mode, ctx.options.keep_host_header)
        if key is None:
            return
        counting = self.counting_on_idle.setdefault(key, set())
        if len(self._offerable(key)) > len(counting):
            counting.add(client.id)
            return
        opening: asyncio.Future[Pooled | None] = asyncio.get_running_loop().create_future()
        ahead = self.opening_for[client.id] = Opening(key, time.time(), opening)
        self._spawn(self._open_ahead(ahead))

    async def _open_ahead(self, ahead: Opening) -> None:
        key, opening = ahead.key, ahead.done
        pooled = None
        try:
            pooled = await asyncio.wait_for(_open(key, ahead), CONNECT_TIMEOUT_S)
            logger.debug("upstream connection %s opened ahead of a request", pooled.id)
        except asyncio.CancelledError:
            raise
        except Exception as e:  # the request connects itself, and says what failed
            logger.debug("upstream connection to %s:%d not opened ahead of a request (%s)", key.host, key.port,
                         e or type(e).__name__)
        finally:
            if not opening.done():
                opening.set_result(pooled)
            elif pooled is not None:
                pooled.close()

    def _forget_client(self, client_id: str) -> None:
        for counting in self.counting_on_idle.values():
            counting.discard(client_id)
        if (ahead := self.opening_for.pop(client_id, None)) is not None:
            self.let_go(ahead.done)

    def client_disconnected(self, client: connection.Client) -> None:
        self._forget_client(client.id)
        # Before mitmproxy closes the client's upstream connections.
        handler = connections.handler_of(client)
        if handler is None or not self.on:
            return
        for conn in list(handler.transports):
            if not upstream_pool.poolable(conn) or (parked := upstream_pool.park(handler, conn)) is None:
                continue
            pooled, ending = parked
            ending.add_done_callback(self._parked(pooled))

    def _parked(self, pooled: Pooled) -> Callable[[asyncio.Task], None]:
        """What receives `pooled` once its client's task for it ended (its reader is free then)."""
        return lambda _task: self._receive(pooled)

    # the pool (upstream_pool.Pool)

    def take(self, key: PoolKey, credential: bytes, client: connection.Client) -> Pooled | None:
        """An idle connection for `key` whose requests had `credential`, else a fresh one; None if none."""
        self.counting_on_idle.get(key, set()).discard(client.id)
        offerable = self._offerable(key)
        found = None
        for candidate in (*(p for p in reversed(offerable) if p.credential == credential),
                          *(p for p in reversed(offerable) if p.credential is None)):
            if candidate.alive():
                found = candidate
                break
        if found is None:
            self._rewarm(key)  # the request connects itself; the pool gets ready for the next
            return None
        self.idle[key].remove(found)
        self._unschedule(found)
        found.credential = credential
        found.taken_idle_s = time.monotonic() - found.idle_since
        self._rewarm(key)
        if (ahead := self.opening_for.get(client.id)) is not None and ahead.key == key:
            self._forget_client(client.id)  # the one opened for it goes to the pool
        return found

    def opened_ahead(self, key: PoolKey, client: connection.Client) -> Opening | None:
        """The connection being opened for `client` since it connected, if it is `key`'s (once)."""
        ahead = self.opening_for.get(client.id)
        if ahead is None or ahead.key != key:
            return None
        del self.opening_for[client.id]
        return ahead

    def put_back(self, pooled: Pooled) -> None:
        self._receive(pooled)

    def reuse_failed(self, pooled: Pooled) -> None:
        """`pooled`, taken from the pool, closed before any byte of its request's answer."""
        if pooled.taken_idle_s is not None:
            self._died(pooled, pooled.taken_idle_s, "a reused connection closed before its answer")

    def let_go(self, opening: asyncio.Future[Pooled | None]) -> None:
        """A connection opened ahead that no request waits for: into the pool once open."""
        opening.add_done_callback(self._opened_unclaimed)

    def _opened_unclaimed(self, opening: asyncio.Future[Pooled | None]) -> None:
        if not opening.cancelled() and (pooled := opening.result()) is not None:
            self._receive(pooled)

    # internals

    def _receive(self, pooled: Pooled) -> None:
        """A connection enters the pool (parked once its client task ended, or a warm one)."""
        idle = self.idle.setdefault(pooled.key, [])
        now = time.monotonic()
        if (not self.started or not self.on or not pooled.alive() or len(idle) >= ctx.options.relay_upstream_pool_max
                or not self.life.offers(pooled.key, 0.0, pooled.uses > 0, now)):
            pooled.close()
            return
        pooled.idle_since = now
        pooled.taken_idle_s = None
        _watch_transport(pooled.writer)  # a parked connection was mitmproxy's, without
        idle.append(pooled)
        pooled.watching = _Watch(pooled, self._ended)
        pooled.transport.set_protocol(pooled.watching)
        pooled.transport.resume_reading()
        loop = asyncio.get_running_loop()
        self.timers[pooled] = loop.call_later(self._idle_limit(pooled.key), self._expire, pooled)
        if buffered := pooled.reader._buffer:  # type: ignore[attr-defined]
            # What came before the watch (a connection opened ahead: the TLS session tickets
            # after its handshake) is the watch's to read first.
            data = bytes(buffered)
            buffered.clear()
            pooled.watching.data_received(data)
        logger.debug("upstream connection %s pooled (%d idle for %s:%d)", pooled.id, len(idle), pooled.key.host,
                     pooled.key.port)

    def _idle_limit(self, key: PoolKey) -> float:
        """How long a connection of `key`'s waits in the pool (a fresh one at least `MIN_IDLE_S`,
        where the upstream's allow no reuse: no connect a moment)."""
        if (learned := self.life.limit(key, time.monotonic())) is None:
            return ctx.options.relay_upstream_pool_idle
        return min(ctx.options.relay_upstream_pool_idle, max(MIN_IDLE_S, learned))

    def _expire(self, pooled: Pooled) -> None:
        self.timers.pop(pooled, None)
        if self._drop(pooled, "idle limit"):
            self._rewarm(pooled.key)

    def _drop(self, pooled: Pooled, why: str) -> bool:
        idle = self.idle.get(pooled.key, [])
        if pooled not in idle:
            return False
        idle.remove(pooled)
        self._unschedule(pooled)
        pooled.unwatch()
        pooled.close()
        logger.debug("upstream connection %s left the pool: %s", pooled.id, why)
        return True

    def _unschedule(self, pooled: Pooled) -> None:
        if timer := self.timers.pop(pooled, None):
            timer.cancel()

    def _ended(self, pooled: Pooled, why: str) -> None:
        """`pooled`'s watch saw it end while idle (or bytes no idle connection may get)."""
        if why.startswith("closed by the upstream"):
            self._died(pooled, time.monotonic() - pooled.idle_since, "closed an idle connection")
        if self._drop(pooled, why):
            self._rewarm(pooled.key)

    def _died(self, pooled: Pooled, idle_s: float, how: str) -> None:
        key = pooled.key
        if (limit := self.life.died(key, idle_s, time.monotonic())) is None:
            return
        if limit == 0.0:
            logger.info("%s:%d %s after %.2f s idle: its connections are not reused (each would race "
                        "its close) until none died for %.0f s", key.host, key.port, how, idle_s, FORGET_AFTER_S)
        else:
            logger.info("%s:%d %s after %.1f s idle: its connections are reused while idle less than %.1f s",
                        key.host, key.port, how, idle_s, limit)

    def _rewarm_all(self) -> None:
        for key in self.warm:
            self._rewarm(key)

    def _rewarm(self, key: PoolKey) -> None:
        """Open connections for a warm key until `relay_upstream_pool_warm` are fresh or opening."""
        if not self.started or key not in self.warm:
            return
        fresh = sum(1 for p in self.idle.get(key, ()) if p.credential is None)
        for _ in range(ctx.options.relay_upstream_pool_warm - fresh - self.connecting.get(key, 0)):
            self.connecting[key] = self.connecting.get(key, 0) + 1
            self._spawn(self._warm_up(key))

    async def _warm_up(self, key: PoolKey) -> None:
        try:
            pooled = await asyncio.wait_for(_open(key), CONNECT_TIMEOUT_S)
        except asyncio.CancelledError:
            raise
        except Exception as e:  # any failure: said once, tried again later
            wait = self.backoff.get(key, REWARM_BACKOFF_S[0])
            self.backoff[key] = min(2 * wait, REWARM_BACKOFF_S[1])
            # Said once until one succeeds again: an upstream that is down is not news every 30 s.
            level = logging.WARNING if wait == REWARM_BACKOFF_S[0] else logging.DEBUG
            logger.log(level, "upstream connection to %s:%d not opened ahead of requests (%s); trying again in %.0f s",
                       key.host, key.port, e or type(e).__name__, wait)
            await asyncio.sleep(wait)
            self.connecting[key] -= 1
            self._rewarm(key)
            return
        self.connecting[key] -= 1
        self.backoff.pop(key, None)
        self._receive(pooled)

    def _spawn(self, coro: Any) -> asyncio.Task:
        task = asyncio.get_running_loop().create_task(coro)
        self.tasks.add(task)
        task.add_done_callback(self.tasks.discard)
        return task

    def _close_all(self) -> None:
        for idle in self.idle.values():
            for pooled in list(idle):
                self._drop(pooled, "the pool closed")
        self.idle.clear()


async def _open(key: PoolKey, ahead: Opening | None = None) -> Pooled:
    """A new upstream connection for `key`, its TLS made by mitmproxy's `tls_start_server`
    hook (as for a connection mitmproxy opens) offering HTTP/1.1; opened `ahead` for a
    client: told when its TCP connect is done."""
    server = connection.Server(address=(key.host, key.port), sni=key.sni, tls=key.tls)
    if key.tls:
        server.alpn_offers = (HTTP1_ALPN,)
    server.timestamp_start = time.time()
    reader, writer = await dial.open_upstream(key.host, key.port)
    server.timestamp_tcp_setup = time.time()
    if ahead is not None:
        ahead.tcp_setup = server.timestamp_tcp_setup
    _watch_transport(writer)
    tls = None
    try:
        if key.tls:
            client = connection.Client(peername=("0.0.0.0", 0), sockname=("0.0.0.0", 0), timestamp_start=time.time())
            data = TlsData(server, context.Context(client, ctx.options))
            ctx.master.addons.trigger(TlsStartServerHook(data))
            if data.ssl_conn is None:
                raise ConnectionError("no TLS context for the upstream")
            tls = data.ssl_conn
            try:
                await _handshake(tls, reader, writer)
            except (ConnectionError, SSL.Error):
                tls_resumption.handshake_failed(tls)
                raise
            server.timestamp_tls_setup = time.time()
            if tls.get_alpn_proto_negotiated() not in (b"", HTTP1_ALPN):
                raise ConnectionError(f"the upstream chose {tls.get_alpn_proto_negotiated()!r}")
    except BaseException:
        writer.close()
        raise
    return Pooled(key=key, id=server.id, reader=reader, writer=writer, tls=tls,
                  timestamp_start=server.timestamp_start, timestamp_tcp_setup=server.timestamp_tcp_setup,
                  timestamp_tls_setup=server.timestamp_tls_setup, alpn_offers=tuple(server.alpn_offers))


async def _handshake(tls: SSL.Connection, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
    while True:
        try:
            tls.do_handshake()
        except SSL.WantReadError:
            _flush(tls, writer)
            data = await reader.read(65536)
            if not data:
                raise ConnectionError("the upstream closed the connection during the TLS handshake") from None
            tls.bio_write(data)
            continue
        _flush(tls, writer)
        return


def _flush(tls: SSL.Connection, writer: asyncio.StreamWriter) -> None:
    """Send what `tls` has for the upstream (as the TLS layer's `tls_interact`)."""
    while True:
        try:
            writer.write(tls.bio_read(65535))
        except SSL.WantReadError:
            return


class _Watch(asyncio.Protocol):
    """An idle connection's transport protocol while it waits in the pool: TLS records that
    carry no data (session tickets, key updates) are taken, as mitmproxy's TLS layer would;
    data, a close or an error end it (`ended(pooled, why)`, once)."""

    def __init__(self, pooled: Pooled, ended: Callable[[Pooled, str], None]) -> None:
        self.pooled = pooled
        self.ended: Callable[[Pooled, str], None] | None = ended
        self.reading: Any = pooled.writer._protocol  # type: ignore[attr-defined]  # its reader's

    def data_received(self, data: bytes) -> None:
        tls = self.pooled.tls
        if tls is None:
            self._end("unexpected bytes from the upstream")
            return
        tls.bio_write(data)
        try:
            tls.recv(65536)
        except SSL.WantReadError:
            _flush(tls, self.pooled.writer)
            return
        except SSL.ZeroReturnError:
            self._end("closed by the upstream (TLS close_notify)")
            return
        except SSL.Error as e:
            self._end(f"TLS error: {e}")
            return
        self._end("unexpected bytes from the upstream")

    def eof_received(self) -> bool:
        self._end("closed by the upstream")
        return False

    def connection_lost(self, exc: Exception | None) -> None:
        self._end("closed by the upstream" if exc is None else f"connection lost: {exc}")

    def pause_writing(self) -> None:
        self.reading.pause_writing()

    def resume_writing(self) -> None:
        self.reading.resume_writing()

    def _end(self, why: str) -> None:
        if self.ended is not None and self.pooled.watching is self:
            ended, self.ended = self.ended, None
            ended(self.pooled, why)
