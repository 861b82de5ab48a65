"""Timing accuracy through a real mitmdump: inject a known delay into one hop at a
time and check the record puts it in the right phase and the verdict names it.

Delays are a few hundred ms so that noise on a busy machine cannot decide: each
check is `injected - JITTER_MS <= phase < injected + SLACK_MS`. JITTER_MS allows
for what the relay cannot see: an interval injected by the client or the fake is
measured between two arrivals at the relay, and a busy event loop can notice the
first one late (an accept, a chunk) by a few ms.

The cases share a settled relay per set of options (`relay_at`) and a delaying link per
fake (`far_fake_tls`); each finds its records by its `x-request-id`, and once the
relays stopped no request id may have more records than its test found (no flow is
recorded twice).
"""

from __future__ import annotations

import threading
import time
from collections.abc import Iterator

import pytest

from ttft_relay.timing import phases
from tests.conftest import FAKE_ANTHROPIC_KEY, FAKE_OPENAI_KEY, reverse_to
from ttft_relay.testing.fakes.client import HttpConnection, request
from ttft_relay.testing.fakes.forwarder import DelayingForwarder

pytestmark = pytest.mark.shared_fake

SLACK_MS = 250
JITTER_MS = 25
UPLOAD_PAUSE_S = 0.15
ONE_WAY_MS = 100
PREFILL_MS = 400
STALL_S = 0.5

APIS = {
    "openai.chat": ("/v1/chat/completions", {"model": "gpt-4o-mini", "stream": True,
                                              "messages": [{"role": "user", "content": "Say hello"}]}),
    "openai.responses": ("/v1/responses", {"model": "gpt-4o-mini", "stream": True, "input": "Say hello"}),
    "anthropic.messages": ("/v1/messages", {"model": "claude-sonnet-4", "max_tokens": 64, "stream": True,
                                            "messages": [{"role": "user", "content": "Say hello"}]}),
}
AUTH = {
    "openai.chat": {"Authorization": f"Bearer {FAKE_OPENAI_KEY}"},
    "openai.responses": {"Authorization": f"Bearer {FAKE_OPENAI_KEY}"},
    "anthropic.messages": {"x-api-key": FAKE_ANTHROPIC_KEY, "anthropic-version": "2023-06-01"},
}


def post(conn: HttpConnection, api: str, headers: dict | None = None, **upload) -> bytes:
    path, body = APIS[api]
    response = conn.request("POST", path, body, {**AUTH[api], **(headers or {})}, **upload)
    assert response.status == 200, response.read()[:300]
    assert response.header("server-timing"), "Server-Timing header missing"
    return response.read()


def one_request(url: str, api: str, headers: dict | None = None, **upload) -> bytes:
    with HttpConnection(url) as conn:
        return post(conn, api, headers, **upload)


def assert_within(value: float | None, injected: float, what: str, rec: dict) -> None:
    """`value` is the injected delay, within JITTER_MS below and SLACK_MS above, plus however late
    the relay's event loop ran during the request (`rec`'s loop_lag_ms: on a loaded machine the
    relay notices arrivals late by that much, and says so)."""
    assert value is not None, f"{what} missing"
    lag = rec.get("loop_lag_ms") or 0
    assert injected - JITTER_MS <= value < injected + SLACK_MS + lag, \
        f"{what} = {value:.1f} ms, injected {injected} ms, the relay's loop {lag} ms late"


def settle(relay, min_s: float = 1.0, timeout: float = 8.0) -> None:
    """Wait until the relay answers out-of-scope requests in steady time, three in a row (within
    20 % or 5 ms of the quickest so far: behind a far link every answer pays its round trips),
    and has run `min_s`: just after start the relay can see arrivals late by tens of ms."""
    started, steady, quickest = time.time(), 0, float("inf")
    while (steady < 3 or time.time() - started < min_s) and time.time() - started < timeout:
        t = time.time()
        one_out_of_scope(relay.url())
        took = time.time() - t
        quickest = min(quickest, took)
        steady = steady + 1 if took <= quickest * 1.2 + 0.005 else 0


def one_out_of_scope(url: str) -> None:
    with HttpConnection(url) as conn:
        conn.request("GET", "/warm-up").read()


@pytest.fixture(scope="module")
def relay_at(shared_relay):
    """A settled relay in `mode`, one per mode and options for the module; trimming off, so
    that only the injected delay differs between hops."""
    settled = set()

    def start(mode: str, **options):
        relay = shared_relay(mode, relay_trim="false", **options)
        if id(relay) not in settled:
            settle(relay)
            settled.add(id(relay))
        return relay

    return start


@pytest.fixture(scope="module")
def far_fake_tls(module_fake_tls) -> Iterator[DelayingForwarder]:
    """The TLS fake behind a link of ONE_WAY_MS each way, for the module."""
    with DelayingForwarder("127.0.0.1", module_fake_tls.port, ONE_WAY_MS) as forwarder:
        yield forwarder


