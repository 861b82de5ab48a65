"""The upstream pool through a real mitmdump: a new client connection takes an open upstream
connection, never another credential's, and one the upstream closed is replaced.

The far-link cases put the HTTPS fake behind a delaying link (ONE_WAY_MS each way): a new
client connection that had to connect upstream would pay a TLS handshake (one more round
trip) before its request; with the pool its first token is that of a request on a kept-alive
connection. Ratios only, with room for a loaded machine: a handshake adds 2 x ONE_WAY_MS
to a first token of about 2 x ONE_WAY_MS + the prefill.
"""

from __future__ import annotations

import contextlib
import statistics
import subprocess
import time
from collections.abc import Iterator

import pytest

from tests.conftest import FAKE_OPENAI_KEY, reverse_to
from tests.test_far_links_e2e import relay_in
from ttft_relay.testing.fakes.client import HttpConnection
from ttft_relay.testing.fakes.forwarder import DelayingForwarder
from ttft_relay.testing.fakes.upstream import FakeUpstream

ONE_WAY_MS = 100
PREFILL_MS = 50
REQUESTS = 6
ATTEMPTS = 3
CHAT = ("/v1/chat/completions", {"model": "gpt-4o-mini", "stream": True,
                                 "messages": [{"role": "user", "content": "Say hello"}]})


def first_token_ms(conn: HttpConnection, rid: str, key: str = FAKE_OPENAI_KEY) -> float:
    """From the request's last byte to the first body chunk, as the client sees it."""
    path, body = CHAT
    response = conn.request("POST", path, body, {"Authorization": f"Bearer {key}", "x-request-id": rid,
                                                 "x-fake-prefill-ms": str(PREFILL_MS)})
    assert response.status == 200, response.read()[:300]
    chunks = list(response.chunks())
    assert response.complete and b"[DONE]" in b"".join(c.data for c in chunks)
    return (chunks[0].at - response.request_sent_at) * 1000


def new_connection_request(url: str, rid: str, key: str = FAKE_OPENAI_KEY) -> float:
    with HttpConnection(url) as conn:
        return first_token_ms(conn, rid, key)


@pytest.fixture
def far_fake_tls(fake_tls) -> Iterator[DelayingForwarder]:
    with DelayingForwarder("127.0.0.1", fake_tls.port, ONE_WAY_MS) as forwarder:
        yield forwarder


@pytest.mark.parametrize("keys", [False, True], ids=["open", "keyed"])
def test_a_new_client_connection_is_as_quick_as_a_kept_alive_one_on_a_far_link(far_fake_tls, start_relay, rid, keys,
                                                                               monkeypatch):
    options = {}
    key = FAKE_OPENAI_KEY
    if keys:
        key = "relay-key-" + "x" * 32
        monkeypatch.setenv("TTFT_TEST_RELAY_KEY", key)
        monkeypatch.setenv("TTFT_TEST_UPSTREAM_KEY", FAKE_OPENAI_KEY)
        options = {"relay_access_keys": "env:TTFT_TEST_RELAY_KEY",
                   "relay_upstream_keys": "localhost=env:TTFT_TEST_UPSTREAM_KEY"}
    relay = start_relay(f"reverse:https://localhost:{far_fake_tls.port}@0", relay_trim="false",
                        relay_upstream_pool="true", **options)
    ratios = []
    for attempt in range(ATTEMPTS):  # a loaded machine can be slow by chance; a handshake, every time
        with HttpConnection(relay.url()) as kept:  # the floor: a request on a connection kept alive
            first_token_ms(kept, rid, key)
            kept_alive = [first_token_ms(kept, rid, key) for _ in range(REQUESTS)]
        fresh = [new_connection_request(relay.url(), rid, key) for _ in range(REQUESTS)]
        records = relay.log.of(rid, (attempt + 1) * (1 + 2 * REQUESTS))
        new_ones = records[-REQUESTS:]
        assert all(rec["reused_connection"] is True for rec in new_ones), new_ones
        assert not any({"upstream_connect", "upstream_tls"} & set(rec["phases"]) for rec in new_ones), new_ones
        # The pool's handshakes still tell the far upstream's round trip.
        assert all(rec["rtt_ms"] and rec["rtt_ms"] > ONE_WAY_MS for rec in new_ones), new_ones
        ratios.append(statistics.median(fresh) / statistics.median(kept_alive))
        if ratios[-1] <= 1.1:
            return
    pytest.fail(f"new connections' first token over kept-alive ones' in {ATTEMPTS} rounds: {ratios}")


