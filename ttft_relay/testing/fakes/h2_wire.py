"""HTTP/2 on the wire for tests: a raw client (`H2Client`) and a server connection (`serve_h2`).

`H2Client` speaks HTTP/2 over TLS (ALPN h2) frame by frame with the `h2` library, so
a test can send what no polite client sends: thousands of HEADERS + RST_STREAM in one
write, a body nobody reads. `serve_h2` serves one server-side HTTP/2 connection for
`ttft_relay/testing/fakes/upstream.py`'s fake (`FakeUpstream(h2=True)`), several streams sharing one
upstream connection as they do with a real HTTP/2 API.
"""

from __future__ import annotations

import asyncio
import socket
import ssl
import time
from collections.abc import Awaitable, Callable, Iterable
from dataclasses import dataclass, field
from pathlib import Path

import h2.config
import h2.connection
import h2.errors
import h2.events
import h2.exceptions

READ_SIZE = 1 << 16


@dataclass
class Stream:
    """What one side saw of one stream."""

    headers: dict[str, str] = field(default_factory=dict)
    body: bytearray = field(default_factory=bytearray)
    ended: bool = False
    reset: int | None = None
    """The error code of a RST_STREAM the peer sent, if it sent one."""

    @property
    def status(self) -> int | None:
        return int(self.headers[":status"]) if ":status" in self.headers else None

    @property
    def over(self) -> bool:
        return self.ended or self.reset is not None


class H2Client:
    """A blocking HTTP/2 client over TLS, one connection, frames under the test's control."""

    def __init__(self, port: int, ca_pem: Path, timeout: float = 30) -> None:
        context = ssl.create_default_context(cafile=str(ca_pem))
        context.set_alpn_protocols(["h2"])
        raw = socket.create_connection(("127.0.0.1", port), timeout=timeout)
        self.sock = context.wrap_socket(raw, server_hostname="127.0.0.1")
        assert self.sock.selected_alpn_protocol() == "h2", "the relay did not negotiate HTTP/2"
        self.conn = h2.connection.H2Connection(h2.config.H2Configuration(client_side=True, header_encoding="utf-8"))
        self.conn.initiate_connection()
        self.streams: dict[int, Stream] = {}
        self.goaway: h2.events.ConnectionTerminated | None = None
        self.closed = False
        self.flush()

    def request(self, method: str, path: str, headers: Iterable[tuple[str, str]] = (), body: bytes = b"",
                end_stream: bool = True) -> int:
        """Open a stream (HEADERS, then `body` as DATA); buffered until `flush`."""
        sid = self.conn.get_next_available_stream_id()
        pseudo = [(":method", method), (":path", path), (":scheme", "https"), (":authority", "127.0.0.1")]
        self.conn.send_headers(sid, pseudo + list(headers), end_stream=end_stream and not body)
        if body:
            self.conn.send_data(sid, body, end_stream=end_stream)
        self.streams[sid] = Stream()
        return sid

    def reset(self, sid: int, code: int = h2.errors.ErrorCodes.CANCEL) -> None:
        self.conn.reset_stream(sid, code)

    def flush(self) -> None:
        if data := self.conn.data_to_send():
            self.sock.sendall(data)

    def pump(self, until: Callable[[], bool], timeout: float = 30) -> None:
        """Read and handle frames until `until()` holds or the relay closed the connection."""
        deadline = time.monotonic() + timeout
        while not until() and not self.closed:
            left = deadline - time.monotonic()
            if left <= 0:
                raise TimeoutError(f"not there after {timeout} s: {self.streams if len(self.streams) < 5 else ''}")
            self.sock.settimeout(left)
            try:
                data = self.sock.recv(READ_SIZE)
            except TimeoutError:
                continue
            except (ConnectionError, ssl.SSLError):
                data = b""
            if not data:
                self.closed = True
                break
            for event in self.conn.receive_data(data):
                self._handle(event)
            try:
                self.flush()
            except (ConnectionError, ssl.SSLError):
                self.closed = True

    def receive_available(self) -> None:
        """Handle what the relay has sent so far, without waiting for more."""
        self.sock.setblocking(False)
        try:
            while not self.closed:
                try:
                    data = self.sock.recv(READ_SIZE)
                except (BlockingIOError, ssl.SSLWantReadError):
                    break
                except (ConnectionError, ssl.SSLError):
                    data = b""
                if not data:
                    self.closed = True
                for event in self.conn.receive_data(data):
                    self._handle(event)
        finally:
            self.sock.setblocking(True)
        self.flush()

    def upload(self, sid: int, size: int, piece: int = 16384) -> int:
        """Send up to `size` body bytes on stream `sid`, as long as the stream may carry
        them (not reset, not closed); returns how many went out."""
        sent = 0
        while sent < size and self.streams[sid].reset is None and not self.closed:
            n = min(piece, size - sent, self.conn.local_flow_control_window(sid))
            if n <= 0:
                self.pump(lambda: self.conn.local_flow_control_window(sid) > 0 or self.streams[sid].reset is not None)
                continue
            self.conn.send_data(sid, b"x" * n, end_stream=sent + n == size)
            self.flush()
            sent += n
            self.receive_available()
        return sent

    def _handle(self, event: h2.events.Event) -> None:
        stream = self.streams.get(getattr(event, "stream_id", 0) or 0)
        if isinstance(event, h2.events.ResponseReceived) and stream is not None:
            stream.headers = dict(event.headers)
        elif isinstance(event, h2.events.DataReceived):
            if stream is not None:
                stream.body += event.data
            self.conn.acknowledge_received_data(event.flow_controlled_length, event.stream_id)
        elif isinstance(event, h2.events.StreamEnded) and stream is not None:
            stream.ended = True
        elif isinstance(event, h2.events.StreamReset) and stream is not None:
            stream.reset = event.error_code
        elif isinstance(event, h2.events.ConnectionTerminated):
            self.goaway = event

    def close(self) -> None:
        self.sock.close()

    def __enter__(self) -> H2Client:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


