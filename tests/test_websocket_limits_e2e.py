"""End to end: WebSocket messages past the relay's bounds (ttft_relay/patches/fixes/websocket_limits.py),
from a hostile client and a hostile upstream (ttft_relay/testing/fakes/hostile.py), through a real mitmdump with
the relay: a deflate bomb is inflated no further than the bound and closes the socket 1009 on both
sides with a record that says so; fragment and ping floods close it 1008; the relay's memory stays
bounded and it goes on serving. Then hypothesis throws frames and extension offers at it from both
sides, the way tests/test_wire_fuzz.py throws HTTP/1 requests.
"""

from __future__ import annotations

import json
import os
from pathlib import Path

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from ttft_relay.testing.fakes import hostile
from ttft_relay.testing.fakes.hostile import (AWAIT_MESSAGE, BINARY, CLOSE, CONTINUATION, PING, PONG, TEXT, HostileUpstream,
                                 RawClient, deflate_bomb, deflated, frame)

MIB = 1024 * 1024
CRASHES = ("mitmproxy has crashed", "Traceback", "Unhandled error", "Addon error")
CREATE = json.dumps({"type": "response.create", "model": "gpt-5.1-codex", "input": []}).encode()
ATTACKS = {
    "bomb-after-create": lambda s: [AWAIT_MESSAGE, frame(TEXT, deflate_bomb(64 * MIB), rsv1=True, masked=False)],
    "pings": lambda s: [frame(PING, b"p", masked=False) * 5000],
    "created": lambda s: [AWAIT_MESSAGE, frame(TEXT, deflated(b'{"type":"response.created","response":{"id":"r1"}}'),
                                              rsv1=True, masked=False)],
}


def rss_mb(pid: int) -> float:
    status = Path(f"/proc/{pid}/status").read_text()
    return int(next(ln for ln in status.splitlines() if ln.startswith("VmHWM:")).split()[1]) / 1024


@pytest.fixture(scope="module")
def upstream():
    with HostileUpstream(ATTACKS) as u:
        yield u


@pytest.fixture
def relay(upstream, shared_relay):
    return shared_relay(f"reverse:{upstream.base_url}@0", relay_websocket_message_max="1m")


def close_of(c: RawClient) -> tuple[int | None, str]:
    f = c.until_close(30)
    assert f is not None, "the relay cut the connection without a close frame"
    return hostile.close_code(f), f.payload[2:].decode()


def test_a_client_deflate_bomb_closes_1009_inflated_no_further_than_the_bound(relay, upstream, rid):
    before = rss_mb(relay.proc.pid)
    with RawClient(relay.port, headers={"x-request-id": rid}) as c:
        assert c.status == 101 and c.deflate
        c.send(frame(TEXT, deflate_bomb(1024 * MIB), rsv1=True, masked=True))  # 1 MB on the wire, 1 GB inflated
        code, reason = close_of(c)
    assert code == 1009 and reason.startswith("ttft-relay: message over 1 MiB") and reason.endswith("from the client")
    session = next(s for s in upstream.wait_ended(len(upstream.sessions)) if s.headers.get("x-request-id") == rid)
    assert hostile.close_code(session.close) == 1009 and session.received == 0  # nothing of it went on
    # Without the bound: 1 GB inflated at once (4.97 GB RSS for the run), then forwarded.
    assert rss_mb(relay.proc.pid) - before < 200
    handshake, refused = sorted(relay.log.of(rid, 2), key=lambda r: r["turn"])
    assert handshake["status"] == 101 and handshake["error"] is None
    assert refused["turn"] == 1 and refused["error"] == reason and refused["error_phase"] == "relay"
    assert relay.wait_for_output(r"WebSocket .*ttft-relay: message over 1 MiB .*from the client; closing the socket")


def test_an_upstream_deflate_bomb_mid_turn_ends_the_turn_with_1009(relay, rid):
    with RawClient(relay.port, headers={"x-request-id": rid, "x-attack": "bomb-after-create"}) as c:
        c.send(frame(TEXT, deflated(CREATE), rsv1=True, masked=True))
        code, reason = close_of(c)
        assert c.received == 0  # none of the bomb reached the client
    assert code == 1009 and reason.endswith("from the upstream")
    handshake, turn = sorted(relay.log.of(rid, 2), key=lambda r: r["turn"])
    assert turn["model"] == "gpt-5.1-codex" and turn["error"] == reason and turn["error_phase"] != "relay"


def test_a_message_in_too_many_fragments_closes_1008(relay, rid):
    with RawClient(relay.port, headers={"x-request-id": rid}, deflate=False) as c:
        c.send(frame(TEXT, b"a", fin=False, masked=True) + frame(CONTINUATION, b"a", fin=False, masked=True) * 100_000)
        code, reason = close_of(c)
    assert code == 1008 and "more than 4096 fragments" in reason
    assert relay.log.of(rid, 2)[-1]["error"] == reason


def test_a_ping_flood_closes_1008_and_few_pings_reach_the_other_side(relay, upstream, rid):
    with RawClient(relay.port, headers={"x-request-id": rid}, deflate=False) as c:
        c.send(frame(PING, b"p", masked=True) * 100_000)
        code, reason = close_of(c)
    assert code == 1008 and "control frames" in reason
    session = next(s for s in upstream.wait_ended(len(upstream.sessions)) if s.headers.get("x-request-id") == rid)
    assert session.received <= 100  # at most the burst's pings went on (1 byte each)
    relay.log.of(rid, 2)


