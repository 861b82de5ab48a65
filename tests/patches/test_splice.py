"""Pin test of ttft_relay/patches/splice.py: the client gets exactly what mitmproxy's own
path sends, in the same order, and the mitmproxy code the splice stands in for is pinned
(end to end: tests/test_streaming_e2e.py and every e2e suite that streams).

The layer tests drive mitmproxy's real HttpLayer (client and upstream HTTP/1) event by
event, once with the splice and once without, and compare everything that leaves it.
"""

from __future__ import annotations

import random

import pytest
from mitmproxy import connection, options
from mitmproxy.addons.proxyserver import Proxyserver
from mitmproxy.connection import ConnectionState
from mitmproxy.proxy import commands, context, events, layer
from mitmproxy.proxy.layers.http import HttpLayer, HTTPMode, HttpStream
from mitmproxy.proxy.layers.http._http1 import Http1Client, Http1Connection, Http1Server

from ttft_relay.patches import splice, trailers
from tests.patches.pins import assert_unchanged

PINNED = {
    # what the splice does for each chunk instead, and the states it checks
    "HttpStream.state_stream_response_body": (HttpStream.state_stream_response_body, "3fb6320300d3ddd5"),
    "Http1Server.send": (Http1Server.send, "cc218a1337c0f5cf"),
    "HttpLayer.event_to_child": (HttpLayer.event_to_child, "1095f6e1581d1780"),
    "HttpStream._handle_event": (HttpStream._handle_event, "e3cbfef7310ae81f"),
    # what it wraps, and where the read chunks come from
    "Http1Connection.read_body": (trailers._ORIGINAL_READ_BODY, "aece271029af36e4"),
    "Http1Connection._handle_event": (Http1Connection._handle_event, "2ac8db3e43ae743f"),
    "Layer.handle_event": (layer.Layer.handle_event, "fd88b0fb09ceddbb"),
}


def test_the_mitmproxy_code_under_it_is_unchanged():
    assert_unchanged(PINNED, splice)


def test_install_and_uninstall():
    assert not splice.installed()
    splice.install()
    try:
        assert splice.installed() and Http1Client.read_body is not Http1Connection.read_body
    finally:
        splice.uninstall()
    assert not splice.installed() and Http1Client.read_body is Http1Connection.read_body
    splice.uninstall()  # twice is harmless
    assert Http1Client.read_body is Http1Connection.read_body


class Tap:
    """A stream callable that records what it saw and changes what it passes on."""

    def __init__(self, split: bool = False) -> None:
        self.seen: list[bytes] = []
        self.split = split

    def __call__(self, chunk: bytes):
        self.seen.append(chunk)
        if self.split and len(chunk) > 1:
            return [chunk[:1], b"", chunk[1:]]  # an empty piece too: mitmproxy frames it as it is
        return chunk.upper()


def drive(upstream_reads: list[bytes], *, requests: int = 1, tap_split: bool = False, stream: object = "tap",
          store: bool = False, hold_responseheaders: bool = False, response_head: bytes | None = None,
          client_leaves_after: int | None = None):
    """mitmproxy's HttpLayer between an HTTP/1 client and an HTTP/1 upstream: `requests`
    requests on one kept-alive connection, each answered by `upstream_reads` (the
    upstream's reads, as they arrive). Returns (what went to the client, what went
    upstream, the other commands in order, what the taps saw and the flows kept, the
    number of sends to the client)."""
    opts = options.Options()
    Proxyserver().load(opts)
    opts.store_streamed_bodies = store
    client = connection.Client(peername=("127.0.0.1", 40000), sockname=("127.0.0.1", 8080),
                               timestamp_start=1.0, state=ConnectionState.OPEN)
    ctx = context.Context(client, opts)
    ctx.server = connection.Server(address=("upstream.test", 80))
    http_layer = HttpLayer(ctx, HTTPMode.transparent)
    sent: dict[str, list[bytes]] = {"client": [], "upstream": []}
    others: list[str] = []
    taps: list[Tap] = []
    held: list[events.Event] = []
    opened: list[connection.Server] = []
    flows: list = []

    def run(event: events.Event) -> None:
        queue = [event]
        while queue:
            for command in http_layer.handle_event(queue.pop(0)):
                if isinstance(command, commands.SendData):
                    sent["client" if command.connection is client else "upstream"].append(command.data)
                    continue
                others.append(type(command).__name__ + (f"({command.name})" if isinstance(command, commands.StartHook) else ""))
                if isinstance(command, commands.OpenConnection):
                    opened.append(command.connection)
                    command.connection.state = ConnectionState.OPEN
                    command.connection.timestamp_start = 2.0
                    queue.append(events.OpenConnectionCompleted(command, None))
                elif isinstance(command, commands.StartHook) and command.blocking:
                    if command.name == "responseheaders":
                        flow = command.args()[0]
                        flows.append(flow)
                        if stream == "tap":
                            taps.append(Tap(tap_split))
                            flow.response.stream = taps[-1]
                        else:
                            flow.response.stream = stream
                        if hold_responseheaders:
                            held.append(events.HookCompleted(command))
                            continue
                    queue.append(events.HookCompleted(command))

    run(events.Start())
    head = response_head or b"HTTP/1.1 200 OK\r\ncontent-type: text/event-stream\r\ntransfer-encoding: chunked\r\n\r\n"
    for _ in range(requests):
        run(events.DataReceived(client, b"POST /v1/chat/completions HTTP/1.1\r\nhost: upstream.test\r\n"
                                        b"content-length: 2\r\n\r\n{}"))
        run(events.DataReceived(opened[-1], head))
        for i, data in enumerate(upstream_reads):
            run(events.DataReceived(opened[-1], data))
            if i == 0:
                while held:
                    run(held.pop(0))
            if i == client_leaves_after:
                client.state = ConnectionState.CLOSED
                run(events.ConnectionClosed(client))
    seen = [(t.seen, f.response.raw_content) for t, f in zip(taps, flows)] if taps else [f.response.raw_content for f in flows]
    return b"".join(sent["client"]), b"".join(sent["upstream"]), others, seen, len(sent["client"])


