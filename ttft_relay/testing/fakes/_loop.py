"""A private asyncio event loop in a background thread, so synchronous tests can run servers.

`LoopServer` is the small TCP server built on it (the forwarder, the refusing proxy).

Both the fake upstream and the delaying forwarder are asyncio servers; tests and
benchmarks are mostly synchronous. `LoopThread` owns one loop and one thread and
shuts both down completely: every task still running at `stop()` is cancelled,
so a stalled connection can never keep a test process alive.
"""

from __future__ import annotations

import asyncio
import ssl
import threading
from collections.abc import Callable, Coroutine
from typing import Any, Self, TypeVar

T = TypeVar("T")

STOP_TIMEOUT_S = 5.0


class LoopThread:
    """Runs an event loop in a daemon thread until `stop()`."""

    def __init__(self, name: str) -> None:
        self.name = name
        self.loop: asyncio.AbstractEventLoop | None = None
        self._thread: threading.Thread | None = None

    def start(self) -> None:
        self.loop = asyncio.new_event_loop()
        self._thread = threading.Thread(target=self._run, args=(self.loop,), name=self.name, daemon=True)
        self._thread.start()

    def run(self, coro: Coroutine[Any, Any, T], timeout: float = STOP_TIMEOUT_S) -> T:
        """Run `coro` on the loop and wait for its result in the calling thread."""
        assert self.loop is not None, "start() first"
        return asyncio.run_coroutine_threadsafe(coro, self.loop).result(timeout)

    def call_soon(self, fn: Callable[[], object]) -> None:
        """Schedule `fn` on the loop from any thread. Before `start()` nothing can be waiting on the
        loop, so `fn` runs at once; after `stop()` there is nothing left to wake, so it is dropped."""
        if self.loop is None:
            fn()
            return
        try:
            self.loop.call_soon_threadsafe(fn)
        except RuntimeError:  # loop already closed: nothing left to wake
            pass

    def stop(self) -> None:
        """Cancel every task on the loop, stop it, join the thread and close the loop."""
        if self.loop is None or self._thread is None or not self._thread.is_alive():
            return
        self.run(self._cancel_all_tasks())
        self.loop.call_soon_threadsafe(self.loop.stop)
        self._thread.join(STOP_TIMEOUT_S)

    async def _cancel_all_tasks(self) -> None:
        current = asyncio.current_task()
        tasks = [t for t in asyncio.all_tasks() if t is not current]
        for task in tasks:
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)

    @staticmethod
    def _run(loop: asyncio.AbstractEventLoop) -> None:
        asyncio.set_event_loop(loop)
        try:
            loop.run_forever()
        finally:
            loop.run_until_complete(loop.shutdown_asyncgens())
            loop.close()


class LoopServer:
    """A TCP server on 127.0.0.1 (any free port) served by its own `LoopThread`.

    Subclasses implement `_serve(reader, writer)` for each accepted connection, and
    `_ssl_context()` to serve TLS. Use as a context manager or call `start()` / `stop()`.
    """

    thread_name = "loop-server"

    def __init__(self) -> None:
        self.port = 0
        self._loop_thread = LoopThread(self.thread_name)
        self._server: asyncio.Server | None = None

    async def _serve(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        raise NotImplementedError

    def _ssl_context(self) -> ssl.SSLContext | None:
        """The TLS the server speaks; None: plain TCP."""
        return None

    def start(self) -> Self:
        self._loop_thread.start()
        self._server = self._loop_thread.run(
            asyncio.start_server(self._serve, "127.0.0.1", 0, backlog=1024, ssl=self._ssl_context()))
        self.port = self._server.sockets[0].getsockname()[1]
        return self

    def stop(self) -> None:
        if self._server is not None:
            self._loop_thread.call_soon(self._server.close)
            self._server = None
        self._loop_thread.stop()

    def __enter__(self) -> Self:
        return self.start()

    def __exit__(self, *exc_info: object) -> None:
        self.stop()
