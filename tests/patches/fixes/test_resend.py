"""Pin test of ttft_relay/patches/resend.py (end to end: tests/test_trim_windows_e2e.py, with
the official SDKs, streamed and not)."""

from __future__ import annotations

from mitmproxy.proxy.layers.http import HttpStream

from ttft_relay.patches import resend
from tests.patches.pins import assert_unchanged, source

PINNED = {
    "HttpStream.send_response": (resend._ORIGINAL_SEND_RESPONSE, "d581bc106152e369"),
    # _resend does what this does after the request hook, once more
    "HttpStream.state_consume_request_body": (HttpStream.state_consume_request_body, "45459c1bbd8bdb1a"),
    "HttpStream.make_server_connection": (HttpStream.make_server_connection, "ddc7bc72f4d2fbc7"),
    # a held answer is read whole (not streamed) and ends in send_response
    "HttpStream.state_wait_for_response_headers": (HttpStream.state_wait_for_response_headers, "10e32e91b2948164"),
    "HttpStream.state_consume_response_body": (HttpStream.state_consume_response_body, "5323db61dfc7e2e1"),
}


def test_the_mitmproxy_code_under_it_is_unchanged():
    assert_unchanged(PINNED, resend)


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
    resend.install()
    assert resend.installed()
    resend.uninstall()
    assert not resend.installed() and HttpStream.send_response is resend._ORIGINAL_SEND_RESPONSE
