"""Raw HTTP/1.1 (and WebSocket) client helpers for tests: every body chunk is seen the moment it arrives.

SDKs and `requests` buffer, retry and decode; these helpers do none of that, so a
test can time each chunk, see the exact bytes (still content-encoded), send a
body slowly, or go through a proxy (absolute-form for http://, CONNECT for
https://). Times are `time.time()`, comparable with mitmproxy's timestamps.
"""

from __future__ import annotations

import json
import socket
import ssl
import time
from collections.abc import Iterator
from dataclasses import dataclass
from http.client import IncompleteRead
from pathlib import Path
from typing import Any
from urllib.parse import urlsplit

from wsproto import ConnectionType, WSConnection
from wsproto.events import AcceptConnection, CloseConnection, RejectConnection, RejectData, Request, TextMessage
from wsproto.extensions import PerMessageDeflate

from ttft_relay.testing.fakes.http_wire import find_header, header_has_token

Body = bytes | str | dict[str, Any] | list[Any]
Headers = dict[str, str] | list[tuple[str, str]]
READ_SIZE = 64 * 1024


@dataclass(frozen=True)
class TimedChunk:
    """A piece of a response body and when it arrived."""

    at: float
    """`time.time()` when the chunk was complete."""
    data: bytes


class _SocketReader:
    """Buffered reads from a socket (line, exact count, or whatever is there)."""

    def __init__(self, sock: socket.socket) -> None:
        self._sock = sock
        self._buffer = bytearray()

    def _recv(self) -> bool:
        data = self._sock.recv(READ_SIZE)
        self._buffer += data
        return bool(data)

    def read_line(self) -> bytes:
        while (end := self._buffer.find(b"\r\n")) < 0:
            if not self._recv():
                raise IncompleteRead(bytes(self._buffer))
        line = bytes(self._buffer[:end])
        del self._buffer[: end + 2]
        return line

    def read_exactly(self, count: int) -> bytes:
        while len(self._buffer) < count:
            if not self._recv():
                raise IncompleteRead(bytes(self._buffer), count - len(self._buffer))
        data = bytes(self._buffer[:count])
        del self._buffer[:count]
        return data

    def read_some(self, limit: int) -> bytes:
        """Up to `limit` bytes, waiting only if nothing is buffered; b"" at end of stream."""
        if not self._buffer:
            self._recv()
        data = bytes(self._buffer[:limit])
        del self._buffer[:limit]
        return data


class RawResponse:
    """A response whose head has been read; the body is read as it arrives via `chunks()`."""

    def __init__(self, reader: _SocketReader, method: str, request_sent_at: float) -> None:
        self._reader = reader
        self.request_sent_at = request_sent_at
        """When the last request byte was written."""
        status_line = reader.read_line()
        while True:
            _version, status, *reason = status_line.decode("latin-1").split(" ", 2)
            self.status = int(status)
            self.reason = reason[0] if reason else ""
            self.headers = _read_headers(reader)
            if self.status >= 200 or self.status == 101:
                break
            status_line = reader.read_line()  # 100 Continue and friends: the real answer follows
        self.head_at = time.time()
        self._no_body = method == "HEAD" or self.status in (204, 304)
        self.complete = False
        """True once the whole body was read."""

    def header(self, name: str) -> str | None:
        return find_header(self.headers, name)

    def chunks(self) -> Iterator[TimedChunk]:
        """The body as it arrives: one item per HTTP chunk (chunked bodies) or per socket read.
        Raises `IncompleteRead` if the connection ends before the body does."""
        if not self._no_body:
            yield from self._body()
        self.complete = True

    def _body(self) -> Iterator[TimedChunk]:
        if header_has_token(self.headers, "transfer-encoding", "chunked"):
            yield from self._chunked_body()
        elif (length := self.header("content-length")) is not None:
            yield from self._sized_body(int(length))
        else:  # delimited by the connection closing
            while data := self._reader.read_some(READ_SIZE):
                yield TimedChunk(time.time(), data)

    def _chunked_body(self) -> Iterator[TimedChunk]:
        while size := int(self._reader.read_line().split(b";", 1)[0], 16):
            data = self._reader.read_exactly(size)
            yield TimedChunk(time.time(), data)
            self._reader.read_exactly(2)  # CRLF after the chunk data
        while self._reader.read_line():
            pass  # trailer fields

    def _sized_body(self, remaining: int) -> Iterator[TimedChunk]:
        while remaining:
            data = self._reader.read_some(remaining)
            if not data:
                raise IncompleteRead(b"", remaining)
            remaining -= len(data)
            yield TimedChunk(time.time(), data)

    def read(self) -> bytes:
        """The whole (remaining) body."""
        return b"".join(chunk.data for chunk in self.chunks())

    def json(self) -> Any:
        return json.loads(self.read())


