"""A worker's listeners are its supervisor's sockets: N workers accept from one kernel queue.

`ttft-relay run --workers N` (ttft_relay/workers.py) binds every TCP listener itself and
starts N workers that inherit those sockets. mitmproxy binds its listeners in
`AsyncioServerInstance._start`, before it loads scripts, so a worker installs this
patch before mitmproxy starts (`install`, from `workers.worker_main`): the wrap of
`_start` serves a mode the supervisor bound from duplicates of its sockets, through
asyncio's own server (`asyncio.start_server(sock=...)`), and binds any other mode as
mitmproxy does. So each worker owns its clients' sockets (their address, TCP_INFO), and
a connection waits in the one queue until some worker is free to accept it.

- A worker accepts only once the relay runs and mitmproxy's start-up check has passed
  (`serve_after_startup`, from the relay's `running`): a worker whose start fails (a bad
  option, a key file missing) exits without taking a connection off the shared queue.
  Then it tells the supervisor that it is ready (a byte on `ready_fd`).
- The supervisor binds a socket without listening on it: the first worker to serve
  listens (with the supervisor's backlog), so the port opens when a worker serves, and a
  client of a relay still starting is refused (and retries) instead of waiting for it in
  the queue. A socket systemd passed listens already (socket activation): a client that
  connects while the relay starts waits, and its record names the wait `relay starting`.
- A stop leaves the connections queued on systemd's sockets (`kept_open`) for the
  relay's next start (a restart), instead of refusing new ones as it does on its own.
- asyncio's accept loop takes up to `backlog` connections per readiness event (100 by
  default); on a shared queue that lets the first worker to wake drain a burst, however
  busy it is. Servers here accept up to ACCEPT_BATCH (8) per turn of their event loop:
  a burst is shared, and a busy worker, whose turns are long, accepts less. One per turn
  throttled accepting under load instead (`scripts/bench streams`, 2 workers at 40
  streams/s on a loaded 2-core machine: first token p99 5.9 s with 1, 0.75 s with 8,
  1.3 s with 100, one worker 2.0 s). The queue's length is the
  supervisor's `listen()` (`relay_listen_backlog`, which `capacity.ListenBacklog` sets
  again to the same value): asyncio's own `listen(ACCEPT_BATCH)` on the shared socket
  would shorten it for every worker, so the duplicates ignore it (`_SharedListener`).
- A mode that also listens on UDP (a reverse https listener's HTTP/3, reverse dns)
  serves TCP only: UDP sockets are not shared, so HTTP/3 needs `--workers 1`.
- Each server gets its own duplicates of the descriptors: closing it (the worker stops)
  leaves the shared socket listening for the other workers. A stopping or retiring
  worker closes the inherited descriptors too (`release`): a socket no process serves
  any more then closes, and refuses.
"""

from __future__ import annotations

import asyncio
import logging
import os
import socket
import weakref
from collections.abc import Collection, Mapping, Sequence

from mitmproxy import ctx, master
from mitmproxy.addons import errorcheck
from mitmproxy.proxy import mode_servers

logger = logging.getLogger(__name__)

_ORIGINAL_START = mode_servers.AsyncioServerInstance._start
ORIGINALS = {(mode_servers.AsyncioServerInstance, "_start"): _ORIGINAL_START}
PINS = {
    "AsyncioServerInstance._start": (_ORIGINAL_START, "f96507081fa6236b"),
    # accepting starts after `running` and after the start-up error check that follows it
    "Master.run": (master.Master.run, "45c44c14f8f79349"),
    "ErrorCheck.shutdown_if_errored": (errorcheck.ErrorCheck.shutdown_if_errored, "7c55b7c2459d8a53"),
}
ACCEPT_BATCH = 8
"""Connections a worker accepts at most per turn of its event loop (see the module docstring)."""

_inherited: dict[str, tuple[int, ...]] = {}
"""Mode spec (as configured) → the inherited listening sockets' descriptors."""
_kept_open: set[str] = set()
"""Mode specs whose sockets systemd holds open across a stop."""
_kept_servers: weakref.WeakSet[asyncio.Server] = weakref.WeakSet()
_backlog = 0
"""The listen backlog of a socket the supervisor bound without listening."""
_ready_fd: int | None = None
_serving = False
_waiting: list[asyncio.Server] = []
"""Servers started before `serve_after_startup`: they accept once it has run."""
_tasks: set[asyncio.Task] = set()


