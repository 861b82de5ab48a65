"""Pin test of ttft_relay/patches/layer_events.py (end to end: tests/test_h2_e2e.py, tests/test_preauth_e2e.py)."""

from __future__ import annotations

from mitmproxy.proxy.layers.http import HttpLayer, HttpStream
from mitmproxy.proxy.layers.http._http2 import Http2Client, Http2Connection

from ttft_relay.patches import layer_events
from tests.patches.pins import assert_unchanged, source

PINNED = {
    "HttpLayer._handle_event": (layer_events._ORIGINAL_HANDLE_EVENT, "6ba31883cc7a06b3"),
    # how the layer reaches a stream and a connection
    "HttpLayer.event_to_child": (HttpLayer.event_to_child, "1095f6e1581d1780"),
    # the upstream side: our stream id mapped to the connection's, then RST_STREAM
    "Http2Client._handle_event": (Http2Client._handle_event, "02de05a5b89f087b"),
    "Http2Connection._handle_event": (Http2Connection._handle_event, "7fc814a8a507f234"),
    # the stream: the error hook, then the client's reply
    "HttpStream.handle_protocol_error": (HttpStream.handle_protocol_error, "59fc3b2eeeabf63a"),
    # an early connect: the request a flow makes for its connection, and how the layer
    # answers it (an open one reused, one opening waited for, the answer to its source)
    "HttpStream.make_server_connection": (HttpStream.make_server_connection, "ddc7bc72f4d2fbc7"),
    "HttpLayer.get_connection": (HttpLayer.get_connection, "1aa1c63e3175766c"),
    "HttpLayer.register_connection": (HttpLayer.register_connection, "deed6282affc431f"),
}


def test_the_mitmproxy_code_under_it_is_unchanged():
    assert_unchanged(PINNED, layer_events)


def test_the_lines_it_depends_on():
    assert "raise AssertionError(f\"Unexpected event: {event}\")" in source(layer_events._ORIGINAL_HANDLE_EVENT)
    assert "self.h2_conn.reset_stream(event.stream_id, error_code.value)" in source(Http2Connection._handle_event)
    assert "case ErrorCode.CANCEL | ErrorCode.CLIENT_DISCONNECTED:" in source(Http2Connection._handle_event)
    assert "self.their_stream_id[ours] = event.stream_id" in source(Http2Client._handle_event)
    asked = source(HttpStream.make_server_connection)
    assert "(self.flow.request.host, self.flow.request.port)," in asked
    assert "self.flow.request.scheme == \"https\"," in asked
    assert "self.flow.server_conn.via," in asked and "self.flow.server_conn.transport_protocol," in asked
    assert "stream = self.command_sources.pop(cmd)" in source(HttpLayer.register_connection)


def test_install_and_uninstall():
    layer_events.install()
    try:
        assert HttpLayer._handle_event is not layer_events._ORIGINAL_HANDLE_EVENT
    finally:
        layer_events.uninstall()
    assert HttpLayer._handle_event is layer_events._ORIGINAL_HANDLE_EVENT
