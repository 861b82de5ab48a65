"""Hostile peers, byte by byte: WebSocket frames written by hand (what no well-behaved
library sends), a client that speaks them to a relay after a real upgrade, and an upstream
that answers an HTTP request or a WebSocket upgrade with whatever an attack yields (a
stalled body, a garbage chunk header, a gzip or deflate bomb). For the tests of the relay's
bounds and `benchmarks/hostile.py`.

Frames from the client are masked with the all-zero key (masking is then the identity, and
the RFC allows any key on the wire), so a 1 GB deflate bomb costs nothing to send.
"""

from __future__ import annotations

import base64
import contextlib
import hashlib
import socket
import struct
import threading
import time
import zlib
from collections.abc import Callable, Iterable, Iterator
from dataclasses import dataclass, field
from functools import lru_cache
from typing import Any

TEXT, BINARY, CONTINUATION, CLOSE, PING, PONG = 0x1, 0x2, 0x0, 0x8, 0x9, 0xA
_GUID = b"258EAFA5-E914-47DA-95CA-C5AB0DC85B11"


def frame(opcode: int, payload: bytes = b"", *, fin: bool = True, rsv1: bool = False, masked: bool) -> bytes:
    """One WebSocket frame (RFC 6455 5.2); `masked` for frames from a client (key 0)."""
    head = bytes([(0x80 if fin else 0) | (0x40 if rsv1 else 0) | opcode])
    mask = 0x80 if masked else 0
    n = len(payload)
    if n <= 125:
        head += bytes([mask | n])
    elif n <= 0xFFFF:
        head += bytes([mask | 126]) + struct.pack("!H", n)
    else:
        head += bytes([mask | 127]) + struct.pack("!Q", n)
    return head + (b"\0\0\0\0" if masked else b"") + payload


def deflated(data: bytes | Iterable[bytes]) -> bytes:
    """`data` as a permessage-deflate message payload (RFC 7692 7.2.1: raw deflate, flushed,
    without the trailing 00 00 ff ff)."""
    c = zlib.compressobj(9, zlib.DEFLATED, -15)
    pieces = [data] if isinstance(data, bytes) else data
    out = b"".join(c.compress(p) for p in pieces) + c.flush(zlib.Z_SYNC_FLUSH)
    return out[:-4]


@lru_cache(maxsize=4)
def deflate_bomb(size: int) -> bytes:
    """A compressed text message that inflates to `size` bytes of "a" (1 GB: about 1 MB)."""
    return _repeated_deflate(b"a", size)[:-4]


def _repeated_deflate(byte: bytes, size: int, wbits: int = -15) -> bytes:
    """Raw deflate of `size` times `byte`, ending in a sync flush: one compressed MiB after a
    full flush (no reference back past it), repeated, so a bomb costs no compressing."""
    piece = byte * (1 << 20)
    whole, rest = divmod(size, len(piece))
    c = zlib.compressobj(9, zlib.DEFLATED, wbits)
    segment = c.compress(piece) + c.flush(zlib.Z_FULL_FLUSH)
    return segment * whole + c.compress(piece[:rest]) + c.flush(zlib.Z_SYNC_FLUSH)


def accept_key(key: str) -> str:
    return base64.b64encode(hashlib.sha1(key.encode() + _GUID).digest()).decode()


def _read_head(sock: socket.socket) -> tuple[bytes, bytes]:
    """(head, what came after it) from a socket."""
    data = b""
    while b"\r\n\r\n" not in data:
        chunk = sock.recv(65536)
        if not chunk:
            raise ConnectionError(f"closed before a complete head: {data[:200]!r}")
        data += chunk
    head, _, rest = data.partition(b"\r\n\r\n")
    return head, rest


@dataclass
class Frame:
    fin: bool
    rsv1: bool
    opcode: int
    payload: bytes


class FrameReader:
    """Frames from a byte stream (unmasked or masked), as they complete."""

    def __init__(self, data: bytes = b"") -> None:
        self.buf = bytearray(data)

    def feed(self, data: bytes) -> Iterator[Frame]:
        self.buf += data
        while (f := self._one()) is not None:
            yield f

    def _one(self) -> Frame | None:
        b = self.buf
        if len(b) < 2:
            return None
        n, pos = b[1] & 0x7F, 2
        if n == 126:
            if len(b) < 4:
                return None
            n, pos = struct.unpack_from("!H", b, 2)[0], 4
        elif n == 127:
            if len(b) < 10:
                return None
            n, pos = struct.unpack_from("!Q", b, 2)[0], 10
        key = None
        if b[1] & 0x80:
            key, pos = bytes(b[pos:pos + 4]), pos + 4
        if len(b) < pos + n:
            return None
        payload = bytes(b[pos:pos + n])
        if key is not None and key != b"\0\0\0\0":
            payload = unmasked(payload, key)
        f = Frame(bool(b[0] & 0x80), bool(b[0] & 0x40), b[0] & 0x0F, payload)
        del b[:pos + n]
        return f


