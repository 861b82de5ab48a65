"""`DelayingForwarder`: a TCP forwarder that puts a one-way delay on every byte, like a far-away link.

Put it between the relay and an (HTTPS) fake upstream and every round trip costs
2 x `delay_ms`: a TLS 1.3 handshake gains about one round trip, request -> response
head one more. Bytes keep their order; a half-close (EOF) is forwarded after the
same delay, a reset or error on either side aborts both.

The forwarder accepts the client's TCP connection itself, at once, so the TCP
connect as the client measures it is *not* delayed. `connect_delay_ms` delays
opening the upstream side instead; as the client's first bytes wait in the
forwarder meanwhile, it shows up as extra time to the first answer, not as a slow
connect.
"""

from __future__ import annotations

import asyncio
import threading

from ttft_relay.testing.fakes._loop import LoopServer

READ_SIZE = 64 * 1024


class DelayingForwarder(LoopServer):
    """Forwards 127.0.0.1:`port` to `target_host`:`target_port`, delaying each direction by `delay_ms`."""

    thread_name = "delaying-forwarder"

    def __init__(self, target_host: str, target_port: int, delay_ms: float, *, connect_delay_ms: float = 0) -> None:
        super().__init__()
        self.target_host = target_host
        self.target_port = target_port
        self.delay_ms = delay_ms
        self.connect_delay_ms = connect_delay_ms
        self._lock = threading.Lock()
        self._connections = 0
        self._clients: set[asyncio.StreamWriter] = set()

    @property
    def connections(self) -> int:
        """How many client connections the forwarder has accepted so far."""
        with self._lock:
            return self._connections

    def hang_up(self) -> None:
        """Close every connection now on the client's side, as a server closes its idle
        keep-alive connections (the client reads their end at once, not after the delay)."""
        self._loop_thread.call_soon(lambda: [writer.close() for writer in list(self._clients)])

    async def _serve(self, client_reader: asyncio.StreamReader, client_writer: asyncio.StreamWriter) -> None:
        with self._lock:
            self._connections += 1
        self._clients.add(client_writer)
        writers = [client_writer]
        graceful = False
        try:
            async with asyncio.TaskGroup() as group:
                # Read the client while connecting upstream, so its first bytes are stamped when they arrived.
                to_upstream: asyncio.Queue[tuple[float, bytes]] = asyncio.Queue()
                group.create_task(self._read_into(client_reader, to_upstream))
                await asyncio.sleep(self.connect_delay_ms / 1000)
                upstream_reader, upstream_writer = await asyncio.open_connection(self.target_host, self.target_port)
                writers.append(upstream_writer)
                to_client: asyncio.Queue[tuple[float, bytes]] = asyncio.Queue()
                group.create_task(self._deliver(to_upstream, upstream_writer))
                group.create_task(self._read_into(upstream_reader, to_client))
                group.create_task(self._deliver(to_client, client_writer))
            graceful = True
        except* OSError:  # ConnectionError included: one side failed, so break both, as a broken path would
            pass
        finally:
            self._clients.discard(client_writer)
            for writer in writers:
                if graceful:
                    writer.close()
                else:
                    writer.transport.abort()

    async def _read_into(self, reader: asyncio.StreamReader, queue: asyncio.Queue[tuple[float, bytes]]) -> None:
        """Stamp each read with its delivery time; b"" marks end of stream."""
        loop = asyncio.get_running_loop()
        while True:
            data = await reader.read(READ_SIZE)
            queue.put_nowait((loop.time() + self.delay_ms / 1000, data))
            if not data:
                return

    @staticmethod
    async def _deliver(queue: asyncio.Queue[tuple[float, bytes]], writer: asyncio.StreamWriter) -> None:
        loop = asyncio.get_running_loop()
        while True:
            due, data = await queue.get()
            await asyncio.sleep(max(0.0, due - loop.time()))
            if not data:
                writer.write_eof()
                return
            writer.write(data)
            await writer.drain()
