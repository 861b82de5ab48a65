"""Timing accuracy through a real mitmdump: inject a known delay into one hop at a
time and check the record puts it in the right phase and the verdict names it.

Delays are a few hundred ms so that noise on a busy machine cannot decide: each
check is `injected - JITTER_MS <= phase < injected + SLACK_MS`. JITTER_MS allows
for what the relay cannot see: an interval injected by the client or the fake is
measured between two arrivals at the relay, and a busy event loop can notice the
first one late (an accept, a chunk) by a few ms.
"""

from __future__ import annotations

import threading
import time
from pathlib import Path

import orjson
import pytest

from ttft_relay.timing import phases
from tests.conftest import FAKE_ANTHROPIC_KEY, FAKE_OPENAI_KEY, reverse_to
from tests.fakes.client import HttpConnection, request
from tests.fakes.forwarder import DelayingForwarder

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


def read_log(path: Path, count: int, timeout: float = 10.0) -> list[dict]:
    """The log's records once it holds `count` (and, a moment later, still exactly `count`)."""
    deadline = time.time() + timeout
    while time.time() < deadline:
        lines = path.read_bytes().splitlines() if path.exists() else []
        if len(lines) >= count:
            time.sleep(0.2)  # a duplicate record would show up now
            return [orjson.loads(line) for line in path.read_bytes().splitlines()]
        time.sleep(0.05)
    raise AssertionError(f"{path} has {len(lines)} records, expected {count}")


def post(conn: HttpConnection, api: str, headers: dict | None = None, **upload) -> bytes:
    path, body = APIS[api]
    response = conn.request("POST", path, body, {**AUTH[api], **(headers or {})}, **upload)
    assert response.status == 200, response.read()[:300]
    assert response.header("server-timing"), "Server-Timing header missing"
    return response.read()


def one_request(url: str, api: str, headers: dict | None = None, **upload) -> bytes:
    with HttpConnection(url) as conn:
        return post(conn, api, headers, **upload)


def assert_within(value: float | None, injected: float, what: str) -> None:
    assert value is not None, f"{what} missing"
    assert injected - JITTER_MS <= value < injected + SLACK_MS, f"{what} = {value:.1f} ms, injected {injected} ms"


@pytest.fixture
def log(tmp_path) -> Path:
    return tmp_path / "timing.jsonl"  # where conftest's start_relay points relay_timing_log


def settle(relay, min_s: float = 1.0, timeout: float = 8.0) -> None:
    """Wait until the relay answers out-of-scope requests quickly, three in a row, and has run
    `min_s`: just after start a background thread loading tokenizers competes for the
    interpreter, and the relay sees arrivals late by tens of ms."""
    started, fast = time.time(), 0
    while (fast < 3 or time.time() - started < min_s) and time.time() - started < timeout:
        t = time.time()
        one_out_of_scope(relay.url())
        fast = fast + 1 if time.time() - t < 0.02 else 0


def one_out_of_scope(url: str) -> None:
    with HttpConnection(url) as conn:
        conn.request("GET", "/warm-up").read()


@pytest.fixture
def relay_at(start_relay):
    """A settled relay in `mode`; trimming off, so that only the injected delay differs between hops."""

    def start(mode: str, **options):
        relay = start_relay(mode, relay_trim="false", **options)
        settle(relay)
        return relay

    return start


def test_slow_client_upload(fake, relay_at, log):
    relay = relay_at(reverse_to(fake))
    for api in APIS:
        one_request(relay.url(), api, upload_pieces=4, upload_pause_s=UPLOAD_PAUSE_S)
    records = read_log(log, len(APIS))
    for api, rec in zip(APIS, records):
        assert rec["api"] == api
        assert_within(rec["phases"]["client_upload"], 3 * UPLOAD_PAUSE_S * 1000, f"{api} client_upload")
        assert rec["verdict"] == phases.CLIENT_UPLOAD, rec


@pytest.mark.parametrize("strategy", ["eager", "lazy"])
def test_far_upstream_lands_in_upstream_tls(fake_tls, relay_at, log, strategy):
    with DelayingForwarder("127.0.0.1", fake_tls.port, ONE_WAY_MS) as forwarder:
        relay = relay_at(f"reverse:https://localhost:{forwarder.port}@0", connection_strategy=strategy)
        for api in APIS:
            one_request(relay.url(), api)  # a new client connection: a new upstream connection
        records = read_log(log, len(APIS))
    for api, rec in zip(APIS, records):
        assert rec["reused_connection"] is False
        assert_within(rec["phases"]["upstream_tls"], 2 * ONE_WAY_MS, f"{api} upstream_tls")
        # The request's own round trip is in the wait, and the round trip estimate knows it.
        assert_within(rec["phases"]["upstream_wait"], 2 * ONE_WAY_MS, f"{api} upstream_wait")
        assert_within(rec["rtt_ms"], 2 * ONE_WAY_MS, f"{api} rtt_ms")
        assert rec["verdict"] == phases.UPSTREAM_TLS, rec
        if strategy == "eager":
            assert rec["marks"]["upstream_connect_start"] < 0  # opened before the head was read
        else:
            assert rec["marks"]["upstream_connect_start"] >= rec["marks"]["forwarded"]


