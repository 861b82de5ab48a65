"""Pin test of ttft_relay/patches/speed/splice.py: the client gets exactly what mitmproxy's own
path sends, in the same order, and the mitmproxy code the splice stands in for is pinned
(end to end: tests/test_streaming_e2e.py and every e2e suite that streams).

The layer tests drive mitmproxy's real HttpLayer (client and upstream HTTP/1) event by
event, once without the splice, once with it and once with its direct reads too (the
upstream's reads then go to the protocol that stands in for its transport's, as asyncio
would hand them, with mitmproxy's handler and the client's transport faked), and compare
everything that leaves it.
"""

from __future__ import annotations

import asyncio
import datetime
import random
import re
import socket

import pytest
from mitmproxy import connection, options
from mitmproxy.addons.proxyserver import Proxyserver
from mitmproxy.connection import ConnectionState
from cryptography import x509
from cryptography.hazmat.primitives import hashes
from cryptography.hazmat.primitives.asymmetric import ec
from OpenSSL import SSL
from mitmproxy.proxy import commands, context, events, server, tunnel
from mitmproxy.proxy import server as server_mod
from mitmproxy.proxy.layers.tls import TLSLayer
from mitmproxy.proxy.layers.http import HttpLayer, HTTPMode
from mitmproxy.proxy.layers.http._http1 import Http1Client, Http1Connection

from ttft_relay.patches import connections
from ttft_relay.patches.speed import splice
from tests.patches.pins import assert_unchanged, source


def test_the_mitmproxy_code_under_it_is_unchanged():
    assert_unchanged(splice.PINS, splice)


def test_the_lines_direct_reads_depend_on():
    src = source(server.ConnectionHandler.handle_connection)
    assert "data = await reader.read(65535)" in src  # the reader its transport's protocol feeds
    assert "await self.server_event(events.DataReceived(connection, data))" in src
    assert "await self.drain_writers()" in src
    # the TLS layer reads everything its TLS connection holds, even for an empty read
    src = source(TLSLayer.receive_data)
    assert "if data:\n            self.tls.bio_write(data)" in src and "plaintext.extend(self.tls.recv(65535))" in src


def test_an_asyncio_stream_reader_s_buffer_is_where_they_look():
    """`connections.plain_streams` takes over only from a reader that holds nothing."""

    async def check():
        reader = asyncio.StreamReader()
        assert not reader._buffer
        reader.feed_data(b"x")
        assert reader._buffer == b"x"

    asyncio.run(check())


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


class Transport:
    """What the direct reads use of an asyncio transport: the upstream's protocol slot and
    reading switch, the client's writes and write buffer."""

    def __init__(self, protocol: object = None, written: list[bytes] | None = None, buffered: int = 0) -> None:
        self.protocol = protocol
        self.written = written
        self.buffered = buffered
        self.closing = False
        self.reading = True

    def get_protocol(self):
        return self.protocol

    def set_protocol(self, protocol) -> None:
        self.protocol = protocol

    def pause_reading(self) -> None:
        self.reading = False

    def resume_reading(self) -> None:
        self.reading = True

    def is_closing(self) -> bool:
        return self.closing

    def write(self, data: bytes) -> None:
        assert self.written is not None
        self.written.append(data)

    def get_write_buffer_size(self) -> int:
        return self.buffered

    def get_write_buffer_limits(self) -> tuple[int, int]:
        return 16384, 65536


class Writer:
    """The client's StreamWriter: its transport, and a drain that waits until `drained` is set."""

    def __init__(self, transport: Transport) -> None:
        self.transport = transport
        self.drained = asyncio.Event()
        if not transport.buffered:
            self.drained.set()

    async def drain(self) -> None:
        await self.drained.wait()


