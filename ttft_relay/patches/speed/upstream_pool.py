"""Upstream connections that outlive their client connection: mitmproxy's seams for the pool (`ttft_relay.upstream_pool.UpstreamPool`).

mitmproxy 12.3.1 ties each upstream connection to one client connection: the client's
`ConnectionHandler` opens it (`open_connection`: TCP connect, then the `ServerTLSLayer` in
the client's HTTP layer runs the TLS handshake) and closes it when the client goes
(`handle_client` cancels its task, `handle_connection` closes the socket). So every new
client connection paid a full upstream connect and handshake before its first request
could leave. The pool keeps those connections instead, and gives them to later clients;
the seams below are all it takes from mitmproxy (pinned, `tests/patches/speed/test_upstream_pool.py`):

1. **Which connections may be pooled** (the wrap of `HttpLayer.get_connection`): on a
   reverse listener, a request for that listener's own upstream (no upstream proxy, TCP,
   an HTTP/1 client: mitmproxy gives an HTTP/2 client's streams one-shot HTTP/1
   connections) notes the `Server` mitmproxy creates for it with the credential of the
   flow that asked (`credential`), and every request the client connection sends to the
   upstream adds its credential to the client's set.

2. **Adoption** (the wrap of `ConnectionHandler.open_connection`): such a `Server`, when the
   pool holds a connection for it (`take`: same address, TLS and SNI, the same credential or
   a fresh one that carried none) or is opening one for its client since it connected
   (`opened_ahead`: waited for as for a connect, after `server_connect`, from that connect's
   start: a connect timeout's record names the phase it was in), takes that
   connection instead of connecting: the same
   hooks and events in the same order as mitmproxy's connect (`server_connect`; in place
   of the TCP connect the pooled socket, its reader and writer, with the timestamps of its
   real connect; `server_connected`; `OpenConnectionCompleted`), then mitmproxy's own
   `handle_connection` reads it, and `server_disconnected` ends it for this client.

3. **Its TLS** (the wrap of `ServerTLSLayer.start_handshake`): the adopted `Server`'s TLS
   layer takes the pooled connection's TLS connection (pyOpenSSL, the handshake done) and
   goes on as after a handshake, through mitmproxy's own code (`receive_handshake_data`
   finds it done: certificate, ALPN, cipher and version read from it,
   `tls_established_server`); the handshake's time stays the real one. Every byte after
   that is mitmproxy's TLS layer's, as on any connection (the splice's direct reads too).

4. **Parking** (`park`, from the `client_disconnected` hook, before mitmproxy closes the
   client's upstream connections): a poolable connection that is idle and clean — open
   both ways, HTTP/1.1, its `Http1Client` waiting for a next request with nothing buffered,
   no unread bytes in its reader or its TLS connection, nothing unsent, its transport read
   by mitmproxy's own protocol (not the direct reads), and only one credential ever sent
   on it — stops being read (`pause_reading`) and its place in the client's handler gets
   a writer that closes nothing (`Detached`); mitmproxy then tears the client down as
   always (its layers get `ConnectionClosed`, which writes nothing on an idle HTTP/1
   connection) and the socket, its reader and writer (the same objects: their flow
   control stays coherent) and its TLS connection go to the pool once that task ended.

5. **A retry where reuse lost a race** (through `fixes.error_replies.instead_of_errors`): a
   server may close a kept-alive connection just as the relay writes a request on it (its
   idle timeout, a restart), or its path may go silent (the pool's sockets then end with an
   error within `relay_upstream_pool_silence`, which mitmproxy reads as a close). A request
   whose pooled connection closed before any byte of
   its answer came — nothing of it reached the provider's application, which answers
   every request it read — is sent once more, on a connection opened for it (never another
   pooled one), as `fixes.resend` sends a request again; the client sees one answer. Only a
   request whose body the relay holds whole, once per flow; not where the relay closed the
   connection itself (`connections.close`: a deadline, a stop), which mitmproxy's layers read
   as the server's close too (a stop's cut request went again, and its client had no answer).
   Without the pool the same race needs a kept-alive client connection and is the client's to
   retry, as with any proxy.

Anything else — a connection that is not idle, half-closed, upgraded, errored, HTTP/2,
behind an upstream proxy, on another listener or address — is mitmproxy's as before.

Why adoption of the socket and its TLS connection by a new `Server`, and not: moving a
whole upstream layer stack from one client's HTTP layer to another's (its contexts, layers
and reader task all belong to the first client's handler); a relay-side HTTP client below
mitmproxy sharing one connection (or one HTTP/2 connection) among clients, as Go relays do
(every response parsed twice, by it and by mitmproxy); TLS by Python's `ssl` with
mitmproxy's TLS layer left out (a second copy of mitmproxy's upstream TLS settings, and
the splice's TLS path lost); fresh pre-opened connections only, never reused (a handshake
per request still, off the request's path). Adoption keeps mitmproxy's own layers, hooks
and TLS code on every byte, and a `Server` per client connection as mitmproxy has it.
"""

