"""Pin test of ttft_relay/patches/connections.py (its uses: tests/test_selfwatch*.py, tests/test_guard.py,
tests/test_faults_e2e.py)."""

from __future__ import annotations

from mitmproxy.addons import proxyserver
from mitmproxy.proxy import mode_servers, server
from mitmproxy.proxy.layers.http import HttpLayer, HttpStream

from ttft_relay.patches import connections
from ttft_relay.patches.fixes import error_replies
from tests.patches.pins import assert_unchanged, source


def test_the_mitmproxy_code_under_it_is_unchanged():
    assert_unchanged(connections.PINS, connections)


def test_the_lines_it_depends_on():
    # A connection's handler is registered by its client's id; its transports hold the IO.
    assert "self.connections[connection_id] = handler" in source(proxyserver.Proxyserver.register_connection)
    assert "register_connection(handler.layer.context.client.id, handler)" in source(
        mode_servers.ServerInstance.handle_stream)
    assert "self.transports[command.connection] = ConnectionIO(" in source(server.ConnectionHandler.open_connection)
    assert "self.transports[client] = ConnectionIO(" in source(server.LiveConnectionHandler.__init__)
    assert "self._servers = await self.listen(host, port)" in source(mode_servers.AsyncioServerInstance._start)
    # A cancelled connect's message is the connection's error, and the error of its flows.
    src = source(server.ConnectionHandler.open_connection)
    assert "except (OSError, asyncio.CancelledError) as e:\n                err = str(e)" in src
    assert "command.connection.error = err" in src
    assert "events.OpenConnectionCompleted(command, err)" in src
    assert "reply = (None, command.err)" in source(HttpLayer.register_connection)
    assert "ResponseProtocolError(self.stream_id, err, ErrorCode.CONNECT_FAILED)" in source(
        HttpStream.make_server_connection)
    assert "self.flow.error = flow.Error(event.message)" in source(error_replies._ORIGINAL_HANDLE_PROTOCOL_ERROR)
