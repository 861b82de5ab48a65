"""A saturated relay names itself: a real mitmdump whose event loop a CPU hog keeps busy.

The hog (ttft_relay/testing/fakes/hog.py) takes the loop for HOG_MS out of every HOG_EVERY_MS, as
other streams would on a saturated relay: new connections wait in the accept queue
and the upstream's first token in its socket until the loop comes round. The client
times its own first token; the relay's record must match it (the kernel's view of
when bytes arrived, from TCP_INFO) and the verdict must name the relay. Without the
self-watch's marks the same record is far short of what the client saw: that is
what makes the test able to fail.
"""

from __future__ import annotations

import statistics
import sys
import time
import uuid

import pytest

from ttft_relay.timing import phases
from tests.conftest import reverse_to
from ttft_relay.testing.fakes.client import HttpConnection, stream_post
from ttft_relay.testing.harness import REPO, MitmdumpProcess, metrics_url, scrape, total

pytestmark = pytest.mark.skipif(not sys.platform.startswith("linux"), reason="TCP_INFO is Linux's")

HOG_MS, HOG_EVERY_MS = 250, 300
REQUESTS = 8
BODY = {"model": "gpt-4o-mini", "stream": True, "messages": [{"role": "user", "content": "Say hello"}]}


def client_first_token_ms(url: str, request_id: str) -> float:
    start = time.time()
    for chunk in stream_post(url + "/v1/chat/completions", BODY, {"x-request-id": request_id}):
        if b"Hello" in chunk.data:
            first = chunk.at
            break
    return (first - start) * 1000


def test_a_saturated_relay_says_so_and_its_first_token_is_the_clients(fake, tmp_path, confdir):
    fake.behaviour.prefill_ms = 50
    fake.behaviour.chunks = 5
    log = tmp_path / "timing.jsonl"
    relay = MitmdumpProcess(
        [reverse_to(fake)], confdir,
        # Without the upstream pool: each request on a connection of its own (on a connection kept
        # for long, loopback's delayed ACKs draw tail-loss probes, which count as retransmits).
        options={"relay_timing_log": log, "relay_metrics_listen": "127.0.0.1:0", "relay_timing_console": "false",
                 "relay_upstream_pool": "false"},
        extra_args=["-s", str(REPO / "ttft_relay" / "testing" / "fakes" / "hog.py")],
        env={"TTFT_HOG_MS": str(HOG_MS), "TTFT_HOG_EVERY_MS": str(HOG_EVERY_MS)},
    )
    with relay:
        relay.wait_for_output(r"Loading script .*hog\.py")
        client = {}
        for i in range(REQUESTS):
            # Requests land at different points of the hog's cycle: some wait to be
            # accepted, some for their first token to be read (injected timing, not a sync).
            time.sleep(i * HOG_EVERY_MS / REQUESTS / 1000)
            rid = uuid.uuid4().hex
            client[rid] = client_first_token_ms(relay.url(), rid)
        records = {r["request_id"]: r for r in relay.log.wait(REQUESTS)}
        samples = scrape(metrics_url(relay))
    assert len(relay.log.records()) == REQUESTS  # once stopped: no flow recorded twice

    assert "Addon error" not in relay.text()
    ours = {rid: records[rid]["ttft_ms"] for rid in client}
    # The same records as the relay would have made them without its self-watch.
    blind_phases = {rid: phases.compute({k: v for k, v in records[rid]["marks"].items()
                                         if k not in phases.ARRIVAL_MARKS}, tokens_expected=True) for rid in client}
    blind = {rid: p["ttft"] for rid, p in blind_phases.items()}
    blind_verdicts = [phases.verdict(p, rtt_ms=records[rid]["rtt_ms"]) for rid, p in blind_phases.items()]
    details = {rid[:6]: (round(client[rid]), round(ours[rid]), round(blind[rid]), records[rid]["verdict"])
               for rid in client}
    # The client waited for the hog: far more than the fake's 50 ms prefill.
    assert statistics.median(client.values()) > 150, details
    # The record's own first token is what the client saw, within ±10 % (per request
    # within 10 % plus the kernel clock's resolution).
    assert statistics.median(ours.values()) == pytest.approx(statistics.median(client.values()), rel=0.10), details
    for rid in client:
        assert abs(ours[rid] - client[rid]) <= 0.10 * client[rid] + 10, details
    # Without the kernel's view the waiting was invisible: the wait to be accepted went
    # missing from the first token, the wait for the token to be read was blamed on the upstream.
    assert any(blind[rid] < 0.8 * client[rid] for rid in client), details
    assert blind_verdicts.count(phases.UPSTREAM_WAIT) >= REQUESTS // 2, blind_verdicts
    saturated = [r for r in records.values() if r["verdict"] == phases.RELAY_SATURATED]
    assert len(saturated) >= REQUESTS * 3 // 4, details
    assert all(r["loop_lag_ms"] >= HOG_MS * 0.8 for r in saturated), [r["loop_lag_ms"] for r in saturated]
    # Both sockets found and read: loopback, so no retransmits (and RTTs of microseconds).
    assert all(r["client_rtt_ms"] is not None and r["client_retransmits"] == 0 for r in records.values())
    assert all(r["upstream_tcp_rtt_ms"] is not None and r["upstream_retransmits"] == 0 for r in records.values())
    # The lag as a metric: samples, some of them as late as the hog holds the loop.
    count = total(samples, "ttft_relay_event_loop_lag_seconds_count")
    late = count - total(samples, "ttft_relay_event_loop_lag_seconds_bucket", le="0.1")
    assert count > 0 and late > 0, (count, late)
    assert any(k.startswith("ttft_relay_accept_queue_connections[") for k in samples)
    # The collector's pauses: in every record (the longest of 1 ms or more, 0.0 if none) and as a metric.
    assert all(isinstance(r["gc_pause_ms"], float) for r in records.values())
    assert total(samples, "ttft_relay_gc_pause_seconds_count") > 0
    assert total(samples, "ttft_relay_relay_queue_seconds_count") == REQUESTS


KEPT_REQUESTS, KEPT_EVERY_S = 40, 0.02


def test_healthy_kept_alive_requests_on_loopback_are_never_called_client_network(fake, start_relay, tmp_path):
    # On a kept connection the kernel's smoothed RTT takes samples the client's delayed
    # acknowledgements and a busy machine inflate (milliseconds on loopback, next to
    # phases of a millisecond or two); the path's own round trip is microseconds.
    fake.behaviour.prefill_ms = 0
    fake.behaviour.chunks = 3
    relay = start_relay(reverse_to(fake), relay_timing_console=False)
    with HttpConnection(relay.url()) as conn:
        for i in range(KEPT_REQUESTS):
            response = conn.request("POST", "/v1/chat/completions", BODY, {"x-request-id": f"kept-{i}"})
            assert response.status == 200 and response.read()
            time.sleep(KEPT_EVERY_S)  # the injected pace of an agent's requests, not a sync
    records = relay.log.wait(KEPT_REQUESTS)
    called = [(r["client_rtt_ms"], r["client_min_rtt_ms"], r["phases"].get("ttft"), r["verdict"]) for r in records]
    assert all(r["client_min_rtt_ms"] is not None and r["client_min_rtt_ms"] < 1.0 for r in records), called
    assert not [c for c in called if c[-1] == phases.CLIENT_NETWORK], called
