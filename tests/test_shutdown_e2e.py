"""A clean stop with streams in flight, through a real mitmdump: every flow in flight
gets its record and its client gets the API's error event, then a clean end.

The fake upstream stalls each stream after a few events (connection open), so the
streams are in flight for as long as the test wants; the test signals the relay once
every client has its first events.
"""

from __future__ import annotations

import concurrent.futures
import signal
import time

import orjson
import pytest
from mitmproxy.test import taddons, tflow

from ttft_relay import apis, state
from ttft_relay.timing import addon as timing
from tests.conftest import reverse_to
from ttft_relay.testing.fakes import client
from ttft_relay.testing.harness import read_records
from tests.test_faults_e2e import WAIT, body_for, last_event

STREAMS = {
    apis.OPENAI_CHAT: 3,
    apis.ANTHROPIC_MESSAGES: 2,
}


@pytest.mark.parametrize("signum", [signal.SIGTERM, signal.SIGINT])
def test_a_clean_stop_records_and_tells_every_stream_in_flight(signum, fake, start_relay, tmp_path):
    relay = start_relay(reverse_to(fake), relay_shutdown_grace=0)  # the streams stall: cut at once
    fake.behaviour.stall_after_chunks = 2
    open_streams = []
    for api, count in STREAMS.items():
        for _ in range(count):
            path, body = body_for(api, stream=True)
            conn, response = client.request("POST", relay.url() + path, body, timeout=WAIT)
            assert response.status == 200
            chunks = response.chunks()
            first = next(chunks).data  # the relay has forwarded the stream's head and first event
            open_streams.append((api, conn, response, chunks, first))
    assert fake.wait_received(len(open_streams), WAIT)

    relay.proc.send_signal(signum)
    assert relay.proc.wait(WAIT) == 0

    for api, conn, response, chunks, first in open_streams:
        with conn:
            body = first + b"".join(chunk.data for chunk in chunks)
        assert response.complete, body  # a clean end, not a cut
        assert "relay shutting down" in last_event(api, body)["message"]
    recs = read_records(tmp_path / "timing.jsonl")
    assert len(recs) == len(open_streams), recs
    for rec in recs:
        # Cut mid-stream: the phase it was in, not the relay's.
        assert rec["error"] == "relay shutting down", rec
        assert rec["error_phase"] in ("head_to_first_token", "stream"), rec
        assert rec["verdict"] == "relay shutting down" and rec["client_aborted"] is False
        assert rec["status"] == 200  # what the client got: the head went out before the stop


def test_a_request_the_stop_cut_in_the_upstreams_wait_keeps_that_wait_in_its_phase(fake, start_relay, tmp_path):
    relay = start_relay(reverse_to(fake))
    fake.behaviour.head_delay_ms = 60_000  # the upstream is still thinking when the relay stops
    path, body = body_for(apis.OPENAI_CHAT, stream=True)
    with concurrent.futures.ThreadPoolExecutor(1) as pool:
        sent = pool.submit(client.request, "POST", relay.url() + path, body, timeout=WAIT)
        assert fake.wait_received(1, WAIT)
        time.sleep(0.5)  # the scenario, not a sync: the upstream's wait runs on for a while before the stop
        relay.proc.send_signal(signal.SIGTERM)
        conn, response = sent.result(WAIT)
    with conn:
        assert response.status == 503 and "relay shutting down" in response.read().decode()
    assert relay.proc.wait(WAIT) == 0
    (rec,) = read_records(tmp_path / "timing.jsonl")
    assert rec["error"] == "relay shutting down" and rec["error_phase"] == "upstream_wait", rec
    assert rec["verdict"] == "relay shutting down" and "in upstream wait" in rec["verdict_detail"], rec
    # The time went to the upstream's wait, not to the relay (it read `relay 1005` once).
    assert rec["phases"]["upstream_wait"] >= 0.8 * rec["phases"]["total"], rec


def test_a_stop_refuses_new_connections_answers_open_ones_and_finishes_the_stream(fake, start_relay, tmp_path):
    relay = start_relay(reverse_to(fake), relay_shutdown_grace=30)
    fake.behaviour.stall_after_chunks = 2
    path, body = body_for(apis.OPENAI_CHAT, stream=True)
    kept = client.HttpConnection(relay.url(), timeout=WAIT)  # a client's pooled connection, idle
    kept.request("POST", path, body_for(apis.OPENAI_CHAT, stream=False)[1]).read()
    conn, response = client.request("POST", relay.url() + path, body, timeout=WAIT)
    chunks = response.chunks()
    next(chunks)
    relay.proc.send_signal(signal.SIGTERM)
    relay.wait_for_output(r"stopping: waiting up to 30 s for 1 flow")
    with pytest.raises(ConnectionRefusedError):  # the listener closed first: refused, not reset
        client.request("POST", relay.url() + path, body, timeout=WAIT)
    with kept:
        late = kept.request("POST", path, body)
        assert late.status == 503
        assert "relay shutting down" in orjson.loads(late.read())["error"]["message"]
    fake.release_stalls()  # the stream in flight finishes within the grace period
    with conn:
        rest = b"".join(chunk.data for chunk in chunks)
    assert response.complete and b"[DONE]" in rest
    assert relay.proc.wait(WAIT) == 0
    recs = read_records(tmp_path / "timing.jsonl")
    assert sorted(rec["status"] for rec in recs) == [200, 200, 503], recs
    assert all(rec["error"] is None for rec in recs if rec["status"] == 200)
    (refused,) = [rec for rec in recs if rec["status"] == 503]
    assert refused["error"] == "relay shutting down" and refused["error_phase"] == "relay"
    assert refused["verdict"] == "relay shutting down"


def test_timing_records_a_flow_still_uploading_when_the_relay_stops(tmp_path):
    # No clean end is possible before the request is in: the record is written at
    # `done`, before the log closes (mitmproxy's `error` for it would come after).
    t = timing.Timing()
    with taddons.context(t) as tctx:
        tctx.configure(t, relay_timing_log=str(tmp_path / "timing.jsonl"))
        f = tflow.tflow()
        f.request.timestamp_end = None
        state.attach(f, state.FlowState(api=apis.get(apis.OPENAI_CHAT), model="gpt-x", stream=True))
        t.requestheaders(f)
        t.done()
        t.error(f)  # what mitmproxy does once it cancels the connection: no second record
    (rec,) = read_records(tmp_path / "timing.jsonl")
    assert rec["error"] == "relay shutting down" and rec["error_phase"] == "client_upload"
    assert rec["verdict"] == "relay shutting down" and rec["status"] is None
