"""Pin test of ttft_relay/patches/fixes/interim_answers.py (end to end: tests/test_streaming_e2e.py)."""

from __future__ import annotations

import pytest
from mitmproxy.proxy.layers.http._http1 import Http1Client

from ttft_relay.patches.fixes import interim_answers
from tests.patches.pins import assert_unchanged


def test_the_mitmproxy_code_under_it_is_unchanged():
    assert_unchanged(interim_answers.PINS, interim_answers)


@pytest.mark.parametrize(
    "data, size",
    [
        (b"HTTP/1.1 103 Early Hints\r\nLink: </a>\r\n\r\nHTTP/1.1 200 OK\r\n", 40),
        (b"HTTP/1.1 100 Continue\r\n\r\n", 25),
        (b"HTTP/1.1 103 Early Hints\r\nLink: </a>\r\n", 0),  # not complete yet
        (b"HTTP/1.1 101 Switching Protocols\r\n\r\n", 0),  # the answer of an upgrade
        (b"HTTP/1.1 200 OK\r\n\r\n", 0),
        (b"HTTP/1.1 199 Whatever\r\n\r\n", 25),
        (b"garbage", 0),
    ],
)
def test_interim_heads_are_recognised(data, size):
    assert interim_answers.interim_head_size(data) == size


def test_the_interim_skip_installs_and_uninstalls():
    interim_answers.install()
    try:
        assert Http1Client.read_headers is interim_answers._read_response_headers
    finally:
        interim_answers.uninstall()
    assert Http1Client.read_headers is interim_answers._ORIGINAL_READ_RESPONSE_HEADERS
