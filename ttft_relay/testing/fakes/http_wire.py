"""Server-side HTTP/1.1 request reading for the fake upstream: just enough of RFC 9112.

Request line, headers, and a body framed by Content-Length or chunked transfer
coding (trailers skipped); `Expect: 100-continue` is answered. `Inbound` also
notices a client hanging up while the server is busy writing a response, which a
plain `StreamReader` cannot tell without consuming the next request's bytes.
"""

from __future__ import annotations

import asyncio
import socket
import struct
from collections.abc import Iterable
from dataclasses import dataclass

MAX_HEAD_BYTES = 64 * 1024
READ_SIZE = 64 * 1024


class BadRequest(Exception):
    """The client sent something this parser cannot read as HTTP/1.1."""


def find_header(headers: Iterable[tuple[str, str]], name: str) -> str | None:
    """The first value of header `name` (case-insensitive), or None."""
    name = name.lower()
    return next((value for key, value in headers if key.lower() == name), None)


def header_has_token(headers: Iterable[tuple[str, str]], name: str, token: str) -> bool:
    """True if comma-separated header `name` lists `token` (case-insensitive), e.g. Connection: close."""
    value = find_header(headers, name) or ""
    return token.lower() in (part.strip().lower() for part in value.split(","))


@dataclass(frozen=True)
class RequestHead:
    """Request line and header fields (in order, names as sent)."""

    method: str
    target: str
    version: str
    headers: tuple[tuple[str, str], ...]

    def wants_keep_alive(self) -> bool:
        """HTTP/1.1 keeps the connection unless told `close`; HTTP/1.0 only if told `keep-alive`."""
        if header_has_token(self.headers, "connection", "close"):
            return False
        return self.version == "HTTP/1.1" or header_has_token(self.headers, "connection", "keep-alive")


class Inbound:
    """Buffered reading from one connection that never loses bytes to a hang-up watch.

    Reads go through one pending read task that survives cancellation (it is
    shielded), so `wait_hangup()` can be raced against response writing and then
    abandoned without dropping whatever the client sent meanwhile.
    """

    def __init__(self, reader: asyncio.StreamReader) -> None:
        self._reader = reader
        self._buffer = bytearray()
        self._pending: asyncio.Future[bytes] | None = None

    async def _fill(self) -> bool:
        """Append the next read to the buffer; False at end of stream (or reset)."""
        if self._pending is None:
            self._pending = asyncio.ensure_future(self._reader.read(READ_SIZE))
        try:
            data = await asyncio.shield(self._pending)
        except ConnectionError:
            data = b""
        self._pending = None
        self._buffer += data
        return bool(data)

    async def read_some(self) -> bytes:
        """Whatever is buffered, else the next read; b"" at end of stream."""
        if not self._buffer:
            await self._fill()
        data = bytes(self._buffer)
        self._buffer.clear()
        return data

    async def wait_hangup(self) -> None:
        """Return once the client has closed its side of the connection."""
        while await self._fill():
            pass

    async def read_until(self, separator: bytes, limit: int) -> bytes | None:
        """Bytes up to and including `separator`; None if the stream ended before any byte."""
        while (end := self._buffer.find(separator)) < 0:
            if len(self._buffer) > limit:
                raise BadRequest(f"no {separator!r} within {limit} bytes")
            if not await self._fill():
                if self._buffer:
                    raise BadRequest("connection closed mid-message")
                return None
        end += len(separator)
        data = bytes(self._buffer[:end])
        del self._buffer[:end]
        return data

    async def read_exactly(self, count: int) -> bytes:
        while len(self._buffer) < count:
            if not await self._fill():
                raise BadRequest("connection closed mid-body")
        data = bytes(self._buffer[:count])
        del self._buffer[:count]
        return data

    def close(self) -> None:
        if self._pending is not None:
            self._pending.cancel()


async def read_request(inbound: Inbound, writer: asyncio.StreamWriter) -> tuple[RequestHead, bytes, bool] | None:
    """The next request on the connection as (head, body, body_was_chunked); None at a clean close."""
    raw_head = await inbound.read_until(b"\r\n\r\n", MAX_HEAD_BYTES)
    if raw_head is None:
        return None
    head = _parse_head(raw_head)
    if header_has_token(head.headers, "expect", "100-continue"):
        writer.write(b"HTTP/1.1 100 Continue\r\n\r\n")
        await writer.drain()
    if header_has_token(head.headers, "transfer-encoding", "chunked"):
        return head, await _read_chunked_body(inbound), True
    length = find_header(head.headers, "content-length") or "0"
    if not length.isdigit():
        raise BadRequest(f"bad Content-Length {length!r}")
    return head, await inbound.read_exactly(int(length)), False


def _parse_head(raw: bytes) -> RequestHead:
    try:
        lines = raw.decode("latin-1").split("\r\n")[:-2]
        method, target, version = lines[0].split(" ")
        headers = tuple((name.strip(), value.strip()) for name, value in (line.split(":", 1) for line in lines[1:]))
    except ValueError as exc:
        raise BadRequest(f"malformed request head: {raw[:200]!r}") from exc
    if not version.startswith("HTTP/1."):
        raise BadRequest(f"unsupported version {version!r}")
    return RequestHead(method, target, version, headers)


async def _read_chunked_body(inbound: Inbound) -> bytes:
    body = bytearray()
    while True:
        size_line = await inbound.read_until(b"\r\n", MAX_HEAD_BYTES)
        if size_line is None:
            raise BadRequest("connection closed mid-body")
        try:
            size = int(size_line.split(b";", 1)[0], 16)
        except ValueError as exc:
            raise BadRequest(f"bad chunk size line {size_line!r}") from exc
        if size == 0:
            break
        body += await inbound.read_exactly(size + 2)
        del body[-2:]  # the CRLF after the chunk data
    while await inbound.read_until(b"\r\n", MAX_HEAD_BYTES) not in (b"\r\n", None):
        pass  # trailer fields: not needed by any test
    return bytes(body)


def reset_connection(writer: asyncio.StreamWriter) -> None:
    """Abort the connection with a TCP RST (SO_LINGER 0), not a FIN: what a crashed upstream looks like."""
    sock = writer.get_extra_info("socket")
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, struct.pack("ii", 1, 0))
    writer.transport.abort()


async def sleep_ms(ms: float) -> None:
    if ms > 0:
        await asyncio.sleep(ms / 1000)
