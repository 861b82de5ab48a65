"""Pin test of ttft_relay/patches/fixes/eager_connects.py (end to end: tests/test_faults_e2e.py, tests/test_preauth_e2e.py)."""

from __future__ import annotations

from mitmproxy.addons import tlsconfig
from mitmproxy.proxy.layers import modes, tls
from mitmproxy.proxy.layers.http import HttpLayer

from ttft_relay.patches.fixes import eager_connects
from tests.patches.pins import assert_unchanged, source


def test_the_mitmproxy_code_under_it_is_unchanged():
    assert_unchanged(eager_connects.PINS, eager_connects)


def test_the_lines_it_depends_on():
    # A failed eager connect ends the layer; the HTTP layer reports a context server's error.
    assert "self._handle_event = self.done" in source(eager_connects._ORIGINAL_FINISH_START)
    assert "(None, self.context.server.error)" in source(HttpLayer.get_connection)
    # Without an eager connect, finish_start only hands the start to its child layer.
    assert source(eager_connects._ORIGINAL_FINISH_START).rstrip().endswith(
        "self._handle_event = self.child_layer.handle_event  # type: ignore\n"
        "        yield from self.child_layer.handle_event(events.Start())\n        return None")
    assert "establish_server_tls_first = (" in source(eager_connects._ORIGINAL_TLS_CLIENTHELLO)
    assert "tls_clienthello.establish_server_tls_first" in source(tls.ClientTLSLayer.receive_handshake_data)


def test_eager_connects_are_deferred_only_for_the_named_listeners():
    eager_connects.defer(lambda mode: mode.listen_port() == 8001)
    try:
        assert modes.DestinationKnown.finish_start is eager_connects._finish_start
        assert tlsconfig.TlsConfig.tls_clienthello is eager_connects._tls_clienthello
    finally:
        eager_connects.defer(None)
    assert modes.DestinationKnown.finish_start is eager_connects._ORIGINAL_FINISH_START
    assert tlsconfig.TlsConfig.tls_clienthello is eager_connects._ORIGINAL_TLS_CLIENTHELLO


def test_the_wrap_stays_while_either_use_needs_it():
    eager_connects.uninstall()
    try:
        eager_connects.read_request_after_failure(True)
        eager_connects.defer(lambda mode: True)
        eager_connects.read_request_after_failure(False)
        assert modes.DestinationKnown.finish_start is eager_connects._finish_start
        eager_connects.read_request_after_failure(True)
        eager_connects.defer(None)
        assert modes.DestinationKnown.finish_start is eager_connects._finish_start
    finally:
        eager_connects.uninstall()
    assert modes.DestinationKnown.finish_start is eager_connects._ORIGINAL_FINISH_START
