"""mitmproxy's live connections and listening sockets, read through private paths (no patch).

Reading mitmproxy's sockets (`selfwatch`: TCP_INFO of a flow's connections and of each
listener) needs no patch, only two private paths: a live connection's socket is its
handler's `transports[connection].writer` (an asyncio StreamWriter), the handler being
the proxyserver addon's `connections[client.id]` (`ServerInstance.handle_stream`,
`ConnectionHandler.open_connection`); the listening sockets are each running
instance's `_servers` (as for `listen_backlog`).
"""

from __future__ import annotations

import asyncio
import socket
from collections.abc import Iterable, Mapping
from typing import Any

from mitmproxy.proxy import mode_servers


def listening_sockets(instances: Iterable[Any]) -> list[socket.socket]:
    """The TCP listening sockets of mitmproxy's running server instances."""
    found = []
    for instance in instances:
        if isinstance(instance, mode_servers.AsyncioServerInstance):
            for server in instance._servers:
                found += [s for s in getattr(server, "sockets", ()) if s.type == socket.SOCK_STREAM]
    return found


def connection_socket(connections: Mapping[Any, Any], client: Any, conn: Any) -> socket.socket | None:
    """The socket of `conn` (the client's own connection or one of its upstream
    connections), from the proxyserver addon's `connections`; None once it is gone,
    or for a connection without a socket (UDP, WireGuard)."""
    handler = connections.get(client.id)
    io = handler.transports.get(conn) if handler is not None else None
    writer = io.writer if io is not None else None
    return writer.get_extra_info("socket") if isinstance(writer, asyncio.StreamWriter) else None
