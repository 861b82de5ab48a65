"""Pin test of ttft_relay/patches/fixes/websocket_limits.py, and its bounds on wsproto connections as
mitmproxy makes them (end to end, and fuzzed: tests/test_websocket_limits_e2e.py)."""

from __future__ import annotations

import importlib.metadata
import zlib

import pytest
from mitmproxy import connection
from mitmproxy.proxy.layers.websocket import WebsocketConnection
from wsproto import ConnectionType
from wsproto.events import CloseConnection, Message, Ping
from wsproto.extensions import PerMessageDeflate

from ttft_relay.testing.fakes.hostile import CONTINUATION, PING, TEXT, deflate_bomb, deflated, frame
from tests.patches.pins import assert_unchanged
from ttft_relay.patches.fixes import websocket_limits
from ttft_relay.patches.fixes.websocket_limits import Bounds, BoundedDeflate, MessageLimits


def test_the_code_under_it_is_unchanged():
    assert importlib.metadata.version("wsproto") == "1.3.2"
    assert_unchanged(websocket_limits.PINS, websocket_limits)


class _Conn:
    peername = ("127.0.0.1", 1)


def server_side(bounds: Bounds, *, deflate: bool = True) -> WebsocketConnection:
    """The relay's reading side of a client's socket, as mitmproxy makes it, bounded."""
    exts = []
    if deflate:
        d = PerMessageDeflate()
        d.finalize("permessage-deflate")
        exts.append(d)
    websocket_limits.install(bounds)
    try:
        return WebsocketConnection(ConnectionType.SERVER, exts, conn=_Conn())
    finally:
        websocket_limits.uninstall()


def events(ws: WebsocketConnection, data: bytes) -> list:
    ws.receive_data(data)
    return list(ws.events())


def message_bytes(evs: list) -> bytes:
    return b"".join(e.data.encode() if isinstance(e.data, str) else e.data for e in evs if isinstance(e, Message))


def closed(evs: list) -> CloseConnection | None:
    return next((e for e in evs if isinstance(e, CloseConnection)), None)


MIB = 1024 * 1024


def test_the_wrap_bounds_both_sides_and_keeps_the_negotiated_parameters():
    d = PerMessageDeflate()
    d.finalize("permessage-deflate; client_no_context_takeover; server_max_window_bits=10")
    websocket_limits.install(Bounds(message_bytes=MIB))
    try:
        ws = WebsocketConnection(ConnectionType.CLIENT, [d], conn=_Conn())
    finally:
        websocket_limits.uninstall()
    exts = ws._proto.extensions
    assert [type(e) for e in exts] == [BoundedDeflate, MessageLimits]
    assert exts[0].client_no_context_takeover and exts[0].server_max_window_bits == 10 and exts[0].enabled()
    assert exts[1].peer == "upstream" and exts[1].bounds.message_bytes == MIB
    assert WebsocketConnection.__init__ is websocket_limits._ORIGINAL_INIT


def test_a_deflate_bomb_is_inflated_no_further_than_the_bound():
    ws = server_side(Bounds(message_bytes=MIB))
    limits = ws._proto.extensions[-1]
    bomb = deflate_bomb(256 * MIB)
    evs = events(ws, frame(TEXT, bomb, rsv1=True, masked=True))
    close = closed(evs)
    assert close is not None and close.code == 1009
    assert close.reason.startswith("ttft-relay: message over 1 MiB") and close.reason.endswith("from the client")
    assert limits.size <= MIB + 1  # what was inflated: the bound and one byte, not 256 MiB
    assert len(message_bytes(evs)) <= MIB


@pytest.mark.parametrize("compressed", [True, False])
def test_a_message_at_the_bound_passes_and_one_byte_more_does_not(compressed):
    bound = 100_000
    for size, passes in ((bound, True), (bound + 1, False)):
        ws = server_side(Bounds(message_bytes=bound))
        data = b"x" * size
        payload = deflated(data) if compressed else data
        # in three fragments, the bound counted over the whole message
        third = len(payload) // 3
        wire = (frame(TEXT, payload[:third], fin=False, rsv1=compressed, masked=True)
                + frame(CONTINUATION, payload[third:2 * third], fin=False, masked=True)
                + frame(CONTINUATION, payload[2 * third:], masked=True))
        evs = events(ws, wire)
        if passes:
            assert closed(evs) is None and message_bytes(evs) == data
        else:
            assert closed(evs).code == 1009


