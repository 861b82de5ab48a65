"""Pin test of ttft_relay/patches/error_texts.py: the texts it matches are the ones mitmproxy writes."""

from __future__ import annotations

import pytest
from mitmproxy.flow import Error
from mitmproxy.proxy import server
from mitmproxy.proxy.layers.http._http1 import Http1Connection
from mitmproxy.proxy.layers.http._http2 import Http2Connection

from ttft_relay.patches.fixes import answer_on_head
from ttft_relay.patches import error_texts
from tests.patches.pins import assert_unchanged, source


def test_the_mitmproxy_code_under_it_is_unchanged():
    assert_unchanged(error_texts.PINS, error_texts)


def test_the_texts_are_mitmproxys():
    assert 'f"Client disconnected.",' in source(Http1Connection.wait)
    assert 'f"stream reset by client ({err_str})",' in source(Http2Connection.handle_h2_event)
    assert 'io.handler.cancel("client disconnected")' in source(server.ConnectionHandler.handle_client)
    assert "self.flow.error.msg == flow.Error.KILLED_MESSAGE" in source(answer_on_head._ORIGINAL_CHECK_KILLED)
    assert error_texts.KILLED == Error.KILLED_MESSAGE == "Connection killed."


@pytest.mark.parametrize("message, gone", [
    ("Client disconnected.", True),
    ("stream reset by client (CANCEL)", True),
    ("client disconnected", True),
    ("Server disconnected.", False),
    ("upstream connect timeout after 5 s", False),
    (Error.KILLED_MESSAGE, False),
])
def test_a_client_gone_is_told_from_other_failures(message, gone):
    assert error_texts.client_gone(message) is gone