class HttpConnection:
    """One client connection to `origin` (scheme://host:port), optionally through a proxy, reusable for
    several requests in sequence (read each response fully before the next request)."""

    def __init__(
        self, origin: str, *, proxy: str | None = None, ca: str | Path | None = None, timeout: float = 30.0
    ) -> None:
        target = urlsplit(origin)
        self.host, self.tls = target.hostname or "", target.scheme == "https"
        self.port = target.port or (443 if self.tls else 80)
        self._absolute_form = proxy is not None and not self.tls
        if proxy is None:
            sock = socket.create_connection((self.host, self.port), timeout)
        else:
            proxy_url = urlsplit(proxy)
            sock = socket.create_connection((proxy_url.hostname, proxy_url.port or 80), timeout)
            if self.tls:
                _connect_tunnel(sock, self.host, self.port)
        sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        if self.tls:
            context = ssl.create_default_context(cafile=str(ca) if ca else None)
            context.set_alpn_protocols(["http/1.1"])
            sock = context.wrap_socket(sock, server_hostname=self.host)
        self.sock = sock
        self._reader = _SocketReader(sock)

    def request(
        self,
        method: str,
        path: str,
        body: Body = b"",
        headers: Headers | None = None,
        *,
        upload_pieces: int = 1,
        upload_pause_s: float = 0.0,
        chunked: bool = False,
    ) -> RawResponse:
        """Send a request and read the response head. With `upload_pieces` > 1 the body goes out in
        that many parts with `upload_pause_s` between them (the injected slowness, not a sync);
        `chunked` sends it with chunked transfer coding instead of Content-Length."""
        payload = _encode_body(body)
        header_list = list(headers.items()) if isinstance(headers, dict) else list(headers or [])
        default_port = 443 if self.tls else 80
        host = self.host if self.port == default_port else f"{self.host}:{self.port}"
        defaults = [("Host", host)]
        if isinstance(body, (dict, list)):
            defaults.append(("Content-Type", "application/json"))
        defaults.append(("Transfer-Encoding", "chunked") if chunked else ("Content-Length", str(len(payload))))
        header_list = [h for h in defaults if find_header(header_list, h[0]) is None] + header_list

        scheme = "https" if self.tls else "http"
        target = f"{scheme}://{host}{path}" if self._absolute_form else path
        head = f"{method} {target} HTTP/1.1\r\n" + "".join(f"{k}: {v}\r\n" for k, v in header_list) + "\r\n"
        self.sock.sendall(head.encode("latin-1"))
        for index, piece in enumerate(_split(payload, upload_pieces)):
            if index:
                time.sleep(upload_pause_s)
            self.sock.sendall(b"%x\r\n%b\r\n" % (len(piece), piece) if chunked else piece)
        if chunked:
            self.sock.sendall(b"0\r\n\r\n")
        return RawResponse(self._reader, method, time.time())

    def close(self) -> None:
        self.sock.close()

    def __enter__(self) -> HttpConnection:
        return self

    def __exit__(self, *exc_info: object) -> None:
        self.close()


def request(
    method: str,
    url: str,
    body: Body = b"",
    headers: Headers | None = None,
    *,
    proxy: str | None = None,
    ca: str | Path | None = None,
    timeout: float = 30.0,
    **upload: Any,
) -> tuple[HttpConnection, RawResponse]:
    """One request on a fresh connection; returns the connection (close it) and the response.
    `upload` takes `upload_pieces`, `upload_pause_s`, `chunked` as for `HttpConnection.request`."""
    parts = urlsplit(url)
    connection = HttpConnection(f"{parts.scheme}://{parts.netloc}", proxy=proxy, ca=ca, timeout=timeout)
    try:
        path = parts.path + (f"?{parts.query}" if parts.query else "")
        return connection, connection.request(method, path, body, headers, **upload)
    except BaseException:
        connection.close()
        raise


def stream_post(
    url: str,
    body: Body,
    headers: Headers | None = None,
    *,
    proxy: str | None = None,
    ca: str | Path | None = None,
    timeout: float = 30.0,
) -> Iterator[TimedChunk]:
    """POST and yield the response body chunks as they arrive (raises on a non-2xx status).
    A generator: the request goes out on the first `next()`."""
    connection, response = request("POST", url, body, headers, proxy=proxy, ca=ca, timeout=timeout)
    with connection:
        if not 200 <= response.status < 300:
            raise RuntimeError(f"HTTP {response.status}: {response.read()[:500]!r}")
        yield from response.chunks()


def slow_upload(
    url: str,
    body: Body,
    *,
    pieces: int,
    pause_s: float,
    headers: Headers | None = None,
    proxy: str | None = None,
    ca: str | Path | None = None,
    chunked: bool = False,
    timeout: float = 30.0,
) -> tuple[HttpConnection, RawResponse]:
    """POST with the body sent in `pieces` parts, `pause_s` apart: a client with a slow uplink."""
    return request(
        "POST", url, body, headers, proxy=proxy, ca=ca, timeout=timeout,
        upload_pieces=pieces, upload_pause_s=pause_s, chunked=chunked,
    )


