"""Marks → phases → verdict, without a proxy."""

import pytest
from hypothesis import given
from hypothesis import strategies as st

from ttft_relay.timing import phases

CRITICAL_UP_TO_TTFT = ("client_upload", "relay", "upstream_connect", "upstream_tls", "upstream_wait", "head_to_first_token")


def stream_marks(**overrides: float) -> dict[str, float]:
    """A streamed request on a reused connection, every hop a few ms."""
    m = {
        "request_body": 2.0,
        "forwarded": 3.0,
        "response_head": 60.0,
        "first_byte": 61.0,
        "first_event": 61.0,
        "first_token": 70.0,
        "last_token": 400.0,
        "end": 401.0,
    }
    m.update(overrides)
    return m


def test_relative_marks_in_ms_and_timeline_order():
    rel = phases.relative_marks({"end": 101.5, "request_body": 100.25, "unknown": 1.0}, 100.0)
    assert rel == {"request_body": 250.0, "end": 1500.0}
    assert list(rel) == ["request_body", "end"]


def test_reused_connection_has_no_connect_or_tls_phase():
    p = phases.compute(stream_marks(), tokens_expected=True)
    assert p == {
        "client_upload": 2.0,
        "relay": 1.0,
        "upstream_wait": 57.0,
        "head_to_first_token": 10.0,
        "stream": 330.0,
        "ttft": 70.0,
        "total": 401.0,
    }


def test_lazy_connect_after_forwarded_is_on_the_critical_path():
    m = stream_marks(upstream_connect_start=3.5, upstream_tcp=10.0, upstream_tls=210.0, response_head=460.0, first_token=470.0)
    p = phases.compute(m, tokens_expected=True)
    assert p["relay"] == 1.5  # forwarded → connect start is the relay's
    assert p["upstream_connect"] == 6.5
    assert p["upstream_tls"] == 200.0
    assert p["upstream_wait"] == 250.0
    assert p["ttft"] == 470.0


def test_eager_connect_the_request_waited_on_is_on_its_path():
    # Accepted at -301, connect at -300, TCP at -280, TLS at -80; the client's request was in
    # the kernel from the accept on (client_arrived), its head parsed at 0, once the connect was done.
    m = stream_marks(client_connect=-301.0, client_arrived=-301.0, upstream_connect_start=-300.0,
                     upstream_tcp=-280.0, upstream_tls=-80.0)
    p = phases.compute(m, tokens_expected=True)
    assert p["connection_setup"] == 0.0
    assert p["relay_queue"] == 1.0 + 80.0  # held: accept → connect start, TLS done → head read
    assert p["upstream_connect"] == 20.0
    assert p["upstream_tls"] == 200.0
    assert p["client_upload"] == 2.0 and p["relay"] == 1.0
    assert p["upstream_wait"] == 57.0
    assert p["ttft"] == 371.0


def test_the_clock_starts_at_the_requests_first_byte_not_at_the_connection():
    # A client that opened its connection 777 ms before writing the request (Codex's fallback):
    # the early connect ended long before; the relay read the head as it came.
    m = stream_marks(client_connect=-777.0, upstream_connect_start=-776.0, upstream_tcp=-770.0, upstream_tls=-760.0)
    p = phases.compute(m, tokens_expected=True)
    assert p["connection_setup"] == 777.0
    assert p["ttft"] == 70.0 and p["client_upload"] == 2.0
    assert p["upstream_connect"] == p["upstream_tls"] == 0.0  # this request opened it, but did not wait on it
    # The TCP handshake is set-up too: from the client's SYN.
    assert phases.compute(stream_marks(client_syn=-150.0, client_connect=-1.0), tokens_expected=True)[
        "connection_setup"] == 150.0


