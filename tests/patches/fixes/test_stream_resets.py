"""Pin test of ttft_relay/patches/fixes/stream_resets.py (end to end: tests/test_h2_e2e.py; without
it a deadline closes the shared connection: tests/test_faults_e2e.py)."""

from __future__ import annotations

from mitmproxy.proxy.layers.http import HttpLayer
from mitmproxy.proxy.layers.http._http2 import Http2Client, Http2Connection

from ttft_relay.patches import layer_events
from ttft_relay.patches.fixes import stream_resets
from tests.patches.pins import assert_unchanged, source


def test_the_mitmproxy_code_under_it_is_unchanged():
    assert_unchanged(stream_resets.PINS, stream_resets)
    assert stream_resets.USES == (layer_events,)


def test_the_lines_it_depends_on():
    assert "self.h2_conn.reset_stream(event.stream_id, error_code.value)" in source(Http2Connection._handle_event)
    assert "case ErrorCode.CANCEL | ErrorCode.CLIENT_DISCONNECTED:" in source(Http2Connection._handle_event)
    assert "self.their_stream_id[ours] = event.stream_id" in source(Http2Client._handle_event)


def test_install_and_uninstall():
    stream_resets.install()
    try:
        assert stream_resets.installed() and HttpLayer._handle_event is not layer_events._ORIGINAL_HANDLE_EVENT
    finally:
        stream_resets.uninstall()
    assert not stream_resets.installed() and HttpLayer._handle_event is layer_events._ORIGINAL_HANDLE_EVENT


def test_off_the_caller_hears_that_nothing_was_reset():
    stream_resets.uninstall()
    heard: list[bool] = []
    stream_resets.reset(object(), None, "deadline", heard.append)  # type: ignore[arg-type]
    assert heard == [False]  # faults.Deadlines then closes the connection