def test_slow_client_upload(fake, relay_at, rid):
    relay = relay_at(reverse_to(fake))
    for api in APIS:
        one_request(relay.url(), api, {"x-request-id": rid}, upload_pieces=4, upload_pause_s=UPLOAD_PAUSE_S)
    records = relay.log.of(rid, len(APIS))
    for api, rec in zip(APIS, records):
        assert rec["api"] == api
        assert_within(rec["phases"]["client_upload"], 3 * UPLOAD_PAUSE_S * 1000, f"{api} client_upload", rec)
        assert rec["verdict"] == phases.CLIENT_UPLOAD, rec


IDLE_BEFORE_REQUEST_S = 0.5


@pytest.mark.parametrize("strategy", ["eager", "lazy"])
def test_a_connection_opened_ahead_is_set_up_not_the_requests_wait(fake, relay_at, rid, strategy):
    # Codex opens its fallback connection before it writes the request (777 ms, seen): the
    # request's clock starts at its first byte, the idle connection is connection_setup.
    relay = relay_at(reverse_to(fake), connection_strategy=strategy)
    with HttpConnection(relay.url()) as conn:
        time.sleep(IDLE_BEFORE_REQUEST_S)  # the client's own pause, being measured
        post(conn, "openai.chat", {"x-request-id": rid})
    (rec,) = relay.log.of(rid)
    p = rec["phases"]
    assert_within(p["connection_setup"], IDLE_BEFORE_REQUEST_S * 1000, "connection_setup", rec)
    assert p["client_upload"] < JITTER_MS and rec["ttft_ms"] < SLACK_MS, p
    assert rec["verdict"] != phases.CLIENT_UPLOAD, rec


@pytest.mark.parametrize("strategy", ["eager", "lazy"])
def test_far_upstream_lands_in_upstream_tls(fake_tls, far_fake_tls, relay_at, rid, strategy):
    # Without the upstream pool: a new client connection, a new upstream connection.
    relay = relay_at(f"reverse:https://localhost:{far_fake_tls.port}@0", connection_strategy=strategy,
                     relay_upstream_pool=False)
    for api in APIS:
        one_request(relay.url(), api, {"x-request-id": rid})
    records = relay.log.of(rid, len(APIS))
    for api, rec in zip(APIS, records):
        assert rec["reused_connection"] is False
        assert_within(rec["phases"]["upstream_tls"], 2 * ONE_WAY_MS, f"{api} upstream_tls", rec)
        # The request's own round trip is in the wait, and the round trip estimate knows it.
        assert_within(rec["phases"]["upstream_wait"], 2 * ONE_WAY_MS, f"{api} upstream_wait", rec)
        assert_within(rec["rtt_ms"], 2 * ONE_WAY_MS, f"{api} rtt_ms", rec)
        # The link as one hop: its handshake and the request's round trip, a round trip each.
        assert rec["verdict"] == phases.UPSTREAM_NETWORK, rec
        if strategy == "eager":
            assert rec["marks"]["upstream_connect_start"] < 0  # opened before the head was read
        else:
            assert rec["marks"]["upstream_connect_start"] >= rec["marks"]["forwarded"]


def test_reused_connection_has_no_connect_or_tls(fake_tls, far_fake_tls, relay_at, rid):
    relay = relay_at(f"reverse:https://localhost:{far_fake_tls.port}@0", connection_strategy="eager",
                     relay_upstream_pool=False)
    with HttpConnection(relay.url()) as conn:
        for api in APIS:
            post(conn, api, {"x-request-id": rid})
    first, *reused = relay.log.of(rid, len(APIS))
    assert first["reused_connection"] is False and "upstream_tls" in first["phases"]
    for rec in reused:
        assert rec["reused_connection"] is True
        assert not {"upstream_connect", "upstream_tls"} & set(rec["phases"])
        assert not {"upstream_connect_start", "upstream_tcp", "upstream_tls"} & set(rec["marks"])
        # Far, not slow: the remembered round trip explains the wait.
        assert rec["verdict"] == phases.UPSTREAM_NETWORK, rec


@pytest.mark.parametrize("knob, phase", [("prefill-ms", "head_to_first_token"), ("head-delay-ms", "upstream_wait")])
def test_upstream_wait(fake, relay_at, rid, knob, phase):
    relay = relay_at(reverse_to(fake))
    for api in APIS:
        one_request(relay.url(), api, {f"x-fake-{knob}": str(PREFILL_MS), "x-request-id": rid})
    records = relay.log.of(rid, len(APIS))
    for api, rec in zip(APIS, records):
        assert_within(rec["phases"][phase], PREFILL_MS, f"{api} {phase}", rec)
        assert_within(rec["ttft_ms"], PREFILL_MS, f"{api} ttft", rec)
        # The upstream's own wait, and no other hop: while the relay is still learning this model it
        # blames nobody for it (`ok`, learning), queueing once it has learned its first token takes
        # a few ms for this prompt.
        assert rec["verdict"] in (phases.OK, phases.UPSTREAM_WAIT, phases.UPSTREAM_QUEUEING), rec
        if rec["verdict"] == phases.OK:
            assert "learning this upstream · model" in rec["verdict_detail"], rec


