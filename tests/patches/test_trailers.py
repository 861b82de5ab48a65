"""Pin test of ttft_relay/patches/trailers.py (end to end: tests/test_bad_input_e2e.py)."""

from __future__ import annotations

from ttft_relay.patches import error_replies, trailers
from tests.patches.pins import assert_unchanged, source

PINNED = {
    "Http1Connection.read_body": (trailers._ORIGINAL_READ_BODY, "aece271029af36e4"),
    "HttpStream.handle_protocol_error": (error_replies._ORIGINAL_HANDLE_PROTOCOL_ERROR, "59fc3b2eeeabf63a"),
}


def test_the_mitmproxy_code_under_it_is_unchanged():
    assert_unchanged(PINNED, trailers)


def test_the_lines_it_depends_on():
    # Trailers end the body reader with NotImplementedError, and a client's protocol
    # error sends the client nothing (the server side answers it).
    assert 'raise NotImplementedError(f"HTTP trailers are not implemented yet.")' in source(trailers._ORIGINAL_READ_BODY)
    assert "if isinstance(event, ResponseProtocolError):" in source(error_replies._ORIGINAL_HANDLE_PROTOCOL_ERROR)