def test_reused_connection_has_no_connect_or_tls(fake_tls, relay_at, log):
    with DelayingForwarder("127.0.0.1", fake_tls.port, ONE_WAY_MS) as forwarder:
        relay = relay_at(f"reverse:https://localhost:{forwarder.port}@0")
        with HttpConnection(relay.url()) as conn:
            for api in APIS:
                post(conn, api)
        records = read_log(log, len(APIS))
    first, *reused = records
    assert first["reused_connection"] is False and "upstream_tls" in first["phases"]
    for rec in reused:
        assert rec["reused_connection"] is True
        assert not {"upstream_connect", "upstream_tls"} & set(rec["phases"])
        assert not {"upstream_connect_start", "upstream_tcp", "upstream_tls"} & set(rec["marks"])
        # Far, not slow: the remembered round trip explains the wait.
        assert rec["verdict"] == phases.UPSTREAM_NETWORK, rec


@pytest.mark.parametrize("knob, phase", [("prefill-ms", "head_to_first_token"), ("head-delay-ms", "upstream_wait")])
def test_upstream_wait(fake, relay_at, log, knob, phase):
    relay = relay_at(reverse_to(fake))
    for api in APIS:
        one_request(relay.url(), api, {f"x-fake-{knob}": str(PREFILL_MS)})
    records = read_log(log, len(APIS))
    for api, rec in zip(APIS, records):
        assert_within(rec["phases"][phase], PREFILL_MS, f"{api} {phase}")
        assert_within(rec["ttft_ms"], PREFILL_MS, f"{api} ttft")
        assert rec["verdict"] == phases.UPSTREAM_WAIT, rec


def test_mid_stream_stall(fake, relay_at, log):
    relay = relay_at(reverse_to(fake))
    for api in APIS:
        gate = fake.hold_before_chunk(6)  # well after the first token for every API, with 8 pieces

        def stall(gate=gate) -> None:
            fake.wait_chunk_sent(5)
            time.sleep(STALL_S)
            gate.set()

        staller = threading.Thread(target=stall)
        staller.start()
        one_request(relay.url(), api, {"x-fake-chunks": "8"})
        staller.join()
    records = read_log(log, len(APIS))
    for api, rec in zip(APIS, records):
        assert_within(rec["max_gap_ms"], STALL_S * 1000, f"{api} max_gap_ms")
        assert rec["ttft_ms"] < STALL_S * 1000
        assert rec["verdict"] == phases.STREAM_STALL, rec


def test_client_abort_is_recorded_once(fake, relay_at, log):
    relay = relay_at(reverse_to(fake))
    gate = fake.hold_before_chunk(6)
    path, body = APIS["openai.chat"]
    conn, response = request("POST", relay.url() + path, body, AUTH["openai.chat"] | {"x-fake-chunks": "8"})
    next(response.chunks())
    conn.close()
    time.sleep(0.3)
    gate.set()
    (rec,) = read_log(log, 1)
    assert rec["client_aborted"] is True
    assert rec["verdict"] == "client aborted in stream", rec


def test_records_hold_no_secrets_and_one_line_per_flow(fake, relay_at, log):
    relay = relay_at(reverse_to(fake))
    secret_header = "x-custom-secret"
    for api in APIS:
        one_request(relay.url(), api, {secret_header: "HEADER-VALUE-SHOULD-NOT-LEAK"})
    one_request(relay.url(), "openai.chat", upload_pieces=2, upload_pause_s=0.05)
    records = read_log(log, len(APIS) + 1)
    assert len({r["id"] for r in records}) == len(records)
    raw = log.read_bytes()
    for needle in (FAKE_OPENAI_KEY, FAKE_ANTHROPIC_KEY, "HEADER-VALUE-SHOULD-NOT-LEAK", "Say hello", "Bearer"):
        assert needle.encode() not in raw
    for rec in records:
        assert rec["schema"] == 1 and rec["status"] == 200 and rec["stream"] is True
        assert rec["usage"] and rec["usage"]["output_tokens"] > 0
        assert rec["chunks"] > 0 and rec["ttft_ms"] is not None


@pytest.mark.parametrize("strategy", ["eager", "lazy"])
def test_regular_proxy_mode_https_through_connect(fake_tls, relay_at, log, strategy):
    with DelayingForwarder("127.0.0.1", fake_tls.port, ONE_WAY_MS) as forwarder:
        relay = relay_at("regular@0", connection_strategy=strategy)
        with HttpConnection(f"https://localhost:{forwarder.port}", proxy=relay.url(), ca=relay.ca_pem) as conn:
            post(conn, "openai.chat")
            post(conn, "openai.chat")
        first, second = read_log(log, 2)
    assert first["upstream"] == f"localhost:{forwarder.port}"
    assert_within(first["phases"]["upstream_tls"], 2 * ONE_WAY_MS, "upstream_tls")
    assert first["verdict"] == phases.UPSTREAM_TLS, first
    assert second["reused_connection"] is True and second["verdict"] == phases.UPSTREAM_NETWORK, second