class TlsPipe:
    """An upstream's TLS connection in memory: `records` is what the upstream's end sends
    for some bytes; `relay` is the relay's end, which the direct reads decrypt with, and
    `receive` what mitmproxy's TLS layer gives its child layers for a read (receive_data)."""

    def __init__(self) -> None:
        key = ec.generate_private_key(ec.SECP256R1())
        name = x509.Name([x509.NameAttribute(x509.NameOID.COMMON_NAME, "upstream.test")])
        cert = (x509.CertificateBuilder().subject_name(name).issuer_name(name).public_key(key.public_key())
                .serial_number(1).not_valid_before(datetime.datetime(2020, 1, 1))
                .not_valid_after(datetime.datetime(2100, 1, 1)).sign(key, hashes.SHA256()))
        server_context = SSL.Context(SSL.TLS_METHOD)
        server_context.use_privatekey(key)
        server_context.use_certificate(cert)
        self.upstream = SSL.Connection(server_context, None)
        self.upstream.set_accept_state()
        self.relay = SSL.Connection(SSL.Context(SSL.TLS_METHOD), None)
        self.relay.set_connect_state()
        for _ in range(4):  # the handshake's flights
            for end in (self.relay, self.upstream):
                try:
                    end.do_handshake()
                except SSL.WantReadError:
                    pass
            self._carry(self.relay, self.upstream)
            self._carry(self.upstream, self.relay)

    @staticmethod
    def _carry(source: SSL.Connection, to: SSL.Connection) -> None:
        try:
            to.bio_write(source.bio_read(65536))
        except SSL.WantReadError:
            pass

    def records(self, data: bytes) -> bytes:
        self.upstream.sendall(data)
        return self.upstream.bio_read(1 << 20)

    def close_notify(self) -> bytes:
        self.upstream.shutdown()
        return self.upstream.bio_read(65536)

    def receive(self, data: bytes) -> tuple[bytes, bool]:
        """(plaintext, whether close_notify came), as the TLS layer's receive_data reads them."""
        if data:
            self.relay.bio_write(data)
        plaintext = b""
        while True:
            try:
                plaintext += self.relay.recv(65535)
            except SSL.WantReadError:
                return plaintext, False
            except SSL.ZeroReturnError:
                return plaintext, True


class Handler:
    """mitmproxy's ConnectionHandler as the direct reads use it: its events go to `run`
    (an upstream read through `tls`, if set, as its TLS layer would pass it on)."""

    def __init__(self, run, tls: TlsPipe | None = None) -> None:
        self.run = run
        self.tls = tls
        self.timeout_watchdog = self
        self.activity = 0
        self.logged: list[str] = []

    def register_activity(self) -> None:
        self.activity += 1

    async def server_event(self, event: events.Event) -> None:
        self.receive(event)

    def receive(self, event: events.Event) -> None:
        if self.tls is not None and isinstance(event, events.DataReceived) and isinstance(event.connection, connection.Server):
            plaintext, closed = self.tls.receive(event.data)
            if plaintext:
                self.run(events.DataReceived(event.connection, plaintext))
            if closed:
                event.connection.state &= ~ConnectionState.CAN_READ
                self.run(events.ConnectionClosed(event.connection))
            return
        self.run(event)

    def log(self, message: str, level: int) -> None:
        self.logged.append(message)

    async def drain_writers(self) -> None:
        pass

    def close_connection(self, conn: connection.Connection) -> None:
        self.closed = conn


class Original:
    """The upstream transport's own protocol (mitmproxy's StreamReaderProtocol): what reaches
    it, and the connection's end as `handle_connection` then tells the layers."""

    def __init__(self) -> None:
        self.calls: list[str] = []
        self.closed = lambda: None

    def eof_received(self) -> None:
        self.calls.append("eof_received")
        self.closed()

    def connection_lost(self, exc) -> None:
        self.calls.append(f"connection_lost({exc!r})")
        self.closed()


def in_mitmproxy_s_loop(coro):
    """Run `coro` in an event loop whose tasks start eagerly, as in mitmproxy's."""
    loop = asyncio.new_event_loop()
    loop.set_task_factory(asyncio.eager_task_factory)
    try:
        return loop.run_until_complete(coro)
    finally:
        loop.close()


def drive(upstream_reads: list[bytes], *, direct: bool = False, **kwargs):
    """`drive_layer` in an event loop, with the direct reads' handler and transports."""
    return in_mitmproxy_s_loop(_drive(upstream_reads, direct, **kwargs))


