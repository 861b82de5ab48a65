"""Pin test of ttft_relay/patches/connections.py (its use: tests/test_selfwatch.py, tests/test_selfwatch_e2e.py)."""

from __future__ import annotations

from mitmproxy.proxy import mode_servers, server

from ttft_relay.patches import connections
from tests.patches.pins import assert_unchanged, source

PINNED = {
    # where a live connection's socket is (selfwatch reads its TCP_INFO)
    "ServerInstance.handle_stream": (mode_servers.ServerInstance.handle_stream, "21eea06f208c752e"),
    "ConnectionHandler.open_connection": (server.ConnectionHandler.open_connection, "5e0b3cbaf7a4030a"),
    "LiveConnectionHandler.__init__": (server.LiveConnectionHandler.__init__, "2cb1077a21556ca9"),
    # where a running listener keeps its servers
    "AsyncioServerInstance._start": (mode_servers.AsyncioServerInstance._start, "f96507081fa6236b"),
}


def test_the_mitmproxy_code_under_it_is_unchanged():
    assert_unchanged(PINNED, connections)


def test_the_lines_it_depends_on():
    # A connection's handler is registered by its client's id; its transports hold asyncio writers.
    assert "register_connection(handler.layer.context.client.id, handler)" in source(
        mode_servers.ServerInstance.handle_stream)
    assert "self.transports[command.connection] = ConnectionIO(" in source(server.ConnectionHandler.open_connection)
    assert "self.transports[client] = ConnectionIO(" in source(server.LiveConnectionHandler.__init__)
    assert "self._servers = await self.listen(host, port)" in source(mode_servers.AsyncioServerInstance._start)
