"""One timed probe over a raw socket: DNS, TCP, proxy tunnel, TLS, request, first byte, first token.

The probe measures each step itself, like `curl -w` (time_namelookup, time_connect,
time_appconnect, time_starttransfer, time_total) plus the first *token*, found by the
relay's own `addons.sse.StreamWatcher` in the streamed answer. It uses a fresh
connection each time (HTTP/1.1, `Connection: close`), so every probe pays the full
setup, as a new client would. Only stdlib sockets and ssl: nothing buffers the answer.

Marks are ms since the probe began (`diagnosis.PROBE_MARKS`). One deadline covers
the whole probe: a dead or silent upstream ends in an error naming the phase, never
in a hang.

`run_websocket_probe` does the same for one turn on a new Responses WebSocket, as
Codex opens one per session (permessage-deflate offered): the upgrade request, its
`101`, then one `response.create` and its events, framed by wsproto (a mitmproxy
dependency).
"""

from __future__ import annotations

import logging
import socket
import ssl
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import Any
from urllib.parse import urlsplit

import orjson

from wsproto import ConnectionType, WSConnection
from wsproto.events import AcceptConnection, CloseConnection, Ping, RejectConnection, RejectData, Request, TextMessage
from wsproto.extensions import PerMessageDeflate
from wsproto.utilities import RemoteProtocolError

from .. import apis
from ..stream.sse import StreamWatcher
from .findings import ProbeResult
from .probe_requests import ProbeRequest, websocket_headers

logger = logging.getLogger(__name__)

READ_SIZE = 64 * 1024
MAX_HEAD_BYTES = 64 * 1024
MAX_ERROR_BODY = 16 * 1024
ERROR_EXCERPT = 200


class ProbeError(Exception):
    """A probe failed; the message says how, for the report."""


@dataclass(frozen=True)
class Endpoint:
    """A base URL split into what a connection needs; a trailing `/v1` is dropped
    (API paths carry it), so both `https://host` and `https://host/v1` work."""

    scheme: str
    host: str
    port: int
    prefix: str

    @classmethod
    def parse(cls, url: str) -> Endpoint:
        parts = urlsplit(url if "://" in url else f"http://{url}")
        if parts.scheme not in ("http", "https") or not parts.hostname:
            raise ValueError(f"not an http(s) URL: {url!r}")
        prefix = parts.path.rstrip("/").removesuffix("/v1")
        return cls(parts.scheme, parts.hostname, parts.port or (443 if parts.scheme == "https" else 80), prefix)

    @property
    def tls(self) -> bool:
        return self.scheme == "https"

    @property
    def authority(self) -> str:
        host = f"[{self.host}]" if ":" in self.host else self.host
        return host if self.port == (443 if self.tls else 80) else f"{host}:{self.port}"

    def url(self, path: str) -> str:
        return f"{self.scheme}://{self.authority}{self.prefix}{path}"


@dataclass(frozen=True)
class Route:
    """How a probe reaches `target`: straight to it, or through an HTTP proxy
    (`CONNECT` for an https target, an absolute-form request for plain http)."""

    target: Endpoint
    proxy: Endpoint | None = None

    @property
    def first_hop(self) -> Endpoint:
        return self.proxy or self.target

    @property
    def tunnels(self) -> bool:
        return self.proxy is not None and self.target.tls


class ChunkedDecoder:
    """Removes HTTP/1.1 chunked framing incrementally: wire bytes in, body bytes out."""

    def __init__(self) -> None:
        self._buffer = b""
        self._left = 0
        self._state = "size"
        self.done = False

    def feed(self, data: bytes) -> bytes:
        self._buffer += data
        out: list[bytes] = []
        while not self.done:
            if self._state == "data":
                if not self._buffer:
                    break
                piece, self._buffer = self._buffer[: self._left], self._buffer[self._left :]
                out.append(piece)
                self._left -= len(piece)
                if self._left == 0:
                    self._state = "crlf"
                continue
            line_end = self._buffer.find(b"\r\n")
            if line_end < 0:
                break
            line, self._buffer = self._buffer[:line_end], self._buffer[line_end + 2 :]
            if self._state == "crlf":
                self._state = "size"
            elif self._state == "size":
                self._left = int(line.split(b";")[0].strip() or b"0", 16)
                self._state = "data" if self._left else "trailer"
            elif not line:  # the blank line that ends the trailer
                self.done = True
        return b"".join(out)