async def _drive(upstream_reads: list[bytes], direct: bool, **kwargs):
    return drive_layer(upstream_reads, direct=direct, **kwargs)


def drive_direct(upstream_reads: list[bytes], **kwargs):
    """`drive` with the splice and its direct reads installed (only)."""
    splice.install(direct=True)
    try:
        return drive(upstream_reads, direct=True, **kwargs)
    finally:
        splice.uninstall()


def drive_layer(upstream_reads: list[bytes], *, direct: bool = False, requests: int = 1, tap_split: bool = False,
                stream: object = "tap", store: bool = False, hold_responseheaders: bool = False,
                response_head: bytes | None = None, client_leaves_after: int | None = None,
                client_buffered: int = 0, upstream_ends: bool = False, upstream_tls: bool = False,
                close_notify_after: int | None = None, upstream_closed_after: int | None = None):
    """mitmproxy's HttpLayer between an HTTP/1 client and an HTTP/1 upstream: `requests`
    requests on one kept-alive connection, each answered by `upstream_reads` (the
    upstream's reads, as they arrive). Returns (what went to the client, what went
    upstream, the other commands in order, what the taps saw and the flows kept, the
    number of sends to the client, and a record: reads the direct reads took and those
    mitmproxy parsed, what reached the upstream transport's own protocol, the watchdog's
    activity, the upstream transport and the client's writer)."""
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

    pipe = TlsPipe() if upstream_tls else None
    handler = Handler(run, pipe)
    original = Original()
    original.closed = lambda: run(events.ConnectionClosed(opened[-1]))
    upstream_transport = Transport(original, written=sent["upstream"])
    client_transport = Transport(written=sent["client"], buffered=client_buffered)
    client_writer = Writer(client_transport)
    record = {"direct": 0, "parsed": 0}

    def read(conn: connection.Server, data: bytes) -> None:
        protocol = upstream_transport.protocol
        wire = pipe.records(data) if pipe is not None else data
        if isinstance(protocol, splice._DirectReads):
            record["direct"] += 1
            protocol.data_received(wire)
        else:
            record["parsed"] += 1
            handler.receive(events.DataReceived(conn, wire))

    original_plain_streams, original_tls_of = connections.plain_streams, splice._tls_of
    reader_task = asyncio.current_task()  # the upstream's reads come from here, as from handle_connection
    if direct:
        connections.plain_streams = lambda c, s: (  # type: ignore[assignment]
            (handler, upstream_transport, client_writer) if asyncio.current_task() is reader_task else None)
        if pipe is not None:
            splice._tls_of = lambda layers, conn: pipe.relay if isinstance(conn, connection.Server) else None
    try:
        if close_notify_after is not None:
            assert pipe is not None and requests == 1
            upstream_reads = upstream_reads[:close_notify_after]
        _exchange(run, read, client, client_transport, opened, held, upstream_reads, requests, response_head,
                  client_leaves_after, upstream_closed_after)
        if close_notify_after is not None:
            assert pipe is not None
            protocol = upstream_transport.protocol
            if isinstance(protocol, splice._DirectReads):
                protocol.data_received(pipe.close_notify())
            else:
                handler.receive(events.DataReceived(opened[-1], pipe.close_notify()))
        if upstream_ends:
            upstream_transport.protocol.connection_lost(None)  # asyncio's call, whichever protocol it is
    finally:
        connections.plain_streams, splice._tls_of = original_plain_streams, original_tls_of
    record.update(original=original.calls, watchdog=handler.activity, upstream=upstream_transport, client=client_writer,
                  handler=handler)
    seen = [(t.seen, f.response.raw_content) for t, f in zip(taps, flows)] if taps else [f.response.raw_content for f in flows]
    return b"".join(sent["client"]), b"".join(sent["upstream"]), others, seen, len(sent["client"]), record