def unmasked(payload: bytes, key: bytes) -> bytes:
    """`payload` XORed with the 4-byte `key` repeated, as one big integer: a byte at a time in
    Python took seconds of the GIL for a 20 MiB frame, stalling every thread of the process that
    measured (a victim stream's reader among them)."""
    n = len(payload)
    mask = (key * (n // 4 + 1))[:n]
    return (int.from_bytes(payload, "big") ^ int.from_bytes(mask, "big")).to_bytes(n, "big")


def close_code(f: Frame) -> int | None:
    return struct.unpack("!H", f.payload[:2])[0] if len(f.payload) >= 2 else None


class RawClient:
    """A WebSocket client that sends whatever bytes it is given after a real upgrade
    (offering permessage-deflate unless `deflate=False`, or the extensions `offer` names)."""

    def __init__(self, port: int, path: str = "/v1/responses", *, headers: dict[str, str] | None = None,
                 deflate: bool = True, offer: str | None = None, timeout: float = 30) -> None:
        self.sock = socket.create_connection(("127.0.0.1", port), timeout)
        key = base64.b64encode(b"hostile-ws-key!!").decode()
        lines = [f"GET {path} HTTP/1.1", f"Host: 127.0.0.1:{port}", "Upgrade: websocket", "Connection: Upgrade",
                 f"Sec-WebSocket-Key: {key}", "Sec-WebSocket-Version: 13"]
        if offer is not None or deflate:
            lines.append(f"Sec-WebSocket-Extensions: {offer if offer is not None else 'permessage-deflate'}")
        lines += [f"{k}: {v}" for k, v in (headers or {}).items()]
        self.sock.sendall(("\r\n".join(lines) + "\r\n\r\n").encode())
        head, rest = _read_head(self.sock)
        self.status = int(head.split(b" ", 2)[1])
        self.head = head.decode("latin-1")
        self.reader = FrameReader(rest)
        self.received = 0
        """Payload bytes of data frames read so far (as on the wire: compressed if deflated)."""
        self.frames: list[Frame] = []

    @property
    def deflate(self) -> bool:
        return "permessage-deflate" in self.head.lower()

    def send(self, data: bytes) -> None:
        self.sock.sendall(data)

    def until_close(self, timeout: float = 30) -> Frame | None:
        """Read until a close frame comes (returned) or the connection ends (None)."""
        deadline = time.monotonic() + timeout
        pending = list(self.reader.feed(b""))
        while True:
            for f in pending:
                if f.opcode == CLOSE:
                    return f
                self.received += len(f.payload)
                if f.opcode not in (TEXT, BINARY, CONTINUATION):
                    self.frames.append(f)
            left = deadline - time.monotonic()
            if left <= 0:
                raise TimeoutError("no close frame")
            self.sock.settimeout(left)
            try:
                data = self.sock.recv(1 << 20)
            except ConnectionResetError:
                return None
            if not data:
                return None
            pending = list(self.reader.feed(data))

    def close(self) -> None:
        self.sock.close()

    def __enter__(self) -> RawClient:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


HOLD = b""
"""Yielded by an attack: send nothing more, keep the connection open until the relay closes it."""
AWAIT_MESSAGE = b"<await a message>"
"""Yielded by a WebSocket attack: wait for the relay's next whole data message, then go on."""


@dataclass
class UpstreamSession:
    method: str
    path: str
    headers: dict[str, str]
    attack: str | None
    request_line: str = ""
    close: Frame | None = None
    """WebSocket: the close frame the relay sent this upstream, if any."""
    received: int = 0
    """WebSocket: payload bytes of the relay's data frames; HTTP: bytes after the request."""
    digest: Any = field(default_factory=hashlib.sha256)
    """WebSocket: the SHA-256 of those payloads, unmasked, in order (what the relay passed on)."""
    ended: bool = False


class HostileUpstream:
    """An upstream on loopback that answers with whatever `attacks[x-attack header]()` yields.

    An HTTP request (its body read by Content-Length) gets the attack's bytes as its whole
    answer, head included; a WebSocket upgrade gets a `101` (permessage-deflate when
    offered, or the `Sec-WebSocket-Extensions` the request's `x-answer-extensions` says)
    and then the attack's frames. Either way it then reads until the relay closes,
    recording what came (`sessions`). A context manager: leaving it ends the connections still
    open (a relay that outlives it, such as a module's shared one, would hold them)."""

    def __init__(self, attacks: dict[str, Callable[[UpstreamSession], Iterable[bytes]]]) -> None:
        self.attacks = attacks
        self.sessions: list[UpstreamSession] = []
        self.changed = threading.Condition()
        self._listener = socket.create_server(("127.0.0.1", 0), backlog=1024)
        self.port = self._listener.getsockname()[1]
        self._threads: list[threading.Thread] = []
        self._open: set[socket.socket] = set()
        self._stopping = False

    @property
    def base_url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def __enter__(self) -> HostileUpstream:
        t = threading.Thread(target=self._accept, daemon=True)
        t.start()
        self._threads.append(t)
        return self

    def __exit__(self, *exc: object) -> None:
        self._stopping = True
        with contextlib.suppress(OSError):
            self._listener.shutdown(socket.SHUT_RDWR)  # wakes the accepting thread; a close would not
        self._listener.close()
        with self.changed:
            for conn in self._open:
                with contextlib.suppress(OSError):
                    conn.shutdown(socket.SHUT_RDWR)  # wakes the thread reading it; a close would not
        for t in self._threads:
            t.join(5)

    def wait_ended(self, count: int = 1, timeout: float = 30) -> list[UpstreamSession]:
        with self.changed:
            if not self.changed.wait_for(lambda: sum(s.ended for s in self.sessions) >= count, timeout):
                raise TimeoutError(f"{sum(s.ended for s in self.sessions)} of {count} upstream connections ended")
            return list(self.sessions)

    def _accept(self) -> None:
        while not self._stopping:
            try:
                conn, _ = self._listener.accept()
            except OSError:
                return
            t = threading.Thread(target=self._serve, args=(conn,), daemon=True)
            t.start()
            self._threads.append(t)

    def _serve(self, conn: socket.socket) -> None:
        with self.changed:
            if self._stopping:
                conn.close()
                return
            self._open.add(conn)
        try:
            self._serve_open(conn)
        finally:
            with self.changed:
                self._open.discard(conn)

    def _serve_open(self, conn: socket.socket) -> None:
        with conn:
            conn.settimeout(120)
            try:
                head, rest = _read_head(conn)
            except (ConnectionError, OSError):
                return
            lines = head.decode("latin-1").split("\r\n")
            method, path = (lines[0].split(" ") + ["", ""])[:2]
            request_line = lines[0]
            headers = {k.strip().lower(): v.strip() for k, _, v in (ln.partition(":") for ln in lines[1:])}
            session = UpstreamSession(method, path, headers, headers.get("x-attack"), request_line=request_line)
            with self.changed:
                self.sessions.append(session)
            upgrade = "websocket" in headers.get("upgrade", "").lower()
            try:
                if upgrade:
                    answer = ["HTTP/1.1 101 Switching Protocols", "Upgrade: websocket", "Connection: Upgrade",
                              f"Sec-WebSocket-Accept: {accept_key(headers.get('sec-websocket-key', ''))}"]
                    if (extensions := headers.get("x-answer-extensions")) is not None:
                        answer.append(f"Sec-WebSocket-Extensions: {extensions}")
                    elif "permessage-deflate" in headers.get("sec-websocket-extensions", ""):
                        answer.append("Sec-WebSocket-Extensions: permessage-deflate")
                    conn.sendall(("\r\n".join(answer) + "\r\n\r\n").encode())
                else:
                    length = int(headers.get("content-length", "0") or 0)
                    while len(rest) < length:
                        if not (more := conn.recv(65536)):
                            return
                        rest += more
                    rest = rest[length:]
                reader = FrameReader(rest) if upgrade else None
                for data in self.attacks.get(session.attack or "", lambda s: ())(session):
                    if data is HOLD:
                        break
                    if data is AWAIT_MESSAGE and reader is not None:
                        self._await_message(conn, reader)
                        continue
                    conn.sendall(data)
                else:
                    if not upgrade:
                        return  # the answer is complete: close
                self._read_until_closed(conn, session, reader)
            except OSError:
                pass
            finally:
                with self.changed:
                    session.ended = True
                    self.changed.notify_all()

    @staticmethod
    def _await_message(conn: socket.socket, reader: FrameReader) -> None:
        pending = list(reader.feed(b""))
        while not any(f.fin and f.opcode in (TEXT, BINARY, CONTINUATION) for f in pending):
            if not (data := conn.recv(1 << 20)):
                raise ConnectionError("closed while waiting for a message")
            pending += list(reader.feed(data))

    @staticmethod
    def _read_until_closed(conn: socket.socket, session: UpstreamSession, reader: FrameReader | None) -> None:
        pending = list(reader.feed(b"")) if reader is not None else []
        while session.close is None:
            for f in pending:
                if f.opcode == CLOSE:
                    session.close = f
                    conn.sendall(frame(CLOSE, f.payload[:2], masked=False))
                    return
                session.received += len(f.payload)
                session.digest.update(f.payload)
            data = conn.recv(1 << 20)
            if not data:
                return
            if reader is None:
                session.received += len(data)
                pending = []
            else:
                pending = list(reader.feed(data))


def gzip_bomb(size: int, head: bytes = b"") -> bytes:
    """`head` then about `size` bytes of SSE comment lines (1 GB: about 1 MB), gzip-compressed."""
    c = zlib.compressobj(9, zlib.DEFLATED, -15)
    line = b": " + b"x" * 1021 + b"\n"
    piece = line * 1024
    segment = c.compress(piece) + c.flush(zlib.Z_FULL_FLUSH)
    count = size // len(piece)
    start = c.compress(head) + c.flush(zlib.Z_FULL_FLUSH)
    crc = zlib.crc32(head)
    for _ in range(count):
        crc = zlib.crc32(piece, crc)
    total = len(head) + count * len(piece)
    body = start + segment * count + c.flush(zlib.Z_FINISH)
    return (b"\x1f\x8b\x08\x00\x00\x00\x00\x00\x00\xff" + body + struct.pack("<II", crc, total & 0xFFFFFFFF))