class _Probe:
    """One probe's run: the socket, the deadline, the marks so far, the phase in progress."""

    def __init__(self, result: ProbeResult, timeout: float) -> None:
        self.result = result
        self.timeout = timeout
        self.t0 = time.perf_counter()
        self.deadline = self.t0 + timeout
        self.phase = "dns"
        self.sock: socket.socket | None = None
        self._pending = b""

    def mark(self, name: str, at: float | None = None) -> None:
        self.result.marks[name] = round(((time.perf_counter() if at is None else at) - self.t0) * 1000, 3)

    def remaining(self) -> float:
        left = self.deadline - time.perf_counter()
        if left <= 0:
            raise TimeoutError
        return left

    def connect(self, hop: Endpoint) -> socket.socket:
        infos = socket.getaddrinfo(hop.host, hop.port, type=socket.SOCK_STREAM)
        self.mark("dns")
        self.phase = "tcp"
        last_error: OSError | None = None
        for family, kind, proto, _, address in infos:
            sock = socket.socket(family, kind, proto)
            sock.settimeout(self.remaining())
            try:
                sock.connect(address)
            except OSError as e:
                sock.close()
                last_error = e
                continue
            sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
            self.sock = sock
            self.mark("tcp")
            return sock
        raise last_error or ProbeError(f"no address for {hop.host}")

    def tunnel(self, target: Endpoint) -> None:
        self.phase = "tunnel"
        self.send(f"CONNECT {target.host}:{target.port} HTTP/1.1\r\nHost: {target.host}:{target.port}\r\n\r\n".encode())
        status, _, _ = self.read_head()
        if status != 200:
            raise ProbeError(f"the proxy answered CONNECT with HTTP {status}")
        self.mark("tunnel")

    def start_tls(self, target: Endpoint, context: ssl.SSLContext) -> None:
        assert self.sock is not None
        self.phase = "tls"
        self.sock.settimeout(self.remaining())
        self.sock = context.wrap_socket(self.sock, server_hostname=target.host)
        self.result.tls_version = self.sock.version()
        self.mark("tls")

    def send(self, data: bytes) -> None:
        assert self.sock is not None
        self.sock.settimeout(self.remaining())
        self.sock.sendall(data)

    def recv(self) -> bytes:
        assert self.sock is not None
        if self._pending:
            data, self._pending = self._pending, b""
            return data
        self.sock.settimeout(self.remaining())
        return self.sock.recv(READ_SIZE)

    def read_head(self, on_first_byte: bool = False) -> tuple[int, dict[str, str], bytes]:
        """Status, headers (lower-case names) and whatever body bytes came with the head."""
        data = b""
        while b"\r\n\r\n" not in data:
            chunk = self.recv()
            if not chunk:
                raise ProbeError("connection closed before a response head")
            if on_first_byte and not data:
                self.mark("head")
                self.phase = "first_token"
            data += chunk
            if len(data) > MAX_HEAD_BYTES:
                raise ProbeError("response head too large")
        head, _, rest = data.partition(b"\r\n\r\n")
        lines = head.decode("latin-1").split("\r\n")
        try:
            status = int(lines[0].split()[1])
        except (IndexError, ValueError):
            raise ProbeError(f"not an HTTP response: {lines[0][:80]!r}") from None
        headers = {}
        for line in lines[1:]:
            name, _, value = line.partition(":")
            headers[name.strip().lower()] = value.strip()
        return status, headers, rest

    def body_chunks(self, headers: dict[str, str], first: bytes) -> Iterator[bytes]:
        """The response body as it arrives, framing removed, until its end."""
        chunked = "chunked" in headers.get("transfer-encoding", "").lower()
        length = None if chunked else headers.get("content-length")
        left = int(length) if length is not None else None
        decoder = ChunkedDecoder() if chunked else None
        data = first
        while True:
            if data:
                piece = decoder.feed(data) if decoder else data[:left] if left is not None else data
                if left is not None:
                    left -= len(piece)
                if piece:
                    yield piece
            if (decoder and decoder.done) or left == 0:
                return
            data = self.recv()
            if not data:
                if decoder or left:
                    raise ProbeError("connection closed in the middle of the answer")
                return

    def close(self) -> None:
        if self.sock is not None:
            self.sock.close()