def _exchange(run, read, client, client_transport, opened, held, upstream_reads, requests, response_head,
              client_leaves_after, upstream_closed_after=None) -> None:
    run(events.Start())
    head = response_head or b"HTTP/1.1 200 OK\r\ncontent-type: text/event-stream\r\ntransfer-encoding: chunked\r\n\r\n"
    for _ in range(requests):
        run(events.DataReceived(client, b"POST /v1/chat/completions HTTP/1.1\r\nhost: upstream.test\r\n"
                                        b"content-length: 2\r\n\r\n{}"))
        read(opened[-1], head)
        for i, data in enumerate(upstream_reads):
            read(opened[-1], data)
            if i == 0:
                while held:
                    run(held.pop(0))
            if i == upstream_closed_after:
                opened[-1].state = ConnectionState.CLOSED  # mitmproxy's close_connection; the transport closes later
            if i == client_leaves_after:
                client.state = ConnectionState.CLOSED
                client_transport.closing = True
                run(events.ConnectionClosed(client))


def both(*args, **kwargs):
    """(mitmproxy's path, the splice's, the splice's with direct reads) for the same reads."""
    assert not splice.installed()
    plain = drive(*args, **kwargs)
    splice.install(direct=False)
    try:
        spliced = drive(*args, **kwargs)
        splice.install(direct=True)
        direct = drive(*args, direct=True, **kwargs)
    finally:
        splice.uninstall()
    return plain, spliced, direct


def chunked(*pieces: bytes) -> bytes:
    return b"".join(b"%x\r\n%s\r\n" % (len(p), p) for p in pieces) + b"0\r\n\r\n"


def events_body(n: int) -> bytes:
    return chunked(*(b'data: {"choices":[{"delta":{"content":"tok%d"}}]}\n\n' % i for i in range(n)))


def chunk_per_read(body: bytes) -> list[bytes]:
    """`body` read one chunk at a time (an `events_body`: each chunk's data ends in a blank
    line), the last chunk a read of its own."""
    ends = [m.end() for m in re.finditer(rb"\n\n\r\n", body)]
    return [body[i:j] for i, j in zip([0, *ends], [*ends, len(body)])]


def reads_of(body: bytes, rng: random.Random, most: int) -> list[bytes]:
    reads, at = [], 0
    while at < len(body):
        step = rng.randint(1, most)
        reads.append(body[at:at + step])
        at += step
    return reads


@pytest.mark.parametrize("upstream_tls", [False, True], ids=["plain", "tls"])
@pytest.mark.parametrize("seed", range(12))
def test_the_client_gets_exactly_what_mitmproxy_sends(seed, upstream_tls):
    """Reads cut anywhere (inside a chunk header, its data, its CRLF, the last chunk),
    several chunks per read or several reads per chunk, two requests kept alive; over
    TLS, each read one TLS record or more (the direct reads decrypt them)."""
    rng = random.Random(seed)
    reads = reads_of(events_body(30), rng, rng.choice([3, 40, 200, 5000, 40000]))
    plain, spliced, direct = both(reads, requests=2, tap_split=seed % 3 == 0, store=seed % 2 == 0,
                                  upstream_tls=upstream_tls)
    assert spliced[:4] == plain[:4] and direct[:4] == plain[:4]
    assert plain[0].count(b"HTTP/1.1 200") == 2 and plain[0].endswith(b"0\r\n\r\n")
    payloads = b"".join(b'data: {"choices":[{"delta":{"content":"tok%d"}}]}\n\n' % i for i in range(30))
    assert [b"".join(seen) for seen, _ in plain[3]] == [payloads, payloads]  # each tap saw its whole body
    assert all(bool(kept) == (seed % 2 == 0) for _, kept in plain[3])  # store_streamed_bodies kept it


def test_it_engages_and_sends_a_read_once():
    """Not a test of nothing: with the splice, the chunks of one read leave in one send."""
    reads = [events_body(5)[:-5], b"0\r\n\r\n"]
    plain, spliced, direct = both(reads)
    assert spliced[:4] == plain[:4] and direct[:4] == plain[:4]
    assert plain[4] == 1 + 5 + 1  # head, one send per chunk, the last chunk
    assert spliced[4] == 1 + 1 + 1


