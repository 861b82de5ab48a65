"""mitmproxy's live connections and listening sockets, read and acted on through private paths (no patch).

The relay reaches into mitmproxy's connection handling in a few places that no hook or
public API serves: selfwatch reads the sockets (TCP_INFO of a flow's connections and of
each listener); `faults` closes a flow's upstream connection on a deadline, cancels an
upstream connect that takes too long, hands an HTTP/2 stream reset to a client's
handler (`layer_events`) and asks whether a client's socket holds unsent bytes; `guard`
hands it an early upstream connect (`layer_events`), counts client connections, writes
a refusal before mitmproxy closes one, and closes one that sent no request head in time;
the splice's direct reads take a streamed body's upstream reads over (`plain_streams`:
the handler, whose `server_event`, `drain_writers`, `timeout_watchdog` and
`close_connection` they use, the upstream's asyncio transport, the client's writer). All
of it goes through here:

- the proxyserver addon's `connections` maps a client's id to its `ConnectionHandler`
  (`ServerInstance.handle_stream`), whose `transports` map each connection (the
  client's, `LiveConnectionHandler.__init__`; each upstream one from the moment its
  connect starts, `ConnectionHandler.open_connection`) to a `ConnectionIO`: its asyncio
  task (`handler`), reader and writer (an asyncio StreamWriter for TCP);
- `ConnectionHandler.close_connection` closes one of them as the proxy layers would;
- cancelling an upstream connect's task with a message makes that message the
  connection's error (`open_connection`: `str(e)` of the CancelledError), and the HTTP
  layer fails every flow waiting for the connection with exactly that text
  (`HttpLayer.register_connection`, `HttpStream.make_server_connection`), which is how
  `faults` knows its own connect timeout in the `error` hook;
- the listening sockets are each running instance's `_servers` (as for `listen_backlog`);
- a connection the upstream pool parked keeps a `Detached` writer in the handler it left,
  whose socket is still read here.
"""

from __future__ import annotations

import asyncio
import socket
import weakref
from collections.abc import Collection
from typing import Any

from mitmproxy import connection, ctx
from mitmproxy.addons import proxyserver
from mitmproxy.proxy import mode_servers, server
from mitmproxy.proxy.layers.http import HttpLayer, HttpStream


PINS = {
    # a client's handler by its id, its connections' IO (the client's, each upstream one)
    "Proxyserver.register_connection": (proxyserver.Proxyserver.register_connection, "d79bb91554a8bda2"),
    "ServerInstance.handle_stream": (mode_servers.ServerInstance.handle_stream, "21eea06f208c752e"),
    "ConnectionIO": (server.ConnectionIO, "f498a46ab1b0f40f"),
    "ConnectionHandler.open_connection": (server.ConnectionHandler.open_connection, "5e0b3cbaf7a4030a"),
    "LiveConnectionHandler.__init__": (server.LiveConnectionHandler.__init__, "2cb1077a21556ca9"),
    "ConnectionHandler.close_connection": (server.ConnectionHandler.close_connection, "c0d10cc05dd65b80"),
    # a connection's error reaches the flows waiting for it verbatim
    "HttpLayer.register_connection": (HttpLayer.register_connection, "deed6282affc431f"),
    "HttpStream.make_server_connection": (HttpStream.make_server_connection, "ddc7bc72f4d2fbc7"),
    "HttpStream.handle_protocol_error": (HttpStream.handle_protocol_error, "59fc3b2eeeabf63a"),
    # where a running listener keeps its servers
    "AsyncioServerInstance._start": (mode_servers.AsyncioServerInstance._start, "f96507081fa6236b"),
}


def _proxyserver() -> Any:
    master = getattr(ctx, "master", None)  # none where layers run without a proxy (their tests)
    return master.addons.get("proxyserver") if master is not None else None


def handler_of(client: connection.Client) -> Any:
    """mitmproxy's `ConnectionHandler` of `client`'s connection; None once it is gone."""
    proxyserver = _proxyserver()
    return proxyserver.connections.get(client.id) if proxyserver else None


def registered(client: connection.Client) -> bool:
    """Whether mitmproxy handles `client`'s connection (from `client_connected` on)."""
    return handler_of(client) is not None


def client_count() -> int:
    """Client connections mitmproxy handles now."""
    proxyserver = _proxyserver()
    return len(proxyserver.connections) if proxyserver else 0