@dataclass
class ServerSide:
    """The server's end of one HTTP/2 connection, as a responder writes to it."""

    conn: h2.connection.H2Connection
    writer: asyncio.StreamWriter
    a_reset: asyncio.Event = field(default_factory=asyncio.Event)
    """Set at the first stream reset on the connection."""
    window_opened: asyncio.Event = field(default_factory=asyncio.Event)
    """Set at each WINDOW_UPDATE or SETTINGS from the peer (either may open windows)."""

    def send_headers(self, sid: int, headers: list[tuple[str, str]]) -> None:
        self.conn.send_headers(sid, headers)
        self.writer.write(self.conn.data_to_send())

    async def send_data(self, sid: int, data: bytes) -> None:
        """`data` on stream `sid`, in as many frames as the peer's windows allow, each flushed."""
        while data:
            if (room := min(self.conn.local_flow_control_window(sid), self.conn.max_outbound_frame_size)) <= 0:
                self.window_opened.clear()
                await self.window_opened.wait()
                continue
            self.conn.send_data(sid, data[:room])
            data = data[room:]
            self.writer.write(self.conn.data_to_send())
            await self.writer.drain()

    def end_stream(self, sid: int) -> None:
        self.conn.end_stream(sid)
        self.writer.write(self.conn.data_to_send())


Respond = Callable[[ServerSide, int, Stream], Awaitable[None]]


async def serve_h2(reader: asyncio.StreamReader, writer: asyncio.StreamWriter, respond: Respond) -> None:
    """Serves one HTTP/2 connection: each request, once its body has ended, is answered by
    `respond(side, stream_id, stream)` in a task of its own, cancelled when its stream is
    reset or the connection ends."""
    conn = h2.connection.H2Connection(h2.config.H2Configuration(client_side=False, header_encoding="utf-8"))
    conn.initiate_connection()
    writer.write(conn.data_to_send())
    side = ServerSide(conn, writer)
    streams: dict[int, Stream] = {}
    tasks: dict[int, asyncio.Task[None]] = {}
    try:
        while data := await reader.read(READ_SIZE):
            for event in conn.receive_data(data):
                if isinstance(event, h2.events.RequestReceived):
                    streams[event.stream_id] = Stream(headers=dict(event.headers))
                elif isinstance(event, h2.events.DataReceived):
                    streams[event.stream_id].body += event.data
                    conn.acknowledge_received_data(event.flow_controlled_length, event.stream_id)
                elif isinstance(event, h2.events.StreamEnded):
                    streams[event.stream_id].ended = True
                    tasks[event.stream_id] = asyncio.ensure_future(respond(side, event.stream_id, streams[event.stream_id]))
                elif isinstance(event, h2.events.StreamReset) and event.stream_id in streams:
                    streams[event.stream_id].reset = event.error_code
                    if task := tasks.pop(event.stream_id, None):
                        task.cancel()
                    side.a_reset.set()
                elif isinstance(event, (h2.events.WindowUpdated, h2.events.RemoteSettingsChanged)):
                    side.window_opened.set()  # a WINDOW_UPDATE, or a larger initial window
            writer.write(conn.data_to_send())
    except (ConnectionError, h2.exceptions.ProtocolError):
        pass
    finally:
        for task in tasks.values():
            task.cancel()
        writer.close()