def test_a_slow_upload_after_an_early_connect_is_the_clients():
    # The client kept sending for 300 ms after its head was read; the connect was done before.
    m = stream_marks(request_body=300.0, forwarded=301.0, upstream_connect_start=-50.0, upstream_tcp=-40.0,
                     upstream_tls=-1.0, response_head=360.0, first_token=370.0)
    p = phases.compute(m, tokens_expected=True)
    assert p["client_upload"] == 300.0
    assert p["upstream_connect"] == p["upstream_tls"] == 0.0
    assert p["ttft"] == 370.0


def test_connect_and_tls_to_the_relay_are_connection_setup():
    # CONNECT + TLS: accepted at -301; mitmproxy finished the upstream's TLS (-80) before the
    # client's (-70); the request's first byte came after. None of that is the request's upload.
    m = stream_marks(client_connect=-301.0, client_tls=-70.0, request_body=30.0, forwarded=31.0,
                     upstream_connect_start=-300.0, upstream_tcp=-280.0, upstream_tls=-80.0)
    p = phases.compute(m, tokens_expected=True)
    assert p["connection_setup"] == 301.0
    assert p["client_upload"] == 30.0
    assert p["upstream_connect"] == p["upstream_tls"] == 0.0
    assert sum(p[name] for name in CRITICAL_UP_TO_TTFT if name in p) == p["ttft"]


def test_connect_overlapping_the_upload_counts_only_past_forwarded():
    # A slow upload (0 → 500) while the connect ran from 100 to 600.
    m = stream_marks(request_body=500.0, forwarded=501.0, upstream_connect_start=100.0, upstream_tcp=150.0,
                     upstream_tls=600.0, response_head=650.0, first_token=660.0)
    p = phases.compute(m, tokens_expected=True)
    assert p["client_upload"] == 500.0
    assert p["upstream_connect"] == 0.0
    assert p["upstream_tls"] == 99.0
    assert p["upstream_wait"] == 50.0


def test_non_streamed_ttft_is_time_to_full_response():
    m = {"request_body": 1.0, "forwarded": 2.0, "response_head": 800.0, "end": 805.0}
    p = phases.compute(m, tokens_expected=False)
    assert p["response_body"] == 5.0
    assert p["ttft"] == p["total"] == 805.0
    assert "head_to_first_token" not in p


def test_streamed_without_a_token_has_no_ttft():
    m = {k: v for k, v in stream_marks().items() if k not in ("first_token", "last_token")}
    p = phases.compute(m, tokens_expected=True)
    assert "ttft" not in p and "stream" not in p
    assert p["total"] == 401.0


ms = st.floats(min_value=0, max_value=5000, allow_nan=False)


@given(body=ms, relay=ms, conn_at=st.floats(-5000, 5000), connect=ms, tls=ms, tls_on=st.booleans(),
       new=st.booleans(), wait=ms, prefill=ms, accept=ms)
def test_critical_phases_add_up_to_ttft(body, relay, conn_at, connect, tls, tls_on, new, wait, prefill, accept):
    fwd = body + relay
    m = {"request_body": body, "forwarded": fwd}
    if new and conn_at < 0:
        m["client_connect"] = conn_at - accept
    ready = fwd
    if new:
        m["upstream_connect_start"] = conn_at
        m["upstream_tcp"] = conn_at + connect
        ready = conn_at + connect
        if tls_on:
            m["upstream_tls"] = ready = conn_at + connect + tls
    head = max(fwd, ready) + wait
    m |= {"response_head": head, "first_token": head + prefill, "last_token": head + prefill, "end": head + prefill}
    p = phases.compute(m, tokens_expected=True)
    assert all(p[name] >= 0 for name in CRITICAL_UP_TO_TTFT if name in p)
    assert sum(p.get(name, 0.0) for name in CRITICAL_UP_TO_TTFT) == pytest.approx(p["ttft"], abs=0.01)
    assert ("upstream_connect" in p) == new
    assert ("upstream_tls" in p) == (new and tls_on)