def test_the_last_chunk_in_the_same_read_as_data():
    plain, spliced, direct = both([events_body(3)])
    assert spliced[:4] == plain[:4] and direct[:4] == plain[:4]
    assert plain[0].endswith(b"0\r\n\r\n") and spliced[4] < plain[4]


def test_chunks_that_arrive_while_the_response_hook_runs_wait_for_it():
    """Data read while `responseheaders` is still running is queued by mitmproxy; the
    splice must not overtake it."""
    reads = reads_of(events_body(10), random.Random(7), 60)
    plain, spliced, direct = both(reads, hold_responseheaders=True)
    assert spliced[:4] == plain[:4] and direct[:4] == plain[:4]


@pytest.mark.parametrize("stream", [True, "tap"])
def test_a_client_framing_without_chunks(stream):
    """An upstream answering with a length: the client gets the raw bytes, unframed."""
    body = b"data: x\n\n" * 20
    head = b"HTTP/1.1 200 OK\r\ncontent-type: text/event-stream\r\ncontent-length: %d\r\n\r\n" % len(body)
    plain, spliced, direct = both(reads_of(body, random.Random(3), 25), requests=2, stream=stream, response_head=head)
    assert spliced[:4] == plain[:4] and direct[:4] == plain[:4]
    assert plain[0].count(body.upper() if stream == "tap" else body) == 2


def test_a_broken_chunk_header_is_mitmproxy_s_protocol_error():
    plain, spliced, direct = both([b"5\r\nhello\r\nzz\r\n"])
    assert spliced[:4] == plain[:4] and direct[:4] == plain[:4]
    assert "CloseConnection" in plain[2]