def test_a_client_connection_the_pool_cannot_serve_gets_its_connection_opened_as_it_connects(far_fake_tls, start_relay,
                                                                                             rid):
    """A miss costs no more than without the pool: where the pool holds nothing for a new
    client connection, the upstream connection is opened as the client connects (as
    mitmproxy's eager connect would), so a client that connects ahead of its request (SDK
    pools, an agent starting its turn, a TLS handshake with the relay) finds it ready. The
    pool used to open it only at the request's head: two more far round trips (TCP, TLS)
    on that first token, and under load every client of a burst larger than the pool waited so."""
    relay = start_relay(f"reverse:https://localhost:{far_fake_tls.port}@0", relay_trim="false",
                        relay_upstream_pool="true", relay_upstream_pool_warm="0", termlog_verbosity="debug")
    ratios = []
    # Every client keeps its connection, and so its upstream one, to the end: the pool holds none.
    held: list[HttpConnection] = []
    with contextlib.ExitStack() as clients:
        def connect() -> HttpConnection:
            held.append(clients.enter_context(HttpConnection(relay.url())))
            relay.wait_for_lines(r"opened ahead of a request", len(held))
            return held[-1]

        for attempt in range(ATTEMPTS):
            kept = connect()
            first_token_ms(kept, rid)
            kept_alive = [first_token_ms(kept, rid) for _ in range(REQUESTS)]
            fresh = [first_token_ms(connect(), rid) for _ in range(REQUESTS)]  # each once its connection is open
            new_ones = relay.log.of(rid, (attempt + 1) * (1 + 2 * REQUESTS))[-REQUESTS:]
            # Its own connect (made for it, before its request: no part of its first token).
            assert all(rec["reused_connection"] is False and rec["status"] == 200 for rec in new_ones), new_ones
            ratios.append(statistics.median(fresh) / statistics.median(kept_alive))
            if ratios[-1] <= 1.1:
                return
    pytest.fail(f"new connections' first token over kept-alive ones' in {ATTEMPTS} rounds: {ratios}")


def test_without_the_pool_each_new_client_connection_connects(far_fake_tls, start_relay, rid):
    relay = start_relay(f"reverse:https://localhost:{far_fake_tls.port}@0", relay_trim="false",
                        relay_upstream_pool="false")
    for _ in range(2):
        new_connection_request(relay.url(), rid)
    records = relay.log.of(rid, 2)
    assert [rec["reused_connection"] for rec in records] == [False, False]
    assert records[0]["upstream_connection"] != records[1]["upstream_connection"]
    assert all("upstream_tls" in rec["phases"] for rec in records)


def test_client_connections_share_one_upstream_connection_per_credential(fake, start_relay, rid):
    relay = start_relay(reverse_to(fake), relay_trim="false", relay_upstream_pool="true", relay_upstream_pool_warm="0")
    for key in ("sk-alice-1", "sk-alice-1", "sk-bob-2", "sk-alice-1", "sk-bob-2"):
        new_connection_request(relay.url(), rid, key)
    alice1, alice2, bob1, alice3, bob2 = (rec["upstream_connection"] for rec in relay.log.of(rid, 5))
    assert alice1 == alice2 == alice3  # one connection, kept from client connection to client connection
    assert bob1 == bob2 and bob1 != alice1  # never given to another credential
    assert len({r.conn_id for r in fake.received}) == 2, "two upstream connections in all"