def test_an_uncompressed_frame_over_the_bound_is_refused_from_its_header():
    ws = server_side(Bounds(message_bytes=MIB), deflate=False)
    head = frame(TEXT, b"x" * (2 * MIB), masked=True)[:14]  # header and mask only: the payload never comes
    assert closed(events(ws, head)).code == 1009


def test_messages_after_the_bound_reset_and_context_takeover_still_works():
    ws = server_side(Bounds(message_bytes=1000))
    c = zlib.compressobj(9, zlib.DEFLATED, -15)  # one compressor for all: the peer keeps its context
    wire = b""
    for i in range(50):
        payload = (c.compress(b"y" * 900 + str(i).encode()) + c.flush(zlib.Z_SYNC_FLUSH))[:-4]
        wire += frame(TEXT, payload, rsv1=True, masked=True)
    evs = events(ws, wire)
    assert closed(evs) is None
    assert sum(1 for e in evs if isinstance(e, Message) and e.message_finished) == 50


def test_no_bound_when_the_size_is_zero():
    ws = server_side(Bounds(message_bytes=0))
    data = b"z" * (3 * MIB)
    evs = events(ws, frame(TEXT, deflated(data), rsv1=True, masked=True))
    assert closed(evs) is None and message_bytes(evs) == data


def test_fragments_beyond_the_bound_close_with_policy_violation():
    ws = server_side(Bounds(fragments=10), deflate=False)
    ok = frame(TEXT, b"a", fin=False, masked=True) + frame(CONTINUATION, b"a", fin=False, masked=True) * 8
    evs = events(ws, ok + frame(CONTINUATION, b"a", masked=True))
    assert closed(evs) is None and message_bytes(evs) == b"a" * 10
    evs = events(ws, ok + frame(CONTINUATION, b"a", fin=False, masked=True) + frame(CONTINUATION, b"a", masked=True))
    assert closed(evs).code == 1008 and "more than 10 fragments" in closed(evs).reason


def test_control_frames_beyond_the_bucket_close_the_socket(monkeypatch):
    now = [1000.0]
    monkeypatch.setattr(websocket_limits.time, "monotonic", lambda: now[0])
    ws = server_side(Bounds(control_burst=5, control_per_s=2), deflate=False)
    evs = events(ws, frame(PING, b"p", masked=True) * 5)
    assert sum(isinstance(e, Ping) for e in evs) == 5 and closed(evs) is None
    now[0] += 1.0  # two more tokens
    evs = events(ws, frame(PING, b"p", masked=True) * 2)
    assert sum(isinstance(e, Ping) for e in evs) == 2 and closed(evs) is None
    evs = events(ws, frame(PING, b"p", masked=True))
    assert closed(evs).code == 1008 and "control frames" in closed(evs).reason


def test_pings_between_fragments_do_not_end_the_message_count():
    ws = server_side(Bounds(message_bytes=10), deflate=False)
    wire = (frame(TEXT, b"12345", fin=False, masked=True) + frame(PING, b"p", masked=True)
            + frame(CONTINUATION, b"67890", masked=True))
    evs = events(ws, wire)
    assert closed(evs) is None and message_bytes(evs) == b"1234567890"
    ws = server_side(Bounds(message_bytes=10), deflate=False)
    evs = events(ws, wire[:-len(frame(CONTINUATION, b"67890", masked=True))] + frame(CONTINUATION, b"678901", masked=True))
    assert closed(evs).code == 1009


def test_the_patch_installs_and_uninstalls():
    websocket_limits.install(Bounds())
    try:
        assert WebsocketConnection.__init__ is websocket_limits._bounded_init
    finally:
        websocket_limits.uninstall()
    assert WebsocketConnection.__init__ is websocket_limits._ORIGINAL_INIT


def test_connections_without_the_patch_are_wsprotos_own():
    ws = WebsocketConnection(ConnectionType.SERVER, [], conn=connection.Client(peername=("127.0.0.1", 1),
                                                                               sockname=("127.0.0.1", 2),
                                                                               timestamp_start=0))
    assert ws._proto.extensions == []
