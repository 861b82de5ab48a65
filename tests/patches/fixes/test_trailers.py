"""Pin test of ttft_relay/patches/fixes/trailers.py (end to end: tests/test_bad_input_e2e.py)."""

from __future__ import annotations

import importlib.metadata

from h11._receivebuffer import ReceiveBuffer

from ttft_relay.patches.chunk_reader import ChunkedReader
from ttft_relay.patches.fixes import error_replies, trailers
from tests.patches.pins import assert_unchanged, source


def test_the_mitmproxy_code_under_it_is_unchanged():
    assert importlib.metadata.version("h11") == "0.16.0"
    assert_unchanged(trailers.PINS, trailers)


def buffer(data: bytes) -> ReceiveBuffer:
    buf = ReceiveBuffer()
    buf += data
    return buf


def test_a_chunk_header_too_long_is_seen_only_where_a_header_is_read():
    reader = ChunkedReader()
    long = b"z" * (trailers.CHUNK_LINE_MAX + 1)
    assert trailers._line_too_long(reader, buffer(long))
    assert not trailers._line_too_long(reader, buffer(b"5;" + b"x" * 100 + b"\r\n" + long))  # a line ends in it
    assert not trailers._line_too_long(reader, buffer(long[:-2]))  # within the bound
    reader(buffer(b"ffff\r\n"))  # now in a chunk's data: no line pending
    assert not trailers._line_too_long(reader, buffer(long))
    assert not trailers._line_too_long(object(), buffer(long))  # not chunked


def test_the_lines_it_depends_on():
    # Trailers end the body reader with NotImplementedError, and a client's protocol
    # error sends the client nothing (the server side answers it).
    assert 'raise NotImplementedError(f"HTTP trailers are not implemented yet.")' in source(trailers._ORIGINAL_READ_BODY)
    assert "if isinstance(event, ResponseProtocolError):" in source(error_replies._ORIGINAL_HANDLE_PROTOCOL_ERROR)
