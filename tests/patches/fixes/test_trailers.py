"""Pin test of ttft_relay/patches/trailers.py (end to end: tests/test_bad_input_e2e.py)."""

from __future__ import annotations

import importlib.metadata

from h11._readers import ChunkedReader
from h11._receivebuffer import ReceiveBuffer

from ttft_relay.patches import error_replies, trailers
from tests.patches.pins import assert_unchanged, source

PINNED = {
    "Http1Connection.read_body": (trailers._ORIGINAL_READ_BODY, "aece271029af36e4"),
    "HttpStream.handle_protocol_error": (error_replies._ORIGINAL_HANDLE_PROTOCOL_ERROR, "59fc3b2eeeabf63a"),
    # where h11's reader is in a chunked body (_bytes_in_chunk, _bytes_to_discard, _reading_trailer)
    "ChunkedReader.__init__": (ChunkedReader.__init__, "232ef6fe23fd20ab"),
    "ChunkedReader.__call__": (ChunkedReader.__call__, "2618d847a89a1505"),
}


def test_the_mitmproxy_code_under_it_is_unchanged():
    assert importlib.metadata.version("h11") == "0.16.0"
    assert_unchanged(PINNED, trailers)


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
