"""Limits: what a client may cost the relay, before any authentication and on a WebSocket.

    ClientLimits    before any authentication: a deadline for each request head
                    (slowloris), a bounded number of client connections, a bounded
                    rate of HTTP/2 stream resets (rapid reset).
    WebSocketLimits WebSocket messages of bounded size (after inflating), fragments
                    and control frames, from the client and the upstream alike.
"""

from __future__ import annotations

import asyncio
import logging
import resource
import time
from typing import Any

from mitmproxy import connection, ctx, exceptions, http
from mitmproxy.proxy import mode_specs
from mitmproxy.utils import human

from ..patches import connections, pins
from ..patches.fixes import client_resets, head_limit, websocket_limits
from .exposure import is_http_reverse

logger = logging.getLogger(__name__)

MAX_HEAD_BYTES = 64 * 1024
"""An HTTP/1 request head longer than this gets a 431 (nginx takes 32 KiB, Node 16)."""
RESET_WINDOW_S = 30
"""The window `relay_h2_max_resets` counts in (Netty: 200 resets per 30 s)."""
RESERVED_FDS = 100
"""Descriptors kept for everything but client connections: listeners, logs, the
tokenizer files, a metrics scrape."""


def default_connection_limit(fd_limit: int) -> int:
    """Client connections the relay takes with `fd_limit` descriptors: each client
    connection may hold one upstream connection too."""
    return max(1, (fd_limit - RESERVED_FDS) // 2)


def raise_fd_limit() -> int:
    """The soft limit on open descriptors raised to the hard one (as nginx and Go
    do); returns the limit in force."""
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    if soft != hard and hard != resource.RLIM_INFINITY:
        try:
            resource.setrlimit(resource.RLIMIT_NOFILE, (hard, hard))
            soft = hard
        except (ValueError, OSError):
            pass
    return soft


CONNECTION_REFUSAL = (
    b"HTTP/1.1 503 Service Unavailable\r\ncontent-type: text/plain\r\nconnection: close\r\n"
    b"retry-after: 1\r\ncontent-length: 48\r\n\r\nttft-relay: connection limit reached, try again\n"
)


class OutOfDescriptors:
    """asyncio's accept loop, out of descriptors (EMFILE), reports it through the event loop's
    exception handler, a traceback each time it retries (147 of them in a log at the limit):
    one warning instead, then one a minute at most, with how often it happened meanwhile.
    Connections wait in the listen queue meanwhile (asyncio retries after a second)."""

    ACCEPT_FAILED = "socket.accept() out of system resource"
    EVERY_S = 60.0

    def __init__(self) -> None:
        self.loop: asyncio.AbstractEventLoop | None = None
        self.previous: Any = None
        self.said_at = 0.0
        self.unsaid = 0

    def install(self, loop: asyncio.AbstractEventLoop) -> None:
        if self.loop is None:
            self.loop, self.previous = loop, loop.get_exception_handler()
            loop.set_exception_handler(self._handle)

    def uninstall(self) -> None:
        if self.loop is not None and self.loop.get_exception_handler() == self._handle:
            self.loop.set_exception_handler(self.previous)
        self.loop = None

    def _handle(self, loop: asyncio.AbstractEventLoop, context: dict[str, Any]) -> None:
        if context.get("message") != self.ACCEPT_FAILED:
            if self.previous is not None:
                self.previous(loop, context)
            else:
                loop.default_exception_handler(context)
            return
        now = time.monotonic()
        if self.said_at and now - self.said_at < self.EVERY_S:
            self.unsaid += 1
            return
        more = f" ({self.unsaid} more times since)" if self.unsaid else ""
        logger.warning("out of file descriptors, cannot accept connections: %s; they wait in the listen "
                       "queue (relay_max_connections, the open-file limit)%s", context.get("exception"), more)
        self.said_at, self.unsaid = now, 0


class ClientLimits:
    """What a client gets before any authentication: bounded time for each request
    head, and a bounded number of connections.

    - `relay_client_head_timeout`: a client connection must deliver each request head
      within this many seconds of connecting (or of its previous answer ending);
      otherwise it is closed. mitmproxy's own `tcp_timeout` only bounds silence,
      so a head dribbled one byte at a time (slowloris) held a connection forever.
      Only HTTP listeners (reverse and regular) are timed, and there not tunnels
      (CONNECT), WebSockets or HTTP/2 connections with streams in flight.
    - a request head is at most MAX_HEAD_BYTES (64 KiB), or the client gets a 431.
    - `relay_h2_max_resets`: an HTTP/2 client that resets more streams than this
      within RESET_WINDOW_S gets GOAWAY (ENHANCE_YOUR_CALM) and its connection is
      closed (rapid reset, CVE-2023-44487); every client reset reaches its flow, so a
      reset request never goes upstream and one already there is cancelled.
    - `relay_max_connections`: beyond this many client connections a new one gets
      `503 … connection limit reached` and is closed. At the descriptor limit,
      accepting fails in a loop (a traceback per attempt) and nobody gets an answer;
      the default keeps below that limit (which the relay raises to the hard one).
    """

    def __init__(self) -> None:
        self.client_head_timeout = 0
        self.max_connections = 0
        self.timers: dict[str, asyncio.TimerHandle] = {}
        """Per client connection id waiting for a request head: its deadline."""
        self.active: dict[str, int] = {}
        """Flows in flight per client connection id."""
        self.refused = 0
        self.out_of_fds = OutOfDescriptors()

    def load(self, loader) -> None:
        if pins.on(head_limit):
            head_limit.limit_request_heads(MAX_HEAD_BYTES)
        loader.add_option(
            "relay_client_head_timeout", int, 30,
            "Seconds a client connection has for each request head, from connecting or "
            "from its previous answer; 0: no limit.",
        )
        loader.add_option(
            "relay_h2_max_resets", int, 200,
            f"Streams an HTTP/2 client connection may reset within {RESET_WINDOW_S} s; past them it "
            "gets GOAWAY (ENHANCE_YOUR_CALM) and is closed. 0: no limit.",
        )
        loader.add_option(
            "relay_max_connections", int, 0,
            "Client connections served at once; more are refused with a 503. 0: as many as "
            "the limit on open files allows (raised to its hard limit at start).",
        )

    def configure(self, updated: set[str]) -> None:
        if "relay_client_head_timeout" in updated:
            self.client_head_timeout = max(ctx.options.relay_client_head_timeout, 0)
        if "relay_h2_max_resets" in updated and pins.on(client_resets):
            client_resets.install(max(ctx.options.relay_h2_max_resets, 0), RESET_WINDOW_S)
        if "relay_max_connections" in updated:
            limit = ctx.options.relay_max_connections
            self.max_connections = limit if limit > 0 else default_connection_limit(raise_fd_limit())

    def running(self) -> None:
        self.out_of_fds.install(asyncio.get_running_loop())

    def done(self) -> None:
        self.out_of_fds.uninstall()
        head_limit.uninstall()
        client_resets.uninstall()

    def client_connected(self, client: connection.Client) -> None:
        if not connections.registered(client):
            return
        if connections.client_count() > self.max_connections:
            if not self.refused:
                logger.warning("connection limit (%d) reached: refusing new connections", self.max_connections)
            self.refused += 1
            client.error = "connection limit reached"
            if (writer := connections.writer(client, client)) is not None:
                writer.write(CONNECTION_REFUSAL)  # mitmproxy closes it next; the close sends this first
            return
        if self.refused and connections.client_count() <= self.max_connections // 2:
            logger.info("connection limit: %d connections refused, accepting again", self.refused)
            self.refused = 0
        self._arm(client)

    def client_disconnected(self, client: connection.Client) -> None:
        self._disarm(client)
        self.active.pop(client.id, None)

    def http_connect(self, flow: http.HTTPFlow) -> None:
        self._disarm(flow.client_conn)  # a tunnel: what it carries is timed by its own flows

    def requestheaders(self, flow: http.HTTPFlow) -> None:
        self._disarm(flow.client_conn)
        self.active[flow.client_conn.id] = self.active.get(flow.client_conn.id, 0) + 1

    def response(self, flow: http.HTTPFlow) -> None:
        client = flow.client_conn
        left = self.active.get(client.id, 1) - 1
        self.active[client.id] = left
        # A WebSocket or a tunnel may stay quiet; a finished HTTP exchange waits for the next head.
        if left <= 0 and flow.websocket is None and flow.request.method != "CONNECT" and client.connected:
            self._arm(client)

    def error(self, flow: http.HTTPFlow) -> None:
        self.response(flow)

    def _arm(self, client: connection.Client) -> None:
        self._disarm(client)
        mode = client.proxy_mode
        if self.client_head_timeout and (is_http_reverse(mode) or isinstance(mode, mode_specs.RegularMode)):
            loop = asyncio.get_running_loop()
            self.timers[client.id] = loop.call_later(self.client_head_timeout, self._timed_out, client)

    def _disarm(self, client: connection.Client) -> None:
        if timer := self.timers.pop(client.id, None):
            timer.cancel()

    def _timed_out(self, client: connection.Client) -> None:
        self.timers.pop(client.id, None)
        if client in connections.open_on(client):
            logger.info("%s: no request head within %d s, closing", human.format_address(client.peername),
                        self.client_head_timeout)
            connections.close(client, client)


def _client_transport(side: websocket_limits.MessageLimits) -> Any:
    """The asyncio transport of the client connection `side` reads (None once it is gone)."""
    client = side.conn
    if not isinstance(client, connection.Client):
        return None
    transport = getattr(connections.writer(client, client), "transport", None)
    return transport if transport is not None and not transport.is_closing() else None


def _pause_reading(side: websocket_limits.MessageLimits) -> bool:
    if (transport := _client_transport(side)) is None:
        return False
    transport.pause_reading()
    return True


def _resume_reading(side: websocket_limits.MessageLimits) -> None:
    if (transport := _client_transport(side)) is not None:
        transport.resume_reading()


class WebSocketLimits:
    """WebSocket messages bounded as they are read, from either side
    (`ttft_relay/patches/fixes/websocket_limits.py`): a message's size once inflated
    (`relay_websocket_message_max`, 24 MiB: a permessage-deflate bomb is inflated no
    further), its fragments (4096) and the control frames around them (100 at once, then
    10/s). Past one the socket closes, 1009 or 1008 to both sides, with one warning.

    Why 24 MiB: to know a message is too big the relay must inflate it that far, in one go
    on the event loop, and a deflate bomb inflates slowly (zlib's distance-1 copies: 0.7 s
    for 64 MiB on this machine, every other stream waiting). 24 MiB holds the Realtime API's
    largest event (15 MiB of audio, 20 MiB as base64 JSON) and a turn's images, at about a
    third of that stall."""

    def load(self, loader) -> None:
        loader.add_option(
            "relay_websocket_message_max", str, "24m",
            "Largest WebSocket message, from the client or the upstream, once inflated (e.g. 16m, "
            "64m); a larger one closes the socket (1009). 0: no limit.",
        )
        loader.add_option(
            "relay_websocket_inflight_max", str, "64m",
            "WebSocket message bytes clients may have in flight together (read, not yet complete), across the "
            "relay; a client whose message passes it is paused (its socket not read) until there is room. "
            "0: no limit.",
        )

    def configure(self, updated: set[str]) -> None:
        if updated & {"relay_websocket_message_max", "relay_websocket_inflight_max"}:
            sizes = {}
            for name in ("relay_websocket_message_max", "relay_websocket_inflight_max"):
                try:
                    sizes[name] = human.parse_size(getattr(ctx.options, name)) or 0
                except ValueError as e:
                    raise exceptions.OptionsError(f"{name}: {e}") from e
            if pins.on(websocket_limits):
                websocket_limits.install(websocket_limits.Bounds(message_bytes=sizes["relay_websocket_message_max"],
                                                                 total_bytes=sizes["relay_websocket_inflight_max"]),
                                         _pause_reading, _resume_reading)

    def done(self) -> None:
        websocket_limits.uninstall()

    def websocket_end(self, flow: http.HTTPFlow) -> None:
        websocket_limits.ended(flow.client_conn)

    def client_disconnected(self, client: connection.Client) -> None:
        websocket_limits.ended(client)

    def response(self, flow: http.HTTPFlow) -> None:
        # An upstream's 101 whose permessage-deflate parameters wsproto cannot take crashed the
        # connection's handler as the socket started (and every event after). Without them the
        # socket starts uncompressed: a compressed frame from that upstream then closes it 1002,
        # where a client of its own would have failed the connection at the handshake.
        response = flow.response
        if response is None or response.status_code != 101 or "sec-websocket-extensions" not in response.headers:
            return
        header = response.headers["sec-websocket-extensions"]
        kept = websocket_limits.valid_extensions(header)
        if kept != header:
            logger.warning("%s: the upstream's WebSocket handshake answer has invalid extensions, dropped: %r",
                           flow.request.host, header)
            if kept:
                response.headers["sec-websocket-extensions"] = kept
            else:
                del response.headers["sec-websocket-extensions"]