def test_rtt_from_tls_handshake_or_tcp_connect():
    assert phases.handshake_rtt_ms({"upstream_connect_start": 0, "upstream_tcp": 1, "upstream_tls": 201}, "TLSv1.3") == 200
    assert phases.handshake_rtt_ms({"upstream_connect_start": 0, "upstream_tcp": 1, "upstream_tls": 201}, "TLSv1.2") == 100
    assert phases.handshake_rtt_ms({"upstream_connect_start": 0, "upstream_tcp": 30}, None) == 30
    assert phases.handshake_rtt_ms({}, None) is None


def test_verdict_far_upstream_differs_from_slow_upstream():
    p = {"client_upload": 1, "relay": 1, "upstream_wait": 300, "head_to_first_token": 20}
    assert phases.verdict(p, rtt_ms=250) == phases.UPSTREAM_NETWORK
    assert phases.verdict(p, rtt_ms=5) == phases.UPSTREAM_WAIT
    assert phases.verdict(p) == phases.UPSTREAM_WAIT
    # Prefill after an early head is the upstream's wait too.
    assert phases.verdict({"upstream_wait": 20, "head_to_first_token": 400}, rtt_ms=10) == phases.UPSTREAM_WAIT


def test_verdict_near_tie_goes_to_the_handshake():
    # A fresh TLS connection to a far upstream: the handshake and the request cost one round trip each.
    p = {"client_upload": 1, "relay": 1, "upstream_connect": 1, "upstream_tls": 203, "upstream_wait": 255}
    assert phases.verdict(p, rtt_ms=205) == phases.UPSTREAM_TLS


@pytest.mark.parametrize("phase, words", [
    ("client_upload", phases.CLIENT_UPLOAD), ("relay", phases.RELAY),
    ("upstream_connect", phases.UPSTREAM_CONNECT), ("upstream_tls", phases.UPSTREAM_TLS),
])
def test_verdict_names_the_dominant_phase(phase, words):
    p = {"client_upload": 5, "relay": 5, "upstream_wait": 5, phase: 500}
    assert phases.verdict(p) == words


def test_stall_only_counts_when_it_cannot_be_prefill():
    m = stream_marks(first_byte=61.0, first_token=461.0)
    assert phases.stall_ms(m, 400.0) == 0.0  # fits between first byte and first token
    assert phases.stall_ms(m, 900.0) == 900.0
    assert phases.stall_ms({"first_byte": 1.0}, 900.0) == 0.0  # no token at all
    p = phases.compute(stream_marks(), tokens_expected=True)
    assert phases.verdict(p, stall=phases.stall_ms(stream_marks(), 600.0)) == phases.STREAM_STALL


def test_error_verdicts_name_the_phase():
    assert phases.verdict({}, error="boom", error_phase="upstream_tls") == "error in upstream TLS"
    assert phases.verdict({}, error="x", error_phase="upstream_wait", client_aborted=True) == "client aborted in upstream wait"


@pytest.mark.parametrize("marks, tls, expected", [
    ({}, True, "client_upload"),
    ({"request_body": 1}, True, "relay"),
    ({"request_body": 1, "forwarded": 2, "upstream_connect_start": 2}, True, "upstream_connect"),
    ({"request_body": 1, "forwarded": 2, "upstream_connect_start": 2, "upstream_tcp": 3}, True, "upstream_tls"),
    ({"request_body": 1, "forwarded": 2, "upstream_connect_start": 2, "upstream_tcp": 3}, False, "upstream_wait"),
    ({"request_body": 1, "forwarded": 2}, True, "upstream_wait"),
    ({"request_body": 1, "forwarded": 2, "response_head": 3}, True, "head_to_first_token"),
    ({"request_body": 1, "forwarded": 2, "response_head": 3, "first_token": 4}, True, "stream"),
])
def test_error_phase_is_the_first_unfinished(marks, tls, expected):
    assert phases.error_phase(marks, tls_expected=tls, tokens_expected=True) == expected


