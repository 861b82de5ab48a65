"""The relay's self-watch: TCP_INFO read right, the event loop's lag sampled, bytes the kernel held marked."""

from __future__ import annotations

import asyncio
import gc
import socket
import struct
import sys
import time

import pytest

from ttft_relay.observe import selfwatch
from ttft_relay.testing.harness import connect_many, handshakes_completed

linux = pytest.mark.skipif(not sys.platform.startswith("linux"), reason="TCP_INFO as Linux lays it out")


def test_parse_tcp_info_reads_the_fields_at_their_offsets():
    raw = bytearray(selfwatch._TCP_INFO_ASK)
    struct.pack_into("=II", raw, 24, 7, 4096)
    struct.pack_into("=I", raw, 44, 321)
    struct.pack_into("=I", raw, 52, 1234)
    struct.pack_into("=I", raw, 68, 25_500)
    struct.pack_into("=I", raw, 100, 3)
    struct.pack_into("=Q", raw, 128, 5000)
    struct.pack_into("=II", raw, 144, 17, 24_250)
    struct.pack_into("=I", raw, 224, 2)
    struct.pack_into("=HHI", raw, 240, 1, 1, 1110)
    assert selfwatch.parse_tcp_info(bytes(raw)) == selfwatch.TcpInfo(
        7, 4096, 1234, 25.5, 3, last_data_sent_ms=321, bytes_received=5000, notsent_bytes=17, min_rtt_ms=24.25,
        out_of_order=2, rto_count=1, rto_time_ms=1110)
    # An older kernel's shorter struct: what it does not fill is None.
    assert selfwatch.parse_tcp_info(bytes(raw[:selfwatch._TCP_INFO_LEN])) == selfwatch.TcpInfo(
        7, 4096, 1234, 25.5, 3, last_data_sent_ms=321)
    assert selfwatch.parse_tcp_info(bytes(raw[:60])) is None
    # No RTT sample yet: no minimum.
    struct.pack_into("=I", raw, 148, 0xFFFFFFFF)
    assert selfwatch.parse_tcp_info(bytes(raw)).min_rtt_ms is None


def test_a_handshake_took_its_round_trip_or_its_syn_ack_timeouts():
    info = selfwatch.TcpInfo(0, 0, 0, 151.0, 0, rto_count=0, rto_time_ms=0)
    assert selfwatch.handshake_ms(info) == 151.0
    assert selfwatch.handshake_ms(info._replace(total_retrans=1, rto_count=1, rto_time_ms=1110)) == 1110.0


def test_counters_since_an_earlier_reading():
    now = selfwatch.Counters(5, 300, 7)
    assert now.since(None) == now
    assert now.since(selfwatch.Counters(2, 100, 7)) == selfwatch.Counters(3, 200, 0)
    assert selfwatch.Counters(1, None, None).since(selfwatch.Counters(0, None, None)) == selfwatch.Counters(1, None, None)


def test_settled_once_everything_written_is_acknowledged():
    info = selfwatch.TcpInfo(0, 0, 0, 1.0, 0, notsent_bytes=0)
    assert selfwatch.settled(info, 0)
    assert not selfwatch.settled(info._replace(unacked=2), 0)
    assert not selfwatch.settled(info._replace(notsent_bytes=10), 0)
    assert not selfwatch.settled(info, 512)  # still in the relay's own write buffer
    assert selfwatch.settled(None, 512)  # nothing more to learn


def test_no_socket_or_a_closed_one_gives_nothing():
    assert selfwatch.tcp_info(None) is None
    s = socket.socket()
    s.close()
    assert selfwatch.tcp_info(s) is None
    assert selfwatch.arrival(None, time.time()) is None


@linux
def test_a_listening_socket_tells_its_accept_queue():
    with socket.socket() as listener:
        listener.bind(("127.0.0.1", 0))
        listener.listen(64)
        clients = connect_many(listener.getsockname()[1], 3)
        try:
            assert len(handshakes_completed(clients)) == 3
            info = selfwatch.tcp_info(listener)
            assert (info.unacked, info.sacked) == (3, 64)
            listener.accept()[0].close()
            assert selfwatch.tcp_info(listener).unacked == 2
        finally:
            for c in clients:
                c.close()


@linux
def test_arrival_is_when_the_kernel_had_the_bytes_not_when_they_were_read():
    with socket.create_server(("127.0.0.1", 0)) as listener:
        a = socket.create_connection(listener.getsockname())
        b = listener.accept()[0]
    with a, b:
        sent = time.time()
        a.sendall(b"GET / HTTP/1.1\r\n\r\n")
        time.sleep(0.3)  # the bytes wait unread: the hold being measured
        read = time.time()
        arrived = selfwatch.arrival(b, read)
        assert arrived is not None
        assert sent - selfwatch.HOLD_MIN_MS / 1000 <= arrived <= sent + selfwatch.HOLD_MIN_MS / 1000
        # Read at once: no hold worth a mark.
        a.sendall(b"more")
        assert selfwatch.arrival(b, time.time()) is None
        info = selfwatch.tcp_info(b)
        assert info.total_retrans == 0 and info.rtt_ms < 100


def test_loop_lag_is_how_late_the_timer_fires():
    samples = []
    lag = selfwatch.LoopLag(lambda s, tick: samples.append(s), interval=0.01)

    async def main():
        lag.start(asyncio.get_running_loop())
        await asyncio.sleep(0.05)
        before = time.time()
        time.sleep(0.25)  # the loop is blocked: the CPU hog being measured
        await asyncio.sleep(0.05)
        lag.stop()
        return before

    before = asyncio.run(main())
    assert max(samples) >= 0.2
    assert lag.worst(before) == max(samples)
    assert lag.worst(time.time() + 1) == 0.0


