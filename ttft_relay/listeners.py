"""How a stopping relay lets go of its listeners without resetting a connection.

A listening socket closed with connections in its accept queue (the handshake done, the
client already sending its request) resets each of them: the client cannot tell whether
its POST reached the provider. So a stop (`faults.Shutdown`) lets go in three steps,
before it waits for the flows in flight:

1. the kernel stops completing handshakes on the socket: a socket filter that drops
   every packet (`refuse_handshakes`). A client connecting now has its SYN unanswered;
   its retry (a second later) finds the port closed and is refused;
2. the connections already queued are accepted and served as any other (the server
   keeps accepting until `queued` says the queue is empty);
3. the listener closes: new connections are refused at once.

With `ttft-relay run --workers N` the socket is one, shared by the supervisor and its
workers: a filter set by any of them is the socket's, and the queue is drained by
whichever worker accepts. A worker retiring on a reload (`RETIRE_SIGNAL`, from the
supervisor) only closes its own copies: the socket, its queue and its new connections
stay with the workers that replace it.
"""

from __future__ import annotations

import asyncio
import ctypes
import logging
import os
import signal
import socket
import struct
import time

logger = logging.getLogger(__name__)

RETIRE_SIGNAL = signal.SIGUSR2
"""Supervisor → worker: stop accepting, finish the turns in flight, exit (a reload)."""
DRAIN_S = 1.0
"""How long a stop accepts what was queued before the listener closes: the queue empties
within a turn or two of the event loop; a worker that never served waits this long."""
POLL_S = 0.005

SO_ATTACH_FILTER = 26  # linux/asm-generic/socket.h
_DROP_ALL = (ctypes.c_uint8 * 8).from_buffer_copy(struct.pack("=HBBI", 0x06, 0, 0, 0))
"""A classic BPF program of one instruction, `ret #0`: every packet dropped."""
_TCP_INFO_UNACKED = 24
"""Offset of tcpi_unacked in struct tcp_info: on a listening socket, its accept queue's length."""


def refuse_handshakes(fd: int) -> None:
    """No more handshakes complete on the listening socket `fd` (Linux; elsewhere nothing)."""
    prog = struct.pack("@HP", 1, ctypes.addressof(_DROP_ALL))  # struct sock_fprog
    try:
        with socket.socket(fileno=os.dup(fd)) as sock:
            sock.setsockopt(socket.SOL_SOCKET, SO_ATTACH_FILTER, prog)
    except OSError as e:
        logger.debug("cannot stop handshakes on a listener: %s", e)


def queued(fd: int) -> int:
    """Connections waiting in the accept queue of the listening socket `fd` (0 where the
    system does not say)."""
    if not hasattr(socket, "TCP_INFO"):
        return 0
    try:
        with socket.socket(fileno=os.dup(fd)) as sock:
            info = sock.getsockopt(socket.IPPROTO_TCP, socket.TCP_INFO, 104)
    except OSError:
        return 0
    return struct.unpack_from("=I", info, _TCP_INFO_UNACKED)[0] if len(info) >= _TCP_INFO_UNACKED + 4 else 0


def tcp_servers(proxyserver) -> list[asyncio.Server]:
    """The asyncio servers behind mitmproxy's listeners (its `proxyserver` addon's; none
    without one: the relay's addons loaded without mitmproxy's, as in tests)."""
    if proxyserver is None:
        return []
    return [s for instance in proxyserver.servers for s in getattr(instance, "_servers", [])
            if isinstance(s, asyncio.Server)]


async def let_go(servers: list[asyncio.Server], *, refuse: bool) -> None:
    """Close `servers`' listening sockets. With `refuse` (a stop), first no new handshake,
    then what the kernel queued is accepted: no connection it took is reset. Without (a
    worker retiring), only this process's copies close."""
    fds = [ts.fileno() for server in servers for ts in server.sockets]
    if refuse:
        for fd in fds:
            refuse_handshakes(fd)
        deadline = time.monotonic() + DRAIN_S
        while any(queued(fd) for fd in fds) and time.monotonic() < deadline:
            await asyncio.sleep(POLL_S)
    for server in servers:
        server.close()