def test_server_timing_has_only_head_time_phases():
    p = phases.compute(stream_marks(), tokens_expected=True)
    assert phases.server_timing(p) == "client_upload;dur=2.0, relay;dur=1.0, upstream_wait;dur=57.0"


# --- what the kernel held for a busy relay (selfwatch's *_arrived marks) ------------


def test_relay_queue_is_what_the_kernel_held_and_the_wait_starts_at_arrival():
    # The connection sat 300 ms in the accept queue, the first token 40 ms in the upstream socket.
    m = stream_marks(client_arrived=-300.0, head_arrived=58.0, token_arrived=62.0)
    p = phases.compute(m, tokens_expected=True)
    assert p["relay_queue"] == pytest.approx(300.0 + 8.0)  # accept queue + the token read 8 ms late
    assert p["upstream_wait"] == 55.0  # forwarded (3) → head in the kernel (58)
    assert p["head_to_first_token"] == 4.0  # 58 → 62, the upstream's
    assert p["ttft"] == 370.0  # what the client saw
    assert phases.verdict(p) == phases.RELAY_SATURATED


def test_without_arrival_marks_there_is_no_relay_queue_phase():
    assert "relay_queue" not in phases.compute(stream_marks(), tokens_expected=True)


def test_arrivals_later_than_the_reads_change_nothing():
    # A kernel clock a jiffy behind, or the bytes read at once: no queue, the same phases.
    m = stream_marks(client_arrived=1.0, body_arrived=3.0, head_arrived=61.0, token_arrived=75.0)
    p = phases.compute(m, tokens_expected=True)
    assert p.pop("relay_queue") == 0.0
    assert p == phases.compute(stream_marks(), tokens_expected=True)


def test_a_body_read_late_by_a_busy_relay_is_not_a_slow_upload():
    # An eager 400 ms connect; head and body were both in the kernel at accept (-401), the
    # busy relay read the body 11 ms after the head.
    m = stream_marks(client_connect=-401.0, upstream_connect_start=-400.0, upstream_tcp=-1.0,
                     request_body=11.0, forwarded=12.0)
    blind = phases.compute(m, tokens_expected=True)
    assert blind["upstream_connect"] == 0.0 and blind["connection_setup"] == 401.0  # missed without the kernel's view
    m |= {"client_arrived": -401.0, "body_arrived": -401.0}
    p = phases.compute(m, tokens_expected=True)
    assert p["connection_setup"] == 0.0
    assert p["upstream_connect"] == 399.0
    assert p["client_upload"] == 0.0
    assert p["relay_queue"] == 1.0 + 1.0 + 11.0  # before the connect, after it, the body read late
    assert phases.verdict(p) == phases.UPSTREAM_CONNECT


def test_not_streamed_answer_read_late():
    m = {"request_body": 1.0, "forwarded": 2.0, "head_arrived": 50.0, "response_head": 250.0, "end": 260.0}
    p = phases.compute(m, tokens_expected=False)
    assert p["upstream_wait"] == 48.0 and p["relay_queue"] == 200.0 and p["response_body"] == 10.0
    assert p["ttft"] == 260.0


def test_a_stall_the_event_loop_explains_is_the_relays():
    p = phases.compute(stream_marks(), tokens_expected=True)
    stall = phases.stall_ms(stream_marks(), 600.0)
    assert phases.verdict(p, stall=stall, loop_lag_ms=550.0) == phases.RELAY_SATURATED
    assert phases.verdict(p, stall=stall, loop_lag_ms=5.0) == phases.STREAM_STALL


def test_the_client_link_is_named_even_on_a_kept_alive_connection():
    p = phases.compute(stream_marks(), tokens_expected=True)  # every phase small
    assert phases.verdict(p, client_rtt_ms=400.0) == phases.CLIENT_NETWORK
    assert phases.verdict(p, client_rtt_ms=0.1) == phases.UPSTREAM_WAIT