from __future__ import annotations

import asyncio
import hashlib
import logging
import time
import weakref
from dataclasses import dataclass, field
from typing import Protocol

from mitmproxy import connection, http
from mitmproxy.addons import tlsconfig
from mitmproxy.connection import ConnectionState, Server
from mitmproxy.proxy import commands, events, layer, server, server_hooks, tunnel
from mitmproxy.proxy.layers import tls as tls_layers
from mitmproxy.proxy.layers.http import GetHttpConnection, HttpClient, HttpLayer, HttpStream, ResponseProtocolError
from mitmproxy.proxy.layers.http._http1 import Http1Client, Http1Connection
from mitmproxy.proxy.mode_specs import ReverseMode
from mitmproxy.utils import human
from OpenSSL import SSL

from ... import apis
from .. import connections
from ..fixes import error_replies, resend

logger = logging.getLogger(__name__)

_ORIGINAL_GET_CONNECTION = HttpLayer.get_connection
_ORIGINAL_OPEN_CONNECTION = server.ConnectionHandler.open_connection
_ORIGINAL_START_HANDSHAKE = tls_layers.ServerTLSLayer.start_handshake
ORIGINALS = {
    (HttpLayer, "get_connection"): _ORIGINAL_GET_CONNECTION,
    (server.ConnectionHandler, "open_connection"): _ORIGINAL_OPEN_CONNECTION,
    (tls_layers.ServerTLSLayer, "start_handshake"): _ORIGINAL_START_HANDSHAKE,
}
PINS = {
    "HttpLayer.get_connection": (_ORIGINAL_GET_CONNECTION, "1aa1c63e3175766c"),
    "ConnectionHandler.open_connection": (_ORIGINAL_OPEN_CONNECTION, "5e0b3cbaf7a4030a"),
    "ServerTLSLayer.start_handshake": (_ORIGINAL_START_HANDSHAKE, "0dcfcb2a69b9608b"),
    # parking: the client_disconnected hook comes before its upstream connections are cancelled,
    # and a cancelled connection's end closes the writer its handler holds then
    "ConnectionHandler.handle_client": (server.ConnectionHandler.handle_client, "01f1b7cc991c4711"),
    "ConnectionHandler.handle_connection": (server.ConnectionHandler.handle_connection, "95c3f93e9824e527"),
    # an OpenConnection's task starts as the handler takes it, before its transports entry is made
    "ConnectionHandler.server_event": (server.ConnectionHandler.server_event, "a2b42657ebe8bf6d"),
    # the adopted TLS: an OpenConnection through the TLS layer, a handshake that finds itself done
    "TunnelLayer.start_handshake": (tunnel.TunnelLayer.start_handshake, "c15396d5df2a9fe6"),
    "TunnelLayer._handle_command": (tunnel.TunnelLayer._handle_command, "11ede598b3b37965"),
    "TunnelLayer._handle_event": (tunnel.TunnelLayer._handle_event, "00676a887c456cec"),
    "TLSLayer.receive_handshake_data": (tls_layers.TLSLayer.receive_handshake_data, "721fe6313c0979fe"),
    "TLSLayer.receive_close": (tls_layers.TLSLayer.receive_close, "244aa237c481fc55"),
    # an idle HTTP/1 client connection, and what it does with a ConnectionClosed (nothing sent)
    "HttpClient._handle_event": (HttpClient._handle_event, "bc1cae775a49a4fe"),
    "Http1Connection.mark_done": (Http1Connection.mark_done, "dc5ed395ce4f0763"),
    "Http1Client.read_headers": (Http1Client.read_headers, "415454c5fa8b5981"),
    # a pooled connection's close before the answer's head: the stream's state then, and its request
    "HttpStream.handle_protocol_error": (error_replies._ORIGINAL_HANDLE_PROTOCOL_ERROR, "59fc3b2eeeabf63a"),
    # the warm-up's TLS comes from this hook, as a connection mitmproxy opens
    "TlsConfig.tls_start_server": (tlsconfig.TlsConfig.tls_start_server, "2e2dc9c25670cf64"),
}

