"""chunked.py: the data chunks of a chunked body decoded as h11 decodes them, and
everything else left to h11 with h11's own state (pure; the splice's pin test drives it
inside mitmproxy's layers)."""

from __future__ import annotations

import random

import h11
import pytest
from h11._receivebuffer import ReceiveBuffer

from ttft_relay.chunked import ChunkedData
from ttft_relay.patches import chunk_reader
from ttft_relay.patches.chunk_reader import ChunkedReader


def h11_reads(reads: list[bytes], reader: ChunkedReader | None = None) -> list[object]:
    """What h11 makes of each read, as mitmproxy's read_body calls it."""
    reader = reader or ChunkedReader()
    buf, out = ReceiveBuffer(), []
    for data in reads:
        buf += data
        while True:
            try:
                event = reader(buf)
            except h11.ProtocolError as e:
                return out + [f"error: {e}"]
            if event is None:
                break
            out.append(bytes(event.data) if isinstance(event, h11.Data) else "end")
            if not isinstance(event, h11.Data):
                return out
    return out


def decoded_then_h11(reads: list[bytes]) -> list[object]:
    """The decoder first, h11 (given the decoder's state) from the first byte it left."""
    decoder, out = ChunkedData(), []
    for i, data in enumerate(reads):
        pieces: list[bytes] = []
        used = decoder.feed(data, pieces)
        out += [p for p in pieces if p]
        if used < len(data):
            reader = ChunkedReader()
            chunk_reader.go_on_from(reader, decoder.in_chunk, decoder.discard)  # as the splice hands back
            return out + h11_reads([data[used:], *reads[i + 1:]], reader)
    return out


def body(rng: random.Random) -> bytes:
    parts = []
    for _ in range(rng.randint(1, 30)):
        data = bytes(rng.choice(b"abc\r\n:") for _byte in range(rng.choice([1, 5, 40, 700])))
        size = rng.choice(["%x", "%X", "%04x"]) % len(data)
        ext = rng.choice([b""] * 8 + [b";a=b", b" "])
        parts.append(size.encode() + ext + b"\r\n" + data + b"\r\n")
    parts.append(rng.choice([b"0\r\n\r\n", b"0\r\nx-trailer: 1\r\n\r\n", b"000\r\n\r\n", b"zz\r\n", b"5\r\nabcdeXY"]))
    return b"".join(parts)


@pytest.mark.parametrize("seed", range(300))
def test_the_same_as_h11_for_any_reads(seed):
    rng = random.Random(seed)
    data = body(rng)
    cuts = sorted(rng.sample(range(1, len(data)), min(len(data) - 1, rng.randint(0, 12))))
    reads = [data[i:j] for i, j in zip([0, *cuts], [*cuts, len(data)])]
    assert decoded_then_h11(reads) == h11_reads(reads)


def test_it_decodes_plain_chunks_and_stops_before_the_last():
    decoder, pieces = ChunkedData(), []
    data = b"5\r\nhello\r\n1A\r\n" + b"x" * 26 + b"\r\n0\r\n\r\n"
    assert decoder.feed(data, pieces) == len(data) - 5
    assert pieces == [b"hello", b"x" * 26] and (decoder.in_chunk, decoder.discard) == (0, b"")


def test_a_chunk_across_reads_is_a_piece_per_read():
    decoder, pieces = ChunkedData(), []
    assert decoder.feed(b"a\r\n0123", pieces) == 7
    assert decoder.feed(b"456789\r", pieces) == 7
    assert pieces == [b"0123", b"456789"] and (decoder.in_chunk, decoder.discard) == (0, b"\n")


@pytest.mark.parametrize("data", [b"5", b"5\r", b"5;ext\r\nhello\r\n", b" 5\r\nhello\r\n", b"\r\n", b"1" * 17 + b"\r\n"])
def test_what_it_leaves_to_h11(data):
    assert ChunkedData().feed(data, []) == 0
