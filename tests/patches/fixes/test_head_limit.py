"""Pin test of ttft_relay/patches/fixes/head_limit.py (end to end: tests/test_bad_input_e2e.py)."""

from __future__ import annotations

from mitmproxy.proxy.layers.http._http1 import Http1Server

from ttft_relay.patches.fixes import head_limit
from tests.patches.pins import assert_unchanged, source


def test_the_mitmproxy_code_under_it_is_unchanged():
    assert_unchanged(head_limit.PINS, head_limit)


def test_the_lines_it_depends_on():
    # The head is buffered until it ends, with no bound.
    assert "FIXME: protect against header size DoS" in source(head_limit._ORIGINAL_READ_HEADERS)


def test_the_limit_installs_and_uninstalls():
    head_limit.limit_request_heads(1000)
    try:
        assert Http1Server.read_headers is head_limit._read_headers
    finally:
        head_limit.uninstall()
    assert Http1Server.read_headers is head_limit._ORIGINAL_READ_HEADERS