def request_bytes(route: Route, request: ProbeRequest) -> bytes:
    """The request head and body as sent on the first hop."""
    target = route.target
    path = target.prefix + request.path
    if route.proxy is not None and not target.tls:
        path = target.url(request.path)  # a plain-http proxy wants the absolute URL
    lines = [f"POST {path} HTTP/1.1", f"host: {target.authority}"]
    lines += [f"{name}: {value}" for name, value in request.headers]
    lines += [f"content-length: {len(request.body)}", "connection: close"]
    return ("\r\n".join(lines) + "\r\n\r\n").encode() + request.body


def error_excerpt(body: bytes) -> str:
    """The message of an API error body (`{"error": {"message": ...}}` and kin), or its start."""
    try:
        obj = orjson.loads(body)
    except orjson.JSONDecodeError:
        return body.decode("utf-8", "replace").strip()[:ERROR_EXCERPT]
    error = obj.get("error", obj) if isinstance(obj, dict) else obj
    message = error.get("message") if isinstance(error, dict) else None
    return str(message or error)[:ERROR_EXCERPT]


def _open(run: _Probe, route: Route, tls_context: ssl.SSLContext) -> None:
    """DNS, TCP, the proxy's tunnel and TLS, as the route needs them."""
    run.connect(route.first_hop)
    if route.tunnels:
        run.tunnel(route.target)
    if route.target.tls:
        run.start_tls(route.target, tls_context)


def _fail(result: ProbeResult, run: _Probe, error: BaseException, timeout: float) -> None:
    """The result's error for an exception a probe ended with (the phase is the run's)."""
    if isinstance(error, TimeoutError):
        result.error = f"timed out after {timeout:g} s"
    elif isinstance(error, socket.gaierror):
        result.error = f"DNS lookup failed: {error.strerror or error}"
    elif isinstance(error, ssl.SSLError):
        result.error = f"TLS failed: {error.reason or error}"
    elif isinstance(error, OSError):
        result.error = error.strerror or str(error)
    else:
        result.error = str(error)
    result.error_phase = run.phase


PROBE_ERRORS = (OSError, ProbeError, RemoteProtocolError)
"""What a probe can end with (TimeoutError, socket.gaierror and ssl.SSLError are OSErrors)."""


def run_probe(route: Route, request: ProbeRequest, **probe: Any) -> ProbeResult:
    """Send `request` along `route` once and time it; failures end up in the result.
    `probe`: the keywords of `_timed` (path, prompt, api, timeout, tls_context)."""
    return _timed(route, request, _http_exchange, transport="http",
                  no_token="the answer carried no token (not an event stream of this API?)", **probe)


def run_websocket_probe(route: Route, request: ProbeRequest, **probe: Any) -> ProbeResult:
    """Open a Responses WebSocket along `route`, send `request` as one turn, time it."""
    return _timed(route, request, _websocket_exchange, transport="websocket", no_token="the turn carried no token",
                  **probe)


Exchange = Callable[["_Probe", Route, ProbeRequest, StreamWatcher], None]
"""One transport's part of a probe: from the open connection to the stream's end."""


def _timed(
    route: Route,
    request: ProbeRequest,
    exchange: Exchange,
    *,
    transport: str,
    no_token: str,
    path: str,
    prompt: str,
    api: str,
    timeout: float,
    tls_context: ssl.SSLContext,
) -> ProbeResult:
    """A probe's frame, whatever its transport: the result and its marks, the connection,
    the watcher that finds the first token, and every failure turned into the result."""
    result = ProbeResult(
        path=path, prompt=prompt, request_id=request.request_id,
        prompt_tokens=request.prompt_tokens, body_bytes=len(request.body), transport=transport,
    )
    run = _Probe(result, timeout)
    watcher = StreamWatcher(apis.get(api))
    try:
        _open(run, route, tls_context)
        run.phase = "send"
        exchange(run, route, request, watcher)
        if watcher.error:
            raise ProbeError(f"error in the stream: {watcher.error}")
        if watcher.first_token is None:
            raise ProbeError(no_token)
    except PROBE_ERRORS as e:
        _fail(result, run, e, timeout)
        logger.debug("%s probe %s %s failed in %s: %s", transport, path, prompt, run.phase, result.error)
    finally:
        run.close()
    run.mark("end")
    return result


