"""Benchmark floor: a plain asyncio TCP forwarder, the least Python can do per read.

`python -m benchmarks.forwarder HOST PORT` listens on a free loopback port (printed as
`listening http://127.0.0.1:PORT`) and copies every read of each connection to a new
connection to HOST:PORT and back: no HTTP, no TLS, nothing watched. What a relay costs
above it is what its HTTP and its work cost; a relay cannot go below it.
"""

from __future__ import annotations

import asyncio
import sys


class _Half(asyncio.Protocol):
    """One side of a forwarded connection: what it reads goes to `peer`."""

    def __init__(self, peer: asyncio.Transport | None = None) -> None:
        self.peer = peer
        self.early: list[bytes] = []  # read before the other side was connected

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        self.transport = transport

    def data_received(self, data: bytes) -> None:
        if self.peer is None:
            self.early.append(data)
        else:
            self.peer.write(data)

    def connection_lost(self, exc: Exception | None) -> None:
        if self.peer is not None:
            self.peer.close()


class _Client(_Half):
    def __init__(self, upstream: tuple[str, int]) -> None:
        super().__init__()
        self.upstream = upstream

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        super().connection_made(transport)
        asyncio.get_running_loop().create_task(self._connect())

    async def _connect(self) -> None:
        loop = asyncio.get_running_loop()
        try:
            upstream, _ = await loop.create_connection(lambda: _Half(self.transport), *self.upstream)
        except OSError:
            self.transport.close()
            return
        self.peer = upstream
        for data in self.early:
            upstream.write(data)
        self.early.clear()


async def serve(host: str, port: int) -> None:
    loop = asyncio.get_running_loop()
    server = await loop.create_server(lambda: _Client((host, port)), "127.0.0.1", 0)
    print(f"listening http://127.0.0.1:{server.sockets[0].getsockname()[1]}", flush=True)
    await server.serve_forever()


if __name__ == "__main__":
    asyncio.run(serve(sys.argv[1], int(sys.argv[2])))
