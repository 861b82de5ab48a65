"""Pin test of ttft_relay/patches/fixes/answer_on_head.py (end to end: tests/test_preauth_e2e.py, tests/test_shutdown_e2e.py)."""

from __future__ import annotations

from mitmproxy.proxy.layers.http import HttpStream

from ttft_relay.patches.fixes import answer_on_head
from tests.patches.pins import assert_unchanged, source


def test_the_mitmproxy_code_under_it_is_unchanged():
    assert_unchanged(answer_on_head.PINS, answer_on_head)


def test_the_lines_it_depends_on():
    # A flow killed in requestheaders ends in check_killed, before any body is read.
    src = source(HttpStream.state_wait_for_request_headers)
    assert src.index("yield HttpRequestHeadersHook(self.flow)") < src.index("if (yield from self.check_killed(True)):")
    assert src.index("if (yield from self.check_killed(True)):") < src.index("self.client_state = self.state_consume_request_body")
    assert "ResponseProtocolError(self.stream_id, \"killed\", ErrorCode.KILL)" in source(answer_on_head._ORIGINAL_CHECK_KILLED)
