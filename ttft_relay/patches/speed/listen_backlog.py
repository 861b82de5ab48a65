"""TCP listeners queue more than asyncio's 100 new connections, so a burst is not dropped.

mitmproxy listens with asyncio's default backlog of 100. In a burst of new connections
larger than that, while the one event loop is busy, the kernel's accept queue overflows
and the clients it drops wait for a SYN retransmit: 1 s, then 3 s, added to their first
token. No option sets the backlog. The wrap of `AsyncioServerInstance.listen` (every
TCP listener, at every (re)start) calls `listen()` again on the new sockets with a
larger backlog, which Linux and the BSDs apply to a socket that is already listening;
the kernel caps it at `net.core.somaxconn`. mitmdump starts its listeners before it
loads scripts, so those already running are found through the proxyserver addon's
public `servers` and each instance's `_servers` (pinned by `AsyncioServerInstance._start`).
"""

from __future__ import annotations

import logging
import os
import socket
from collections.abc import Iterable
from typing import Any

from mitmproxy import master
from mitmproxy.proxy import mode_servers

logger = logging.getLogger(__name__)

_ORIGINAL_LISTEN = mode_servers.AsyncioServerInstance.listen
ORIGINALS = {(mode_servers.AsyncioServerInstance, "listen"): _ORIGINAL_LISTEN}
PINS = {
    "AsyncioServerInstance.listen": (_ORIGINAL_LISTEN, "7670a9038b44170d"),
    "AsyncioServerInstance._start": (mode_servers.AsyncioServerInstance._start, "f96507081fa6236b"),
    # when listeners start: before `running`, where the backlog reaches those running
    "Master.run": (master.Master.run, "45c44c14f8f79349"),
}
_listen_backlog = 0
ASYNCIO_DEFAULT_BACKLOG = 100
"""What `asyncio.start_server` listens with, and so mitmproxy."""


def set_listen_backlog(backlog: int, running: Iterable[Any] = ()) -> None:
    """TCP listeners queue up to `backlog` new connections: those of the server
    instances in `running` at once, every listener (re)started later when it starts.
    0: mitmproxy's own backlog, for both."""
    global _listen_backlog
    _listen_backlog = backlog
    mode_servers.AsyncioServerInstance.listen = _listen if backlog > 0 else _ORIGINAL_LISTEN  # type: ignore[method-assign]
    for instance in running:
        if isinstance(instance, mode_servers.AsyncioServerInstance):
            _relisten(instance._servers, backlog or ASYNCIO_DEFAULT_BACKLOG)


def uninstall() -> None:
    set_listen_backlog(0)


def installed() -> bool:
    return mode_servers.AsyncioServerInstance.listen is _listen


async def _listen(self: mode_servers.AsyncioServerInstance, host: str, port: int) -> list[Any]:
    servers = await _ORIGINAL_LISTEN(self, host, port)
    _relisten(servers, _listen_backlog or ASYNCIO_DEFAULT_BACKLOG)  # set to 0 while we awaited
    return servers


def _relisten(servers: Iterable[Any], backlog: int) -> None:
    for server in servers:
        for listening in getattr(server, "sockets", ()):  # asyncio servers; UDP ones have none
            if listening.type != socket.SOCK_STREAM:
                continue
            try:
                # a duplicate descriptor of the same socket: listen() applies to both
                with socket.socket(fileno=os.dup(listening.fileno())) as same:
                    # One not listening yet (a worker's, before it serves) opens when it serves.
                    if same.getsockopt(socket.SOL_SOCKET, socket.SO_ACCEPTCONN):
                        same.listen(backlog)
            except OSError as e:  # the patch must never cost a listener
                logger.warning("cannot set the listen backlog of %s to %d: %s", listening.getsockname(), backlog, e)
