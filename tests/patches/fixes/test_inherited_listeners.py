"""Pin test of ttft_relay/patches/fixes/inherited_listeners.py, and what it does with a socket
several workers share: two server instances in one process stand for two workers
(the workers end to end: tests/test_workers.py)."""

from __future__ import annotations

import asyncio
import contextlib
import os
import socket

import pytest
from mitmproxy import master
from mitmproxy.addons import errorcheck
from mitmproxy.proxy import mode_servers
from mitmproxy.test import taddons

from ttft_relay.patches.fixes import inherited_listeners
from ttft_relay.testing.harness import connect_many, handshakes_completed
from tests.patches.pins import assert_unchanged, source

SPEC = "reverse:http://127.0.0.1:9@127.0.0.1:0"
QUEUE = 300
BURST = 60


def test_the_mitmproxy_code_under_it_is_unchanged():
    assert_unchanged(inherited_listeners.PINS, inherited_listeners)


def test_the_lines_it_depends_on():
    # A running instance keeps its servers in `_servers`; `_start` is where they are made.
    assert "self._servers = await self.listen(host, port)" in source(mode_servers.AsyncioServerInstance._start)
    run = source(master.Master.run)
    running = run.index("await self.running()")
    assert running < run.index("await ec.shutdown_if_errored()", running) < run.index("ec.finish()")
    assert source(errorcheck.ErrorCheck.shutdown_if_errored).count("await asyncio.sleep(0)") == 1


class _NoConnections:
    connections: dict = {}

    @contextlib.contextmanager
    def register_connection(self, connection_id, handler):
        yield


@pytest.fixture
def shared():
    """A listening socket as the supervisor binds it, and a pipe for the ready signal."""
    sock = socket.socket()
    sock.bind(("127.0.0.1", 0))
    sock.listen(QUEUE)
    readable, writable = os.pipe()
    os.set_blocking(readable, False)
    inherited_listeners.install({SPEC: [sock.fileno()]}, writable)
    yield sock, readable
    inherited_listeners.uninstall()  # closes the pipe's end it was given, if it still holds it
    sock.close()
    os.close(readable)


def _worker(accepted: list) -> mode_servers.ServerInstance:
    instance = mode_servers.ServerInstance.make(SPEC, _NoConnections())

    async def handle_stream(reader, writer) -> None:
        accepted.append(writer)

    instance.handle_stream = handle_stream  # type: ignore[method-assign]
    return instance


async def _turns(n: int) -> None:
    for _ in range(n):
        await asyncio.sleep(0)


def test_workers_accept_from_the_shared_queue_only_once_running_and_each_takes_its_share(shared):
    sock, ready = shared
    port = sock.getsockname()[1]

    async def run() -> tuple[list, list, list[socket.socket]]:
        with taddons.context():
            firsts, seconds = [], []
            workers = [_worker(firsts), _worker(seconds)]
            for w in workers:
                await w.start()
            try:
                assert {w.listen_addrs for w in workers} == {(("127.0.0.1", port),)}  # the supervisor's socket
                # Started, not accepting: the connections wait in the kernel's queue, which
                # asyncio's listen(ACCEPT_BATCH) on the shared socket did not shorten.
                clients = connect_many(port, QUEUE)
                assert len(handshakes_completed(clients)) == QUEUE
                await asyncio.sleep(0.2)
                assert firsts == seconds == [] and _said(ready) == b""
                inherited_listeners.serve_after_startup()
                await _accepted(firsts, seconds, QUEUE)
                assert _said(ready) == b"r"
                # A burst while both are idle: no awaits here, so all of it is queued
                # before either event loop looks.
                before = len(firsts), len(seconds)
                clients += connect_many(port, BURST)
                await _accepted(firsts, seconds, QUEUE + BURST)
                return firsts[before[0]:], seconds[before[1]:], clients
            finally:
                for w in workers:
                    await w.stop()
                for writer in firsts + seconds:
                    writer.close()

    firsts, seconds, clients = asyncio.run(run())
    try:
        assert len(firsts) + len(seconds) == BURST
        # A few connections per turn: both event-loop readers took turns. With asyncio's
        # own batch (the backlog, 100), the first reader to run drains the burst at once.
        assert len(firsts) > BURST // 4 and len(seconds) > BURST // 4, (len(firsts), len(seconds))
    finally:
        for c in clients:
            c.close()
    # The workers stopped (their duplicates closed); the shared socket still listens.
    with socket.create_connection(("127.0.0.1", port), timeout=5):
        pass


async def _accepted(firsts: list, seconds: list, n: int) -> None:
    deadline = asyncio.get_running_loop().time() + 10
    while len(firsts) + len(seconds) < n and asyncio.get_running_loop().time() < deadline:
        await asyncio.sleep(0.01)


def _said(fd: int) -> bytes:
    try:
        return os.read(fd, 1)
    except BlockingIOError:
        return b""


def test_a_worker_whose_start_logged_an_error_accepts_nothing(shared):
    sock, ready = shared

    async def run() -> list:
        with taddons.context() as tctx:
            check = errorcheck.ErrorCheck()
            tctx.master.addons.add(check)
            accepted: list = []
            worker = _worker(accepted)
            await worker.start()
            try:
                clients = connect_many(sock.getsockname()[1], 3)
                check.logger.has_errored.append(object())  # as an error logged during start-up
                inherited_listeners.serve_after_startup()
                await _turns(5)
                await asyncio.sleep(0.2)
                for c in clients:
                    c.close()
                return accepted
            finally:
                check.finish()
                await worker.stop()
                for writer in accepted:
                    writer.close()

    assert asyncio.run(run()) == [] and _said(ready) == b""


def test_modes_not_inherited_listen_as_mitmproxy_does(shared):
    async def run() -> tuple:
        with taddons.context():
            instance = mode_servers.ServerInstance.make("reverse:http://127.0.0.1:9@127.0.0.1:0", _NoConnections())
            instance.mode = mode_servers.mode_specs.ProxyMode.parse("reverse:http://127.0.0.1:10@127.0.0.1:0")
            await instance.start()
            try:
                return instance.listen_addrs
            finally:
                await instance.stop()

    (addr,) = asyncio.run(run())
    assert addr[1] not in (0, shared[0].getsockname()[1])