def test_gc_pauses_are_each_collection_timed_and_the_long_ones_kept(monkeypatch):
    monkeypatch.setattr(selfwatch, "GC_PAUSE_KEPT_MS", 0.0)  # every one kept: the test's own are short
    pauses = selfwatch.GcPauses()
    before = time.time()
    pauses.install()
    try:
        assert gc.callbacks.count(pauses._callback) == 1
        pauses.install()  # once only
        assert gc.callbacks.count(pauses._callback) == 1
        gc.collect()
        gc.collect(0)
    finally:
        pauses.uninstall()
    assert pauses._callback not in gc.callbacks
    drained = pauses.drain()
    assert [g for g, _ in drained][-2:] == [2, 0] and all(p >= 0 for _, p in drained)
    assert pauses.drain() == []  # handed over once
    assert pauses.worst(before) == max(p for _, p in drained) > 0
    assert pauses.worst(time.time() + 1) == 0.0
    gc.collect()  # after uninstall: not seen
    assert pauses.drain() == []


def test_forgets_a_connections_retransmit_count_when_it_closes():
    # mitmproxy calls client_disconnected(client) and server_disconnected(data): one signature each.
    from mitmproxy.proxy import server_hooks
    from mitmproxy.test import tflow

    from ttft_relay.observe import selfwatch

    watch = selfwatch.SelfWatch()
    client, server = tflow.tclient_conn(), tflow.tserver_conn()
    watch.counted.update({client.id: selfwatch.Counters(3, 0, 0), server.id: selfwatch.Counters(1, 0, 0)})
    watch.handshakes[client.id] = 1.0
    watch.client_disconnected(client)
    watch.server_disconnected(server_hooks.ServerConnectionHookData(server=server, client=client))
    assert watch.counted == {} and watch.handshakes == {}


def test_an_http2_request_is_alone_on_its_connection_only_with_no_other_stream_since_it_was_written():
    from mitmproxy.test import tflow

    flow, sibling, elsewhere = tflow.tflow(), tflow.tflow(), tflow.tflow()
    sibling.server_conn = flow.server_conn
    written = 100.0
    assert selfwatch.alone_on(flow, written, [flow, elsewhere], None)  # another connection's stream is not its
    assert selfwatch.alone_on(flow, written, [flow], 99.0)  # the last other stream ended before it was written
    # Another stream in flight on the connection, or one that ended after it was written: its frames
    # (a request, window updates) may be the connection's last send.
    assert not selfwatch.alone_on(flow, written, [flow, sibling], None)
    assert not selfwatch.alone_on(flow, written, [flow], 100.5)


def test_an_http2_requests_resending_is_marked_only_when_it_was_alone_on_its_connection(monkeypatch):
    """TCP_INFO's retransmits and last send are the connection's: on HTTP/2 they are the
    request's own only with no other stream on the connection since it was written, and only
    until its head (then the relay sends window updates as the answer comes)."""
    from mitmproxy.test import tflow

    from ttft_relay import apis, state

    def upstream_flow(server=None, *, alpn=b"h2", answered=True):
        flow = tflow.tflow(resp=answered)
        if server is not None:
            flow.server_conn = server
        flow.server_conn.alpn = alpn
        state.attach(flow, state.FlowState(api=apis.get(apis.OPENAI_CHAT), stream=True))
        state.mark(flow, "forwarded", time.time() - 1.0)
        return flow

    def kernel(retransmits: int, last_sent_ms: int) -> None:
        info = selfwatch.TcpInfo(0, 0, 0, 1.0, retransmits, last_data_sent_ms=last_sent_ms)
        monkeypatch.setattr(selfwatch, "tcp_info", lambda sock: info)

    watch = selfwatch.SelfWatch()
    alone = upstream_flow()
    watch.request(alone)
    kernel(retransmits=1, last_sent_ms=500)
    watch.responseheaders(alone)
    resent = state.get(alone).marks["upstream_resent"]
    assert time.time() - 0.6 < resent < time.time() - 0.4

    # Nothing resent before the head: a later retransmit is the relay's window update for the
    # answer, not the request.
    quiet = upstream_flow()
    watch.request(quiet)
    kernel(retransmits=0, last_sent_ms=500)
    watch.responseheaders(quiet)
    kernel(retransmits=1, last_sent_ms=0)
    watch.response(quiet)
    assert "upstream_resent" not in state.get(quiet).marks

    # Another stream on the connection since the request was written: its frames may be the
    # ones resent, and the last sent. Left unmarked, never a wrong figure.
    crowded = upstream_flow()
    sibling = upstream_flow(crowded.server_conn)
    watch.request(crowded)
    watch.request(sibling)
    kernel(retransmits=1, last_sent_ms=500)
    watch.responseheaders(crowded)
    watch.response(crowded)
    assert "upstream_resent" not in state.get(crowded).marks

    # Failed without a head: read as it fails, as `upstream_sent` is.
    failed = upstream_flow(answered=False)
    watch.request(failed)
    kernel(retransmits=1, last_sent_ms=500)
    watch.error(failed)
    assert "upstream_resent" in state.get(failed).marks

    # HTTP/1: the relay sends the upstream nothing else while it waits: read as the record is made.
    http1 = upstream_flow(alpn=b"http/1.1")
    watch.request(http1)
    kernel(retransmits=0, last_sent_ms=500)
    watch.responseheaders(http1)
    kernel(retransmits=1, last_sent_ms=300)
    watch.response(http1)
    assert "upstream_resent" in state.get(http1).marks