def test_mid_stream_stall(fake, relay_at, rid):
    relay = relay_at(reverse_to(fake))
    for api in APIS:
        gate = fake.hold_before_chunk(6)  # well after the first token for every API, with 8 pieces

        def stall(gate=gate) -> None:
            fake.wait_chunk_sent(5)
            time.sleep(STALL_S)  # the stall being measured, not a sync
            gate.set()

        staller = threading.Thread(target=stall)
        staller.start()
        one_request(relay.url(), api, {"x-fake-chunks": "8", "x-request-id": rid})
        staller.join()
    records = relay.log.of(rid, len(APIS))
    for api, rec in zip(APIS, records):
        assert_within(rec["max_gap_ms"], STALL_S * 1000, f"{api} max_gap_ms", rec)
        assert rec["ttft_ms"] < STALL_S * 1000
        assert rec["verdict"] == phases.STREAM_STALL, rec


def test_client_abort_is_recorded_once(fake, relay_at, rid):
    relay = relay_at(reverse_to(fake))
    fake.hold_before_chunk(6)  # never released: the client goes away while the stream waits
    path, body = APIS["openai.chat"]
    conn, response = request("POST", relay.url() + path, body,
                             AUTH["openai.chat"] | {"x-fake-chunks": "8", "x-request-id": rid})
    chunks, read = response.chunks(), b""
    while b'"delta":{"content":"' not in read:  # the first token, not the role chunk before it
        read += next(chunks).data
    conn.close()
    # The relay saw the client go and let go of the upstream: the fake's reply ended so (every
    # reply ended: settling a relay the module had not started sent some before this one).
    assert fake.wait_finished(len(fake.sent)) and fake.sent[-1].outcome == "client_closed"
    (rec,) = relay.log.of(rid)  # and once: a second record fails the module once the relay stopped
    assert rec["client_aborted"] is True
    assert rec["verdict"] == "client aborted in stream", rec


def test_records_hold_no_secrets_and_one_line_per_flow(fake, relay_at, rid):
    relay = relay_at(reverse_to(fake))
    secret_header = "x-custom-secret"
    for api in APIS:
        one_request(relay.url(), api, {secret_header: "HEADER-VALUE-SHOULD-NOT-LEAK", "x-request-id": rid})
    one_request(relay.url(), "openai.chat", {"x-request-id": rid}, upload_pieces=2, upload_pause_s=0.05)
    records = relay.log.of(rid, len(APIS) + 1)
    assert len({r["id"] for r in records}) == len(records)
    raw = relay.log.path.read_bytes()  # every record the relay wrote so far, this test's among them
    for needle in (FAKE_OPENAI_KEY, FAKE_ANTHROPIC_KEY, "HEADER-VALUE-SHOULD-NOT-LEAK", "Say hello", "Bearer"):
        assert needle.encode() not in raw
    for rec in records:
        assert rec["schema"] == 1 and rec["status"] == 200 and rec["stream"] is True
        assert rec["usage"] and rec["usage"]["output_tokens"] > 0
        assert rec["chunks"] > 0 and rec["ttft_ms"] is not None


@pytest.mark.parametrize("strategy", ["eager", "lazy"])
def test_regular_proxy_mode_https_through_connect(fake_tls, far_fake_tls, relay_at, rid, strategy):
    relay = relay_at("regular@0", connection_strategy=strategy)
    with HttpConnection(f"https://localhost:{far_fake_tls.port}", proxy=relay.url(), ca=relay.ca_pem) as conn:
        post(conn, "openai.chat", {"x-request-id": rid})
        post(conn, "openai.chat", {"x-request-id": rid})
    first, second = relay.log.of(rid, 2)
    assert first["upstream"] == f"localhost:{far_fake_tls.port}"
    if strategy == "lazy":
        assert_within(first["phases"]["upstream_tls"], 2 * ONE_WAY_MS, "upstream_tls", first)
        assert first["verdict"] == phases.UPSTREAM_NETWORK, first  # the link, as one hop
    else:
        # Eager: mitmproxy connected upstream during the client's own TLS handshake, before the
        # request's first byte: that handshake is the connection's set-up, not the request's wait.
        m = first["marks"]
        assert_within(m["upstream_tls"] - m["upstream_tcp"], 2 * ONE_WAY_MS, "upstream TLS (marks)", first)
        assert m["upstream_tls"] < m["client_tls"] < 0
        assert first["phases"]["connection_setup"] >= 2 * ONE_WAY_MS - JITTER_MS, first
        assert first["phases"]["upstream_tls"] == 0.0
        assert first["verdict"] == phases.UPSTREAM_NETWORK, first
    assert second["reused_connection"] is True and second["verdict"] == phases.UPSTREAM_NETWORK, second