def _connect_tunnel(sock: socket.socket, host: str, port: int) -> None:
    sock.sendall(f"CONNECT {host}:{port} HTTP/1.1\r\nHost: {host}:{port}\r\n\r\n".encode())
    reader = _SocketReader(sock)
    status = reader.read_line().split(b" ")
    _read_headers(reader)
    if len(status) < 2 or status[1] != b"200":
        raise ConnectionError(f"proxy refused CONNECT: {b' '.join(status)!r}")


def _read_headers(reader: _SocketReader) -> list[tuple[str, str]]:
    headers = []
    while line := reader.read_line():
        name, _, value = line.decode("latin-1").partition(":")
        headers.append((name.strip(), value.strip()))
    return headers


def _encode_body(body: Body) -> bytes:
    if isinstance(body, bytes):
        return body
    if isinstance(body, str):
        return body.encode()
    return json.dumps(body).encode()


def _split(payload: bytes, pieces: int) -> list[bytes]:
    if not payload:
        return []
    size = -(-len(payload) // max(1, pieces))
    return [payload[i : i + size] for i in range(0, len(payload), size)]


RESPONSES_TERMINAL_EVENTS = frozenset({"response.completed", "response.failed", "response.incomplete", "error"})


class WebSocketRefused(ConnectionError):
    """The server answered the upgrade with something other than 101."""

    def __init__(self, status: int, body: bytes) -> None:
        super().__init__(f"WebSocket upgrade refused: HTTP {status}: {body[:300]!r}")
        self.status = status
        self.body = body


class WebSocketClient:
    """A blocking WebSocket client (wsproto), offering permessage-deflate like Codex does.

    `ws://host:port/path` only (put a relay in reverse mode in front for anything else).
    `turn()` runs one Responses turn: send a `response.create`, read events to the terminal one.
    """

    def __init__(
        self, url: str, headers: Headers | None = None, *, deflate: bool = True, timeout: float = 30.0
    ) -> None:
        target = urlsplit(url)
        self.sock = socket.create_connection((target.hostname, target.port or 80), timeout)
        self.sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        self._ws = WSConnection(ConnectionType.CLIENT)
        self._events: list[object] = []
        self._text: list[str] = []
        header_list = list(headers.items()) if isinstance(headers, dict) else list(headers or [])
        self.sock.sendall(self._ws.send(Request(
            host=target.netloc, target=target.path + (f"?{target.query}" if target.query else ""),
            extensions=[PerMessageDeflate()] if deflate else [],
            extra_headers=[(k.encode("latin-1"), v.encode("latin-1")) for k, v in header_list],
        )))
        answer = self._next_event()
        if isinstance(answer, RejectConnection):
            body, finished = b"", not answer.has_body
            while not finished:
                part = self._next_event()
                assert isinstance(part, RejectData), part
                body, finished = body + part.data, part.body_finished
            self.close()
            raise WebSocketRefused(answer.status_code, body)
        assert isinstance(answer, AcceptConnection), answer
        self.accepted = answer
        """The server's 101: `accepted.extensions` lists what was agreed (permessage-deflate)."""

    def _next_event(self) -> object:
        while not self._events:
            data = self.sock.recv(READ_SIZE)
            self._ws.receive_data(data or None)
            self._events.extend(self._ws.events())
            if not data and not self._events:
                raise ConnectionError("connection closed by the server")
        return self._events.pop(0)

    def send_json(self, message: Any) -> None:
        self.sock.sendall(self._ws.send(TextMessage(data=json.dumps(message))))

    def receive_json(self) -> tuple[float, Any]:
        """The next whole text message, parsed, and `time.time()` when it was complete.
        Raises ConnectionError when the server closes instead."""
        while True:
            event = self._next_event()
            if isinstance(event, TextMessage):
                self._text.append(event.data)
                if event.message_finished:
                    text, self._text = "".join(self._text), []
                    return time.time(), json.loads(text)
            elif isinstance(event, CloseConnection):
                raise ConnectionError(f"WebSocket closed by the server: {event.code} {event.reason}")

    def turn(self, create: dict[str, Any]) -> list[tuple[float, dict[str, Any]]]:
        """Send `create` (its `type` set to response.create) and return the timed events up to the terminal one."""
        self.send_json({"type": "response.create", **create})
        events = []
        while True:
            events.append(self.receive_json())
            if events[-1][1].get("type") in RESPONSES_TERMINAL_EVENTS:
                return events

    def close(self) -> None:
        try:
            if self._ws.state.name == "OPEN":
                self.sock.sendall(self._ws.send(CloseConnection(code=1000)))
        except OSError:
            pass  # the server is gone already (a reset): nothing to say goodbye to
        finally:
            self.sock.close()

    def __enter__(self) -> WebSocketClient:
        return self

    def __exit__(self, *exc_info: object) -> None:
        self.close()