HTTP1_ALPN = b"http/1.1"
CREDENTIAL_HEADERS = (*apis.KEY_HEADERS, "proxy-authorization", "cookie")
"""Where a request carries who it is: an API key in any API's place, a proxy's, a cookie."""


def credential(request: http.Request) -> bytes:
    """A digest of everything in `request` that says whose it is (`CREDENTIAL_HEADERS`, the
    APIs' key parameters): a connection that carried one credential's requests carries no
    other's. On a keyed listener the flow holds the relay key's placeholder, the same for
    every client (the upstream key that goes out is the listener's)."""
    # One pass over the raw header fields (this runs for every request the pool may serve).
    found = [b"%s\0%s" % (name.lower(), value) for name, value in request.headers.fields
             if name.lower() in _CREDENTIAL_FIELDS]
    if b"?" in request.data.path:
        found += [b"?%s\0%s" % (name.encode(), value.encode("utf-8", "surrogateescape"))
                  for name in apis.KEY_PARAMS for value in request.query.get_all(name)]
    return hashlib.sha256(b"\0\0".join(sorted(found))).digest()[:16]


_CREDENTIAL_FIELDS = frozenset(name.encode() for name in CREDENTIAL_HEADERS)


@dataclass(frozen=True)
class PoolKey:
    """Which upstream connections are interchangeable: address, TLS, the SNI they were opened with."""

    host: str
    port: int
    tls: bool
    sni: str | None


def key_of(server: Server) -> PoolKey:
    assert server.address is not None
    return PoolKey(server.address[0], server.address[1], server.tls, server.sni if server.tls else None)


@dataclass(eq=False)
class Pooled:
    """One upstream connection while the pool holds it, and what a `Server` adopting it takes over."""

    key: PoolKey
    id: str
    """The connection's id for records: mitmproxy's id of the `Server` that first had it."""
    reader: asyncio.StreamReader
    writer: asyncio.StreamWriter
    tls: SSL.Connection | None
    timestamp_start: float | None
    timestamp_tcp_setup: float | None
    timestamp_tls_setup: float | None
    alpn_offers: tuple[bytes, ...] = ()
    credential: bytes | None = None
    """The only credential whose requests it carried; None: none yet (a fresh connection)."""
    uses: int = 0
    """Client connections that had it."""
    taken_idle_s: float | None = None
    """How long it had waited idle when the pool last gave it to a request (None: not taken from the pool)."""
    idle_since: float = field(default_factory=time.monotonic)
    watching: asyncio.Protocol | None = None
    """While idle in the pool: the protocol its transport feeds instead of its reader's (the
    pool's watch for the upstream closing it); its own is the reader's again when taken."""

    @property
    def transport(self) -> asyncio.Transport:
        return self.writer.transport  # type: ignore[return-value]

    def alive(self) -> bool:
        return not self.transport.is_closing() and not self.reader.at_eof() and self.reader.exception() is None

    def unwatch(self) -> None:
        """Its transport feeds its reader again."""
        if self.watching is not None:
            self.watching = None
            self.transport.set_protocol(self.writer._protocol)  # type: ignore[attr-defined]

    def close(self) -> None:
        self.writer.close()


@dataclass(eq=False)
class Opening:
    """A connection the pool began to open for a client when it connected (mitmproxy's eager connect would have)."""

    key: PoolKey
    started: float
    """When its connect began (`time.time()`): a request that waits for it waits for that connect."""
    done: asyncio.Future[Pooled | None]
    """The connection once open; None if that failed."""
    tcp_setup: float | None = None
    """When its TCP connect completed (its TLS handshake follows)."""


class Pool(Protocol):
    def take(self, key: PoolKey, credential: bytes, client: connection.Client) -> Pooled | None: ...

    def opened_ahead(self, key: PoolKey, client: connection.Client) -> Opening | None: ...

    def put_back(self, pooled: Pooled) -> None: ...

    def reuse_failed(self, pooled: Pooled) -> None: ...

    def let_go(self, opening: asyncio.Future[Pooled | None]) -> None: ...