def test_an_upstream_ping_flood_closes_the_socket_too(relay, rid):
    with RawClient(relay.port, headers={"x-request-id": rid, "x-attack": "pings"}, deflate=False) as c:
        code, reason = close_of(c)
        pings = [f for f in c.frames if f.opcode == PING]
    assert code == 1008 and reason.endswith("from the upstream") and len(pings) <= 100
    relay.log.of(rid, 2)


def test_messages_within_the_bounds_pass_whole(relay, upstream, rid):
    big = b"x" * MIB  # exactly the bound
    with RawClient(relay.port, headers={"x-request-id": rid, "x-attack": "created"}) as c:
        c.send(frame(TEXT, deflated(CREATE), rsv1=True, masked=True))
        c.send(frame(BINARY, deflated(big), rsv1=True, masked=True))
        c.send(frame(CLOSE, b"\x03\xe8", masked=True))
        code, _ = close_of(c)
    assert code == 1000
    session = next(s for s in upstream.wait_ended(len(upstream.sessions)) if s.headers.get("x-request-id") == rid)
    assert hostile.close_code(session.close) == 1000


# --- fuzz ------------------------------------------------------------------------------------

FUZZ_EXAMPLES = int(os.environ.get("TTFT_FUZZ_EXAMPLES", "60"))
OPCODES = st.sampled_from([TEXT, BINARY, CONTINUATION, CLOSE, PING, PONG, 0x3, 0xB, 0xF])
payloads = st.one_of(
    st.binary(max_size=300),
    st.builds(deflated, st.binary(max_size=2000)),
    st.builds(deflate_bomb, st.sampled_from([MIB + 1, 4 * MIB])),
    st.sampled_from([b"\x03\xe8", b"\x03\xe8bye", b"\x0b\xb8", b"\x00", b"\xff\xff\xff", b'{"type":"response.create"}']),
)
extension_offers = st.sampled_from([
    None, "permessage-deflate", "permessage-deflate; client_max_window_bits",
    "permessage-deflate; client_max_window_bits=8", "permessage-deflate; server_max_window_bits=99",
    "permessage-deflate; client_no_context_takeover; server_no_context_takeover", "x-unknown, permessage-deflate",
    "permessage-deflate; client_max_window_bits=abc", ";;,", "permessage-deflate, permessage-deflate",
])


@st.composite
def frames(draw, masked: bool) -> bytes:
    out = b""
    for _ in range(draw(st.integers(1, 6))):
        payload = draw(payloads)
        f = frame(draw(OPCODES), payload, fin=draw(st.booleans()), rsv1=draw(st.booleans()), masked=masked)
        if draw(st.integers(0, 9)) == 0:
            f = bytes([f[0] | draw(st.sampled_from([0x20, 0x10]))]) + f[1:]  # RSV2/RSV3
        if draw(st.integers(0, 9)) == 0:
            f = f[:draw(st.integers(0, len(f)))]  # cut short
        out += f
    return out


@pytest.fixture(scope="module")
def fuzz_upstream():
    with HostileUpstream({}) as u:
        yield u


def test_hostile_frames_and_extensions_never_crash_hang_or_stop_the_relay(fuzz_upstream, start_relay):
    relay = start_relay(f"reverse:{fuzz_upstream.base_url}@0", relay_websocket_message_max="1m")
    examples = iter(range(10**9))

    @settings(max_examples=FUZZ_EXAMPLES, deadline=None, database=None,
              suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large])
    @given(client=frames(masked=True), upstream=frames(masked=False), offer=extension_offers,
           answer=extension_offers, from_client=st.booleans())
    def one(client: bytes, upstream: bytes, offer: str | None, answer: str | None, from_client: bool) -> None:
        seen = len(relay.output)
        name = f"fuzz-{next(examples)}"
        fuzz_upstream.attacks[name] = lambda s: [] if from_client else [upstream]
        headers = {"x-attack": name, "x-request-id": name}
        if answer is not None:
            headers["x-answer-extensions"] = answer
        try:
            c = RawClient(relay.port, headers=headers, deflate=False, offer=offer, timeout=15)
        except (ConnectionError, OSError):
            c = None  # the relay refused the upgrade or cut it
        if c is not None:
            with c:
                try:
                    if from_client:
                        c.send(client)
                    c.send(frame(CLOSE, b"\x03\xe8", masked=True))
                    c.until_close(15)  # a hang is a TimeoutError
                except (ConnectionError, OSError):
                    pass
        assert relay.proc.poll() is None, relay.text()[-3000:]
        new = "\n".join(relay.output[seen:])
        assert not any(crash in new for crash in CRASHES), new[-3000:]

    one()
    # Still serving a well-formed socket.
    with RawClient(relay.port, headers={"x-attack": "none"}) as c:
        c.send(frame(TEXT, deflated(CREATE), rsv1=True, masked=True) + frame(CLOSE, b"\x03\xe8", masked=True))
        assert hostile.close_code(c.until_close(15)) == 1000

