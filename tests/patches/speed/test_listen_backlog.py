"""Pin test of ttft_relay/patches/speed/listen_backlog.py, and the backlog it gives a listener
(the addon: tests/test_capacity.py)."""

from __future__ import annotations

import asyncio
import contextlib

import pytest
from mitmproxy.proxy import mode_servers
from mitmproxy.test import taddons

from ttft_relay.patches.speed import listen_backlog
from ttft_relay.testing.harness import connect_many, handshakes_completed
from tests.patches.pins import assert_unchanged, source


def test_the_mitmproxy_code_under_it_is_unchanged():
    assert_unchanged(listen_backlog.PINS, listen_backlog)


def test_the_lines_it_depends_on():
    # Every TCP listener comes from `listen`, and a running instance keeps its servers in `_servers`.
    assert "self._servers = await self.listen(host, port)" in source(mode_servers.AsyncioServerInstance._start)
    assert "asyncio.start_server(self.handle_stream, host, port)" in source(listen_backlog._ORIGINAL_LISTEN)


class _NoConnections:
    connections: dict = {}

    @contextlib.contextmanager
    def register_connection(self, connection_id, handler):
        yield


@pytest.mark.parametrize("backlog", [0, 300])
def test_listeners_started_after_install_queue_the_backlog(backlog):
    async def queued() -> int:
        with taddons.context():
            instance = mode_servers.ServerInstance.make("reverse:http://127.0.0.1:9@127.0.0.1:0", _NoConnections())
            listen_backlog.set_listen_backlog(backlog)
            try:
                await instance.start()
                # No await from here on: the event loop accepts nothing while we connect.
                sockets = connect_many(instance.listen_addrs[0][1], 250)
                try:
                    return len(handshakes_completed(sockets))
                finally:
                    for s in sockets:
                        s.close()
            finally:
                listen_backlog.set_listen_backlog(0)
                await instance.stop()

    got = asyncio.run(queued())
    if backlog:
        assert got == 250
    else:  # mitmproxy's own: asyncio's 100 (the kernel queues one more)
        assert listen_backlog.ASYNCIO_DEFAULT_BACKLOG <= got <= listen_backlog.ASYNCIO_DEFAULT_BACKLOG + 1