_pool: Pool | None = None


@dataclass(eq=False)
class _Ask:
    credential: bytes
    http_layer: weakref.ref[HttpLayer]
    fresh: bool = False
    """A retry's connection: opened for it, never a pooled one."""


_asked: weakref.WeakKeyDictionary[Server, _Ask] = weakref.WeakKeyDictionary()
"""The poolable `Server`s mitmproxy created, with what asked for each."""
_sent: weakref.WeakKeyDictionary[HttpLayer, set[bytes]] = weakref.WeakKeyDictionary()
"""Per client HTTP layer, the credentials of its requests for its listener's upstream."""
_adopted: weakref.WeakKeyDictionary[Server, Pooled] = weakref.WeakKeyDictionary()
"""`Server`s that took a pooled connection, and which."""
_retried: weakref.WeakSet[http.HTTPFlow] = weakref.WeakSet()
"""Flows sent once more after their pooled connection closed before their answer."""


def install(pool: Pool | None) -> None:
    """Pool upstream connections through `pool` (None: mitmproxy's own connections again)."""
    global _pool
    _pool = pool
    on = pool is not None
    HttpLayer.get_connection = _get_connection if on else _ORIGINAL_GET_CONNECTION  # type: ignore[method-assign]
    error_replies.instead_of_errors("upstream pool", _retry_a_lost_reuse_race if on else None)
    server.ConnectionHandler.open_connection = (  # type: ignore[method-assign]
        _open_connection if on else _ORIGINAL_OPEN_CONNECTION)
    tls_layers.ServerTLSLayer.start_handshake = (  # type: ignore[method-assign]
        _start_handshake if on else _ORIGINAL_START_HANDSHAKE)


def uninstall() -> None:
    install(None)


def connection_id(conn: Server) -> str | None:
    """The id records give `conn`'s upstream connection: the pooled connection's it adopted,
    else mitmproxy's own; None if it never connected."""
    if (pooled := _adopted.get(conn)) is not None:
        return pooled.id
    return conn.id if conn.timestamp_start is not None else None


def adopted(conn: Server) -> bool:
    """Whether `conn` took a pooled connection."""
    return conn in _adopted


def retried(flow: http.HTTPFlow) -> bool:
    """Whether `flow`'s request was sent once more after its pooled connection closed before its answer."""
    return flow in _retried


# 1. which connections may be pooled


def _asking_credential(http_layer: HttpLayer, event: GetHttpConnection) -> bytes | None:
    mode = http_layer.context.client.proxy_mode
    if (
        type(mode) is not ReverseMode
        or event.address != mode.address
        or event.via is not None
        or event.transport_protocol != "tcp"
        or http_layer.context.client.alpn == b"h2"
    ):
        return None
    flow = getattr(http_layer.command_sources.get(event), "flow", None)
    return credential(flow.request) if isinstance(flow, http.HTTPFlow) else None


def _get_connection(self: HttpLayer, event: GetHttpConnection, *, reuse: bool = True) -> layer.CommandGenerator[None]:
    asking = _asking_credential(self, event)
    if asking is None:
        return (yield from _ORIGINAL_GET_CONNECTION(self, event, reuse=reuse))
    _sent.setdefault(self, set()).add(asking)
    # The handler starts the connect's task (eagerly) as it takes the OpenConnection: the
    # Server is noted before the command goes up.
    for command in _ORIGINAL_GET_CONNECTION(self, event, reuse=reuse):
        if (
            type(command) is commands.OpenConnection
            and isinstance(command.connection, Server)
            and command.connection not in _asked
        ):
            flow = getattr(self.command_sources.get(event), "flow", None)
            _asked[command.connection] = _Ask(asking, weakref.ref(self), fresh=flow in _retried)
        yield command
    return None


# 2. adoption