def both(*args, **kwargs):
    assert not splice.installed()
    plain = drive(*args, **kwargs)
    splice.install()
    try:
        spliced = drive(*args, **kwargs)
    finally:
        splice.uninstall()
    return plain, spliced


def chunked(*pieces: bytes) -> bytes:
    return b"".join(b"%x\r\n%s\r\n" % (len(p), p) for p in pieces) + b"0\r\n\r\n"


def events_body(n: int) -> bytes:
    return chunked(*(b'data: {"choices":[{"delta":{"content":"tok%d"}}]}\n\n' % i for i in range(n)))


def reads_of(body: bytes, rng: random.Random, most: int) -> list[bytes]:
    reads, at = [], 0
    while at < len(body):
        step = rng.randint(1, most)
        reads.append(body[at:at + step])
        at += step
    return reads


@pytest.mark.parametrize("seed", range(12))
def test_the_client_gets_exactly_what_mitmproxy_sends(seed):
    """Reads cut anywhere (inside a chunk header, its data, its CRLF, the last chunk),
    several chunks per read or several reads per chunk, two requests kept alive."""
    rng = random.Random(seed)
    reads = reads_of(events_body(30), rng, rng.choice([3, 40, 200, 5000]))
    plain, spliced = both(reads, requests=2, tap_split=seed % 3 == 0, store=seed % 2 == 0)
    assert spliced[:4] == plain[:4]
    assert plain[0].count(b"HTTP/1.1 200") == 2 and plain[0].endswith(b"0\r\n\r\n")
    payloads = b"".join(b'data: {"choices":[{"delta":{"content":"tok%d"}}]}\n\n' % i for i in range(30))
    assert [b"".join(seen) for seen, _ in plain[3]] == [payloads, payloads]  # each tap saw its whole body
    assert all(bool(kept) == (seed % 2 == 0) for _, kept in plain[3])  # store_streamed_bodies kept it


def test_it_engages_and_sends_a_read_once():
    """Not a test of nothing: with the splice, the chunks of one read leave in one send."""
    reads = [events_body(5)[:-5], b"0\r\n\r\n"]
    plain, spliced = both(reads)
    assert spliced[:4] == plain[:4]
    assert plain[4] == 1 + 5 + 1  # head, one send per chunk, the last chunk
    assert spliced[4] == 1 + 1 + 1


def test_the_last_chunk_in_the_same_read_as_data():
    plain, spliced = both([events_body(3)])
    assert spliced[:4] == plain[:4]
    assert plain[0].endswith(b"0\r\n\r\n") and spliced[4] < plain[4]


def test_chunks_that_arrive_while_the_response_hook_runs_wait_for_it():
    """Data read while `responseheaders` is still running is queued by mitmproxy; the
    splice must not overtake it."""
    reads = reads_of(events_body(10), random.Random(7), 60)
    plain, spliced = both(reads, hold_responseheaders=True)
    assert spliced[:4] == plain[:4]


@pytest.mark.parametrize("stream", [True, "tap"])
def test_a_client_framing_without_chunks(stream):
    """An upstream answering with a length: the client gets the raw bytes, unframed."""
    body = b"data: x\n\n" * 20
    head = b"HTTP/1.1 200 OK\r\ncontent-type: text/event-stream\r\ncontent-length: %d\r\n\r\n" % len(body)
    plain, spliced = both(reads_of(body, random.Random(3), 25), requests=2, stream=stream, response_head=head)
    assert spliced[:4] == plain[:4]
    assert plain[0].count(body.upper() if stream == "tap" else body) == 2


def test_a_broken_chunk_header_is_mitmproxy_s_protocol_error():
    plain, spliced = both([b"5\r\nhello\r\nzz\r\n"])
    assert spliced[:4] == plain[:4]
    assert "CloseConnection" in plain[2]


def test_a_client_that_leaves_mid_stream():
    """mitmproxy drops the stream when its client goes; what the upstream still sends
    goes nowhere, with the splice too."""
    reads = reads_of(events_body(20), random.Random(5), 80)
    plain, spliced = both(reads, client_leaves_after=len(reads) // 2)
    assert spliced[:4] == plain[:4]
    assert not plain[0].endswith(b"0\r\n\r\n")
