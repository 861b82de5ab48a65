"""The data chunks of an HTTP/1 chunked body, decoded the way h11 decodes them (sans-IO).

`ChunkedData` takes over from h11's `ChunkedReader` in the middle of a body and gives
it back later (`patches/speed/splice.py`): its state is h11's own (`in_chunk`: data bytes
left in the current chunk, `discard`: what is left of the CRLF after a chunk's data),
and it yields the same pieces h11 would for the same reads: each read's part of a
chunk's data is one piece, whatever the chunk's size.

It decodes only plain data chunks. At anything else — the last chunk (and trailers),
a chunk extension, a malformed header or footer, a header not complete in this read —
it stops before it, consuming nothing of it, so that h11 (with the state handed back)
reads it next and answers it as it always does, errors included.
"""

from __future__ import annotations

HEADER_MAX = 18
"""The longest chunk header decoded here: 16 hex digits and CRLF (h11 allows any length;
a longer one is handed back)."""

_HEX = frozenset(b"0123456789abcdefABCDEF")


class ChunkedData:
    __slots__ = ("in_chunk", "discard")

    def __init__(self, in_chunk: int = 0, discard: bytes = b"") -> None:
        self.in_chunk = in_chunk
        self.discard = discard

    def feed(self, data: bytes, pieces: list[bytes]) -> int:
        """Append the chunk data in `data` to `pieces`; return how many bytes of `data`
        were consumed (the rest is for h11)."""
        pos, end = 0, len(data)
        while pos < end:
            if self.discard:
                footer = data[pos:pos + len(self.discard)]
                if not self.discard.startswith(footer):
                    return pos  # malformed footer: h11's error
                self.discard = self.discard[len(footer):]
                pos += len(footer)
            elif self.in_chunk:
                piece = data[pos:pos + self.in_chunk]
                pieces.append(piece)
                pos += len(piece)
                self.in_chunk -= len(piece)
                if not self.in_chunk:
                    self.discard = b"\r\n"
            else:
                line_end = data.find(b"\r\n", pos, pos + HEADER_MAX)
                if line_end < 0:
                    return pos  # not complete here, too long, or not a header: h11 reads it
                size = data[pos:line_end]
                if not size or not _HEX.issuperset(size):
                    return pos  # empty, an extension, or not hex
                in_chunk = int(size, 16)
                if not in_chunk:
                    return pos  # the last chunk: the end of the body is h11's
                self.in_chunk = in_chunk
                pos = line_end + 2
        return pos