async def _open_connection(self: server.ConnectionHandler, command: commands.OpenConnection) -> None:
    conn = command.connection
    ask = _asked.get(conn) if type(conn) is Server else None
    if ask is None or ask.fresh or _pool is None or not conn.address:
        return await _ORIGINAL_OPEN_CONNECTION(self, command)
    assert isinstance(conn, Server)
    key = key_of(conn)
    pooled = _pool.take(key, ask.credential, self.client)
    ahead = _pool.opened_ahead(key, self.client) if pooled is None else None
    if pooled is None and ahead is None:
        return await _ORIGINAL_OPEN_CONNECTION(self, command)
    if pooled is not None:
        pooled.unwatch()
    # mitmproxy starts this task eagerly, inside its handler's `server_event`, which makes the
    # connection's entry in `transports` once the task first yields: let it, before this one's.
    await asyncio.sleep(0)
    hook_data = server_hooks.ServerConnectionHookData(client=self.client, server=conn)
    await self.handle_hook(server_hooks.ServerConnectHook(hook_data))
    if conn.error or not conn.address or key_of(conn) != key:
        # An addon killed it, or sent it elsewhere: not this connection's to take.
        if ahead is not None:
            _pool.let_go(ahead.done)
        elif pooled is not None:
            _pool.put_back(pooled)
        if err := conn.error:
            self.log(f"server connection to {human.format_address(conn.address)} killed before connect: {err}")
            await self.handle_hook(server_hooks.ServerConnectErrorHook(hook_data))
            await self.server_event(events.OpenConnectionCompleted(command, f"Connection killed: {err}"))
            return None
        # (that addon's server_connect then runs again, for the connect mitmproxy makes)
        return await _ORIGINAL_OPEN_CONNECTION(self, command)
    if ahead is not None:
        # The connection the pool began to open when this client connected (mitmproxy's
        # eager connect would have): waited for as mitmproxy waits for its connect, whose
        # start it is (a failed wait's record names the phase it failed in by it).
        conn.timestamp_start = ahead.started
        try:
            pooled = await asyncio.shield(ahead.done)
        except asyncio.CancelledError as e:  # the client left, or a connect timeout (`faults`)
            _pool.let_go(ahead.done)
            conn.timestamp_tcp_setup = ahead.tcp_setup
            err = str(e) or "connection cancelled"
            self.log(f"error establishing server connection: {err}")
            conn.error = err
            await self.handle_hook(server_hooks.ServerConnectErrorHook(hook_data))
            await self.server_event(events.OpenConnectionCompleted(command, err))
            raise
        if pooled is None or not pooled.alive():
            if pooled is not None:
                pooled.close()
            # It failed: mitmproxy connects, and says why if that fails too (its
            # server_connect runs again, for that connect).
            return await _ORIGINAL_OPEN_CONNECTION(self, command)
    assert pooled is not None
    pooled.uses += 1
    _adopted[conn] = pooled
    conn.timestamp_start = pooled.timestamp_start
    conn.timestamp_tcp_setup = pooled.timestamp_tcp_setup
    conn.state = ConnectionState.OPEN
    conn.peername = pooled.writer.get_extra_info("peername")
    conn.sockname = pooled.writer.get_extra_info("sockname")
    self.transports[conn] = server.ConnectionIO(handler=asyncio.current_task(), reader=pooled.reader,
                                                writer=pooled.writer)
    addr = human.format_address(conn.address)
    self.log(f"server connect {addr} (pooled connection {pooled.id}, its client connection {pooled.uses})")
    await self.handle_hook(server_hooks.ServerConnectedHook(hook_data))
    await self.server_event(events.OpenConnectionCompleted(command, None))
    try:
        await self.handle_connection(conn)
    finally:
        self.log(f"server disconnect {addr}")
        conn.timestamp_end = time.time()
        await self.handle_hook(server_hooks.ServerDisconnectedHook(hook_data))
    return None


def _retry_a_lost_reuse_race(stream: HttpStream, event: object) -> layer.CommandGenerator[None] | None:
    if not _lost_a_reuse_race(stream, event):
        return None
    _retried.add(stream.flow)
    pooled = _adopted.get(stream.context.server)
    if pooled is not None and _pool is not None:
        _pool.reuse_failed(pooled)  # it learns how long that upstream's kept connections live
    logger.info("pooled connection %s to %s closed before its answer (its client connection %s): "
                "sending the request once more on a new connection",
                pooled.id if pooled else "?", human.format_address(stream.context.server.address),
                pooled.uses if pooled else "?")
    return resend.send_again(stream)


def _lost_a_reuse_race(stream: HttpStream, event: object) -> bool:
    """The stream's pooled connection closed with no byte of its answer (`Http1Client`: "server
    closed connection", nothing buffered), after its whole request went (held whole), once;
    closed by the upstream or its path, not by the relay (a deadline, a stop: no retry)."""
    flow = stream.flow
    return (
        isinstance(event, ResponseProtocolError)
        and event.message == "server closed connection"
        and stream.context.server in _adopted
        and not connections.closed_here(stream.context.server)
        and flow not in _retried
        and resend.can_send_again(stream)
    )