def open_on(client: connection.Client) -> Collection[connection.Connection]:
    """The connections of `client`'s handler: its own and its upstream ones (a connect
    in progress included); empty once the client is gone."""
    handler = handler_of(client)
    return handler.transports.keys() if handler is not None else ()


def writer(client: connection.Client, conn: connection.Connection) -> Any:
    """The writer of `conn`, one of `client`'s connections (an asyncio StreamWriter for
    TCP, mitmproxy_rs's stream for UDP and WireGuard); None once it is gone."""
    handler = handler_of(client)
    io = handler.transports.get(conn) if handler is not None else None
    return io.writer if io is not None else None


def connection_socket(client: connection.Client, conn: connection.Connection) -> socket.socket | None:
    """The socket of `conn` (the client's own connection or one of its upstream ones);
    None once it is gone, or for a connection without a socket (UDP, WireGuard)."""
    w = writer(client, conn)
    return w.get_extra_info("socket") if isinstance(w, (asyncio.StreamWriter, Detached)) else None


def plain_streams(client: connection.Client, server: connection.Connection) -> tuple[Any, Any, asyncio.StreamWriter] | None:
    """(`client`'s handler, `server`'s asyncio transport, `client`'s writer) if both are asyncio TCP
    streams and everything read from `server` has been handed to the layers; else None.

    Handed to the layers means: the call comes from `server`'s own reader task (its
    `handle_connection`, inside `server_event` with a read it just took: any other task
    may run while that task holds a read it has not handed over yet, waiting for
    `server_event`'s lock), its reader holds nothing more, and its transport still feeds
    that reader."""
    handler = handler_of(client)
    if handler is None:
        return None
    up, down = handler.transports.get(server), handler.transports.get(client)
    if up is None or down is None or not isinstance(up.writer, asyncio.StreamWriter) or not isinstance(down.writer, asyncio.StreamWriter):
        return None
    transport = up.writer.transport
    if (
        asyncio.current_task() is not up.handler
        or up.reader._buffer
        or not isinstance(transport.get_protocol(), asyncio.StreamReaderProtocol)
    ):
        return None
    return handler, transport, down.writer


_closed_here: weakref.WeakSet[connection.Connection] = weakref.WeakSet()


def close(client: connection.Client, conn: connection.Connection) -> bool:
    """Close `conn`, one of `client`'s connections, as a layer's CloseConnection would;
    False if it is not open there."""
    handler = handler_of(client)
    if handler is None or conn not in handler.transports:
        return False
    _closed_here.add(conn)
    handler.close_connection(conn)
    return True


def closed_here(conn: connection.Connection) -> bool:
    """Whether the relay closed `conn` itself (`close`: a deadline, a stop): mitmproxy's
    layers read that close as the peer's ("server closed connection")."""
    return conn in _closed_here


def cancel_connect(client: connection.Client, server: connection.Server, message: str) -> bool:
    """End `server`'s connect in progress with `message` as its error (and so the error of
    every flow waiting for it); False if there is no such connect."""
    handler = handler_of(client)
    io = handler.transports.get(server) if handler is not None else None
    if io is None or io.handler is None:
        return False
    io.handler.cancel(message)
    return True


def listening_sockets() -> list[socket.socket]:
    """The TCP listening sockets of mitmproxy's running server instances."""
    proxyserver = _proxyserver()
    found = []
    for instance in proxyserver.servers if proxyserver else ():
        if isinstance(instance, mode_servers.AsyncioServerInstance):
            for server in instance._servers:
                found += [s for s in getattr(server, "sockets", ()) if s.type == socket.SOCK_STREAM]
    return found


class Detached:
    """Stands in for a parked connection's writer in the client handler it left (the upstream
    pool, `speed.upstream_pool`, parks them): what mitmproxy still does to it there (close it,
    drain it, write to it) touches nothing; a hook that runs meanwhile still finds its socket
    (the self-watch reads TCP_INFO)."""

    def __init__(self, writer: asyncio.StreamWriter) -> None:
        self._writer = writer

    def is_closing(self) -> bool:
        return True

    def write(self, data: bytes) -> None:
        pass

    def write_eof(self) -> None:
        pass

    def close(self) -> None:
        pass

    async def drain(self) -> None:
        pass

    def get_extra_info(self, name: str, default: Any = None) -> Any:
        return self._writer.get_extra_info(name, default)
