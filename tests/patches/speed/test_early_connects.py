"""Pin test of ttft_relay/patches/speed/early_connects.py (end to end: tests/test_preauth_e2e.py,
tests/test_upstream_pool_e2e.py)."""

from __future__ import annotations

from mitmproxy.proxy.layers.http import HttpLayer, HttpStream
from mitmproxy.test import tflow

from ttft_relay.patches import layer_events
from ttft_relay.patches.speed import early_connects
from tests.patches.pins import assert_unchanged, source


def test_the_mitmproxy_code_under_it_is_unchanged():
    assert_unchanged(early_connects.PINS, early_connects)
    assert early_connects.USES == (layer_events,)


def test_the_lines_it_depends_on():
    asked = source(HttpStream.make_server_connection)
    assert "(self.flow.request.host, self.flow.request.port)," in asked
    assert "self.flow.request.scheme == \"https\"," in asked
    assert "self.flow.server_conn.via," in asked and "self.flow.server_conn.transport_protocol," in asked
    assert "stream = self.command_sources.pop(cmd)" in source(HttpLayer.register_connection)


def test_on_while_anyone_asks():
    early_connects.uninstall()
    early_connects.install(by="keys")
    early_connects.install(by="pool")
    try:
        early_connects.uninstall(by="keys")
        assert early_connects.installed()
    finally:
        early_connects.uninstall(by="pool")
    assert not early_connects.installed() and HttpLayer._handle_event is layer_events._ORIGINAL_HANDLE_EVENT


def test_off_nothing_is_handed():
    early_connects.uninstall()

    class Handler:
        async def server_event(self, event):  # pragma: no cover - must not be reached
            raise AssertionError("handed")

    early_connects.connect_early(Handler(), tflow.tflow())  # no event loop needed: nothing is scheduled