# 3. its TLS


def _start_handshake(self: tls_layers.ServerTLSLayer) -> layer.CommandGenerator[None]:
    pooled = _adopted.get(self.conn) if isinstance(self.conn, Server) else None
    if pooled is None or pooled.tls is None or self.tls is not None:
        return (yield from _ORIGINAL_START_HANDSHAKE(self))
    self.conn.alpn_offers = pooled.alpn_offers
    self.tls = pooled.tls
    # As a handshake's last read: `receive_handshake_data` finds it done.
    yield from tunnel.TunnelLayer.start_handshake(self)
    self.conn.timestamp_tls_setup = pooled.timestamp_tls_setup
    return None


# 4. parking


def _idle_http1(stack: layer.Layer | None, conn: Server) -> tuple[bool, SSL.Connection | None]:
    """(whether the layers on `conn` are an open TLS layer at most, then an HTTP/1 client
    waiting for its next request with nothing buffered; the TLS connection, if any)."""
    tls: SSL.Connection | None = None
    current = stack
    if isinstance(current, tls_layers.ServerTLSLayer):
        if current.tunnel_connection is not conn or current.tunnel_state is not tunnel.TunnelState.OPEN:
            return False, None
        tls = current.tls
        current = current.child_layer
    if type(current).__name__ != "HttpClient":
        return False, None
    client = getattr(current, "child_layer", None)
    idle = (
        type(client) is Http1Client
        and client.stream_id is None
        and client.request is None
        and not client.buf
        and getattr(client.state, "__func__", None) is Http1Client.read_headers
        and (tls is None) is (not conn.tls)
    )
    return idle, tls


def park(handler: server.ConnectionHandler, conn: connection.Connection) -> tuple[Pooled, asyncio.Task] | None:
    """Take `conn`, one of `handler`'s upstream connections, out of it for the pool if it is
    poolable, idle and clean (see the module docstring): (the pooled connection, the task
    that still ends `conn` for this client: the pool may hand it on once that is done)."""
    ask = _asked.get(conn) if type(conn) is Server else None
    http_layer = ask.http_layer() if ask is not None else None
    io = handler.transports.get(conn)
    if ask is None or http_layer is None or io is None or io.handler is None:
        return None
    assert isinstance(conn, Server)
    sent = _sent.get(http_layer, set())
    reader, writer = io.reader, io.writer
    if (
        len(sent) != 1
        or conn.state is not ConnectionState.OPEN
        or conn.error is not None
        or conn.alpn not in (None, b"", HTTP1_ALPN)
        or not isinstance(writer, asyncio.StreamWriter)
        or not isinstance(reader, asyncio.StreamReader)
    ):
        return None
    transport = writer.transport
    if (
        transport.is_closing()
        or transport.get_protocol() is not writer._protocol  # type: ignore[attr-defined]
        or transport.get_write_buffer_size()
        or not transport.is_reading()  # type: ignore[attr-defined]
        or reader._buffer  # type: ignore[attr-defined]
        or reader.at_eof()
        or reader.exception() is not None
    ):
        return None
    idle, tls = _idle_http1(http_layer.connections.get(conn), conn)
    if not idle or (tls is not None and (tls.get_shutdown() or tls.pending())):
        return None
    transport.pause_reading()  # type: ignore[attr-defined]  # not a byte more for this client's reader task
    io.writer = connections.Detached(writer)  # type: ignore[assignment]
    previous = _adopted.get(conn)
    pooled = Pooled(
        key=key_of(conn),
        id=previous.id if previous is not None else conn.id,
        reader=reader,
        writer=writer,
        tls=tls,
        timestamp_start=conn.timestamp_start,
        timestamp_tcp_setup=conn.timestamp_tcp_setup,
        timestamp_tls_setup=conn.timestamp_tls_setup,
        alpn_offers=tuple(conn.alpn_offers),
        credential=next(iter(sent)),
        uses=previous.uses if previous is not None else 1,
    )
    return pooled, io.handler


def poolable(conn: connection.Connection) -> bool:
    """Whether `conn` is a connection the pool may take back (`park` says whether it can now)."""
    return conn in _asked if type(conn) is Server else False