def test_an_upstream_connection_the_upstream_closed_is_replaced(far_fake_tls, start_relay, rid):
    relay = start_relay(f"reverse:https://localhost:{far_fake_tls.port}@0", relay_trim="false",
                        relay_upstream_pool="true", termlog_verbosity="debug")
    new_connection_request(relay.url(), rid)
    relay.wait_for_output(r"upstream connection \S+ pooled")
    before = far_fake_tls.connections
    far_fake_tls.hang_up()  # as an upstream's idle timeout: every idle connection closed
    relay.wait_for_output(r"left the pool: closed by the upstream")
    for _ in range(3):
        new_connection_request(relay.url(), rid)  # no failure
    records = relay.log.of(rid, 4)
    assert all(rec["status"] == 200 and rec["error"] is None for rec in records), records
    assert records[1]["upstream_connection"] != records[0]["upstream_connection"]
    deadline = time.monotonic() + 10
    while far_fake_tls.connections <= before and time.monotonic() < deadline:
        time.sleep(0.05)  # polling a count the forwarder's thread updates, bounded by the deadline
    assert far_fake_tls.connections > before, "the pool opened new connections"


def test_a_clients_connection_close_ends_its_hop_only(fake, start_relay, rid):
    relay = start_relay(reverse_to(fake), relay_trim="false", relay_upstream_pool="true", relay_upstream_pool_warm="0")
    path, body = CHAT
    for _ in range(2):
        with HttpConnection(relay.url()) as conn:
            response = conn.request("POST", path, body, {"Authorization": f"Bearer {FAKE_OPENAI_KEY}",
                                                         "x-request-id": rid, "Connection": "close"})
            assert response.status == 200 and b"[DONE]" in response.read()
            assert conn.sock.recv(1) == b""  # the relay closed the client's connection, as it asked
    first, second = fake.received
    assert first.header("connection") is None and second.header("connection") is None  # hop-by-hop: not sent on
    assert first.conn_id == second.conn_id  # so the upstream kept its connection, for the next client
    assert [rec["reused_connection"] for rec in relay.log.of(rid, 2)] == [False, True]


def test_a_request_its_pooled_connection_dropped_before_any_answer_is_sent_once_more(fake, start_relay, rid):
    """The keep-alive race: the upstream closes a pooled connection just as a request arrives on
    it (its idle timeout, a restart; the fake's `keepalive_requests`), before any byte of an
    answer. Nothing of the request reached the upstream's application, so the pool sends it
    once more on a connection opened for it: the client gets its answer, not a 502."""
    relay = start_relay(reverse_to(fake), relay_trim="false", relay_upstream_pool="true",
                        relay_upstream_pool_warm="0", termlog_verbosity="debug")
    path, body = CHAT
    headers = {"Authorization": f"Bearer {FAKE_OPENAI_KEY}", "x-request-id": rid, "x-fake-keepalive-requests": "1"}
    statuses = []
    for n in range(2):
        with HttpConnection(relay.url()) as conn:
            response = conn.request("POST", path, body, headers)
            response.read()
            statuses.append(response.status)
        if n == 0:
            relay.wait_for_output(r"upstream connection \S+ pooled")  # the next client takes it
    assert statuses == [200, 200]
    first, second = relay.log.of(rid, 2)
    assert second["status"] == 200 and second["error"] is None
    assert second["upstream_connection"] != first["upstream_connection"], "sent again on a new connection"
    assert len(fake.received) == 2, "the dropped request never reached the fake's answering"
    assert relay.wait_for_output(r"closed before its answer .* sending the request once more")


FIRST_TOKEN_TIMEOUT_S = 40
"""What a request on a dead connection waited for without the pool's silence bound: then a 504."""


