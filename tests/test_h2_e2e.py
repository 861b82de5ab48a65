"""HTTP/2 under hostile clients and with an HTTP/2 upstream, through a real mitmdump over
TLS: a rapid reset (CVE-2023-44487) costs the upstream nothing and ends with GOAWAY; a
reset of a request already upstream cancels it there; a relay deadline on one upstream
stream resets that stream only; a body without a length reaches an HTTP/1 upstream whole;
a request refused on its head has its stream reset instead of its body read; a
CONTINUATION flood is cut off.

Raw frames (`ttft_relay/testing/fakes/h2_wire.py`), because HTTP/2 clients cannot misbehave on purpose.
Every relay here has `http2: true` (the relay's default is HTTP/1.1 to clients). The tests
with no other option share one (`shared_relay`, each finding its records by `rid`); those
with options of their own, or stopping the relay to count what reached the upstream, start
their own.
"""

from __future__ import annotations

import contextlib
import ssl

import h2.errors
import hpack
import orjson
import pytest
from hyperframe.frame import ContinuationFrame, HeadersFrame

from tests.conftest import reverse_to
from ttft_relay.testing.fakes import FakeUpstream
from ttft_relay.testing.fakes.h2_wire import H2Client
from tests.test_guard import RELAY_KEY, UPSTREAM_KEY
from tests.test_preauth_e2e import keyed, keys_file  # noqa: F401 (a fixture)
from ttft_relay.testing.harness import TimingLog, read_records

WAIT = 30
CHAT = "/v1/chat/completions"
STREAMED = orjson.dumps({"model": "gpt-4o-mini", "stream": True, "messages": [{"role": "user", "content": "hi"}]})
JSON = [("content-type", "application/json"), ("content-length", str(len(STREAMED)))]
pytestmark = pytest.mark.shared_fake


@pytest.fixture
def h2_upstream(certs):
    """An upstream that speaks HTTP/2 (and HTTP/1.1), as the APIs do."""
    with FakeUpstream(tls=True, certs=certs, h2=True) as upstream:
        yield upstream


def test_a_rapid_reset_gets_goaway_and_costs_the_upstream_nothing(fake, start_relay, tmp_path):
    relay = start_relay(reverse_to(fake), http2=True, relay_h2_max_resets=100)
    with H2Client(relay.port, relay.ca_pem) as h2c:
        # 2000 requests, each reset at once, in one write: the attack of CVE-2023-44487.
        for _ in range(2000):
            h2c.reset(h2c.request("GET", "/v1/models"))
        h2c.flush()
        h2c.pump(lambda: h2c.goaway is not None, WAIT)
    assert h2c.goaway is not None and h2c.goaway.error_code == h2.errors.ErrorCodes.ENHANCE_YOUR_CALM
    # The 100 resets within the budget and the one past it, each with its record;
    # the 1899 streams after it were never read.
    recs = TimingLog(tmp_path / "timing.jsonl").wait(101)
    relay.stop()  # nothing more can reach the upstream
    assert len(records(tmp_path)) == 101
    errors = [r["error"] or "" for r in recs]
    assert sum("reset by client" in e for e in errors) == 100 and sum("rapid reset" in e for e in errors) == 1
    # mitmproxy lost a reset read together with its request's end, and sent that
    # request upstream (1999 of 2000 did): a request goes out only if its reset came
    # in a later read, after its hooks had run (then it is cancelled).
    assert len(fake.received) <= 10, len(fake.received)


def records(tmp_path) -> list[dict]:
    return read_records(tmp_path / "timing.jsonl")


def test_a_reset_after_the_request_went_upstream_cancels_it(fake, shared_relay, rid):
    relay = shared_relay(reverse_to(fake), http2=True)
    fake.behaviour.stall_after_chunks = 1
    with H2Client(relay.port, relay.ca_pem) as h2c:
        sid = h2c.request("POST", CHAT, [*JSON, ("x-request-id", rid)], STREAMED)
        h2c.flush()
        assert fake.wait_chunk_sent(0, WAIT)
        h2c.reset(sid)
        h2c.flush()
        assert fake.wait_finished(1, WAIT)
    assert fake.sent[0].outcome == "client_closed"
    (rec,) = relay.log.of(rid)
    assert "reset by client" in rec["error"]


def test_a_relay_deadline_on_one_upstream_stream_spares_its_siblings(h2_upstream, start_relay, tmp_path):
    relay = start_relay(reverse_to(h2_upstream), http2=True, relay_idle_timeout=1)
    with H2Client(relay.port, relay.ca_pem) as h2c:
        stalled = h2c.request("POST", CHAT, [*JSON, ("x-fake-stall-after-chunks", "2")], STREAMED)
        # The sibling sends the rest of its answer only once the stalled stream is reset
        # (a relay that closes the shared connection instead cuts it).
        sibling = h2c.request("POST", CHAT, [*JSON, ("x-fake-hold-until-reset", "2"), ("x-fake-chunks", "30")],
                              STREAMED)
        h2c.flush()
        h2c.pump(lambda: h2c.streams[stalled].over and h2c.streams[sibling].over, WAIT)
    assert h2_upstream.wait_finished(2, WAIT)
    assert len({r.conn_id for r in h2_upstream.received}) == 1  # one upstream connection
    up_stalled, up_sibling = h2_upstream.sent
    assert up_stalled.reset == h2.errors.ErrorCodes.CANCEL and up_sibling.reset is None
    assert up_sibling.outcome == "complete" and bytes(h2c.streams[sibling].body) == up_sibling.body
    assert h2c.streams[sibling].ended and h2c.streams[sibling].status == 200
    cut = h2c.streams[stalled]
    assert cut.status == 200 and cut.ended and b"ttft-relay: stream idle for 1 s" in cut.body
    relay.stop()
    by_error = sorted(r["error"] or "" for r in records(tmp_path))
    assert by_error == ["", "stream idle for 1 s"]