def _watch(run: _Probe, watcher: StreamWatcher, piece: bytes) -> None:
    """Feeds the watcher; its first token marks the probe and starts its stream phase, in
    which the longest silence between pieces is the probe's `stall_ms`."""
    now = time.perf_counter()
    after = watcher.last_chunk
    watcher.feed(piece, now)
    result = run.result
    if watcher.first_token is not None and "first_token" not in result.marks:
        run.mark("first_token", watcher.first_token)
        run.phase = "stream"
    elif run.phase == "stream" and after is not None:
        result.stall_ms = round(max(result.stall_ms or 0.0, (now - after) * 1000), 3)


def _http_exchange(run: _Probe, route: Route, request: ProbeRequest, watcher: StreamWatcher) -> None:
    run.send(request_bytes(route, request))
    run.mark("sent")
    run.phase = "wait"
    run.result.status, headers, rest = run.read_head(on_first_byte=True)
    if run.result.status >= 400:
        run.phase = "wait"  # the upstream (or the relay) answered with a failure
        body = b"".join(_limited(run.body_chunks(headers, rest), MAX_ERROR_BODY))
        raise ProbeError(f"HTTP {run.result.status}: {error_excerpt(body)}")
    for piece in run.body_chunks(headers, rest):
        _watch(run, watcher, piece)


def _websocket_exchange(run: _Probe, route: Route, request: ProbeRequest, watcher: StreamWatcher) -> None:
    try:
        _websocket_turn(run, route, request, watcher)
    except RemoteProtocolError as e:
        raise ProbeError(f"WebSocket protocol error: {e}") from e


def _turn_message(request: ProbeRequest) -> bytes:
    """The request as the Responses WebSocket's turn (the socket the probe speaks)."""
    turns = apis.get(apis.OPENAI_RESPONSES).websocket_turns
    assert turns is not None  # the Responses API has them
    return turns.start(orjson.loads(request.body))


def _websocket_turn(run: _Probe, route: Route, request: ProbeRequest, watcher: StreamWatcher) -> None:
    result = run.result
    ws = WSConnection(ConnectionType.CLIENT)
    target = route.target
    resource = target.url(request.path) if route.proxy is not None and not target.tls else target.prefix + request.path
    headers = [(name.encode(), value.encode()) for name, value in websocket_headers(request)]
    run.send(ws.send(Request(host=target.authority, target=resource, extensions=[PerMessageDeflate()],
                             extra_headers=headers)))
    run.mark("sent")
    run.phase = "wait"
    message: list[str] = []
    rejected, done = b"", False
    while not done:
        data = run.recv()
        if not data:
            raise ProbeError("connection closed before the WebSocket answered" if run.phase == "wait"
                             else "connection closed before the turn completed")
        ws.receive_data(data)
        for event in ws.events():
            if isinstance(event, AcceptConnection):
                result.status = 101
                run.mark("head")
                run.phase = "first_token"
                run.send(ws.send(TextMessage(data=_turn_message(request).decode())))
                run.mark("message")
            elif isinstance(event, RejectConnection):
                result.status = event.status_code
                if not event.has_body:
                    raise ProbeError(f"the WebSocket upgrade was refused: HTTP {event.status_code}")
            elif isinstance(event, RejectData):
                rejected += event.data
                if event.body_finished:
                    raise ProbeError(f"the WebSocket upgrade was refused: HTTP {result.status}: "
                                     f"{error_excerpt(rejected)}")
            elif isinstance(event, TextMessage):
                message.append(event.data)
                if event.message_finished:
                    payload = "".join(message).encode()
                    message.clear()
                    _watch(run, watcher, b"data: " + payload + b"\n\n")
                    done = watcher.done or bool(watcher.error)
            elif isinstance(event, Ping):
                run.send(ws.send(event.response()))
            elif isinstance(event, CloseConnection):
                raise ProbeError(f"the WebSocket closed before the turn completed (code {event.code}"
                                 f"{': ' + event.reason if event.reason else ''})")


def _limited(chunks: Iterator[bytes], limit: int) -> Iterator[bytes]:
    """Chunks up to about `limit` bytes: an error body is read for its message only."""
    seen = 0
    for chunk in chunks:
        yield chunk
        seen += len(chunk)
        if seen >= limit:
            return


def tls_context(ca_files: list[str]) -> ssl.SSLContext:
    """The system's trust plus `ca_files` (e.g. the mitmproxy CA for the proxy mode)."""
    context = ssl.create_default_context()
    for path in ca_files:
        context.load_verify_locations(cafile=path)
    context.set_alpn_protocols(["http/1.1"])
    return context
