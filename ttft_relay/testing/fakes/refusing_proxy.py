"""`RefusingProxy`: an HTTP(S) proxy that refuses every request at once and notes what was asked for.

The coding-agent CLIs call home (updates, telemetry, feature flags, model lists)
on hosts the tests do not serve. Given `HTTPS_PROXY` / `HTTP_PROXY` pointing here
(and `NO_PROXY` for loopback, where the fakes and the relay listen), each such
call gets a `403` straight away instead of a DNS failure or a hang, and `refused`
lists the targets (`CONNECT host:port` or the absolute-form URL), so a test can
show what a client tried to reach.
"""

from __future__ import annotations

import asyncio
import threading

from ttft_relay.testing.fakes._loop import LoopServer
from ttft_relay.testing.fakes.http_wire import BadRequest, Inbound, MAX_HEAD_BYTES

REFUSAL = (
    b"HTTP/1.1 403 Forbidden\r\nContent-Type: text/plain\r\nContent-Length: 35\r\nConnection: close\r\n\r\n"
    b"ttft-relay tests: no outside hosts\n"
)


class RefusingProxy(LoopServer):
    """Listens on 127.0.0.1:`port` (any free port) and answers every request with 403."""

    thread_name = "refusing-proxy"

    def __init__(self) -> None:
        super().__init__()
        self._lock = threading.Lock()
        self._refused: list[str] = []

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    @property
    def refused(self) -> list[str]:
        """The request lines' method and target of everything refused so far, in order."""
        with self._lock:
            return list(self._refused)

    async def _serve(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        inbound = Inbound(reader)
        try:
            head = await inbound.read_until(b"\r\n\r\n", MAX_HEAD_BYTES)
            if head:
                method, target = (head.split(b"\r\n", 1)[0].decode("latin-1").split(" ") + [""])[:2]
                with self._lock:
                    self._refused.append(f"{method} {target}")
                writer.write(REFUSAL)
                await writer.drain()
        except (BadRequest, ConnectionError):
            pass
        finally:
            inbound.close()
            writer.close()