@pytest.mark.parametrize(("when", "silence_s"), [("idle", 3), pytest.param("in flight", 9, marks=pytest.mark.slow)])
def test_a_pooled_connection_whose_path_went_silent_is_given_up_within_the_silence_bound(
        far_link, certs, confdir, tmp_path, rid, when, silence_s):
    """A NAT or firewall on the way that forgets a kept connection (its table flushed, an idle
    timeout shorter than the pool's) black-holes it: no reset, no answer, and the kernel would
    retransmit for about 15 minutes. The pool's sockets have keepalive and TCP_USER_TIMEOUT
    (`relay_upstream_pool_silence`): an idle one is dropped from the pool, and a request sent
    on one before any answer byte fails within the bound and goes once more on a new
    connection, long before its first-token timeout's 504. The link (`FarLink.forget`) drops
    every packet of the connections it carried so far; new ones pass. The in-flight case's
    bound is longer than the time its request takes to arrive (the idle probes start a
    third of it after the last answer)."""
    far = far_link(delay_ms=5)
    with far.far.entered():
        fake = FakeUpstream(tls=True, certs=certs, host=far.far.ip).start()
    try:
        relay = relay_in(far.near, [f"reverse:https://{far.far.ip}:{fake.port}@0"], confdir, tmp_path / "timing.jsonl",
                         ssl_insecure=True, relay_upstream_pool=True, relay_upstream_pool_warm=0,
                         relay_upstream_pool_silence=silence_s, relay_first_token_timeout=FIRST_TOKEN_TIMEOUT_S,
                         termlog_verbosity="debug")
        with relay, far.near.entered():
            with HttpConnection(relay.url(), timeout=2 * FIRST_TOKEN_TIMEOUT_S) as conn:
                first_token_ms(conn, rid)
            relay.wait_for_output(r"upstream connection \S+ pooled")
            far.forget()  # the pooled connection's path: silent from now on
            began = time.monotonic()
            if when == "idle":
                relay.wait_for_output(r"left the pool: connection lost", timeout=4 * silence_s)
            with HttpConnection(relay.url(), timeout=2 * FIRST_TOKEN_TIMEOUT_S) as conn:
                first_token_ms(conn, rid)
            answered_s = time.monotonic() - began
            first, second = relay.log.of(rid, 2)
    finally:
        fake.stop()
    assert second["status"] == 200 and second["error"] is None, second
    assert second["upstream_connection"] != first["upstream_connection"], "answered on a new connection"
    assert answered_s < 3 * silence_s < FIRST_TOKEN_TIMEOUT_S, answered_s
    assert [r.conn_id for r in fake.received] == [1, 2], "the lost request never reached the upstream"
    if when == "in flight":
        assert relay.wait_for_output(r"closed before its answer .* sending the request once more")


def test_the_pools_connections_take_the_congestion_control_asked_for(fake, start_relay, rid):
    # reno: every Linux has it and allows it to anyone (the default, BBR, needs the kernel's leave).
    relay = start_relay(reverse_to(fake), relay_trim="false", relay_upstream_pool_warm="0",
                        relay_upstream_pool_congestion="reno", termlog_verbosity="debug")
    new_connection_request(relay.url(), rid)
    relay.wait_for_output(r"upstream connection \S+ pooled")
    sockets = subprocess.run(["ss", "-tin", "dst", f"127.0.0.1:{fake.port}"], capture_output=True, text=True,
                             check=True).stdout
    controls = [line.split()[0] for line in sockets.splitlines() if line[:1].isspace() and line.strip()]
    assert controls == ["reno"], sockets  # the relay's one connection to the fake, the pool's


def test_an_upstream_whose_kept_connections_die_is_not_given_them_again(fake, start_relay, rid):
    """An upstream that advertises keep-alive and closes each kept connection as the next
    request comes (the fake's `keepalive_requests`; the same as one that closes it shortly
    after each answer): the first reuse loses that race and its request goes once more on a
    new connection; the pool learns that this upstream's kept connections die at once, and
    the next clients go on new connections without a failed reuse first (with the pool off:
    every client)."""
    relay = start_relay(reverse_to(fake), relay_trim="false", relay_upstream_pool="true",
                        relay_upstream_pool_warm="0", termlog_verbosity="debug")
    path, body = CHAT
    headers = {"Authorization": f"Bearer {FAKE_OPENAI_KEY}", "x-request-id": rid, "x-fake-keepalive-requests": "1"}
    clients = 5
    for _ in range(clients):
        with HttpConnection(relay.url()) as conn:
            response = conn.request("POST", path, body, headers)
            response.read()
            assert response.status == 200
    records = relay.log.of(rid, clients)
    assert all(rec["status"] == 200 and rec["error"] is None for rec in records), records
    retries = relay.text().count("sending the request once more")
    assert retries == 1, f"{retries} requests paid a lost reuse race, of {clients}"
    assert relay.wait_for_output(r"not reused .* until none died")
    assert len(fake.received) == clients and len({r.conn_id for r in fake.received}) == clients
