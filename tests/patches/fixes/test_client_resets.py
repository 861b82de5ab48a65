"""Pin test of ttft_relay/patches/fixes/client_resets.py (end to end: tests/test_h2_e2e.py)."""

from __future__ import annotations

from mitmproxy.proxy.layers.http import HttpStream
from mitmproxy.proxy.layers.http._http2 import Http2Connection, Http2Server

from ttft_relay.patches.fixes import client_resets
from tests.patches.pins import assert_unchanged, source


def test_the_mitmproxy_code_under_it_is_unchanged():
    assert_unchanged(client_resets.PINS, client_resets)


def test_the_lines_it_depends_on():
    src = source(Http2Connection.handle_h2_event)
    # A stream closed by the time its END_STREAM is handled is forgotten...
    assert "if self.is_closed(event.stream_id):\n                self.streams.pop(event.stream_id, None)" in src
    # ...and a reset is reported only for a stream still known.
    assert "elif isinstance(event, h2.events.StreamReset):\n            if event.stream_id in self.streams:" in src
    assert "self.h2_conn.close_connection(error_code, message.encode())" in source(Http2Connection.protocol_error)
    assert "is_client_error_but_we_already_talk_upstream" in source(HttpStream.handle_protocol_error)


def test_a_reset_budget():
    budget = client_resets.ResetBudget(3, window=10)
    assert [budget.spend(t) for t in (0, 1, 2, 3)] == [True, True, True, False]
    assert budget.spend(14)  # the oldest of the last four (1) is out of the window
    unbounded = client_resets.ResetBudget(0, window=10)
    assert all(unbounded.spend(0) for _ in range(1000))


def test_install_and_uninstall():
    client_resets.install(5, 1.0)
    try:
        assert Http2Server.handle_h2_event is not client_resets._ORIGINAL_HANDLE_H2_EVENT
    finally:
        client_resets.uninstall()
    assert Http2Server.handle_h2_event is client_resets._ORIGINAL_HANDLE_H2_EVENT