def test_a_client_that_leaves_mid_stream():
    """mitmproxy drops the stream when its client goes; what the upstream still sends
    goes nowhere, with the splice too."""
    reads = reads_of(events_body(20), random.Random(5), 80)
    plain, spliced, direct = both(reads, client_leaves_after=len(reads) // 2)
    assert spliced[:4] == plain[:4] and direct[:4] == plain[:4]
    assert not plain[0].endswith(b"0\r\n\r\n")


def test_direct_reads_take_every_read_after_the_first():
    """Not a test of nothing: one chunk per read, and after the first body read mitmproxy
    parses only the head; the last chunk is handed back and ends the flow as mitmproxy's."""
    reads = chunk_per_read(events_body(6))
    assert len(reads) == 7 and reads[-1] == b"0\r\n\r\n"
    plain, spliced, direct = both(reads, requests=2)
    assert direct[:4] == plain[:4]
    # per request: the head and the first body read parsed, the last chunk parsed when handed back
    assert direct[5]["direct"] == 2 * 6 and direct[5]["parsed"] == 2 * 2
    assert direct[5]["watchdog"] == 2 * 6  # each read they took told the inactivity watchdog
    assert spliced[5]["direct"] == 0


@pytest.mark.parametrize("upstream_tls", [False, True], ids=["plain", "tls"])
@pytest.mark.parametrize("seed", range(8))
def test_direct_reads_hand_back_at_what_they_do_not_decode(seed, upstream_tls):
    """A chunk extension, an upper-case hex size and a header split across reads are
    h11's to read; the direct reads take over again after it."""
    rng = random.Random(seed)
    pieces = [b'data: {"n":%d}\n\n' % i for i in range(40)]
    body = b"".join(b"%x;ext=%d\r\n%s\r\n" % (len(p), i, p) if i % 7 == 3 else b"%X\r\n%s\r\n" % (len(p), p)
                    for i, p in enumerate(pieces)) + b"0\r\n\r\n"
    plain, spliced, direct = both(reads_of(body, rng, rng.choice([7, 60, 400])), upstream_tls=upstream_tls)
    assert direct[:4] == plain[:4]
    assert direct[5]["direct"] > 0


@pytest.mark.parametrize("cut", [3, 30, 31, 33])
def test_an_upstream_that_ends_mid_body(cut):
    """EOF inside a chunk's data, its CRLF or the next header: mitmproxy's own error, from
    the state the direct reads handed back."""
    body = events_body(4)
    reads = [body[:60], body[60:60 + cut]]
    plain, spliced, direct = both(reads, upstream_ends=True)
    assert direct[:4] == plain[:4]
    assert direct[5]["direct"] == 1 and direct[5]["original"] == ["connection_lost(None)"]
    assert not plain[0].endswith(b"0\r\n\r\n")


@pytest.mark.parametrize("second", [b"\r", b"\rX5\r\nhello\r\n", b"\r\n5\r\nhelloXX", b"\r\n5\r\nhe"])
def test_a_malformed_footer_after_direct_reads(second):
    """A chunk's CRLF cut between reads or wrong, and a chunk cut inside: h11 is handed
    its own state and fails or goes on exactly as it would have."""
    first = b"5\r\nhello"
    plain, spliced, direct = both([b"3\r\nabc\r\n", first, second, b"llo\r\n0\r\n\r\n"])
    assert direct[:4] == plain[:4]
    assert direct[5]["direct"] >= 2


def test_direct_reads_wait_for_a_full_client_buffer():
    """Over the client's write limit, upstream reading pauses until the client drains."""

    async def run():
        splice.install(direct=True)
        try:
            body = events_body(3)
            result = drive_layer([body[:60], body[60:120]], direct=True, client_buffered=10**6)
        finally:
            splice.uninstall()
        upstream, client = result[5]["upstream"], result[5]["client"]
        assert not upstream.reading
        client.transport.buffered = 0
        client.drained.set()
        await asyncio.sleep(0)  # the waiting task runs once the loop turns
        assert upstream.reading

    in_mitmproxy_s_loop(run())


def test_direct_reads_go_through_one_open_tls_layer_or_none():
    """A connection with nothing between it and the HTTP layer is read as it is; one with
    an open TLS layer through that layer's TLS connection; anything else is left alone (a
    handshake not done, an upstream proxy's tunnel, TLS expected but no layer found)."""
    opts = options.Options()
    client = connection.Client(peername=("127.0.0.1", 40000), sockname=("127.0.0.1", 8080), timestamp_start=1.0)
    server = connection.Server(address=("upstream.test", 443))
    ctx = context.Context(client, opts)
    assert splice._tls_of([], server) is None
    tls_layer = TLSLayer(ctx, server)
    tls_layer.tls = object()
    assert splice._tls_of([tls_layer], server) is False  # its handshake is not done
    tls_layer.tunnel_state = tunnel.TunnelState.OPEN
    assert splice._tls_of([tls_layer], server) is tls_layer.tls
    assert splice._tls_of([tls_layer], client) is None  # another connection's
    proxy_tunnel = tunnel.TunnelLayer(ctx, server, server)
    proxy_tunnel.tunnel_state = tunnel.TunnelState.OPEN
    assert splice._tls_of([proxy_tunnel, tls_layer], server) is False
    assert splice._tls_of([proxy_tunnel], server) is False
    server.tls = True
    assert splice._tls_of([], server) is False


def test_a_tap_that_fails_under_direct_reads_closes_the_upstream(caplog):
    """mitmproxy would log the exception and leave the flow hanging; the direct reads log
    it, give the connection back and close it, so the flow fails and its client is told."""

    class Failing(Tap):
        failed = False

        def __call__(self, chunk: bytes):
            if len(self.seen) == 2 and not self.failed:
                self.failed = True  # once: the harness goes on reading, a closed connection would not
                raise ValueError("tap bug")
            return super().__call__(chunk)

    record = drive_direct(chunk_per_read(events_body(5)), stream=Failing())[5]
    assert record["direct"] >= 1 and isinstance(record["upstream"].protocol, Original)
    assert isinstance(record["handler"].closed, connection.Server)
    assert "direct reads of" in caplog.text and "tap bug" in caplog.text


@pytest.mark.parametrize("after", [1, 3, 4])
def test_an_upstream_closing_tls_mid_body(after):
    """close_notify inside the body, read by the direct reads: handed back, so that the TLS
    layer tells the flow the connection ended, as without them."""
    reads = chunk_per_read(events_body(6))[:-1]
    plain, spliced, direct = both(reads, upstream_tls=True, close_notify_after=after)
    assert direct[:4] == plain[:4]
    assert direct[5]["direct"] == after - 1  # the body's first read is mitmproxy's; the close_notify's was theirs
    assert isinstance(direct[5]["upstream"].protocol, Original)
    assert not plain[0].endswith(b"0\r\n\r\n")


def test_over_tls_a_chunk_across_records_is_the_same_body():
    """Events larger than a TLS record: each piece ends with its record, so the client's
    chunks may begin elsewhere than on mitmproxy's path; the body it decodes, what the tap
    saw and what the flow kept are the same."""
    pieces = [b"data: " + bytes([65 + i % 26]) * 9000 + b"\n\n" for i in range(12)]
    body = chunked(*pieces)
    reads = reads_of(body, random.Random(1), 40000)
    plain, spliced, direct = both(reads, upstream_tls=True, store=True)
    assert direct[5]["direct"] > 0
    assert dechunked(direct[0]) == dechunked(plain[0]) == b"".join(p.upper() for p in pieces)
    assert [(b"".join(seen), kept) for seen, kept in direct[3]] == [(b"".join(seen), kept) for seen, kept in plain[3]]
    assert direct[2] == plain[2]


def dechunked(client_bytes: bytes) -> bytes:
    """The body in what the client got: its chunks' data after the response head."""
    rest, out = client_bytes.split(b"\r\n\r\n", 1)[1], b""
    while True:
        size, rest = rest.split(b"\r\n", 1)
        if not int(size, 16):
            return out
        out, rest = out + rest[:int(size, 16)], rest[int(size, 16) + 2:]


def test_they_take_over_only_from_the_upstream_s_own_reader_task():
    """`connections.plain_streams`: from the task that reads the upstream (mitmproxy's
    handle_connection, between reads) and only then; never from another task (one
    parsing a hand-back may run while that task holds a read not parsed yet), nor while
    the reader holds bytes, nor once another protocol reads the transport."""

    async def check():
        loop = asyncio.get_running_loop()
        pairs = [socket.socketpair() for _ in range(2)]
        streams = [await asyncio.open_connection(sock=a) for a, _ in pairs]
        try:
            client = connection.Client(peername=("127.0.0.1", 1), sockname=("127.0.0.1", 2), timestamp_start=1.0)
            server = connection.Server(address=("upstream.test", 80))
            (up_reader, up_writer), (_, down_writer) = streams
            results = []

            async def reader_task():
                results.append(connections.plain_streams(client, server))
                up_reader.feed_data(b"x")
                results.append(connections.plain_streams(client, server))
                await up_reader.read(1)
                protocol = up_writer.transport.get_protocol()
                up_writer.transport.set_protocol(asyncio.Protocol())
                results.append(connections.plain_streams(client, server))
                up_writer.transport.set_protocol(protocol)

            task = loop.create_task(reader_task())
            handler = type("Handler", (), {})()
            handler.transports = {server: server_mod.ConnectionIO(handler=task, reader=up_reader, writer=up_writer),
                                  client: server_mod.ConnectionIO(handler=None, reader=None, writer=down_writer)}
            original = connections.handler_of
            connections.handler_of = lambda c: handler  # type: ignore[assignment]
            try:
                await task
                assert connections.plain_streams(client, server) is None  # not from the reader task
            finally:
                connections.handler_of = original
            assert results[0] == (handler, up_writer.transport, down_writer)
            assert results[1] is None and results[2] is None
        finally:
            for _, w in streams:
                w.close()
            for a, b in pairs:
                a.close()
                b.close()

    asyncio.run(check())


def test_reads_after_mitmproxy_closed_the_upstream_are_dropped():
    """mitmproxy's close_connection marks the connection closed and cancels its reader task
    (which drops what is read until the transport closes); the direct reads drop it too."""
    reads = chunk_per_read(events_body(6))[:-1]
    closed = drive_direct(reads, upstream_closed_after=2)
    upto = drive_direct(reads[:3])
    assert closed[5]["direct"] == 5 and closed[0] == upto[0]
