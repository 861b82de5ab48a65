"""Pin test of ttft_relay/patches/fixes/resend.py (end to end: tests/test_trim_windows_e2e.py, with
the official SDKs, streamed and not)."""

from __future__ import annotations

from mitmproxy.proxy.layers.http import HttpStream

from ttft_relay.patches.fixes import resend
from tests.patches.pins import assert_unchanged, source


def test_the_mitmproxy_code_under_it_is_unchanged():
    assert_unchanged(resend.PINS, resend)


def test_the_lines_it_depends_on():
    # Nothing of a read-whole answer is sent before its response hook, which send_response yields first.
    src = source(resend._ORIGINAL_SEND_RESPONSE)
    assert src.index("yield HttpResponseHook(self.flow)") < src.index("yield SendHttp(")
    consume = source(HttpStream.state_consume_response_body)
    assert "yield from self.send_response()" in consume and "SendHttp" not in consume
    # The request goes out as head, body, trailers, end, on the connection make_server_connection gives.
    request = source(HttpStream.state_consume_request_body)
    order = ["make_server_connection()", "RequestHeaders(", "RequestData(", "RequestTrailers(", "RequestEndOfMessage("]
    assert [request.index(s) for s in order] == sorted(request.index(s) for s in order)


def test_installed_and_removed():
    resend.install(by="test")
    assert resend.installed()
    resend.uninstall()
    assert not resend.installed() and HttpStream.send_response is resend._ORIGINAL_SEND_RESPONSE
