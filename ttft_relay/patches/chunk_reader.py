"""Where h11's reader of a chunked HTTP/1 body is in that body (h11's private state, no patch).

mitmproxy's HTTP/1 layer reads a body with one of h11's readers (`Http1Connection.body_reader`);
for a chunked body it is h11's `ChunkedReader`, which keeps where it is in private attributes
(`_bytes_in_chunk`, `_bytes_to_discard`, `_reading_trailer`). Two patches need that: the
`trailers` fix, to know whether a chunk header is pending, and the splice's direct reads
(`speed.splice`), which take the state over, decode the body themselves (`ttft_relay/chunked.py`)
and hand it back. They read and set it here, and only here, and the class is the one
mitmproxy's HTTP/1 layer makes its readers from: no module of the relay imports a private
module of h11's (tests/patches/test_chunk_reader.py checks). Its pins are h11's code.
"""

from __future__ import annotations

from typing import Any, NamedTuple

from mitmproxy.proxy.layers.http import _http1

ChunkedReader = _http1.ChunkedReader
"""h11's reader of a chunked body, as mitmproxy's HTTP/1 layer has it."""

PINS = {
    # what its state means: data bytes of the chunk still to come, the chunk's CRLF still to
    # skip, reading the trailer section (after the last chunk)
    "ChunkedReader.__init__": (ChunkedReader.__init__, "232ef6fe23fd20ab"),
    "ChunkedReader.__call__": (ChunkedReader.__call__, "2618d847a89a1505"),
}


class Position(NamedTuple):
    """Where a chunked body's reader is: in a chunk's data (`in_chunk` bytes of it to come), in
    its CRLF (`discard`: what of it is still to skip), in the trailer section, or (all three
    empty) before a chunk header."""

    in_chunk: int
    discard: bytes
    trailer: bool


def position(reader: object) -> Position | None:
    """Where `reader` is in its chunked body; None for any other body reader."""
    if type(reader) is not ChunkedReader:
        return None
    return Position(reader._bytes_in_chunk, reader._bytes_to_discard, reader._reading_trailer)


def go_on_from(reader: Any, in_chunk: int, discard: bytes) -> None:
    """Have `reader` (a `ChunkedReader`, outside its trailer section) go on from where a decoder
    that took its state over stopped: `in_chunk` data bytes of a chunk to come, `discard`
    what of its CRLF is still to skip."""
    reader._bytes_in_chunk, reader._bytes_to_discard = in_chunk, discard
