"""Pin test of ttft_relay/patches/speed/upstream_pool.py (end to end: tests/test_upstream_pool_e2e.py)."""

from __future__ import annotations

from mitmproxy.proxy.layers.http import HttpLayer
from mitmproxy.proxy.layers.http._http1 import Http1Connection
from mitmproxy.proxy.layers.tls import ServerTLSLayer, TLSLayer
from mitmproxy.proxy.server import ConnectionHandler
from mitmproxy.test import tutils

from ttft_relay import patches
from ttft_relay.patches.speed import upstream_pool
from tests.patches.pins import assert_unchanged, source


def test_the_mitmproxy_code_under_it_is_unchanged():
    assert_unchanged(upstream_pool.PINS, upstream_pool)


def test_the_lines_it_depends_on():
    handle_client = source(ConnectionHandler.handle_client)
    assert handle_client.index("ClientDisconnectedHook") < handle_client.index('io.handler.cancel("client disconnected")')
    handle_connection = source(ConnectionHandler.handle_connection)
    assert handle_connection.index("server_event(events.ConnectionClosed(connection))") < handle_connection.index(
        "writer = self.transports[connection].writer")
    open_connection = source(upstream_pool._ORIGINAL_OPEN_CONNECTION)
    for line in ("await self.handle_hook(server_hooks.ServerConnectHook(hook_data))",
                 "command.connection.state = ConnectionState.OPEN",
                 "await self.handle_hook(server_hooks.ServerConnectedHook(hook_data))",
                 "await self.server_event(events.OpenConnectionCompleted(command, None))",
                 "await self.handle_connection(command.connection)",
                 "server_hooks.ServerDisconnectedHook(hook_data)"):
        assert line in open_connection, line
    server_event = source(ConnectionHandler.server_event)
    # The connect's task starts (eagerly, with mitmproxy's task factory) before its transports entry is made.
    assert server_event.index("self.open_connection(command),") < server_event.index(
        "self.transports[command.connection] = ConnectionIO(\n                            handler=handler")
    # Without a TLS context nothing connects: the adopted layer's `tls` is set before the handshake runs.
    assert "if self.tls:\n                yield from self.receive_handshake_data(b\"\")" in source(
        upstream_pool._ORIGINAL_START_HANDSHAKE)
    assert "self.tls.do_handshake()" in source(TLSLayer.receive_handshake_data)
    mark_done = source(Http1Connection.mark_done)
    assert "self.stream_id = None\n            self.state = self.read_headers" in mark_done


def test_installed_and_removed_whole():
    upstream_pool.install(object())  # type: ignore[arg-type]
    try:
        assert {"HttpLayer.get_connection", "ConnectionHandler.open_connection",
                "ServerTLSLayer.start_handshake"} <= set(patches.patched())
    finally:
        upstream_pool.uninstall()
    assert not {"HttpLayer.get_connection", "ConnectionHandler.open_connection",
                "ServerTLSLayer.start_handshake"} & set(patches.patched())
    assert HttpLayer.get_connection is upstream_pool._ORIGINAL_GET_CONNECTION
    assert ServerTLSLayer.start_handshake is upstream_pool._ORIGINAL_START_HANDSHAKE


def test_a_connection_carries_one_credential_and_its_digest_says_which():
    def request(**headers: str):
        r = tutils.treq()
        for name, value in headers.items():
            r.headers[name.replace("_", "-")] = value
        return r

    alice, bob = upstream_pool.credential(request(authorization="Bearer a")), upstream_pool.credential(
        request(authorization="Bearer b"))
    assert alice != bob
    assert alice == upstream_pool.credential(request(authorization="Bearer a", x_request_id="other"))
    # Any API's key slot counts, and a cookie or proxy authorization as well.
    for slot in ("x_api_key", "api_key", "x_goog_api_key", "cookie", "proxy_authorization"):
        assert upstream_pool.credential(request(authorization="Bearer a", **{slot: "k"})) != alice, slot
    keyed = tutils.treq()
    keyed.path = "/v1/models?key=abc"
    other = tutils.treq()
    other.path = "/v1/models?key=xyz"
    assert upstream_pool.credential(keyed) != upstream_pool.credential(other)