def test_a_body_without_a_length_reaches_an_http1_upstream_whole(fake, shared_relay, rid):
    relay = shared_relay(reverse_to(fake), http2=True)
    with H2Client(relay.port, relay.ca_pem) as h2c:
        # HTTP/2 needs no Content-Length; HTTP/1 does (mitmproxy sent none: the upstream
        # read an empty body, then the body as the start of another request).
        sid = h2c.request("POST", CHAT, [("content-type", "application/json"), ("x-request-id", rid)], STREAMED)
        h2c.flush()
        h2c.pump(lambda: h2c.streams[sid].over)
    assert h2c.streams[sid].status == 200 and h2c.streams[sid].body.endswith(b"data: [DONE]\n\n")
    assert fake.received[0].body == STREAMED
    (rec,) = relay.log.of(rid)
    assert rec["error"] is None and rec["model"] == "gpt-4o-mini"


def test_a_request_refused_on_its_head_has_its_stream_reset_not_its_body_read(fake, start_relay, keys_file,  # noqa: F811
                                                                               tmp_path):
    relay = keyed(start_relay, reverse_to(fake), keys_file, http2=True)
    announced = 64 << 20
    with H2Client(relay.port, relay.ca_pem) as h2c:
        refused = h2c.request("POST", CHAT, [("content-type", "application/json"), ("content-length", str(announced))],
                              end_stream=False)
        h2c.flush()
        # A client goes on uploading until the relay asks it to stop (RFC 9113 §8.1:
        # RST_STREAM NO_ERROR after a complete response).
        uploaded = h2c.upload(refused, announced)
        h2c.pump(lambda: h2c.streams[refused].over)
        answer = h2c.streams[refused]
        assert answer.status == 401 and b"missing relay access key" in answer.body
        assert answer.reset == h2.errors.ErrorCodes.NO_ERROR
        assert uploaded < announced // 4, uploaded  # here 2 MB of 64 (all 64 before)
        # Only that stream: the connection carries the next request.
        ok = h2c.request("GET", "/v1/models", [("authorization", f"Bearer {RELAY_KEY}")])
        h2c.flush()
        h2c.pump(lambda: h2c.streams[ok].over)
        assert h2c.streams[ok].status == 200
    relay.stop()
    assert [r["status"] for r in records(tmp_path)] == [401, 200]


def test_a_continuation_flood_is_cut_off(fake, shared_relay, rid):
    # CVE-2024-27316 and kin: a header block that never ends, CONTINUATION after
    # CONTINUATION. h2 takes at most 64 of them (with mitmproxy's 128 KiB frames at
    # most 8 MiB per connection), then the connection closes.
    relay = shared_relay(reverse_to(fake), http2=True)
    with H2Client(relay.port, relay.ca_pem) as h2c:
        head = HeadersFrame(1)
        head.data = hpack.Encoder().encode([(":method", "GET"), (":path", "/v1/models"), (":scheme", "https"),
                                            (":authority", "x")])
        frames = [head.serialize()]
        for _ in range(200):
            more = ContinuationFrame(1)
            more.data = hpack.Encoder().encode([("x-junk", "a" * 16000)])
            frames.append(more.serialize())
        with contextlib.suppress(ConnectionError, ssl.SSLError):
            h2c.sock.sendall(b"".join(frames))
        h2c.pump(lambda: False)
        assert h2c.closed
    with H2Client(relay.port, relay.ca_pem) as h2c:  # and the relay serves on
        sid = h2c.request("GET", "/v1/models", [("x-request-id", rid)])
        h2c.flush()
        h2c.pump(lambda: h2c.streams[sid].over)
        assert h2c.streams[sid].status == 200
    relay.log.of(rid)  # and records it, once


def test_an_http2_client_of_a_keyed_listener_connects_upstream_while_its_body_uploads(h2_upstream, start_relay,
                                                                                      keys_file):  # noqa: F811
    relay = start_relay(reverse_to(h2_upstream), http2=True, relay_access_keys=f"file:{keys_file}",
                        relay_upstream_keys="localhost=env:RELAY_TEST_UPSTREAM_KEY",
                        relay_upstream_pool_warm=0)  # no connection opened ahead, for HTTP/1 clients
    with H2Client(relay.port, relay.ca_pem) as h2c:
        sid = h2c.request("POST", CHAT, [*JSON, ("authorization", f"Bearer {RELAY_KEY}")], end_stream=False)
        h2c.flush()
        # The key is accepted on the head; the body is not sent yet.
        assert h2_upstream.wait_connections(1, 5), "no upstream connection while the body uploads"
        h2c.conn.send_data(sid, STREAMED, end_stream=True)
        h2c.flush()
        h2c.pump(lambda: h2c.streams[sid].over)
        assert h2c.streams[sid].status == 200 and h2c.streams[sid].body.endswith(b"data: [DONE]\n\n")
        again = h2c.request("POST", CHAT, [*JSON, ("authorization", f"Bearer {RELAY_KEY}")], STREAMED)
        h2c.flush()
        h2c.pump(lambda: h2c.streams[again].over)
        assert h2c.streams[again].status == 200
    assert {r.conn_id for r in h2_upstream.received} == {1}  # both streams on the early connection
    assert [r.header("authorization") for r in h2_upstream.received] == [f"Bearer {UPSTREAM_KEY}"] * 2
