"""A blocking WebSocket client for tests (wsproto over a socket): what Codex CLI does on
its Responses WebSocket, reduced to sending text messages and reading them back with
their arrival times. Offers permessage-deflate as Codex does; direct, or through an
HTTPS proxy (CONNECT, then TLS to the upstream)."""

from __future__ import annotations

import socket
import ssl
import time
from dataclasses import dataclass
from pathlib import Path
from urllib.parse import urlsplit

from wsproto import ConnectionType, WSConnection
from wsproto.events import (
    AcceptConnection,
    CloseConnection,
    Message,
    Ping,
    RejectConnection,
    RejectData,
    Request,
    TextMessage,
)
from wsproto.extensions import PerMessageDeflate

from ttft_relay.testing.fakes.client import _connect_tunnel

READ_SIZE = 65536


class HandshakeRefused(Exception):
    def __init__(self, status: int, body: bytes) -> None:
        super().__init__(f"WebSocket handshake refused: HTTP {status}")
        self.status, self.body = status, body


@dataclass(frozen=True)
class Received:
    text: str
    at: float


class WebSocketClient:
    def __init__(self, url: str, *, headers: dict[str, str] | None = None, deflate: bool = True,
                 proxy: str | None = None, ca: str | Path | None = None, timeout: float = 20.0) -> None:
        target = urlsplit(url)
        tls = target.scheme in ("https", "wss")
        host, port = target.hostname or "", target.port or (443 if tls else 80)
        if proxy is None:
            sock = socket.create_connection((host, port), timeout)
        else:
            p = urlsplit(proxy)
            sock = socket.create_connection((p.hostname, p.port or 80), timeout)
            _connect_tunnel(sock, host, port)
        if tls:
            context = ssl.create_default_context(cafile=str(ca) if ca else None)
            context.set_alpn_protocols(["http/1.1"])
            sock = context.wrap_socket(sock, server_hostname=host)
        self.sock = sock
        self.ws = WSConnection(ConnectionType.CLIENT)
        self.closed: CloseConnection | None = None
        self._pending: list[Received] = []
        self._text: list[str] = []
        path = target.path + (f"?{target.query}" if target.query else "")
        self._send(self.ws.send(Request(
            host=target.netloc, target=path, extra_headers=list((headers or {}).items()),
            extensions=[PerMessageDeflate()] if deflate else [])))
        self.accepted: AcceptConnection | None = None
        refused: RejectConnection | None = None
        body, answered = b"", False
        while not answered:
            for event in self._events():
                if isinstance(event, AcceptConnection):
                    self.accepted, answered = event, True
                elif isinstance(event, RejectConnection):
                    refused, answered = event, not event.has_body
                elif isinstance(event, RejectData):
                    body, answered = body + event.data, event.body_finished
        if refused is not None:
            self.sock.close()
            raise HandshakeRefused(refused.status_code, body)

    def send_text(self, text: str) -> float:
        """Send one text message; returns when it was written."""
        self._send(self.ws.send(TextMessage(text)))
        return time.time()

    def receive(self, timeout: float = 20.0) -> Received | None:
        """The next text message (None once the socket has closed)."""
        deadline = time.time() + timeout
        while not self._pending and self.closed is None:
            self.sock.settimeout(max(0.01, deadline - time.time()))
            for event in self._events():
                if isinstance(event, TextMessage):
                    self._text.append(event.data)
                    if event.message_finished:
                        self._pending.append(Received("".join(self._text), time.time()))
                        self._text = []
                elif isinstance(event, Message):
                    pass  # binary: not what these tests exchange
                elif isinstance(event, Ping):
                    self._send(self.ws.send(event.response()))
                elif isinstance(event, CloseConnection):
                    self.closed = event
        return self._pending.pop(0) if self._pending else None

    def close(self) -> None:
        if self.closed is None:
            try:
                self._send(self.ws.send(CloseConnection(code=1000)))
            except OSError:
                pass
        self.sock.close()

    def __enter__(self) -> WebSocketClient:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def _send(self, data: bytes) -> None:
        self.sock.sendall(data)

    def _events(self):
        data = self.sock.recv(READ_SIZE)
        self.ws.receive_data(data or None)
        yield from self.ws.events()