def test_advice_only_for_a_saturated_relay_with_its_numbers():
    text = phases.advice(phases.RELAY_SATURATED, {"relay_queue": 312.4}, 287.0)
    assert "312 ms" in text and "287 ms" in text and "--workers" in text
    assert phases.advice(phases.UPSTREAM_WAIT, {}, 900.0) is None


@given(queue_in=ms, body=ms, body_late=ms, relay=ms, wait=ms, head_late=ms, prefill=ms, token_late=ms)
def test_phases_with_arrivals_add_up_to_what_the_client_saw(queue_in, body, body_late, relay, wait, head_late,
                                                            prefill, token_late):
    # Kernel timeline: arrival, body in, upstream head in, first token in; each read some time later.
    m = {"client_arrived": -queue_in, "body_arrived": body, "request_body": body + body_late}
    fwd = m["request_body"] + relay
    head_in = fwd + wait
    token_in = head_in + prefill
    m |= {"forwarded": fwd, "head_arrived": head_in, "response_head": head_in + head_late,
          "token_arrived": token_in, "first_token": max(token_in, head_in + head_late) + token_late}
    m |= {"last_token": m["first_token"], "end": m["first_token"]}
    p = phases.compute(m, tokens_expected=True)
    assert all(v >= 0 for v in p.values())
    assert sum(p.get(name, 0.0) for name in ("relay_queue", *CRITICAL_UP_TO_TTFT)) == pytest.approx(p["ttft"], abs=0.01)
    assert p["ttft"] == pytest.approx(m["first_token"] + queue_in, abs=0.01)
    assert p["upstream_wait"] == pytest.approx(wait, abs=0.01)


@pytest.mark.parametrize("marks, unfinished", [
    # A first-token deadline: the head came at 37 ms, the relay gave up at 3021 ms.
    ({"request_body": 1.0, "forwarded": 2.0, "response_head": 37.0, "first_byte": 37.0, "end": 3021.0},
     "head_to_first_token"),
    # A WebSocket handshake that hung until the client left at 14,986 ms.
    ({"request_body": 0.0, "forwarded": 1.0, "end": 14986.0}, "upstream_wait"),
    # An upstream connect that never completed.
    ({"request_body": 1.0, "forwarded": 2.0, "upstream_connect_start": 2.5, "end": 10002.0}, "upstream_connect"),
    # A client that never finished its body.
    ({"end": 5000.0}, "client_upload"),
])
def test_every_wait_of_a_failed_request_is_in_a_phase(marks, unfinished):
    p = phases.compute(marks, tokens_expected=True, unfinished=unfinished)
    assert phases.error_phase(marks, tls_expected=False, tokens_expected=True) == unfinished
    assert sum(p.get(name, 0.0) for name in phases.CRITICAL_PHASES) == pytest.approx(p["total"])
    assert p[unfinished] >= 0.9 * p["total"]
    assert "ttft" not in p


def test_a_request_cut_after_its_first_token_keeps_its_phases():
    p = phases.compute(stream_marks(), tokens_expected=True, unfinished="stream")
    assert p == phases.compute(stream_marks(), tokens_expected=True)


@given(queue_in=ms, body=ms, relay=ms, wait=ms, cut=ms, head=st.booleans(), arrived=st.booleans())
def test_a_failed_requests_phases_add_up_to_its_total(queue_in, body, relay, wait, cut, head, arrived):
    m = {"request_body": body, "forwarded": body + relay}
    if arrived:
        m["client_arrived"] = -queue_in
    if head:
        m["response_head"] = body + relay + wait
    m["end"] = max(m.values()) + cut
    unfinished = phases.error_phase(m, tls_expected=False, tokens_expected=True)
    p = phases.compute(m, tokens_expected=True, unfinished=unfinished)
    covered = sum(p.get(name, 0.0) for name in phases.CRITICAL_PHASES)
    assert covered == pytest.approx(p["total"], abs=0.01)
