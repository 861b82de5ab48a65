"""Pin test of ttft_relay/patches/answer_on_head.py (end to end: tests/test_preauth_e2e.py, tests/test_shutdown_e2e.py)."""

from __future__ import annotations

from mitmproxy.proxy.layers.http import HttpStream
from mitmproxy.proxy.layers.http._http1 import Http1Server
from mitmproxy.proxy.layers.http._http2 import Http2Connection
from mitmproxy.proxy.layers.http._http_h2 import BufferedH2Connection

from ttft_relay.patches import answer_on_head
from tests.patches.pins import assert_unchanged, source

PINNED = {
    "HttpStream.check_killed": (answer_on_head._ORIGINAL_CHECK_KILLED, "368cad352d1e82b6"),
    "HttpStream.state_wait_for_request_headers": (HttpStream.state_wait_for_request_headers, "3706d5d5ce01dcd4"),
    "Http1Server.send": (Http1Server.send, "cc218a1337c0f5cf"),
    # HTTP/2: the stream's state, and a reset that drops what flow control holds back
    "Http2Connection.is_closed": (Http2Connection.is_closed, "26e8192aca68a486"),
    "BufferedH2Connection.reset_stream": (BufferedH2Connection.reset_stream, "4066479f1b95343e"),
}


def test_the_mitmproxy_code_under_it_is_unchanged():
    assert_unchanged(PINNED, answer_on_head)


def test_the_lines_it_depends_on():
    # A flow killed in requestheaders ends in check_killed, before any body is read.
    src = source(HttpStream.state_wait_for_request_headers)
    assert src.index("yield HttpRequestHeadersHook(self.flow)") < src.index("if (yield from self.check_killed(True)):")
    assert src.index("if (yield from self.check_killed(True)):") < src.index("self.client_state = self.state_consume_request_body")
    assert "ResponseProtocolError(self.stream_id, \"killed\", ErrorCode.KILL)" in source(answer_on_head._ORIGINAL_CHECK_KILLED)