class _SharedListener(socket.socket):
    """A duplicate of a listening socket other processes accept from too: its queue's
    length is the supervisor's, which asyncio's `listen(backlog)` must not change."""

    def listen(self, backlog: int = 0) -> None:
        pass


def install(listeners: Mapping[str, Sequence[int]], ready_fd: int | None = None, *,
            kept_open: Collection[str] = (), backlog: int = socket.SOMAXCONN) -> None:
    """Serve each mode of `listeners` (spec → descriptors of its sockets) from those
    sockets, listening with `backlog` where they do not listen yet; write a byte to
    `ready_fd` once accepting. `kept_open`: the specs whose sockets systemd holds."""
    global _ready_fd, _serving, _backlog
    _inherited.clear()
    _inherited.update({spec: tuple(fds) for spec, fds in listeners.items()})
    _kept_open.clear()
    _kept_open.update(kept_open)
    _backlog = backlog
    _ready_fd, _serving = ready_fd, False
    _waiting.clear()
    mode_servers.AsyncioServerInstance._start = _start  # type: ignore[method-assign]


def uninstall() -> None:
    global _ready_fd, _serving
    mode_servers.AsyncioServerInstance._start = _ORIGINAL_START  # type: ignore[method-assign]
    _inherited.clear()
    _kept_open.clear()
    _waiting.clear()
    if _ready_fd is not None:
        os.close(_ready_fd)
    _ready_fd, _serving = None, False


async def _start(self: mode_servers.AsyncioServerInstance) -> None:
    fds = _inherited.get(self.mode.full_spec)
    if fds is None:
        return await _ORIGINAL_START(self)
    assert not self._servers
    servers: list = []
    for fd in fds:
        sock = _SharedListener(fileno=os.dup(fd))
        server = await asyncio.start_server(self.handle_stream, sock=sock, backlog=ACCEPT_BATCH,
                                            start_serving=_serving)
        servers.append(server)
        if self.mode.full_spec in _kept_open:
            _kept_servers.add(server)
        if not _serving:
            _waiting.append(server)
    self._servers = servers


def kept_open(server: asyncio.Server) -> bool:
    """Whether systemd holds `server`'s socket open across a stop (its queue waits for the next start)."""
    return server in _kept_servers


def release() -> None:
    """This process lets go of the inherited sockets (a stop, or retiring on a reload), its
    servers closed (`listeners.let_go`): the socket closes once no process holds it, and
    a connection is refused from then on instead of waiting in a queue nobody serves. Its
    modes are no longer served from them."""
    for fds in _inherited.values():
        for fd in fds:
            try:
                os.close(fd)
            except OSError:
                pass
    _inherited.clear()


def serve_after_startup() -> None:
    """From the relay's `running` hook: the inherited listeners accept once mitmproxy has
    checked its start-up for errors, which it does right after `running` (Master.run,
    `ErrorCheck.shutdown_if_errored` yields once before it looks): two turns of the event
    loop from now. Nothing to do where nothing is inherited."""
    if not _inherited or _serving:
        return
    loop = asyncio.get_running_loop()
    loop.call_soon(loop.call_soon, _serve)


def _serve() -> None:
    global _serving
    errorcheck = ctx.master.addons.get("errorcheck")
    if errorcheck is not None and errorcheck.logger.has_errored:
        return  # mitmproxy exits: this worker takes nothing off the queue
    _serving = True
    task = asyncio.get_running_loop().create_task(_start_serving(list(_waiting)))
    _waiting.clear()
    _tasks.add(task)
    task.add_done_callback(_tasks.discard)


async def _start_serving(servers: list[asyncio.Server]) -> None:
    global _ready_fd
    for fds in _inherited.values():
        for fd in fds:
            with socket.socket(fileno=os.dup(fd)) as sock:
                if not sock.getsockopt(socket.SOL_SOCKET, socket.SO_ACCEPTCONN):  # the first to serve opens it
                    sock.listen(_backlog)
    for server in servers:
        await server.start_serving()
    if _ready_fd is not None:
        try:
            os.write(_ready_fd, b"r")
            os.close(_ready_fd)
        except OSError as e:  # the supervisor is gone; PR_SET_PDEATHSIG stops this worker
            logger.debug("cannot tell the supervisor this worker is ready: %s", e)
        _ready_fd = None
